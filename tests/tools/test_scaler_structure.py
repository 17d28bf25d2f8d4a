"""The Scaler's path to its check kernel: how many Python frames, how many backend resolutions.

``scaler.step`` with an amp-aware optimizer reaches the check kernel through its eager entry,
``Scaler.step``, the check pass and the one native-first helper shared with
``fastamp.functional`` (before the split: through a second eager entry, the
``_check_inf_per_device`` hook, ``_check_grads`` and ``_check_plain``). torch's
``torch.compiler.disable`` wrapper adds one frame per eager entry once torch._dynamo is imported
(constructing any ``torch.optim`` optimizer imports it). The backend is resolved once per check
pass and device, also when the native kernel refuses its input and the per-grad path runs
(before: up to three times).
"""

import subprocess
import sys

import pytest
import torch
from helpers import spy_kernels
from torch import nn

import fastamp
from fastamp import backends

_CHECK_OPS = ("unscale_check_", "unscale_check_stats_")
_NATIVE = backends.available("native", "unscale_check_", "cpu")[0]


def _model(seed=0):
    torch.manual_seed(seed)
    return fastamp.cast_model(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.float16)


def _backward(model, scaler, *, strided=False):
    model.zero_grad(set_to_none=True)
    scaler.scale(model(torch.randn(4, 8, dtype=torch.float16)).float().square().mean()).backward()
    if strided:  # same values, not contiguous: the native kernel refuses, the per-grad path runs
        model[0].weight.grad = model[0].weight.grad.t().contiguous().t()


def _iteration(model, scaler, opt):
    """One scaled backward, step and update; whether the step was skipped."""
    _backward(model, scaler)
    scaler.step(opt)
    scaler.update()
    return scaler.last_step_skipped


@pytest.fixture
def kernel_frames(monkeypatch):
    """Frames between ``caller`` and each check kernel call, as (file, function) from the outermost."""
    calls = []

    def wrap(op, backend, impl):
        if op not in _CHECK_OPS:
            return impl

        def kernel(*args):
            frames, f = [], sys._getframe(1)
            while f is not None and f.f_code is not _caller.__code__:
                frames.append((f.f_code.co_filename, f.f_code.co_name))
                f = f.f_back
            calls.append((backend, frames[::-1]))
            return impl(*args)

        return kernel

    spy_kernels(monkeypatch, wrap)
    return calls


@pytest.fixture
def resolutions(monkeypatch):
    """The check ops ``backends.resolve`` was asked about, in order."""
    asked = []
    real = backends.resolve

    def resolve(op, device, backend=None):
        if op in _CHECK_OPS:
            asked.append(op)
        return real(op, device, backend)

    monkeypatch.setattr(backends, "resolve", resolve)
    return asked


def _caller(fn, *args):
    return fn(*args)


def _is_torch_disable_wrapper(frame):
    filename, name = frame
    return name == "_fn" and filename.replace("\\", "/").endswith("torch/_dynamo/eval_frame.py")


@pytest.mark.skipif(not _NATIVE, reason="the one-call path needs fastamp._C")
@pytest.mark.parametrize("track_stats", [False, True], ids=["plain", "stats"])
def test_step_reaches_the_check_kernel_in_four_frames(kernel_frames, track_stats):
    model = _model()
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = fastamp.Scaler(init_scale=2.0**8, track_stats=track_stats)
    _backward(model, scaler)
    _caller(scaler.step, opt)
    scaler.update()
    assert len(kernel_frames) == 1
    backend, frames = kernel_frames[0]
    ours = [name for filename, name in frames if not _is_torch_disable_wrapper((filename, name))]
    assert backend == "native"
    assert ours == ["entry", "step", "_check_grads", "_native_fast_path"], frames
    assert len(frames) - len(ours) <= 1, frames  # torch's disable wrapper of the one eager entry


@pytest.mark.filterwarnings("ignore::fastamp.health.AmpPitfallWarning")  # SGD on fp16 params, on purpose
@pytest.mark.parametrize("strided", [False, True], ids=["one_call", "per_grad"])
@pytest.mark.parametrize("track_stats", [False, True], ids=["plain", "stats"])
def test_backend_resolved_once_per_check(resolutions, strided, track_stats):
    model = _model()
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = fastamp.Scaler(init_scale=2.0**8, track_stats=track_stats)
    _backward(model, scaler, strided=strided)
    scaler.step(opt)
    assert resolutions == ["unscale_check_stats_" if track_stats else "unscale_check_"]
    scaler.update()

    resolutions.clear()
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    _backward(model, scaler, strided=strided)
    scaler.unscale_(sgd)
    assert len(resolutions) == 1
    scaler.update()

    resolutions.clear()
    _backward(model, scaler, strided=strided)
    scaler.clip_grad_norm_(sgd, 1e-3)  # an ordinary optimizer: a check pass, then an unscale+clip pass
    assert len(resolutions) == 2
    scaler.step(sgd)
    scaler.update()


def test_functional_unscale_check_resolves_once_when_the_native_kernel_refuses(resolutions):
    grads = [torch.ones(4, 4).t(), torch.ones(3, dtype=torch.float64)]  # strided, fp64: the Python path
    found_inf = torch.zeros(())
    total = fastamp.functional.unscale_check_(grads, found_inf, torch.full((), 0.5), compute_sumsq=True)
    assert resolutions == ["unscale_check_"]
    assert total.item() == 16 * 0.25 + 3 * 0.25 and found_inf.item() == 0.0


def test_step_still_calls_an_overridden_check_inf_hook():
    """torch's step calls _check_inf_per_device: a subclass that overrides it is still called."""
    seen = []

    class Logged(fastamp.Scaler):
        def _check_inf_per_device(self, optimizer):
            seen.append(optimizer)
            return super()._check_inf_per_device(optimizer)

    model = _model()
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3)
    assert _iteration(model, Logged(init_scale=2.0**8), opt) is False
    assert seen == [opt]


@pytest.mark.skipif(not _NATIVE, reason="the one-call path needs fastamp._C")
@pytest.mark.filterwarnings("ignore::fastamp.health.AmpPitfallWarning")  # SGD on fp16 params, on purpose
@pytest.mark.parametrize("entry", ["step", "unscale_"])
def test_ordinary_optimizer_reaches_the_check_kernel_through_one_eager_entry(kernel_frames, entry):
    """An ordinary optimizer's check runs in torch's hooks (unscale_, then _unscale_grads_), entered once.

    Before: every nested hook went through its own eager entry and, once torch._dynamo was
    imported, torch's disable wrapper (step: 11 frames to the kernel, unscale_: 8).
    """
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = fastamp.Scaler(init_scale=2.0**8)
    _backward(model, scaler)
    _caller(getattr(scaler, entry), sgd)
    if entry == "unscale_":
        scaler.step(sgd)
    scaler.update()
    assert len(kernel_frames) == 1
    backend, frames = kernel_frames[0]
    ours = [name for filename, name in frames if not _is_torch_disable_wrapper((filename, name))]
    hooks = ["unscale_", "_unscale_grads_", "_check_grads", "_native_fast_path"]
    expected = ["entry", "step", *hooks] if entry == "step" else ["entry", *hooks]
    assert backend == "native"
    assert ours == expected, frames
    assert len(frames) - len(ours) <= 1, frames  # torch's disable wrapper of the one eager entry


@pytest.mark.filterwarnings("ignore::fastamp.health.AmpPitfallWarning")  # SGD on fp16 params, on purpose
def test_step_still_calls_overridden_unscale_hooks():
    """torch's step calls unscale_, which calls _unscale_grads_: overrides of either are still called."""
    seen = []

    class Logged(fastamp.Scaler):
        def unscale_(self, optimizer):
            seen.append("unscale_")
            return super().unscale_(optimizer)

        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            seen.append("_unscale_grads_")
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    assert _iteration(model, Logged(init_scale=2.0**8), sgd) is False
    assert seen == ["unscale_", "_unscale_grads_"]

    patched = fastamp.Scaler(init_scale=2.0**8)  # an attribute set on the instance is called too
    real = patched.unscale_
    patched.unscale_ = lambda optimizer: (seen.append("patched"), real(optimizer))[1]
    assert _iteration(model, patched, sgd) is False
    assert seen[-1] == "patched"


def test_import_fastamp_does_not_import_dynamo():
    """``import fastamp`` stays cheap: torch._dynamo (about half of its time otherwise) loads at the first Scaler."""
    code = (
        "import sys, fastamp\n"
        "assert 'torch._dynamo' not in sys.modules, 'import fastamp imported torch._dynamo'\n"
        "fastamp.Scaler()\n"
        "assert 'torch._dynamo' in sys.modules\n"
        "assert fastamp.scaler.compiled._traced_backend._dynamo_marked_constant\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
