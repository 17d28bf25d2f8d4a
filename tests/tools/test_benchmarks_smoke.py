"""Smoke tests of the microbenchmark suite: tiny sizes, one round; no timing assertions."""

import csv
import os
import sys

import pytest
import torch

BENCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "benchmarks")
sys.path.insert(0, BENCH_DIR)

import bench_adamw  # noqa: E402
import bench_step  # noqa: E402
import bench_unscale  # noqa: E402
import common  # noqa: E402
import gpu_cost_model  # noqa: E402


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


ARGS = ["--quick", "--configs", "40x16", "--rounds", "1", "--device", "cpu"]


@pytest.mark.parametrize(
    "module, name, scenarios",
    [
        (
            bench_unscale,
            "bench_unscale",
            {"unscale+clip", "unscale+norm", "check+norm", "check+stats", "unscale+stats"},
        ),
        (bench_adamw, "bench_adamw", {"adamw"}),
        (bench_step, "bench_step", {"step"}),
    ],
)
def test_benchmark_runs_checks_and_reports(tmp_path, module, name, scenarios):
    rows = module.main(ARGS + ["--out", str(tmp_path), "--tag", "t", "--no-plot"])
    assert {r["scenario"] for r in rows} == scenarios
    providers = {r["provider"] for r in rows}
    assert "torch" in providers and "fastamp-torch" in providers
    # The Triton interpreter is never timed on CPU.
    assert "fastamp-triton" not in providers
    for r in rows:
        assert r["check"] == "ok", r
        assert r["ms"] > 0 and r["gbps"] > 0 and r["of_triad"] > 0
        assert r["gbps"] == pytest.approx(r["bytes_per_elem"] * r["numel"] / (r["ms"] / 1e3) / 1e9)
        if r["provider"].startswith("fastamp"):
            assert r["speedup_vs_torch"] > 0
    on_disk = _read_csv(tmp_path / f"{name}-t.csv")
    assert len(on_disk) == len(rows)
    assert float(on_disk[0]["ceiling_triad_gbps"]) > 0
    md = (tmp_path / f"{name}-t.md").read_text()
    for key in ("date", "cpu", "torch", "git_commit", "command", "triad"):
        assert key in md


def test_bytes_per_element_are_counted_per_provider(tmp_path):
    rows = bench_unscale.main(
        ["--quick", "--configs", "3x100", "--rounds", "1", "--out", str(tmp_path), "--no-plot", "--dtypes", "bf16"]
    )
    by = {(r["scenario"], r["provider"]): r["bytes_per_elem"] for r in rows}
    assert by[("unscale+clip", "torch")] == 20  # fp32: unscale r+w, norm r, clip r+w
    assert by[("unscale+norm", "torch")] == 12
    assert by[("unscale+clip", "fastamp-torch")] == 6  # bf16: check r, unscale*clip r+w
    assert by[("unscale+norm", "fastamp-torch")] == 4
    assert by[("check+norm", "fastamp-torch")] == 2
    assert by[("check+stats", "fastamp-torch")] == 2  # same pass; the per-tensor stats are not counted
    assert by[("unscale+stats", "fastamp-torch")] == 4


def test_adamw_rows_count_the_bytes_of_each_master_kind(tmp_path):
    rows = bench_adamw.main(ARGS + ["--out", str(tmp_path), "--no-plot", "--backends", "torch"])
    by = {r["dtype"]: r["bytes_per_elem"] for r in rows if r["provider"] == "fastamp-torch"}
    assert by == {"fp32": 28, "bf16": 28, "bf16-remainder": 26, "bf16-sr": 22, "bf16-10B": 18}
    assert all(r["check"] == "ok" for r in rows)
    md = (tmp_path / "bench_adamw-cpu-quick.md").read_text()
    assert "Remainder masters vs fp32 masters" in md and "bf16-remainder:" in md


def test_stats_overhead_is_summarised(tmp_path):
    bench_unscale.main(ARGS + ["--out", str(tmp_path), "--no-plot", "--backends", "torch", "--dtypes", "bf16"])
    md = (tmp_path / "bench_unscale-cpu-quick.md").read_text()
    assert "Gradient statistics overhead" in md
    assert "check+stats bf16:" in md and "unscale+stats bf16:" in md


def test_stats_check_catches_wrong_counts():
    impl = bench_unscale.fastamp_with_stats("torch", False)

    def wrong(params, grads, found_inf, inv_scale, max_norm):
        out = impl(params, grads, found_inf, inv_scale, max_norm)
        impl.stats[0][0, 1] += 1  # one zero too many
        wrong.stats = impl.stats
        return out

    check = bench_unscale.make_stats_check(wrong, False, torch.bfloat16, torch.device("cpu"))
    with pytest.raises(AssertionError, match="counts"):
        check()
    assert "counts exact" in bench_unscale.make_stats_check(impl, False, torch.bfloat16, torch.device("cpu"))()


def test_plot_is_written(tmp_path):
    bench_adamw.main(ARGS + ["--out", str(tmp_path), "--tag", "p"])
    png = tmp_path / "bench_adamw-p.png"
    assert png.exists() and png.stat().st_size > 10_000


def test_a_provider_failing_its_check_is_not_timed(tmp_path):
    calls = []

    def make(n, per, backends):
        def bad_check():
            raise AssertionError("wrong answer")

        return [
            common.Provider("torch", "s", "fp32", 4, lambda: lambda: calls.append("torch"), None),
            common.Provider("broken", "s", "fp32", 4, lambda: lambda: calls.append("broken"), bad_check, "torch"),
        ]

    parser = __import__("argparse").ArgumentParser()
    common.add_common_args(parser)
    args = parser.parse_args(["--quick", "--configs", "2x8", "--rounds", "1", "--out", str(tmp_path), "--no-plot"])
    rows = common.run_benchmark(args, "fake", "adamw_", make, "fake")
    broken = next(r for r in rows if r["provider"] == "broken")
    assert broken["check"].startswith("FAILED") and "wrong answer" in broken["check"]
    assert "ms" not in broken
    assert "broken" not in calls and "torch" in calls
    assert "Failed the check" in (tmp_path / "fake-cpu-quick.md").read_text()


def test_check_catches_a_wrong_result():
    with pytest.raises(AssertionError, match="grad"):
        common.assert_close("grad[0]", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.1]))
    with pytest.raises(AssertionError):
        common.assert_close("x", torch.tensor([float("nan")]), torch.tensor([0.0]))
    assert common.assert_close("x", torch.tensor([1.0, float("nan")]), torch.tensor([1.0, float("nan")])) == 0.0


def test_configs_and_ceiling():
    parser = __import__("argparse").ArgumentParser()
    common.add_common_args(parser)
    args = parser.parse_args([])
    cfgs = common.parse_configs(args, torch.device("cpu"))
    assert (256, 262144) in cfgs and (20000, 256) in cfgs  # the two targets
    with pytest.raises(SystemExit, match="NxM"):
        common.parse_configs(parser.parse_args(["--configs", "256"]), torch.device("cpu"))
    c = common.measure_ceiling(torch.device("cpu"), numel=1 << 16, rounds=2)
    assert c["triad_gbps"] > 0 and c["copy_gbps"] > 0
    assert c["triad_gbps"] >= c["triad_gbps_median"]


def test_triton_interpreter_is_not_a_timed_backend():
    ok, skipped = common.timable_backends("unscale_check_", torch.device("cpu"))
    assert "triton" not in ok and "torch" in ok
    assert any("triton" in s and "interpreter" in s.lower() for s in skipped)
    with pytest.raises(SystemExit, match="unknown backend"):
        common.timable_backends("unscale_check_", torch.device("cpu"), "cuda-magic")


def test_sync_check_dry_run_on_cpu(tmp_path):
    # The sync counting itself needs CUDA (benchmarks/gpu_check.sh); this exercises the code
    # paths (every configuration, the injected inf) so a GPU run is not wasted on a bug.
    import json

    import sync_check

    assert (
        sync_check.main(["--device", "cpu", "--steps", "2", "--dim", "16", "--seq-len", "16", "--out", str(tmp_path)])
        == 0
    )
    res = json.loads((tmp_path / "sync_check.json").read_text())["results"]
    assert {r["config"] for r in res} == set(sync_check.CONFIGS)
    assert all(r["error_mode"] == "ok" and not r["warn_mode_error"] for r in res)


def test_gpu_cost_model_bytes_match_the_benchmarks(tmp_path):
    """The floors use the benchmarks' own byte counts: the whole bf16 step moves 30 B/param, torch's 48."""
    by_name = {name: nbytes for name, nbytes, _ in gpu_cost_model.rows()}
    assert by_name["torch fp32 step (GradScaler + clip_grad_norm_ + AdamW(fused))"] == 48
    assert by_name["fastamp step, bf16"] == 30
    assert by_name["fastamp AdamW alone, bf16-10B"] == 18
    out = tmp_path / "model.md"
    text = gpu_cost_model.main(["--bandwidth-gbs", "1000", "--sizes", "1e9", "--out", str(out)])
    # 1e9 params x 30 B at 1,000 GB/s = 30 ms
    assert "| fastamp step, bf16 | 30 | 30.000 |" in text
    assert out.read_text() == text
