"""Smoke tests of the microbenchmark suite: tiny sizes, one round; no timing assertions."""

import argparse
import csv
import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

BENCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "benchmarks")
sys.path.insert(0, BENCH_DIR)

import bench_adamw  # noqa: E402
import bench_lowbit  # noqa: E402
import bench_q8_rules  # noqa: E402
import bench_release  # noqa: E402
import bench_step  # noqa: E402
import bench_unscale  # noqa: E402
import common  # noqa: E402
import gpu_cost_model  # noqa: E402


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


ARGS = ["--quick", "--configs", "40x16", "--rounds", "1", "--device", "cpu"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "module, name, scenarios, extra",
    [
        (
            bench_unscale,
            "bench_unscale",
            {"unscale+clip", "unscale+norm", "check+norm", "check+stats", "unscale+stats"},
            [],
        ),
        (bench_adamw, "bench_adamw", {"adamw"}, []),
        # bf16 only (the default is bf16,fp32): each compiled row (inductor) costs ~8 s here, and the fastamp fp32
        # rows, compiled or not, run the same bench code with another dtype (the torch rows still run fp32); the
        # compiled fp32 step itself is checked bit for bit in tests/api/test_compile_scaler.py (adamw-fp32-clip)
        (bench_step, "bench_step", {"step"}, ["--dtypes", "bf16"]),
    ],
    ids=["bench_unscale", "bench_adamw", "bench_step"],
)
def test_benchmark_runs_checks_and_reports(tmp_path, module, name, scenarios, extra):
    rows = module.main(ARGS + extra + ["--out", str(tmp_path), "--tag", "t", "--no-plot"])
    assert {r["scenario"] for r in rows} == scenarios
    providers = {r["provider"] for r in rows}
    assert "torch" in providers and "fastamp-torch" in providers
    # The Triton interpreter is never timed on CPU.
    assert "fastamp-triton" not in providers
    for r in rows:
        assert r["check"] == "ok", r
        assert r["ms"] > 0 and r["gbps"] > 0
        assert r["gbps"] == pytest.approx(r["bytes_per_elem"] * r["numel"] / (r["ms"] / 1e3) / 1e9)
        # every row has a ceiling of its own bytes, timed in the same run
        assert r["traffic"] and common.traffic_bytes(r["traffic"]) == r["bytes_per_elem"]
        assert r["ceiling_gbps"] == pytest.approx(r["bytes_per_elem"] * r["numel"] / (r["ceiling_ms"] / 1e3) / 1e9)
        assert r["of_ceiling"] == pytest.approx(r["gbps"] / r["ceiling_gbps"])
        if r["provider"].startswith("fastamp"):
            assert r["speedup_vs_torch"] > 0
    on_disk = _read_csv(tmp_path / f"{name}-t.csv")
    assert len(on_disk) == len(rows)
    assert all(float(r["ceiling_gbps"]) > 0 for r in on_disk)
    md = (tmp_path / f"{name}-t.md").read_text()
    for key in ("date", "cpu", "torch", "git_commit", "command", "ceilings", "of ceiling", "load_avg_at_end"):
        assert key in md
    for spec in {r["traffic"] for r in rows}:
        assert f"`{spec}`" in md  # what each ceiling ran is written down


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


@pytest.mark.slow
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


def test_configs():
    parser = __import__("argparse").ArgumentParser()
    common.add_common_args(parser)
    args = parser.parse_args([])
    cfgs = common.parse_configs(args, torch.device("cpu"))
    assert (256, 262144) in cfgs and (20000, 256) in cfgs  # the two targets
    with pytest.raises(SystemExit, match="NxM"):
        common.parse_configs(parser.parse_args(["--configs", "256"]), torch.device("cpu"))


def test_traffic_counts_reads_plus_writes():
    assert common.traffic_bytes("g:r2 master:rw4 m:rw4 v:rw4 p:w2") == 28
    assert common.traffic_bytes("g:rw4 ; g:r4 ; g:rw4") == 20
    for bad in ("g:x2", "g:r3", "g", "g:r2 ;", "g:rw", "g:r2 g:rw2"):
        with pytest.raises(ValueError, match="traffic"):
            common.parse_traffic(bad)
    with pytest.raises(ValueError, match="moves 28"):
        common.Provider("p", "s", "bf16", 30, lambda: None, traffic="g:r2 master:rw4 m:rw4 v:rw4 p:w2")


class _CountTraffic(TorchDispatchMode):
    """Bytes each aten op of a ceiling reads and writes; any other op (a temporary, a cast) fails."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__

        def nbytes(t):
            return t.numel() * t.element_size() if isinstance(t, torch.Tensor) and t.dim() > 0 else 0

        if name == "bitwise_xor_":  # in place: self read and written, the other operand read
            self.bytes += 2 * nbytes(args[0]) + nbytes(args[1])
        elif name == "copy_":  # dst written, src read
            assert args[0].dtype == args[1].dtype  # no conversion
            self.bytes += nbytes(args[0]) + nbytes(args[1])
        elif name == "fill_":
            self.bytes += nbytes(args[0])
        elif name == "sum":
            assert args[0].dtype == torch.float32
            self.bytes += nbytes(args[0])
        else:
            raise AssertionError(f"the ceiling ran {func}: not an in-place stream op")
        return func(*args, **(kwargs or {}))


def _all_traffic():
    ns = __import__("argparse").Namespace
    out = set()
    for mod, dtypes in ((bench_adamw, ",".join(bench_adamw.DTYPES)), (bench_unscale, "fp32,bf16,fp16"),
                        (bench_step, "fp32,bf16,fp16")):  # fmt: skip
        for p in mod.make_providers(ns(dtypes=dtypes), torch.device("cpu"))(2, 8, ["torch"]):
            assert p.traffic, p
            out.add(p.traffic)
    # bench_lowbit's rows (1-byte streams: ulp8 corrections, 4-bit codes)
    out.update(t for _, t, _ in bench_lowbit.FASTAMP.values())
    out.update(t for _, t, _ in bench_lowbit.OTHERS.values())
    return sorted(out)


@pytest.mark.parametrize("spec", _all_traffic())
def test_ceiling_moves_exactly_the_providers_bytes(spec):
    """Counted from the aten ops it runs: bytes = traffic_bytes x elements, no other op, data finite."""
    numel = 1001
    pool = {}
    run, what = common.ceiling(spec, numel, torch.device("cpu"), pool)
    before = {k: v.clone() for k, v in pool.items()}
    with _CountTraffic() as c:
        run()
    assert c.bytes == pytest.approx(common.traffic_bytes(spec) * numel, abs=4 * len(pool))  # fp32 sum: whole words
    run()
    for k, v in pool.items():
        assert torch.isfinite(v).all(), (spec, k, what)
    # The CUDA ceiling (a device copy of the same bytes) is device-agnostic code: count it here too.
    copy, _ = common._cuda_ceiling(spec, numel, torch.device("cpu"), {})
    with _CountTraffic() as cc:
        copy()
    assert cc.bytes == pytest.approx(common.traffic_bytes(spec) * numel, abs=1)
    streams = [s for p in common.parse_traffic(spec) for s in p]
    for s in streams:
        assert s.name in what
        if all(t.role == "r" for t in streams if t.name == s.name):
            assert torch.equal(pool[(s.name, s.size)], before[(s.name, s.size)]), f"{s.name} is read only"


def test_ceiling_ops_for_a_bf16_master_step():
    run, what = common.ceiling("g:r2 master:rw4 m:rw4 v:rw4 p:w2", 64, torch.device("cpu"))
    assert what == "[master m v] ^= k; p.copy_(g)"  # the streams with no partner: one op over one allocation
    run, what = common.ceiling("g:r4 ; p:rw4 g:r4 m:rw4 v:rw4 ; x:w2 ; m:rw4", 64, torch.device("cpu"))
    assert what == "g.sum(); p ^= g; m ^= k; v ^= k; x.fill_(k); m ^= k"  # m is in two passes: no block


def test_triton_interpreter_is_not_a_timed_backend():
    ok, skipped = common.timable_backends("unscale_check_", torch.device("cpu"))
    assert "triton" not in ok and "torch" in ok
    assert any("triton" in s and "interpreter" in s.lower() for s in skipped)
    with pytest.raises(SystemExit, match="unknown backend"):
        common.timable_backends("unscale_check_", torch.device("cpu"), "cuda-magic")


@pytest.mark.slow
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
    assert by_name["fastamp AdamW alone, bf16-q8"] == 14  # + 1/8 B of block scales, not counted
    assert by_name["fastamp AdamW alone, bf16-ulp8-q8"] == 12 and by_name["fastamp step, bf16-ulp8-q8"] == 14
    for kind, (*_, nbytes) in bench_adamw.KINDS.items():  # every kind bench_adamw has, with its bytes
        assert by_name[f"fastamp AdamW alone, {kind}"] == nbytes
        assert by_name[f"fastamp step, {kind}"] == nbytes + bench_adamw.DTYPES[kind].itemsize
    out = tmp_path / "model.md"
    text = gpu_cost_model.main(["--bandwidth-gbs", "1000", "--sizes", "1e9", "--out", str(out)])
    # 1e9 params x 30 B at 1,000 GB/s = 30 ms
    assert "| fastamp step, bf16 | 30 | 30.000 |" in text
    assert out.read_text() == text


def test_bench_progress_bar_stays_within_the_terminal_width(monkeypatch):
    """``make bench``'s progress line is redrawn with a carriage return: wider than the terminal it wraps and
    scrolls at every update (it was padded to 150 columns)."""
    import io

    from fastamp._harness import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("COLUMNS", "80")
    out = Tty()
    bar = Progress(3, label="bench_adamw with a long label", stream=out)
    for _ in range(3):
        bar.update(msg="config 64x262144 bf16 native and a long message " * 3)
    frames = out.getvalue().replace("\n", "\r").split("\r")
    assert len([f for f in frames if f]) == 3
    assert all(len(f) < 80 for f in frames)


def test_bench_release_checks_and_reports_the_peak_of_live_grads(tmp_path):
    """24 small layers, buckets of ~2 layers and of one param: each release row checked bit for bit, peak <= goal."""
    rows = bench_release.main(
        [
            "--quick",
            "--buckets-mib",
            "0.02,0",
            "--amp-buckets-mib",
            "0.02,0",
            "--steps",
            "1",
            "--check-steps",
            "2",
            "--out",
            str(tmp_path),
            "--tag",
            "t",
        ]
    )
    assert [r["provider"] for r in rows] == [
        "ordinary",
        "release-0.02MiB",
        "release-0MiB",
        "ordinary-amp",  # fp16 + fastamp.Scaler + a binding clip: the two-backward release
        "release-amp-0.02MiB",
        "release-amp-0MiB",
    ]
    for ordinary, *released in (rows[:3], rows[3:]):
        for r in released:
            assert r["check"] == "ok", r
            assert r["meets_goal"] is True, r
            assert r["peak_live_grads_mib"] < ordinary["peak_live_grads_mib"], r
        assert released[1]["buckets"] == 48  # 24 weights + 24 biases
    assert len(_read_csv(tmp_path / "bench_release-t.csv")) == 6
    md = (tmp_path / "bench_release-t.md").read_text()
    assert "| release-0MiB | ok |" in md and "| release-amp-0MiB | ok |" in md


def test_bench_lowbit_times_every_fastamp_8bit_config(tmp_path):
    """Optimizer-level rows (torch fused fp32, our 10-B config and every q8 config), each checked first."""
    args = ["--quick", "--configs", "2x4099", "--rounds", "1", "--device", "cpu", "--out", str(tmp_path), "--no-plot"]
    rows = bench_lowbit.main(args + ["--tag", "t", "--providers", ",".join(["torch", *bench_lowbit.FASTAMP])])
    by = {r["provider"]: r for r in rows}
    assert set(by) == {"torch", *bench_lowbit.FASTAMP}
    for r in rows:
        assert r["check"] == "ok", r
        assert r["ms"] > 0 and common.traffic_bytes(r["traffic"]) == r["bytes_per_elem"]
        # one round, yet every ceiling timed CEILING_MIN_SAMPLES times (a median of 3 once read 3x "of ceiling")
        assert r["ceiling_samples"] >= common.CEILING_MIN_SAMPLES, r
        assert 0 < r["ceiling_ms_min"] <= r["ceiling_ms"], r
    assert by["fastamp ulp8+q8"]["bytes_per_elem"] == 12 and by["fastamp SR+q8"]["bytes_per_elem"] == 10
    md = (tmp_path / "bench_lowbit-t.md").read_text()
    assert "Time over fastamp 10-B's" in md


def test_bench_lowbit_check_fails_when_no_step_happens():
    """The check every low-bit provider passes before it is timed can fail: an lr-0 'optimizer' moves nothing."""
    with pytest.raises(AssertionError, match="cosine"):
        bench_lowbit._check(lambda ps, lr: torch.optim.SGD(ps, lr=0.0))
    assert "cosine" in bench_lowbit._check(bench_lowbit._fastamp_factory({"state_format": "q8"}, None))


@pytest.mark.parametrize("per", [8192, 300], ids=["8-bit-state", "below-lowbit_min_numel"])
def test_bench_lowbit_rows_claim_the_bytes_their_optimizers_stream(per):
    """Each row's B/elem (and so its ceiling's traffic) is what its optimizer's tensors stream, at its size.

    At 20,000 x 256 the 8-bit optimizers keep dense moments (params below 4096 elements): rows that
    claimed their 8-bit bytes there (10 B for 22) were caught by this. 8192 and 300 elements: no
    block-scale or code-book tensor has a param's size or half of it. torchao and bitsandbytes
    rows are counted where they import (setup compiles torchao's step: slow).
    """
    args = argparse.Namespace(providers=None, backends=None)
    build, _ = bench_lowbit.make_providers(args, torch.device("cpu"))
    provs = build(2, per, ["native"])
    assert {"torch", *bench_lowbit.FASTAMP} <= {p.name for p in provs}
    for p in provs:
        opt = p.setup().__self__  # setup returns the bound opt.step, after one step made the state
        assert bench_lowbit.streamed_bytes_per_elem(opt) == p.bytes_per_elem == common.traffic_bytes(p.traffic), p.name


def test_ceilings_get_their_samples_however_few_the_rounds():
    """A CPU ceiling runs back to back within a round until it has CEILING_MIN_SAMPLES timed runs; CUDA's copy never."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for rounds in (1, 2, 3, 7, 15, 30):
        assert rounds * common.ceiling_repeats(rounds, cpu) >= common.CEILING_MIN_SAMPLES
        assert rounds * (common.ceiling_repeats(rounds, cpu) - 1) < common.CEILING_MIN_SAMPLES  # one fewer is too few
        assert common.ceiling_repeats(rounds, cuda) == 1
    runs = []
    sampler = common._CeilingSamples(lambda: runs.append(1), cpu, repeats=5)
    for _ in range(4):  # time_interleaved's estimate (not kept), then 3 rounds
        sampler()
    assert len(runs) == 16 and sampler.stats()["rounds"] == 15


def test_q8_rules_bench_times_every_row_and_compares_with_its_dense_step(capsys):
    rows = bench_q8_rules.measure(2, 4099, repeats=1)
    assert [r["name"] for r in rows] == [name for name, _, _ in bench_q8_rules.rows_of(2, 4099)]
    assert all(r["ms"] > 0 for r in rows)
    q8_rows = [r for r in rows if r["base"]]
    assert len(q8_rows) == 2 and all(r["ratio"] > 0 for r in q8_rows)
    assert bench_q8_rules.main(["--shapes", "2x4099,3x65", "--threads", "1", "--repeats", "1"]) == 0
    assert "| fastamp Lion q8 |" in capsys.readouterr().out


def test_table_layout_probe_times_every_layout_on_the_same_bits(capsys, monkeypatch):
    pytest.importorskip("fastamp._C", reason="the probe times the native optim_ table")
    import probe_table_layout

    res = probe_table_layout.probe(40, 64, reps=1)  # raises where a layout's params differ in one bit
    assert list(res) == list(probe_table_layout.LAYOUTS)
    assert all(t["checks"] > 0 and t["checks+kernel"] > 0 for t in res.values())
    monkeypatch.setattr(sys, "argv", ["probe_table_layout.py", "--n", "8", "--m", "32", "--reps", "1"])
    probe_table_layout.main()
    assert "| flat-states |" in capsys.readouterr().out
