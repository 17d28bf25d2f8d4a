"""Issue 12, the scaler's part: torch.compile, value checks, failed steps, grad dtypes in the
stats, a true ``torch.amp.GradScaler`` subclass, and a clip norm exact on every CPU.

Each test is written as a user meets the problem; where torch has a behaviour it is the
reference.
"""

import copy
import inspect
import io
import math
import pickle
import struct
import warnings

import numpy as np
import pytest
import torch
from helpers import bits
from torch.amp.grad_scaler import OptState as TorchOptState

import fastamp
from fastamp.health import AmpPitfallWarning


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


# --------------------------------------------------------------------------- torch.compile (item 3)


def _world(kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (8, 5)]
    if kind == "fastamp_adamw":
        opt = fastamp.optim.AdamW(params, lr=0.1)
    elif kind == "torch_adamw_fused":
        opt = torch.optim.AdamW(params, lr=0.1, fused=True)
    else:
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return params, opt, fastamp.Scaler("cpu", init_scale=2.0**8, growth_interval=2)


def _backward(params, scaler, i):
    """The user's scaled backward, outside the compiled function; iteration 0 overflows."""
    x = torch.linspace(-1, 1, 13) * (i + 1)
    loss = (params[0] * x[:8]).sum() + (params[1] * x[8:]).square().sum()
    for p in params:
        p.grad = None
    scaler.scale(loss).backward()
    if i == 0:
        params[0].grad[3] = math.inf


def _state_of(params, opt, scaler):
    out = {f"p{i}": p.detach().clone() for i, p in enumerate(params)}
    for i, p in enumerate(params):
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"p{i}.{k}"] = v.clone()
    if scaler._scale is not None:
        out["scale"] = scaler._scale.clone()
        out["tracker"] = scaler._growth_tracker.clone()
    return out


def _assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert _same(a[k], b[k]), k


def _compile_help_in_errors():
    # torch < 2.7 has no reason= for torch.compiler.disable: dynamo's message is its own there
    return "reason" in inspect.signature(torch.compiler.disable).parameters


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph_breaks", "fullgraph"])
@pytest.mark.parametrize("kind", ["fastamp_adamw", "torch_adamw_fused", "torch_sgd"])
def test_compiled_step_and_update_give_the_eager_result_or_refuse_untouched(kind, fullgraph, fresh_dynamo):
    """scaler.step(opt); scaler.update() inside torch.compile, an inf grad on the first iteration.

    Without fullgraph: bit-identical to the same loop in eager mode (the overflowed step is
    skipped, no inf enters the moments). With fullgraph: fastamp's optimizer compiles into one
    graph with the same result (issue 15; tests/api/test_compile_scaler.py); torch's optimizers
    get an error naming what to compile instead, raised before anything ran; the eager calls
    then still work.
    """
    ref_params, ref_opt, ref_scaler = _world(kind)
    params, opt, scaler = _world(kind)

    def step_and_update():
        scaler.step(opt)
        scaler.update()

    compiled = torch.compile(step_and_update, backend="eager", fullgraph=fullgraph)
    for i in range(3):
        _backward(ref_params, ref_scaler, i)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        _backward(params, scaler, i)
        if fullgraph and kind != "fastamp_adamw":
            before = _state_of(params, opt, scaler)
            grads = [p.grad.clone() for p in params]
            with pytest.raises(Exception) as info:
                compiled()
            if _compile_help_in_errors():
                assert "fastamp.Scaler.step() cannot be captured by torch.compile" in str(info.value)
                assert "compile the model and loss" in str(info.value)
            _assert_same_state(before, _state_of(params, opt, scaler))
            assert all(_same(p.grad, g) for p, g in zip(params, grads))
            assert len(scaler._per_optimizer_states) == 0
            assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
            step_and_update()  # the scaler is intact: the eager calls still work
        else:
            compiled()
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        _assert_same_state(_state_of(ref_params, ref_opt, ref_scaler), _state_of(params, opt, scaler))
        assert scaler.last_step_skipped == ref_scaler.last_step_skipped == (i == 0)


@pytest.fixture
def scaler_twins_not_built():
    """As in a process where torch._dynamo was imported after the scaler's last eager call."""
    from fastamp.scaler import compiled as scaler_module

    saved, ready = [slot[0] for slot, _, _ in scaler_module._EAGER_ENTRIES], scaler_module._eager_ready[0]
    for slot, _, _ in scaler_module._EAGER_ENTRIES:
        slot[0] = None
    scaler_module._eager_ready[0] = False
    yield
    for (slot, _, _), twin in zip(scaler_module._EAGER_ENTRIES, saved):
        slot[0] = twin
    scaler_module._eager_ready[0] = ready


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph_breaks", "fullgraph"])
def test_compile_met_before_the_scaler_saw_dynamo_imported(fullgraph, fresh_dynamo, scaler_twins_not_built):
    """The scaler's eager twins are built once torch._dynamo is imported; a compiled function
    can meet step() before that happened (scale() traced too). Same guarantees."""
    ref_params, ref_opt, ref_scaler = _world("torch_adamw_fused")
    params, opt, scaler = _world("torch_adamw_fused")

    def step_and_update():
        scaler.step(opt)
        scaler.update()

    compiled = torch.compile(step_and_update, backend="eager", fullgraph=fullgraph)
    _backward(ref_params, ref_scaler, 0)
    ref_scaler.step(ref_opt)
    ref_scaler.update()
    _backward(params, scaler, 0)
    if fullgraph:
        before = _state_of(params, opt, scaler)
        with pytest.raises(Exception) as info:
            compiled()
        if _compile_help_in_errors():
            assert "fastamp.Scaler.step() cannot be captured by torch.compile" in str(info.value)
        _assert_same_state(before, _state_of(params, opt, scaler))
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        step_and_update()
    else:
        compiled()
    _assert_same_state(_state_of(ref_params, ref_opt, ref_scaler), _state_of(params, opt, scaler))
    assert scaler.last_step_skipped is True


@pytest.mark.parametrize("kind", ["fastamp_adamw", "torch_sgd"])
def test_compiled_unscale_and_clip_give_the_eager_result(kind, fresh_dynamo):
    ref_params, ref_opt, ref_scaler = _world(kind)
    params, opt, scaler = _world(kind)

    def unscale_and_clip(s, o):
        if kind == "torch_sgd":
            s.unscale_(o)
        return s.clip_grad_norm_(o, 0.5)

    compiled = torch.compile(unscale_and_clip, backend="eager")
    for i in range(3):
        _backward(ref_params, ref_scaler, i + 1)
        _backward(params, scaler, i + 1)
        ref_norm = unscale_and_clip(ref_scaler, ref_opt)
        norm = compiled(scaler, opt)
        assert _same(norm, ref_norm)
        assert all(_same(p.grad, q.grad) for p, q in zip(params, ref_params))
        assert scaler._per_optimizer_states[id(opt)]["stage"] is TorchOptState.UNSCALED
        for s, o in ((ref_scaler, ref_opt), (scaler, opt)):
            s.step(o)
            s.update()
        _assert_same_state(_state_of(ref_params, ref_opt, ref_scaler), _state_of(params, opt, scaler))


def test_fullgraph_clip_refuses_before_touching_the_grads(fresh_dynamo):
    params, opt, scaler = _world("torch_sgd")
    _backward(params, scaler, 1)
    grads = [p.grad.clone() for p in params]
    compiled = torch.compile(lambda: scaler.clip_grad_norm_(opt, 0.5), backend="eager", fullgraph=True)
    with pytest.raises(Exception) as info:
        compiled()
    if _compile_help_in_errors():
        assert "fastamp.Scaler.clip_grad_norm_() cannot be captured" in str(info.value)
    assert all(_same(p.grad, g) for p, g in zip(params, grads))
    assert len(scaler._per_optimizer_states) == 0


# --------------------------------------------------------------------------- values (item 6)


def _running_scaler():
    s = fastamp.Scaler("cpu", init_scale=2.0**8, growth_interval=3, hysteresis=2)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    for i in range(2):
        s.scale(torch.ones(()))
        p.grad = torch.tensor([math.inf if i == 0 else 1.0, 1.0, 1.0])
        s.step(opt)
        s.update()
    return s


def _scaler_snapshot(s):
    return (
        s.state_dict(),
        s.get_growth_factor(),
        s.get_backoff_factor(),
        s.get_growth_interval(),
        bits(s._scale).clone(),
        s._growth_tracker.clone(),
        s._hysteresis_tracker.clone(),
    )


def _sd(**over):
    return lambda s: s.load_state_dict(dict(s.state_dict(), **over))


FP32_VALUE = "must be finite, > 0 and representable in fp32"
BAD_VALUES = [
    # (id, call on a running scaler, exception, message)
    ("init_scale 1e39 (inf in fp32)", lambda s: fastamp.Scaler(init_scale=1e39), ValueError, FP32_VALUE),
    ("init_scale 0", lambda s: fastamp.Scaler(init_scale=0.0), ValueError, FP32_VALUE),
    ("init_scale 1e-50 (0 in fp32)", lambda s: fastamp.Scaler(init_scale=1e-50), ValueError, FP32_VALUE),
    ("growth_factor 1e39", lambda s: fastamp.Scaler(growth_factor=1e39), ValueError, FP32_VALUE),
    ("max_scale inf", lambda s: fastamp.Scaler(max_scale=math.inf), ValueError, "max_scale " + FP32_VALUE),
    ("min_scale 1e39", lambda s: fastamp.Scaler(min_scale=1e39), ValueError, "min_scale " + FP32_VALUE),
    ("hysteresis 2**40", lambda s: fastamp.Scaler(hysteresis=2**40), ValueError, "hysteresis must be an int >= 1"),
    ("update(1e39)", lambda s: s.update(1e39), ValueError, "new_scale " + FP32_VALUE),
    ("update(0.0)", lambda s: s.update(0.0), ValueError, "new_scale " + FP32_VALUE),
    ("update(inf tensor)", lambda s: s.update(torch.tensor(math.inf)), ValueError, "new_scale " + FP32_VALUE),
    ("update(nan tensor)", lambda s: s.update(torch.tensor(math.nan)), ValueError, "new_scale " + FP32_VALUE),
    ("update(-2 tensor)", lambda s: s.update(torch.tensor(-2.0)), ValueError, "new_scale " + FP32_VALUE),
    (
        "update(fp64 tensor 1e39)",
        lambda s: s.update(torch.tensor(1e39, dtype=torch.float64)),
        ValueError,
        "new_scale " + FP32_VALUE,
    ),
    ("set_growth_factor(nan)", lambda s: s.set_growth_factor(math.nan), ValueError, "growth_factor " + FP32_VALUE),
    ("set_growth_factor(0.5)", lambda s: s.set_growth_factor(0.5), ValueError, "growth_factor must be > 1"),
    ("set_growth_factor(str)", lambda s: s.set_growth_factor("2"), TypeError, "growth_factor must be a real"),
    ("set_backoff_factor(1.5)", lambda s: s.set_backoff_factor(1.5), ValueError, "backoff_factor must be in"),
    ("set_backoff_factor(0)", lambda s: s.set_backoff_factor(0.0), ValueError, "backoff_factor " + FP32_VALUE),
    ("set_growth_interval(-1)", lambda s: s.set_growth_interval(-1), ValueError, "growth_interval must be an int"),
    ("set_growth_interval(2.5)", lambda s: s.set_growth_interval(2.5), ValueError, "growth_interval must be an int"),
    ("set_growth_interval(True)", lambda s: s.set_growth_interval(True), ValueError, "growth_interval must be an int"),
    ("load scale 1e39", _sd(scale=1e39), ValueError, "scale " + FP32_VALUE),
    ("load scale 0", _sd(scale=0.0), ValueError, "scale " + FP32_VALUE),
    ("load growth_factor inf", _sd(growth_factor=math.inf), ValueError, "growth_factor " + FP32_VALUE),
    ("load min > max", _sd(min_scale=8.0, max_scale=4.0), ValueError, r"min_scale \(8.0\) must be <= max_scale"),
    ("load max_scale 1e39", _sd(max_scale=1e39), ValueError, "max_scale " + FP32_VALUE),
    ("load hysteresis tracker > hysteresis", _sd(_hysteresis_tracker=3), ValueError, "_hysteresis_tracker must be"),
    ("load growth tracker 2**31", _sd(_growth_tracker=2**31), ValueError, "_growth_tracker must be an int >= 0"),
    ("load last_step_skipped str", _sd(last_step_skipped="no"), ValueError, "last_step_skipped must be a bool"),
]


@pytest.mark.parametrize("call, exc, match", [c[1:] for c in BAD_VALUES], ids=[c[0] for c in BAD_VALUES])
def test_scale_values_are_refused_before_anything_changes(call, exc, match):
    s = _running_scaler()
    before = _scaler_snapshot(s)
    with pytest.raises(exc, match=match):
        call(s)
    after = _scaler_snapshot(s)
    assert before[:4] == after[:4]
    for a, b in zip(before[4:], after[4:]):
        assert torch.equal(a, b)


def test_numpy_scalars_are_accepted_as_torch_accepts_them():
    """A config loaded with numpy (np.int64 from a yaml/np.load, np.float32 from an array)."""
    kw = dict(init_scale=np.float32(2.0**6), growth_factor=np.float64(2.0), backoff_factor=np.float32(0.5))
    ts = torch.amp.GradScaler("cpu", growth_interval=np.int64(3), **kw)
    fs = fastamp.Scaler("cpu", growth_interval=np.int64(3), hysteresis=np.int64(1), **kw)
    fs.set_growth_interval(np.int64(2))
    ts.set_growth_interval(np.int64(2))
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    to, fo = torch.optim.SGD([p], lr=0.1), torch.optim.SGD([q], lr=0.1)
    for i in range(9):
        for s, x, o in ((ts, p, to), (fs, q, fo)):
            s.scale(torch.ones(()))
            x.grad = torch.tensor([math.inf if i % 4 == 3 else 1.0, 2.0])
            s.step(o)
            # torch takes np.float64 (a float subclass) but not np.float32; fastamp takes both
            s.update((np.float32 if s is fs else np.float64)(2.0**5) if i == 6 else None)
        assert fs.get_scale() == ts.get_scale() and fs._get_growth_tracker() == ts._get_growth_tracker()
    assert torch.equal(p, q)
    # the state dict holds Python numbers: it reloads with weights_only=True
    sd = fs.state_dict()
    assert type(sd["growth_interval"]) is int and type(sd["scale"]) is float
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True) == sd


def test_min_and_max_scale_bound_the_scale_from_the_start():
    """Scaler(max_scale=1024) with the default init_scale (65536) starts at 1024, and a
    new_scale or a loaded scale outside the bounds is clamped into them."""
    s = fastamp.Scaler("cpu", max_scale=2.0**10)
    assert s.get_scale() == 2.0**10
    s.scale(torch.ones(()))
    assert s.get_scale() == 2.0**10
    lo = fastamp.Scaler("cpu", init_scale=2.0, min_scale=2.0**4)
    lo.scale(torch.ones(()))
    assert lo.get_scale() == 2.0**4
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.ones(2)
    s.step(opt)
    s.update(2.0**20)
    assert s.get_scale() == 2.0**10
    s.scale(torch.ones(()))
    p.grad = torch.ones(2)
    s.step(opt)
    s.update(torch.tensor(2.0**30))
    assert s.get_scale() == 2.0**10
    torch_sd = torch.amp.GradScaler("cpu").state_dict()  # scale 65536, no bounds
    s.load_state_dict(torch_sd)
    assert s.get_scale() == 2.0**10 and s.state_dict()["max_scale"] == 2.0**10
    fresh = fastamp.Scaler("cpu", max_scale=2.0**12)
    fresh.load_state_dict(torch_sd)  # before the lazy init too
    fresh.scale(torch.ones(()))
    assert fresh.get_scale() == 2.0**12


# --------------------------------------------------------------------------- failed step (item 7)


def test_a_failed_step_leaves_no_grad_scale_or_found_inf_on_the_optimizer():
    """torch's fused AdamW refuses a sparse embedding grad inside its step(). The user then
    fixes the grads and steps the optimizer without the scaler: that step must be a plain
    one (not divided by a stale scale, not skipped by a stale found_inf)."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(6, 3, sparse=True)
    w = torch.nn.Parameter(torch.randn(3))
    twin_emb, twin_w = copy.deepcopy(emb), copy.deepcopy(w)
    opt = torch.optim.AdamW([emb.weight, w], lr=0.1, fused=True)
    twin = torch.optim.AdamW([twin_emb.weight, twin_w], lr=0.1, fused=True)
    scaler = fastamp.Scaler("cpu", init_scale=2.0**4)
    scaler.scale((emb(torch.tensor([1, 2])).sum(1) * w[:2]).sum()).backward()
    w.grad[0] = math.inf  # this iteration overflowed too
    with pytest.raises(RuntimeError, match="sparse gradients"):
        scaler.step(opt)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    # the user's fallback: dense, unscaled grads and a plain step
    g = torch.linspace(-1, 1, 18).reshape(6, 3)
    emb.weight.grad, twin_emb.weight.grad = g.clone(), g.clone()
    w.grad, twin_w.grad = torch.ones(3), torch.ones(3)
    opt.step()
    twin.step()
    assert _same(emb.weight, twin_emb.weight) and _same(w, twin_w)


def test_a_failed_step_restores_a_user_set_grad_scale():
    class Failing(torch.optim.SGD):
        def __init__(self, params):
            super().__init__(params, lr=0.1)
            self._step_supports_amp_scaling = True

        def step(self, closure=None):
            raise ValueError("optimizer refused this step")

    p = torch.nn.Parameter(torch.ones(2))
    opt = Failing([p])
    mine = torch.tensor(3.0)
    opt.grad_scale = mine
    scaler = fastamp.Scaler("cpu")
    scaler.scale(torch.ones(()))
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="refused"):
        scaler.step(opt)
    assert opt.grad_scale is mine and float(mine) == 3.0 and not hasattr(opt, "found_inf")


# --------------------------------------------------------------------------- grad dtypes in stats (item 11)


def _fp16_params_with_fp32_grads():
    lin = torch.nn.Linear(16, 8).half()
    params = list(lin.parameters())
    for p in params:
        if not hasattr(p, "grad_dtype"):
            pytest.skip("this torch cannot hold fp32 grads on fp16 params (no Tensor.grad_dtype)")
        p.grad_dtype = torch.float32
    return lin, params


@pytest.mark.parametrize("strided", [False, True], ids=["one_call_path", "per_grad_path"])
def test_fp32_grads_on_fp16_params_are_judged_by_their_own_dtype(strided):
    """fp16 weights, fp32 grads (p.grad_dtype = torch.float32) of tiny values: nothing underflowed,
    so no grad_underflow warning, and the stats rows say float32."""
    lin, params = _fp16_params_with_fp32_grads()
    opt = torch.optim.SGD(params, lr=1e-3)
    scaler = fastamp.Scaler("cpu", init_scale=1.0, track_stats=True).watch(lin)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AmpPitfallWarning)
        for i in range(3):
            for p in params:
                p.grad = torch.full(p.shape, 1e-6 * (i + 1), dtype=torch.float32)
            if strided:
                params[0].grad = params[0].grad.t().contiguous().t()
            scaler.scale(torch.ones(()))
            scaler.step(opt)
            scaler.update()
    # (fp16_without_master may fire for SGD on fp16 params when an earlier test installed the
    # optimizer guard: true here, and not what this test is about)
    assert not [w for w in caught if "grad_underflow" in str(w.message)]
    stats = scaler.grad_stats()
    assert [t.dtype for t in stats] == [torch.float32, torch.float32]
    assert [t.name for t in stats] == ["weight", "bias"]
    assert all(t.fp16_underflow == t.numel for t in stats)  # the count itself still says what fp16 would lose


# --------------------------------------------------------------------------- a true GradScaler (item 12)


def test_isinstance_torch_gradscaler_with_torchs_per_optimizer_state():
    """What Lightning / Accelerate / torch's own code check: the type, the OptState enum, the keys."""
    scaler = fastamp.Scaler("cpu")
    assert isinstance(scaler, torch.amp.GradScaler)
    assert fastamp.OptState is TorchOptState and fastamp.scaler.OptState is TorchOptState
    # every method of torch's class is fastamp's own (none of torch's runs on fastamp's state)
    for name, value in vars(torch.amp.GradScaler).items():
        if callable(value) and name not in ("__init_subclass__", "__subclasshook__"):
            assert name in vars(fastamp.Scaler), name
    ps = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    sgd, adamw = torch.optim.SGD(ps[:1], lr=0.1), fastamp.optim.AdamW(ps[1:], lr=0.1)
    scaler.scale(torch.ones(()))
    for p in ps:
        p.grad = torch.ones(3)
    scaler.unscale_(sgd)
    scaler.clip_grad_norm_(adamw, 0.5)
    for opt in (sgd, adamw):
        state = scaler._per_optimizer_states[id(opt)]
        assert set(state) == {"stage", "found_inf_per_device"}
        assert state["stage"] is TorchOptState.UNSCALED  # Lightning's check before its own clip
        assert isinstance(state["found_inf_per_device"][torch.device("cpu")], torch.Tensor)
    scaler.step(sgd)
    scaler.step(adamw)
    assert scaler._per_optimizer_states[id(adamw)]["stage"] is TorchOptState.STEPPED
    scaler.update()
    assert len(scaler._per_optimizer_states) == 0


def test_scaler_passes_itself_to_legacy_optimizers_and_sets_attributes_for_amp_aware_ones():
    """torch's test of a GradScaler handed to optimizers, on CPU, with fastamp.Scaler."""
    seen = {}

    class Placeholder(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})
            self._step_supports_amp_scaling = True

    class Legacy(Placeholder):
        def step(self, closure=None, *, grad_scaler=None):
            seen["is_gradscaler"] = isinstance(grad_scaler, torch.amp.GradScaler)
            seen["attrs"] = hasattr(self, "grad_scale") or hasattr(self, "found_inf")
            seen["scale"] = grad_scaler._get_scale_async().clone()
            seen["found"] = grad_scaler._check_inf_per_device(self)
            seen["same"] = grad_scaler._found_inf_per_device(self) is seen["found"]

    class Current(Placeholder):
        def step(self, closure=None):
            seen["grad_scale"] = self.grad_scale.clone()
            seen["found_inf"] = self.found_inf.clone()

    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    o1, o2 = Legacy(m.parameters()), Current(m.parameters())
    scaler = fastamp.Scaler("cpu", init_scale=2.0)
    scaler.scale(m(torch.randn(4, 4)).mean()).backward()
    with pytest.warns(FutureWarning, match="stop passing itself"):
        scaler.step(o1)
    scaler.step(o2)
    scaler.update()
    assert seen["is_gradscaler"] and not seen["attrs"] and seen["same"]
    assert float(seen["scale"]) == 2.0 and float(seen["grad_scale"]) == 2.0 and float(seen["found_inf"]) == 0.0
    assert float(sum(seen["found"].values())) == 0.0
    assert not hasattr(o2, "grad_scale") and not hasattr(o2, "found_inf")


@pytest.mark.parametrize("lazy_init", [True, False])
def test_pickling_like_torchs_gradscaler_test(lazy_init):
    a = fastamp.Scaler("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    if lazy_init:
        a.scale(torch.tensor([4.0]))
        assert a._scale.device.type == "cpu"
    b = pickle.loads(pickle.dumps(a))
    assert isinstance(b, torch.amp.GradScaler) and b.is_enabled() == a.is_enabled()
    assert (b.get_scale(), b.get_growth_factor(), b.get_backoff_factor(), b.get_growth_interval()) == (3.0, 4.0, 0.5, 2)
    assert b._init_growth_tracker == 0
    assert torch.equal(b.scale(torch.tensor([4.0])), torch.tensor([12.0]))
    # mid-life, between iterations: the trajectory continues identically
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    b.scale(torch.ones(()))
    p.grad = torch.ones(2)
    b.step(opt)
    b.update()
    c = pickle.loads(pickle.dumps(b))
    assert c.get_scale() == b.get_scale() == 3.0 and c._get_growth_tracker() == b._get_growth_tracker() == 1
    for s in (b, c):
        s.scale(torch.ones(()))
        p.grad = torch.ones(2)
        s.step(torch.optim.SGD([p], lr=0.0))
        s.update()
    assert c.get_scale() == b.get_scale() == 12.0


# --------------------------------------------------------------------------- exact clip norm (item 13)


def test_clip_norm_is_the_correctly_rounded_sqrt_on_any_cpu():
    """Grads whose sum of squares is exact in fp32 (multiples of 1/8): the norm returned by
    clip_grad_norm_ must be sqrt of it rounded once to fp32, on every CPU (torch's own fp32
    sqrt is 1 ulp off on ~20% of inputs on AMD EPYC)."""
    g = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (17, 5, 1)]
    opt = torch.optim.SGD(params, lr=0.0)
    scaler = fastamp.Scaler("cpu", init_scale=2.0**10, growth_interval=0)
    wrong = []
    for i in range(200):
        ints = [torch.randint(-200, 201, (p.numel(),), generator=g) for p in params]
        for p, k in zip(params, ints):
            p.grad = k.float() / 8 * 2.0**10  # still scaled
        exact_sumsq = sum(int((k * k).sum()) for k in ints) / 64  # < 2**24 / 64: exact in fp32
        expected = struct.unpack("f", struct.pack("f", math.sqrt(exact_sumsq)))[0]
        scaler.scale(torch.ones(()))
        norm = scaler.clip_grad_norm_(opt, 1e9)
        scaler.step(opt)
        scaler.update()
        if norm.item() != expected:
            wrong.append((i, exact_sumsq, norm.item(), expected))
    assert not wrong, f"{len(wrong)} of 200 norms not correctly rounded, e.g. {wrong[:3]}"
