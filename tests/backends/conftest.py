import pytest
import torch
from helpers import native_cpu_isas


@pytest.fixture(params=native_cpu_isas())
def isa(request, monkeypatch):
    """Each instruction-set path of the C++ CPU kernels this machine runs (``FASTAMP_CPU_ISA``
    lowers the one they pick; ``torch.ops.fastamp.cpu_isa()`` says which runs)."""
    monkeypatch.setenv("FASTAMP_CPU_ISA", request.param)
    assert torch.ops.fastamp.cpu_isa() == request.param
    return request.param
