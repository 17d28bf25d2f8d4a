"""Determinism: identical inputs give bit-identical results across runs and thread counts.

Each run is a fresh process (``tests/e2e/_scripts/determinism_run.py``) with 1 or 2 intra-op
threads: the native CPU kernels split their work across threads, and the sum of squares is
reduced in a fixed chunk order, so the results must not depend on the split.
"""

import os
import subprocess
import sys

import pytest
import torch

from fastamp import backends

SCRIPT = os.path.join(os.path.dirname(__file__), "_scripts", "determinism_run.py")

# slow: the fresh-process runs (the ``runs`` fixture) take ~30 s
pytestmark = [
    pytest.mark.skipif(
        not backends.available("native", "unscale_check_", "cpu")[0], reason="native CPU kernels not built"
    ),
    pytest.mark.slow,
]


def _run(threads, out):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(
        [sys.executable, SCRIPT, str(threads), str(out)], env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("det")
    return {"1a": _run(1, d / "1a.pt"), "1b": _run(1, d / "1b.pt"), "2": _run(2, d / "2.pt")}


def _equal(a, b, path=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def test_bit_identical_across_runs(runs):
    _equal(runs["1a"], runs["1b"])


def test_bit_identical_across_thread_counts(runs):
    _equal(runs["1a"], runs["2"])
    assert float(runs["2"]["found"]) == 0.0
    assert float(runs["2"]["sumsq_fp32"]) > 0


def test_in_process_repeat_is_bit_identical():
    # the same call twice in one process (scratch buffers, chunk order) and vs 2 threads
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(n, generator=g) for n in (5, 200_003, 70_000)]
    outs = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 1, 2):
            torch.set_num_threads(threads)
            outs.append(torch.ops.fastamp.unscale_check_(grads, torch.zeros(()), torch.ones(()), False, True))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
