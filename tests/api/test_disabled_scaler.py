"""``fastamp.Scaler(enabled=False)`` used by hand: every public method as torch's disabled GradScaler.

A disabled scaler is what ``Scaler("cuda")`` gives on a machine without CUDA (as torch's), what
``GradScalerKwargs(enabled=False)`` gives in Accelerate, and what a user writes to switch loss
scaling off without changing the loop. torch's disabled ``GradScaler`` keeps none of its settings:
``scale`` returns its input, ``unscale_`` and ``update`` do nothing, ``step`` is
``optimizer.step()`` (a closure allowed), ``get_scale`` is 1.0, ``state_dict`` is empty, and the
getters of settings it never stored raise AttributeError. Each call below runs on both, on the
same params, and must give the same result (or the same exception type), leaving params and grads
bit-identical to torch's.
"""

import copy
import pickle

import pytest
import torch
from helpers import bits

import fastamp

OPTIMIZERS = {
    "torch.SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "fastamp.AdamW": lambda p: fastamp.optim.AdamW(p, lr=1e-2),
    "torch.AdamW(fused)": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
}
TORCH_STATE = {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3, "_growth_tracker": 1}

CALLS = {
    "scale(tensor)": lambda s, o: s.scale(torch.full((2,), 3.0)),
    "scale(nested)": lambda s, o: s.scale([torch.ones(2), (torch.ones(()),)]),
    "unscale_": lambda s, o: s.unscale_(o),
    "unscale_ twice": lambda s, o: (s.unscale_(o), s.unscale_(o)),
    "step": lambda s, o: s.step(o),
    "unscale_ then step twice": lambda s, o: (s.unscale_(o), s.step(o), s.step(o)),
    "step(closure=)": lambda s, o: s.step(o, closure=lambda: torch.tensor(2.0)),
    "update()": lambda s, o: (s.step(o), s.update()),
    "update(new_scale)": lambda s, o: s.update(4.0),
    "update(bad new_scale)": lambda s, o: s.update(-1.0),
    "get_scale": lambda s, o: s.get_scale(),
    "get_scale after scale": lambda s, o: (s.scale(torch.ones(())), s.get_scale())[1],
    "get_growth_factor": lambda s, o: s.get_growth_factor(),
    "get_backoff_factor": lambda s, o: s.get_backoff_factor(),
    "get_growth_interval": lambda s, o: s.get_growth_interval(),
    "set_growth_factor then get": lambda s, o: (s.set_growth_factor(3.0), s.get_growth_factor())[1],
    "set_backoff_factor then get": lambda s, o: (s.set_backoff_factor(0.25), s.get_backoff_factor())[1],
    "set_growth_interval then get": lambda s, o: (s.set_growth_interval(5), s.get_growth_interval())[1],
    "is_enabled": lambda s, o: s.is_enabled(),
    "state_dict": lambda s, o: s.state_dict(),
    "load_state_dict": lambda s, o: (s.load_state_dict(dict(TORCH_STATE)), s.get_scale(), s.state_dict()),
    "pickle round trip": lambda s, o: pickle.loads(pickle.dumps(s)).is_enabled(),
    "deepcopy": lambda s, o: copy.deepcopy(s).is_enabled(),
    # torch's private hooks, which libraries call or override
    "_get_scale_async": lambda s, o: s._get_scale_async(),
    "_get_growth_tracker": lambda s, o: s._get_growth_tracker(),
    "_check_inf_per_device": lambda s, o: s._check_inf_per_device(o),
    "_found_inf_per_device": lambda s, o: s._found_inf_per_device(o),
    "_unscale_grads_": lambda s, o: s._unscale_grads_(o, torch.full((), 0.5), torch.zeros(()), True),
}


def _world(optimizer):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (7, 3)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e4
    return params, OPTIMIZERS[optimizer](params)


def _outcome(scaler, call, optimizer):
    params, opt = _world(optimizer)
    try:
        result = ("returned", call(scaler, opt))
    except Exception as e:  # the kind of failure is compared, not the class name in the message
        result = ("raised", type(e))
    return result, [bits(p) for p in params], [bits(p.grad) for p in params]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(bits(a), bits(b))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) or isinstance(b, dict):
        return (
            isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
        )
    return a == b


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("name", list(CALLS))
def test_a_disabled_scaler_does_what_torchs_disabled_gradscaler_does(name, optimizer):
    call = CALLS[name]
    theirs = _outcome(torch.amp.GradScaler("cpu", enabled=False), call, optimizer)
    ours = _outcome(fastamp.Scaler("cpu", enabled=False), call, optimizer)
    assert ours[0][0] == theirs[0][0] and _same(ours[0][1], theirs[0][1]), (ours[0], theirs[0])
    for got, want in zip(ours[1] + ours[2], theirs[1] + theirs[2]):
        assert torch.equal(got, want), "params or grads differ from torch's"


def test_cuda_scaler_without_cuda_is_disabled_as_torchs():
    if torch.cuda.is_available():
        pytest.skip("a machine without CUDA is the setting")
    with pytest.warns(UserWarning, match="CUDA is not available.  Disabling") as ours:
        scaler = fastamp.Scaler("cuda")
    with pytest.warns(UserWarning) as theirs:
        torch.amp.GradScaler("cuda")
    # torch's text, in fastamp's name (test_scaler checks the name; here: the same words otherwise)
    assert str(ours[0].message) == str(theirs[0].message).replace("torch.cuda.amp.GradScaler", "fastamp.Scaler")
    assert not scaler.is_enabled() and scaler.state_dict() == {} and scaler.get_scale() == 1.0


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_disabled_scalers_extras_are_torchs_clip_and_no_skips(optimizer):
    """fastamp's extras on a disabled scaler: clip_grad_norm_ is torch's clip of the optimizer's grads
    (nothing is scaled), nothing is ever skipped, no statistics."""
    scaler = fastamp.Scaler("cpu", enabled=False, track_stats=True)
    params, opt = _world(optimizer)
    ref_params, _ = _world(optimizer)
    norm = scaler.clip_grad_norm_(opt, 1.0)
    want = torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
    assert torch.equal(norm, want)
    for p, q in zip(params, ref_params):
        assert torch.equal(bits(p.grad), bits(q.grad))
    scaler.step(opt)
    scaler.update()
    assert scaler.skipped_steps == 0 and scaler.last_step_skipped is False
    assert scaler.last_step_skipped_tensor is False
    model = torch.nn.Linear(2, 2)
    assert scaler.watch(model) is scaler and scaler.grad_stats(model) is None
