import os
from pathlib import Path

import torch

# Triton kernels are tested on CPU under the interpreter; the variable must be set before
# triton (or fastamp.kernels) is imported. On a GPU machine the real device is used.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("FASTAMP_TEST_INTERP_SPEEDUP", "1") != "0":
    # skip the interpreter's language re-patch on every @triton.jit helper call (see the module;
    # FASTAMP_TEST_INTERP_SPEEDUP=0 runs triton's interpreter as it is)
    from interp_speedup import install as _install_interp_speedup  # noqa: E402

    _install_interp_speedup()

# Each folder is a tier; its tests get the tier's marker (declared in pyproject.toml, see tests/README.md).
TIERS = ("spec", "backends", "api", "e2e", "tools")
_TESTS = Path(__file__).resolve().parent
_NO_CUDA = "needs a CUDA device (run by benchmarks/gpu_check.sh on a GPU machine)"


def pytest_configure(config):
    """``FASTAMP_TEST_INSTALLED=1`` (the CUDA-build tier): the fastamp under test is the installed one."""
    if os.environ.get("FASTAMP_TEST_INSTALLED") == "1":
        import importlib.util

        origin = getattr(importlib.util.find_spec("fastamp"), "origin", None) or ""
        if "site-packages" not in origin:
            raise pytest.UsageError(f"FASTAMP_TEST_INSTALLED=1 but fastamp would be imported from {origin!r}")


def pytest_collection_modifyitems(config, items):
    """Tier markers from the folder; ``gpu`` on every test that needs CUDA, and its skip where there is none.

    A test needs CUDA when it carries ``pytest.mark.gpu`` (``helpers.requires_cuda``; an optional
    ``reason=`` says more) or is parametrised on ``device``/``dev`` = ``"cuda"``.
    """
    cuda = torch.cuda.is_available()
    for item in items:
        try:
            tier = item.path.resolve().relative_to(_TESTS).parts[0]
        except ValueError:
            tier = None
        if tier in TIERS:
            item.add_marker(tier)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "cuda" in (params.get("device"), params.get("dev")) and item.get_closest_marker("gpu") is None:
            item.add_marker("gpu")
        gpu = item.get_closest_marker("gpu")
        if gpu is not None and not cuda:
            item.add_marker(pytest.mark.skip(reason=gpu.kwargs.get("reason", _NO_CUDA)))


@pytest.fixture
def fresh_dynamo():
    """dynamo's caches and counters empty before and after a compile test (its compiles are counted)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
