"""tests/interp_speedup.py is active where the suite expects it (it only saves test time)."""

import os

import interp_speedup
import pytest

triton = pytest.importorskip("triton")


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("FASTAMP_TEST_INTERP_SPEEDUP", "1") == "0",
    reason="the Triton interpreter is not in use, or the shortcut is turned off",
)
def test_the_interpreter_shortcut_is_installed_on_the_pinned_triton():
    # A triton upgrade whose interpreter changed shape leaves the suite correct but ~1.5x slower on its
    # Triton rows: this says so (re-check interp_speedup's reasoning against the new interpreter).
    assert interp_speedup.install(), f"triton {triton.__version__}: the interpreter's shape changed"
