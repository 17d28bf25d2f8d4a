"""Smoke test of benchmarks/ablation_q8.py (issue 22): ``--quick`` runs and reports, and the harness is what it claims.

Not the decision: 20 steps of a 1-layer model cannot rank the formats (the committed full run,
benchmarks/results/ablation_q8-cpu.md, does that). What is checked: the report, the direction
error's floor (fp32 moments: fp32 rounding only) and that quantisation shows in it; that the
``default`` and ``nearest`` variants (fp32-exact AdamW with requantised moments) are bit for bit
``AdamW(master_weights="remainder", state_format="q8")`` with stochastic / nearest codes; the
FlashOptim reimplementation against hand-computed codes; the decision rule.
"""

import json
import math
import os
import sys

import pytest
import torch

BENCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "benchmarks")
sys.path.insert(0, BENCH_DIR)

import ablation_q8  # noqa: E402
import convergence_q8  # noqa: E402

from fastamp.reference import q8  # noqa: E402

VARIANTS = ["fp32", "default", "nearest", "block64", "flashoptim"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("ablation")
    payload = ablation_q8.main(["--quick", "--out", str(out)])
    return out, payload


def test_quick_writes_json_and_markdown_with_the_run_described(quick):
    out, payload = quick
    on_disk = json.loads((out / "ablation_q8-cpu-quick.json").read_text())
    assert on_disk["decision"] == payload["decision"] and list(on_disk["variants"]) == VARIANTS
    meta = on_disk["meta"]
    assert meta["corpus_sha256"] == convergence_q8.CORPUS_SHA256
    assert meta["git_commit"] and meta["date"] and meta["machine"]["cpu"]
    assert meta["quick"] is True and meta["seeds"] == [0] and meta["steps"] == 20
    md = (out / "ablation_q8-cpu-quick.md").read_text()
    for key in ("git_commit", "date", "cpu", meta["corpus_sha256"], "## Results", "## Decision", "decision rule"):
        assert key in md
    for name in VARIANTS:
        assert f"| {name} |" in md
    assert payload["decision"].startswith("(--quick") and "Decision: " in payload["decision"]


def test_quick_direction_error_has_the_fp32_floor_and_sees_quantisation(quick):
    rows = quick[1]["variants"]
    assert rows["fp32"]["dir_err_max"] < 1e-5  # fp32 vs fp64 arithmetic only
    for name in VARIANTS[1:]:
        r = rows[name]
        assert r["dir_err_mean"] > 1e-3, name  # 8-bit moments do move the direction
        assert r["dir_err_p50"] <= r["dir_err_p99"] <= r["dir_err_max"], name
        assert len(r["dir_err_per_tensor_mean"]) == len(r["covered_tensors"]) > 0
        assert r["covered_params"] / r["n_params"] > 0.9
    # q8 never decodes a nonzero v to 0, by construction
    for name in ("default", "nearest", "block64"):
        assert rows[name]["v_lost_fraction"] == 0.0
    for name, r in rows.items():
        assert r["nonfinite_train_losses"] == [0], name
        (curve,) = r["val_curves"]
        assert curve[0][0] == 0 and curve[-1][0] == 20 and curve[-1][1] < curve[0][1] - 0.5, name
        assert r["vs_default"] == pytest.approx(r["mean"] / rows["default"]["mean"] - 1)


@pytest.fixture(scope="module")
def small_data():
    return convergence_q8.Batches(convergence_q8.Corpus(), convergence_q8.QUICK_MODEL, 8)


@pytest.mark.parametrize("variant,rounding", [("default", "stochastic"), ("nearest", "nearest")])
def test_requantised_fp32_adamw_is_adamw_q8_bit_for_bit(small_data, variant, rounding):
    """The ablation's harness for a q8 variant equals the optimizer's own q8 path: params, moments, masters."""
    data = small_data
    kw = {"master_weights": "remainder", "state_format": "q8", "state_rounding": rounding}
    cfg = convergence_q8.Config("q8", torch.bfloat16, kw, None, "")
    seen = {}
    res = convergence_q8.train(cfg, 3, data, 6, 3e-3, 0.01, 1, after_step=lambda step, opt: seen.setdefault("opt", opt))
    run, hook = ablation_q8.run_variant(ablation_q8.VARIANT_BY_NAME[variant], 3, data, 6, 3e-3, 0.01, 1)
    assert run.result.train_losses == res.train_losses and run.result.final_val == res.final_val
    ours, theirs = hook.opt, seen["opt"]
    n_q8 = 0
    for p, pt in zip(ours.param_groups[0]["params"], theirs.param_groups[0]["params"], strict=True):
        assert torch.equal(p.detach().view(torch.uint8), pt.detach().view(torch.uint8))
        st, stt = ours.state[p], theirs.state[pt]
        if "exp_avg_q" in stt:
            n_q8 += 1
            m = q8.q8_decode_m(stt["exp_avg_q"], stt["exp_avg_scale"])
            v = q8.q8_decode_v(stt["exp_avg_sq_q"], stt["exp_avg_sq_scale"])
        else:
            m, v = stt["exp_avg"], stt["exp_avg_sq"]
        assert torch.equal(st["exp_avg"].view(torch.int32), m.view(torch.int32))
        assert torch.equal(st["exp_avg_sq"].view(torch.int32), v.view(torch.int32))
        if "master_remainder" in stt:
            assert torch.equal(st["master_remainder"], stt["master_remainder"])
    assert n_q8 == len(hook.covered) > 0


def test_flashoptim_codes_by_hand():
    # m: normalised by the group's absmax, softsign 2x / (1 + |x|), int8 floor(127 y + 0.5)
    m = torch.tensor([2.0, -1.0, 0.5, 0.0, -2.0, 1e-3] + [0.0] * 26)
    codes, scales = ablation_q8.flash_quantise(m, signed=True)
    want = [math.floor(2 * x / (1 + abs(x)) * 127 + 0.5) for x in (1.0, -0.5, 0.25, 0.0, -1.0, 5e-4)]
    assert codes.dtype == torch.int8 and codes[:6].tolist() == want == [127, -85, 51, 0, -127, 0]
    assert scales.dtype == torch.float16 and scales.tolist() == [2.0]
    back = ablation_q8.flash_dequantise(codes, scales, signed=True)
    oracle = torch.tensor([2.0 * (c / 127) / (2 - abs(c / 127)) for c in want], dtype=torch.float64)
    assert torch.allclose(back[:6].double(), oracle, rtol=1e-6, atol=0)
    # sqrt(v): linear uint8 floor(255 y + 0.5), decoded (q / 255 * scale)^2
    w = torch.tensor([3.0, 1.5, 0.3, 0.0] + [0.1] * 28)
    cw, sw = ablation_q8.flash_quantise(w, signed=False)
    assert cw.dtype == torch.uint8 and cw[:5].tolist() == [255, 128, 26, 0, 9] and sw.tolist() == [3.0]
    _, v2 = ablation_q8._flash_codec(torch.zeros(32), w * w, None, None)
    assert torch.allclose(v2[:3].double(), torch.tensor([9.0, (128 / 255 * 3) ** 2, (26 / 255 * 3) ** 2]).double())


@pytest.mark.parametrize("signed", [True, False])
def test_flashoptim_every_code_round_trips(signed):
    """Every code, in groups of 32 that each hold the top code (so the absmax is the scale): decode then
    encode gives the same codes and scales."""
    top = 127 if signed else 255
    pool = list(range(-127, 128)) if signed else list(range(256))
    groups = [[top] + pool[i : i + 31] for i in range(0, len(pool), 31)]
    codes = [c for g in groups for c in g + [0] * (32 - len(g))]
    dtype = torch.int8 if signed else torch.uint8
    codes = torch.tensor(codes, dtype=torch.int64).to(dtype)
    scales = torch.full((len(groups),), 0.75, dtype=torch.float16)
    x = ablation_q8.flash_dequantise(codes, scales, signed=signed)
    c2, s2 = ablation_q8.flash_quantise(x, signed=signed)
    assert torch.equal(c2, codes) and torch.equal(s2, scales)


def test_flashoptim_fp16_scale_and_linear_v_lose_small_values():
    # an fp16 scale is 0 below 2^-25: the whole group decodes to 0 (FlashOptim's stored scale is fp16)
    m = torch.full((32,), 1e-9)
    codes, scales = ablation_q8.flash_quantise(m, signed=True)
    assert scales.tolist() == [0.0] and torch.equal(ablation_q8.flash_dequantise(codes, scales, signed=True), m * 0)
    # a v whose root is below 1/510 of its group's largest codes to 0 (v lost); q8 keeps it nonzero
    v = torch.tensor([1.0, 1e-6] + [0.5] * 30)
    m2, v2 = ablation_q8._flash_codec(torch.zeros(32), v, None, None)
    assert v2[1] == 0.0 and v2[0] > 0
    cv, sv = q8.q8_encode_v(v)
    assert q8.q8_decode_v(cv, sv)[1] > 0


def _row(mean, **kw):
    return {"mean": mean, "dir_err_mean": 0.1, "dir_err_p99": 0.2, "v_lost_fraction": 0.0,
            "bytes_per_moment_element": 1.03, **kw}  # fmt: skip


@pytest.mark.parametrize(
    "per_seed,verdict",
    [
        ([-0.003, -0.002, -0.004], "change"),
        ([-0.008, -0.002, +0.001], "noise"),  # the mean beats the margin, one seed does not
        ([-0.001, 0.0, -0.002], "within"),
        ([0.004, 0.003, 0.005], "worse"),
    ],
)
def test_decision_rule(per_seed, verdict):
    d = 1.5
    delta = sum(per_seed) / len(per_seed)
    rows = {"fp32": _row(d), "default": _row(d, vs_default=0.0, vs_default_per_seed=[0.0] * 3)}
    rows["block64"] = _row(d * (1 + delta), vs_default=delta, vs_default_per_seed=per_seed)
    text = ablation_q8.decide(rows, 1000, [0, 1, 2], False)
    changes = verdict == "change"
    assert text.startswith("Decision: change the default to block64" if changes else "Decision: keep the default")
    assert ("block64 beats the default's mean by 0.30% but not in every seed" in text) == (verdict == "noise")
    assert ("Within +-0.2% of the default's val loss: block64." in text) == (verdict == "within")
    assert ("Worse than the default by more than 0.2%: block64." in text) == (verdict == "worse")


@pytest.mark.parametrize(
    "variant,row,reason",
    [
        ("nearest", {"dir_err_mean": 0.3}, "direction error mean is 3.00x the default's"),
        ("block64", {"v_lost_fraction": 0.001}, "decodes a nonzero v to 0"),
        ("flashoptim", {}, "not portable"),
    ],
)
def test_decision_needs_fidelity_no_lost_v_and_portability(variant, row, reason):
    """A lower val loss in every seed is not enough: the variant must also follow AdamW as closely, keep v, be exact."""
    d, per_seed = 1.5, [-0.01, -0.02, -0.03]
    rows = {"fp32": _row(d), "default": _row(d, vs_default=0.0, vs_default_per_seed=[0.0] * 3)}
    rows[variant] = _row(d * 0.98, vs_default=-0.02, vs_default_per_seed=per_seed, **row)
    text = ablation_q8.decide(rows, 1000, [0, 1, 2], False)
    assert text.startswith("Decision: keep the default"), text
    assert f"{variant} has a lower val loss" in text and reason in text
    rows[variant] = _row(d * 0.98, vs_default=-0.02, vs_default_per_seed=per_seed, dir_err_mean=0.05)
    changes = ablation_q8.decide(rows, 1000, [0, 1, 2], False).startswith(f"Decision: change the default to {variant}")
    assert changes == (variant != "flashoptim")  # fidelity and v restored: only the non-portable one stays out


def test_report_from_rewrites_the_decision_and_keeps_the_numbers(quick, tmp_path):
    out, _ = quick
    src = json.loads((out / "ablation_q8-cpu-quick.json").read_text())
    path = tmp_path / "ablation_q8-t.json"
    src["decision"] = "stale"
    path.write_text(json.dumps(src))
    out = ablation_q8.main(["--report-from", str(path)])
    assert out["decision"] != "stale" and out["decision"].startswith("(--quick")
    assert out["variants"] == src["variants"] and out["meta"]["git_commit"] == src["meta"]["git_commit"]
    md = (tmp_path / "ablation_q8-t.md").read_text()
    assert "regenerated from the run's JSON" in md and out["decision"] in md
