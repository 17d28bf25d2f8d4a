"""benchmarks/bench_memory.py: bytes per param from allocated storages, checked against reference/layout.py."""

import os
import sys

import torch

import fastamp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import bench_memory  # noqa: E402


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
