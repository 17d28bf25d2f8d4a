import os

import torch

# Triton kernels are tested on CPU under the interpreter; the variable must be set before
# triton (or fastamp.kernels) is imported. On a GPU machine the real device is used.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(
    not CUDA, reason="needs a CUDA device (run by benchmarks/gpu_check.sh on a GPU machine)"
)
