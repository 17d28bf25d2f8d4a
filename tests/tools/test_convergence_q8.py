"""Smoke test of benchmarks/convergence_q8.py (issue 22): ``--quick`` runs, writes its report, and trains.

Not the criterion: 40 steps of a 1-layer model cannot tell the configurations apart (the
committed full run, benchmarks/results/convergence_q8-cpu.md, does that).
"""

import json
import math
import os
import sys

import pytest

BENCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "benchmarks")
sys.path.insert(0, BENCH_DIR)

import convergence_q8  # noqa: E402

CONFIGS = ["baseline", "remainder-q8", "sr-q8", "ulp8-q8", "pure-bf16", "fastamp-fp16", "fp16-q8", "fp16-ulp8-q8"]
FP16_ROWS = ["fastamp-fp16", "fp16-q8", "fp16-ulp8-q8"]
Q8_ROWS = ["remainder-q8", "sr-q8", "ulp8-q8", "fp16-q8", "fp16-ulp8-q8"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("conv")
    payload = convergence_q8.main(["--quick", "--out", str(out)])
    return out, payload


def test_quick_writes_json_and_markdown_with_the_run_described(quick):
    out, payload = quick
    on_disk = json.loads((out / "convergence_q8-cpu-quick.json").read_text())
    assert on_disk["verdict"] == payload["verdict"] and list(on_disk["configs"]) == CONFIGS
    meta = on_disk["meta"]
    assert meta["corpus_sha256"] == convergence_q8.CORPUS_SHA256
    assert meta["torch"].startswith(convergence_q8.CORPUS_TORCH_VERSION)
    assert meta["git_commit"] and meta["date"] and meta["machine"]["cpu"]
    assert meta["quick"] is True and meta["seeds"] == [0] and meta["steps"] == 40
    md = (out / "convergence_q8-cpu-quick.md").read_text()
    for key in ("git_commit", "date", "cpu", "torch", meta["corpus_sha256"], "## Final validation loss", "## Verdict"):
        assert key in md
    for name in CONFIGS:
        assert f"| {name} |" in md


def test_quick_rows_carry_the_criterion_and_the_q8_coverage(quick):
    rows = quick[1]["configs"]
    for name in ("remainder-q8", "sr-q8", "ulp8-q8", "pure-bf16", "fp16-q8", "fp16-ulp8-q8"):
        r = rows[name]
        assert r["reference"] == ("fastamp-fp16" if name in FP16_ROWS else "baseline")
        assert r["dtype"] == ("float16" if name in FP16_ROWS else "bfloat16")
        assert isinstance(r["pass"], bool) and isinstance(r["pass_mean"], bool) and isinstance(r["pass_seeds"], bool)
        assert r["ratio"] == pytest.approx(r["mean"] / rows[r["reference"]]["mean"])
    assert rows["pure-bf16"]["control"] is True
    for name in ("baseline", "fastamp-fp16"):
        assert "pass" not in rows[name]
    # the 8-bit state is really there: the weight matrices (>= lowbit_min_numel) hold q8 moments,
    # and in the ulp8 rows an int8 master correction (no fp32 master)
    for name in CONFIGS:
        assert (rows[name]["q8_fraction"] > 0.9) == (name in Q8_ROWS), name
        assert (rows[name]["ulp8_fraction"] > 0.9) == ("ulp8" in name), name
    assert rows["ulp8-q8"]["ulp8_fraction"] == rows["ulp8-q8"]["q8_fraction"]


def test_quick_losses_are_finite_and_decrease(quick):
    rows = quick[1]["configs"]
    for name, r in rows.items():
        assert r["nonfinite_train_losses"] == [0], name
        (curve,) = r["val_curves"]
        vals = [v for _, v in curve]
        assert all(math.isfinite(v) for v in vals), name
        assert curve[0][0] == 0 and curve[-1][0] == 40
        assert vals[-1] < vals[0] - 0.5, (name, vals)  # from ~ln(vocab) = 4.5
        assert r["final_val"] == [vals[-1]]
        assert r["train_loss_last10_mean"][0] < r["train_loss_first"][0] - 0.5, name


def test_quick_fp16_rows_skip_every_injected_overflow(quick):
    rows = quick[1]["configs"]
    for name in FP16_ROWS:
        r = rows[name]
        assert r["injected_overflow_steps"] and r["all_injected_skipped"] is True
        assert set(r["injected_overflow_steps"]) <= set(r["skipped_steps"][0])
        assert r["final_scale"][0] < 65536.0  # each injected overflow backed the scale off


def test_corpus_hash_mismatch_names_the_expected_torch_version():
    with pytest.raises(SystemExit, match=f"torch=={convergence_q8.CORPUS_TORCH_VERSION}"):
        convergence_q8.check_corpus("not the corpus")


def test_quick_lion_runs_the_rows_lion_takes_and_skips_every_injected_overflow(tmp_path):
    """``--optimizer lion``: the study with fastamp.optim.Lion, its own tag, no ulp8 rows, q8 moments
    really held (``exp_avg_q``), and the fp16 rows' skips seen without a step count."""
    payload = convergence_q8.main(["--quick", "--optimizer", "lion", "--configs",
                                   "baseline,sr-q8,ulp8-q8,fastamp-fp16,fp16-q8", "--out", str(tmp_path)])  # fmt: skip
    rows = payload["configs"]
    assert list(rows) == ["baseline", "sr-q8", "pure-bf16", "fastamp-fp16", "fp16-q8"]  # ulp8 is AdamW's
    assert payload["meta"]["added_for_verdict"] == ["pure-bf16"]  # the control, for a verdict of this run alone
    assert payload["meta"]["optimizer"] == "Lion"
    md = (tmp_path / "convergence_q8-cpu-quick-lion.md").read_text()
    assert "Lion's 8-bit formats" in md and "betas (0.9, 0.99)" in md
    assert rows["sr-q8"]["q8_fraction"] > 0.9 and rows["baseline"]["q8_fraction"] == 0
    for name in ("fastamp-fp16", "fp16-q8"):
        assert rows[name]["all_injected_skipped"] is True, name
    for r in rows.values():
        vals = [v for _, v in r["val_curves"][0]]
        assert vals[-1] < vals[0] - 0.5


def test_the_configs_a_verdict_needs_are_added_to_those_asked_for():
    """Each judged config's reference, and the negative control (with its reference) whenever one is judged."""
    add = convergence_q8.with_verdict_configs
    # the committed ulp8 results' command (their control ran in another file): the control is added now
    assert add(["baseline", "ulp8-q8", "fastamp-fp16", "fp16-ulp8-q8"]) == (
        ["baseline", "ulp8-q8", "pure-bf16", "fastamp-fp16", "fp16-ulp8-q8"],
        ["pure-bf16"],
    )
    assert add(["fp16-q8"]) == (
        ["baseline", "pure-bf16", "fastamp-fp16", "fp16-q8"],
        ["baseline", "pure-bf16", "fastamp-fp16"],
    )
    assert add(["pure-bf16"]) == (["baseline", "pure-bf16"], ["baseline"])
    assert add(["baseline", "fastamp-fp16"]) == (["baseline", "fastamp-fp16"], [])  # nothing judged, nothing added
    assert add(list(convergence_q8.CONFIG_BY_NAME)) == (list(convergence_q8.CONFIG_BY_NAME), [])
    assert add(["ulp8-q8", "sr-q8"], ("ulp8-q8", "fp16-ulp8-q8")) == (
        ["baseline", "sr-q8", "pure-bf16"],
        ["baseline", "pure-bf16"],
    )


def test_a_subset_run_judges_itself_with_the_control_it_adds(tmp_path):
    payload = convergence_q8.main(["--quick", "--steps", "10", "--evals", "1", "--configs", "ulp8-q8",
                                   "--out", str(tmp_path), "--tag", "subset"])  # fmt: skip
    rows = payload["configs"]
    assert list(rows) == ["baseline", "ulp8-q8", "pure-bf16"]
    assert payload["meta"]["added_for_verdict"] == ["baseline", "pure-bf16"]
    assert rows["pure-bf16"]["control"] is True and isinstance(rows["pure-bf16"]["pass"], bool)
    assert "did not run" not in payload["verdict"] and "negative control pure-bf16" in payload["verdict"]
    md = (tmp_path / "convergence_q8-subset.md").read_text()
    assert "- added to the configurations asked for, so that the verdict stands on this run alone: baseline, " in md
