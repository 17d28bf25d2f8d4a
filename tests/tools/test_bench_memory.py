"""benchmarks/bench_memory.py: bytes per param from allocated storages, checked against reference/layout.py."""

import os
import sys

import torch

import fastamp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import bench_memory  # noqa: E402
import bench_release  # noqa: E402


def test_every_fastamp_row_matches_layout_and_the_bench_passes():
    rows = bench_memory.measure_shape(3, 4099, steps=1)
    fastamp_rows = [r for r in rows if r["config"].startswith("fastamp")]
    assert len(fastamp_rows) >= 7
    for r in fastamp_rows:
        assert r["source"] == "measured", r
        assert abs(r["bpp"] - r["expected"]) <= bench_memory.TOLERANCE, r
    assert bench_memory.main(["--shape", "3x4099", "--quick"]) == 0


def test_storages_are_counted_once_and_grads_and_state_are_counted():
    p = torch.nn.Parameter(torch.zeros(1000, dtype=torch.bfloat16))
    p.grad = torch.zeros_like(p)
    opt = fastamp.optim.AdamW([p], master_weights="remainder")
    opt.step()
    nbytes, n = bench_memory.measured_bytes([p, p], opt)  # the same param twice (tied): one storage
    assert n == 2000
    # param 2 + grad 2 + remainder 2 + m 4 + v 4 bytes per element, plus the 0-dim fp32 step count
    assert nbytes == 14 * 1000 + 4


def test_a_wrapper_subclass_is_opened():
    class Wrapped(torch.Tensor):
        @staticmethod
        def __new__(cls, a, b):
            return torch.Tensor._make_wrapper_subclass(cls, a.shape, dtype=torch.float32)

        def __init__(self, a, b):
            self.a, self.b = a, b

        def __tensor_flatten__(self):
            return ["a", "b"], None

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError(func)

    seen = {}
    bench_memory._storages(Wrapped(torch.zeros(10, dtype=torch.uint8), torch.zeros(3)), seen)
    assert sorted(seen.values()) == [10, 12]


def test_flashoptim_is_computed_from_its_allocation():
    # bf16 param 2 + grad 2 + int8 error 1 + per moment (int8 code 1 + fp16 scale 2/32): 7.125
    rows = {r["config"]: r["bpp"] for r in bench_memory.computed_rows([32 * 1000])}
    assert rows["FlashOptim AdamW, 24-bit master (default)"] == 7.125
    assert rows["FlashOptim AdamW, 32-bit master"] == 8.125


def test_the_release_table_counts_storages_and_the_peak_is_one_bucket():
    """Tiny release table: bytes from storages match layout.py, peak grads = one bucket, bits equal the ordinary run."""
    rows = bench_memory.measure_release(24, 4096, steps=2, buckets_mib=[0.0])
    names = {r["config"] for r in rows}
    assert {
        "fastamp AdamW ulp8 + q8",
        "fastamp AdamW SR + q8",
        "fastamp AdamW ulp8 + q8, fp16 params + Scaler",
    } <= names
    n = 24 * 4096
    for r in rows:
        assert r["checks"] == "ok", r
        assert r["bits_0MiB"] == "ok", r
        # a bucket per param: the largest bucket is one 64x64 weight, 2 B per element (bf16/fp16 grads)
        assert r["largest_bucket_0MiB"] == 4096 * 2 / n
        assert r["peak_grads_0MiB"] <= r["largest_bucket_0MiB"] + bench_memory.PEAK_MARGIN / n
        assert r["peak_grads_0MiB"] > 0  # the samples saw the grads
        # the ordinary run holds every grad at its peak: 2 B/param more than layout.py's no-grad state
        assert abs(r["ordinary_bpp"] - r["ordinary_layout"]) <= bench_memory.TOLERANCE
        assert abs(r["release_0MiB"] - r["layout_0MiB"]) <= bench_memory.TOLERANCE
        assert r["ordinary_bpp"] - r["release_0MiB"] > 1.9


def test_release_state_bytes_come_from_storages():
    """The params + state of a release run is the storages' sum: a known config, counted by hand."""
    cfg = next(c for c in bench_memory.configs() if c["name"] == "fastamp AdamW remainder")
    run = bench_memory._TrainRun(cfg, 3, 64, 0)
    run.step(0, 64)
    assert all(p.grad is None for p in run.params)  # release freed every grad
    n = 3 * 64 * 64
    # bf16 param 2 + int16 remainder 2 + fp32 m 4 + v 4 per element, plus one 0-dim fp32 step count per param
    assert run.state_bytes() == 12 * n + 3 * 4
    assert run.peak == 64 * 64 * 2  # one weight's bf16 grad at a time
    run.h.remove()


def test_release_mode_main_writes_its_table(tmp_path):
    assert (
        bench_memory.main(
            ["--release", "--shape", "24x4096", "--release-steps", "2", "--out", str(tmp_path), "--tag", "t"]
        )
        == 0
    )
    md = (tmp_path / "bench_memory-release-t.md").read_text()
    assert "| fastamp AdamW SR + q8 |" in md and "goal" in md
    assert (tmp_path / "bench_memory-release-t.csv").exists()


def test_the_bit_check_sees_one_flipped_bit_in_the_optimizer_state():
    cfg = next(c for c in bench_memory.configs() if c["name"] == "fastamp AdamW SR + q8")
    a, b = bench_memory._TrainRun(cfg, 2, 64, None), bench_memory._TrainRun(cfg, 2, 64, 0)
    a.step(0, 64)
    b.step(0, 64)
    assert bench_release.same_run(a.params, a.opt, b.params, b.opt)
    codes = b.opt.state[b.params[1]]["exp_avg_q"]
    codes.view(-1)[7] ^= 1
    assert not bench_release.same_run(a.params, a.opt, b.params, b.opt)
    b.h.remove()
