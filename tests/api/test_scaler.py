"""fastamp.Scaler against torch.amp.GradScaler("cpu"): trajectories, state machine, checkpoints."""

import copy
import io
import math
import pickle
import random
import warnings

import pytest
import torch
from tolerances import NORM_RTOL

import fastamp
from fastamp import backends

CPU_BACKENDS = [b for b in backends.BACKENDS if backends.available(b, "unscale_check_", "cpu")[0]]


def _make_params(shapes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _set_grads(params_a, params_b, scale, rng, gen, p_inf, dtype=None):
    """Give both param sets the same scaled grads, sometimes with one inf/nan."""
    for pa, pb in zip(params_a, params_b):
        g = torch.randn(pa.shape, generator=gen) * scale
        if rng.random() < p_inf:
            idx = rng.randrange(g.numel())
            g.view(-1)[idx] = rng.choice([math.inf, -math.inf, math.nan])
        g = g.to(dtype or pa.dtype)
        pa.grad = g.clone()
        pb.grad = g.clone()


def _opt(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if kind == "adamw_foreach":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    if kind == "adamw_single":
        return torch.optim.AdamW(params, lr=1e-3, foreach=False)
    raise ValueError(kind)


PARITY_CASES = [
    # (optimizer kinds, growth_interval, steps, p_inf, explicit unscale_, new_scale every)
    (("sgd",), 1, 5000, 0.15, False, 0),
    (("sgd", "adamw_foreach"), 3, 5000, 0.05, True, 0),
    (("adamw_fused",), 7, 5000, 0.05, False, 0),
    (("adamw_fused", "adamw_single"), 2000, 2500, 0.01, False, 700),
    (("sgd",), 2, 2000, 0.3, True, 300),
]


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: "-".join(c[0]) + f"-gi{c[1]}-n{c[2]}")
def test_parity_with_torch_gradscaler(case):
    kinds, interval, steps, p_inf, explicit_unscale, new_scale_every = case
    rng = random.Random(1234 + interval)
    gen = torch.Generator().manual_seed(interval)
    shapes = [(7,), (3, 5)]
    ta, fa = [], []
    topts, fopts = [], []
    for i, kind in enumerate(kinds):
        pt = _make_params(shapes, seed=i)
        pf = [p.detach().clone().requires_grad_() for p in pt]
        ta.append(pt)
        fa.append(pf)
        topts.append(_opt(kind, pt))
        fopts.append(_opt(kind, pf))
    ts = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=interval)
    fs = fastamp.Scaler("cpu", init_scale=2.0**10, growth_interval=interval)
    n_skipped = 0
    for step in range(steps):
        ts.scale(torch.ones(()))
        fs.scale(torch.ones(()))
        scale_now = ts.get_scale()
        before = [[p.detach().clone() for p in ps] for ps in ta]
        for pt, pf in zip(ta, fa):
            _set_grads(pt, pf, scale_now, rng, gen, p_inf)
        for to, fo in zip(topts, fopts):
            if explicit_unscale:
                ts.unscale_(to)
                fs.unscale_(fo)
            ts.step(to)
            fs.step(fo)
        if new_scale_every and step % new_scale_every == new_scale_every - 1:
            ns = float(2 ** rng.randrange(0, 20))
            ts.update(ns)
            fs.update(torch.tensor(ns) if step % 2 else ns)
        else:
            ts.update()
            fs.update()
        assert fs.get_scale() == ts.get_scale(), f"scale diverged at step {step}"
        assert fs._get_growth_tracker() == ts._get_growth_tracker(), f"tracker diverged at step {step}"
        for pt, pf, pb in zip(ta, fa, before):
            for a, b, _c in zip(pt, pf, pb):
                assert torch.equal(a, b), f"params diverged at step {step}"
            n_skipped += all(torch.equal(a, c) for a, c in zip(pt, pb))
    # the test must have exercised both decisions many times
    assert 0 < n_skipped < steps * len(kinds)


def test_parity_many_scales_reach_cap_and_underflow():
    """Growth refused at 2^127 and decay to 0 exactly as torch, via the scaler."""
    for init, inf_every, n in ((2.0**120, 0, 40), (1.0, 1, 160)):
        ts = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=1)
        fs = fastamp.Scaler("cpu", init_scale=init, growth_interval=1)
        pt = _make_params([(4,)])
        pf = [p.detach().clone().requires_grad_() for p in pt]
        ot, of = torch.optim.SGD(pt, lr=0.1), torch.optim.SGD(pf, lr=0.1)
        for _ in range(n):
            ts.scale(torch.ones(()))
            fs.scale(torch.ones(()))
            g = torch.full((4,), math.inf if inf_every else 1.0)
            pt[0].grad, pf[0].grad = g.clone(), g.clone()
            ts.step(ot)
            fs.step(of)
            ts.update()
            fs.update()
            assert fs.get_scale() == ts.get_scale()
        assert ts.get_scale() in (2.0**127, 0.0)


def _both(fn):
    """Run fn(scaler_cls) for torch and fastamp; return (torch exc, fastamp exc)."""
    out = []
    for cls in (torch.amp.GradScaler, fastamp.Scaler):
        try:
            fn(cls)
            out.append(None)
        except Exception as e:  # noqa: BLE001 - we compare the exceptions themselves
            out.append(e)
    return out


def _loop_parts(cls):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    s = cls("cpu")
    return p, opt, s


def _scaled_backward(s, p):
    s.scale((p * 2).sum()).backward()


MISUSES = {
    "unscale_twice": lambda cls: (lambda p, o, s: (_scaled_backward(s, p), s.unscale_(o), s.unscale_(o)))(
        *_loop_parts(cls)
    ),
    "unscale_after_step": lambda cls: (lambda p, o, s: (_scaled_backward(s, p), s.step(o), s.unscale_(o)))(
        *_loop_parts(cls)
    ),
    "step_twice": lambda cls: (lambda p, o, s: (_scaled_backward(s, p), s.step(o), s.step(o)))(*_loop_parts(cls)),
    "unscale_before_scale": lambda cls: (lambda p, o, s: s.unscale_(o))(*_loop_parts(cls)),
    "step_before_scale": lambda cls: (lambda p, o, s: s.step(o))(*_loop_parts(cls)),
    "update_before_scale": lambda cls: (lambda p, o, s: s.update())(*_loop_parts(cls)),
    "update_without_step": lambda cls: (lambda p, o, s: (_scaled_backward(s, p), s.update()))(*_loop_parts(cls)),
    "closure": lambda cls: (lambda p, o, s: (_scaled_backward(s, p), s.step(o, closure=lambda: 0.0)))(
        *_loop_parts(cls)
    ),
    "step_without_grads": lambda cls: (lambda p, o, s: (s.scale(torch.ones(())), s.step(o)))(*_loop_parts(cls)),
    "new_scale_2d": lambda cls: (lambda p, o, s: (_scaled_backward(s, p), s.step(o), s.update(torch.ones(2))))(
        *_loop_parts(cls)
    ),
    "new_scale_requires_grad": lambda cls: (
        lambda p, o, s: (_scaled_backward(s, p), s.step(o), s.update(torch.ones((), requires_grad=True)))
    )(*_loop_parts(cls)),
    "growth_factor": lambda cls: cls("cpu", growth_factor=1.0),
    "backoff_factor": lambda cls: cls("cpu", backoff_factor=1.0),
    "load_empty": lambda cls: cls("cpu").load_state_dict({}),
    "load_missing_key": lambda cls: cls("cpu").load_state_dict({"scale": 1.0}),
    "pickle_mid_iteration": lambda cls: (lambda p, o, s: (_scaled_backward(s, p), s.unscale_(o), pickle.dumps(s)))(
        *_loop_parts(cls)
    ),
    "scale_non_tensor": lambda cls: cls("cpu").scale([torch.ones(()), 3]),
}


@pytest.mark.parametrize("name", sorted(MISUSES))
def test_misuse_errors_equal_torch(name):
    te, fe = _both(MISUSES[name])
    assert te is not None, f"torch did not raise for {name}"
    assert type(fe) is type(te), (name, repr(te), repr(fe))
    assert str(fe) == str(te), (name, str(te), str(fe))


def test_misuse_changes_nothing():
    p, opt, s = _loop_parts(fastamp.Scaler)
    _scaled_backward(s, p)
    s.step(opt)
    before = (s.get_scale(), s._get_growth_tracker(), p.detach().clone(), p.grad.clone())
    with pytest.raises(RuntimeError):
        s.step(opt)
    with pytest.raises(RuntimeError):
        s.unscale_(opt)
    assert before[:2] == (s.get_scale(), s._get_growth_tracker())
    assert torch.equal(before[2], p.detach()) and torch.equal(before[3], p.grad)


def test_state_dict_both_directions_and_weights_only():
    fs = fastamp.Scaler("cpu", init_scale=128.0, growth_interval=5, hysteresis=2)
    p, opt, _ = _loop_parts(fastamp.Scaler)
    for _ in range(3):
        fs.scale(torch.ones(()))
        p.grad = torch.ones(3)
        fs.step(opt)
        fs.update()
    sd = fs.state_dict()
    ts_sd = torch.amp.GradScaler("cpu", init_scale=128.0, growth_interval=5).state_dict()
    for k, v in ts_sd.items():
        assert k in sd and type(sd[k]) is type(v), k
    assert sd["_growth_tracker"] == 3 and sd["scale"] == 128.0
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded == sd
    # ours -> torch
    ts = torch.amp.GradScaler("cpu")
    ts.load_state_dict(loaded)
    assert ts.get_scale() == 128.0 and ts._get_growth_tracker() == 3 and ts.get_growth_interval() == 5
    # torch -> ours, before and after lazy init
    ts.scale(torch.ones(()))
    tsd = ts.state_dict()
    f2 = fastamp.Scaler("cpu")
    f2.load_state_dict(tsd)
    assert f2.get_scale() == 128.0 and f2._get_growth_tracker() == 3
    f2.scale(torch.ones(()))
    assert f2.get_scale() == 128.0 and f2._get_growth_tracker() == 3
    f3 = fastamp.Scaler("cpu")
    f3.scale(torch.ones(()))
    f3.load_state_dict(sd)
    assert f3.state_dict() == sd


def test_resume_continues_identically():
    def run(n, start_sd=None, offset=0):
        s = fastamp.Scaler("cpu", init_scale=16.0, growth_interval=2, hysteresis=2)
        if start_sd is not None:
            s.load_state_dict(start_sd)
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.1)
        seq = []
        for i in range(n):
            s.scale(torch.ones(()))
            p.grad = torch.tensor([math.inf if (i + offset) % 3 == 1 else 1.0, 1.0])
            s.step(opt)
            s.update()
            seq.append((s.get_scale(), s._get_growth_tracker(), s._get_hysteresis_tracker(), int(s.skipped_steps)))
        return seq, s.state_dict()

    full, _ = run(12)
    first, sd = run(5)
    rest, _ = run(7, sd, offset=5)
    assert first + rest == full


def test_pickle_roundtrip_and_disabled():
    s = fastamp.Scaler("cpu", init_scale=32.0)
    s.scale(torch.ones(()))
    s2 = pickle.loads(pickle.dumps(s))
    assert s2._scale is None and s2.get_scale() == 32.0
    s2.scale(torch.ones(()))
    assert s2._scale is not None and s2.get_scale() == 32.0
    assert copy.deepcopy(s).get_scale() == 32.0

    d = fastamp.Scaler("cpu", enabled=False)
    t = torch.ones(3)
    assert d.scale(t) is t and d.get_scale() == 1.0 and d.state_dict() == {} and not d.is_enabled()
    d.load_state_dict({})
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), math.inf)
    opt = torch.optim.SGD([p], lr=0.1)
    assert d.step(opt, closure=lambda: 7.0) == 7.0  # disabled: plain optimizer.step, closures allowed
    d.update()
    with pytest.raises(AttributeError):
        d.get_growth_factor()


def test_device_none_and_cuda_on_cpu_machine():
    s = fastamp.Scaler()
    assert s.is_enabled()
    out = s.scale(torch.ones(2, dtype=torch.float16))
    assert s._scale.device.type == "cpu" and s._device == "cpu" and out.dtype == torch.float16
    if not torch.cuda.is_available():
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            c = fastamp.Scaler("cuda")
        assert not c.is_enabled() and any("CUDA is not available" in str(x.message) for x in w)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_cuda_warns_in_fastamps_name():
    """torch's warning text, naming the class the user built, at the user's line."""
    with warnings.catch_warnings(record=True) as torch_warns:
        warnings.simplefilter("always")
        torch.amp.GradScaler("cuda")
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        fastamp.Scaler("cuda")
    (want,) = [str(w.message) for w in torch_warns if "CUDA is not available" in str(w.message)]
    (got,) = [w for w in ours if "CUDA is not available" in str(w.message)]
    assert str(got.message) == want.replace("torch.cuda.amp.GradScaler", "fastamp.Scaler")
    assert "GradScaler" not in str(got.message) and got.filename == __file__


def test_scale_promotion_and_nesting():
    s, t = fastamp.Scaler("cpu", init_scale=4.0), torch.amp.GradScaler("cpu", init_scale=4.0)
    loss16 = torch.tensor(3.0, dtype=torch.float16)
    assert s.scale(loss16).dtype == t.scale(loss16).dtype == torch.float32
    x = torch.ones(2, dtype=torch.float16)
    nested = [x, (x, [x])]
    a, b = s.scale(nested), t.scale(nested)
    assert type(a) is list and type(a[1]) is tuple and type(a[1][1]) is list
    assert torch.equal(a[1][1][0], b[1][1][0])
    assert isinstance(s.scale(iter([x])), map)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unscale_grad_dtypes(dtype):
    p = torch.nn.Parameter(torch.ones(5, dtype=dtype))
    s = fastamp.Scaler("cpu", init_scale=8.0)
    s.scale(torch.ones(()))
    opt = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.tensor([8.0, -16.0, 0.0, 4.0, 2.0], dtype=dtype)
    s.unscale_(opt)
    assert torch.equal(p.grad, torch.tensor([1.0, -2.0, 0.0, 0.5, 0.25], dtype=dtype))
    if dtype != torch.float16:
        t = torch.amp.GradScaler("cpu", init_scale=8.0)
        t.scale(torch.ones(()))
        q = torch.nn.Parameter(torch.ones(5, dtype=dtype))
        q.grad = torch.tensor([8.0, -16.0, 0.0, 4.0, 2.0], dtype=dtype)
        t.unscale_(torch.optim.SGD([q], lr=0.1))
        assert torch.equal(q.grad, p.grad)


def test_fp16_overflow_created_by_unscaling_is_caught():
    """scale 0.5 turns fp16 60000 into 120000 (> fp16 max): torch misses it, fastamp flags it."""
    for cls in (torch.amp.GradScaler, fastamp.Scaler):
        s = cls("cpu", init_scale=0.5)
        s.scale(torch.ones(()))
        q = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
        q.grad = torch.tensor([60000.0, 1.0], dtype=torch.float16)
        opt = torch.optim.SGD([q], lr=1.0)
        if cls is torch.amp.GradScaler:
            # torch refuses fp16 grads in unscale_; its own kernel misses the overflow:
            found = torch.zeros(())
            g = q.grad.clone()
            torch._amp_foreach_non_finite_check_and_unscale_([g], found, torch.tensor(2.0))
            assert float(found) == 0.0 and torch.isinf(g[0])
            with pytest.raises(ValueError, match="FP16"):
                s.unscale_(opt)
            continue
        s.step(opt)
        s.update()
        assert s.last_step_skipped is True and s.get_scale() == 0.25
        assert torch.equal(q.detach(), torch.zeros(2, dtype=torch.float16))


def test_zero_scale_does_not_poison_params():
    """At scale 0 torch computes 0*inf = NaN unflagged and steps; fastamp skips.

    fastamp refuses init_scale=0 (issue 12), so both reach 0 the way a run does: by backoff
    (the smallest fp32 subnormal halved rounds to 0).
    """
    results = {}
    for cls in (torch.amp.GradScaler, fastamp.Scaler):
        p = torch.nn.Parameter(torch.ones(3))
        s = cls("cpu", init_scale=2.0**-149)
        opt = torch.optim.SGD([p], lr=1.0)
        s.scale(torch.ones(()))
        p.grad = torch.full((3,), math.inf)
        s.step(opt)
        s.update()
        assert s.get_scale() == 0.0
        s.scale(torch.ones(()))
        p.grad = torch.zeros(3)
        s.step(opt)
        s.update()
        results[cls] = p.detach().clone()
    assert torch.isnan(results[torch.amp.GradScaler]).all()
    assert torch.equal(results[fastamp.Scaler], torch.ones(3))


def test_sparse_grads_match_torch():
    i = torch.tensor([[0, 2, 2, 5]])
    out = {}
    for cls in (torch.amp.GradScaler, fastamp.Scaler):
        for dtype in (torch.float32, torch.float16):
            p = torch.nn.Parameter(torch.zeros(6, dtype=dtype))
            v = torch.tensor([4.0, 8000.0, 60000.0, 2.0], dtype=dtype)
            p.grad = torch.sparse_coo_tensor(i, v, (6,))
            s = cls("cpu", init_scale=2.0)
            s.scale(torch.ones(()))
            opt = torch.optim.SGD([p], lr=1.0)
            found = s._unscale_grads_(opt, torch.tensor(0.5), torch.zeros(()), True)
            out[(cls, dtype)] = (p.grad.is_coalesced(), p.grad._values().clone(), float(sum(found.values())))
    for dtype in (torch.float32, torch.float16):
        a, b = out[(torch.amp.GradScaler, dtype)], out[(fastamp.Scaler, dtype)]
        assert a[0] == b[0] and torch.equal(a[1], b[1]) and a[2] == b[2], dtype
    assert out[(fastamp.Scaler, torch.float16)][2] == 1.0  # 8000 + 60000 coalesced overflows fp16


def test_two_optimizers_one_overflows():
    """torch's per-optimizer skip: only the overflowing optimizer skips; scale backs off once."""
    s = fastamp.Scaler("cpu", init_scale=4.0)
    p1, p2 = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    o1, o2 = torch.optim.SGD([p1], lr=1.0), torch.optim.SGD([p2], lr=1.0)
    s.scale(torch.ones(()))
    p1.grad = torch.tensor([math.inf, 4.0])
    p2.grad = torch.tensor([4.0, 4.0])
    s.step(o1)
    s.step(o2)
    s.update()
    assert torch.equal(p1.detach(), torch.ones(2))
    assert torch.equal(p2.detach(), torch.zeros(2))
    assert s.get_scale() == 2.0 and s.last_step_skipped and int(s.skipped_steps) == 1


def test_hysteresis_and_bounds_trajectory():
    s = fastamp.Scaler("cpu", init_scale=64.0, growth_interval=2, hysteresis=3, min_scale=16.0, max_scale=128.0)
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.0)
    pattern = "IICIIIIICCCCCCC"  # I = overflow, C = clean
    seq = []
    for c in pattern:
        s.scale(torch.ones(()))
        p.grad = torch.tensor([math.inf if c == "I" else 1.0])
        s.step(opt)
        s.update()
        seq.append(s.get_scale())
    # I,I tolerated (hysteresis 3); C refills; I,I tolerated, 3rd I backs off to 32, 4th to 16,
    # 5th would be 8 but min_scale=16; then growth every 2 clean steps, capped at 128.
    assert seq == [64, 64, 64, 64, 64, 32, 16, 16, 16, 32, 32, 64, 64, 128, 128]
    assert int(s.skipped_steps) == 7


def test_last_step_skipped_is_lazy_tensor():
    s = fastamp.Scaler("cpu")
    assert s.last_step_skipped is False
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.1)
    s.scale(torch.ones(()))
    p.grad = torch.tensor([math.nan])
    s.step(opt)
    s.update()
    t = s.last_step_skipped_tensor
    assert isinstance(t, torch.Tensor) and t.dtype == torch.bool and bool(t)
    assert s.last_step_skipped is True
    s.scale(torch.ones(()))
    p.grad = torch.tensor([1.0])
    s.step(opt)
    s.update()
    assert s.last_step_skipped is False and int(s.skipped_steps) == 1


def _clip_setup(kind, seed=0):
    torch.manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(n)) for n in (17, 64, 3)]
    return ps, _opt(kind, ps)


@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_fused_clip_matches_torch(kind, max_norm):
    pt, ot = _clip_setup(kind)
    pf, of = _clip_setup(kind)
    ts, fs = torch.amp.GradScaler("cpu", init_scale=1024.0), fastamp.Scaler("cpu", init_scale=1024.0)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        ts.scale(torch.ones(()))
        fs.scale(torch.ones(()))
        for a, b in zip(pt, pf):
            g = torch.randn(a.shape, generator=gen) * 1024.0
            a.grad, b.grad = g.clone(), g.clone()
        ts.unscale_(ot)
        tn = torch.nn.utils.clip_grad_norm_(pt, max_norm, foreach=True)
        fn = fs.clip_grad_norm_(of, max_norm)
        assert torch.allclose(fn, tn, rtol=NORM_RTOL, atol=0)
        if kind == "adamw_fused":
            # amp-aware: grads untouched (still scaled); the clip is folded into grad_scale
            for a, b in zip(pt, pf):
                assert not torch.equal(a.grad, b.grad) or max_norm > 1e5
        ts.step(ot)
        fs.step(of)
        ts.update()
        fs.update()
    for a, b in zip(pt, pf):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-5, atol=1e-6)


def test_clip_after_unscale_and_other_norms():
    pf, of = _clip_setup("sgd")
    pt, ot = _clip_setup("sgd")
    fs, ts = fastamp.Scaler("cpu", init_scale=64.0), torch.amp.GradScaler("cpu", init_scale=64.0)
    fs.scale(torch.ones(()))
    ts.scale(torch.ones(()))
    for a, b in zip(pt, pf):
        g = torch.randn(a.shape) * 64
        a.grad, b.grad = g.clone(), g.clone()
    fs.unscale_(of)
    ts.unscale_(ot)
    fn = fs.clip_grad_norm_(of, 0.1, norm_type=math.inf)
    tn = torch.nn.utils.clip_grad_norm_(pt, 0.1, norm_type=math.inf)
    assert torch.equal(fn, tn)
    for a, b in zip(pt, pf):
        assert torch.equal(a.grad, b.grad)
    with pytest.raises(RuntimeError, match="non-finite"):
        fs2 = fastamp.Scaler("cpu")
        fs2.scale(torch.ones(()))
        pf[0].grad = torch.full_like(pf[0], math.inf)
        fs2.clip_grad_norm_(of, 1.0, error_if_nonfinite=True)


def test_torch_fused_optimizer_multi_device_flag_is_binary():
    """found_inf handed to amp-aware optimizers is 0/1 (torch's fused kernels skip only on ==1)."""
    s = fastamp.Scaler("cpu")
    s.scale(torch.ones(()))
    seen = {}

    class Spy(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None):
            seen["found_inf"] = self.found_inf.clone()
            seen["grad_scale"] = self.grad_scale.clone()

    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([math.inf, 1.0])
    opt = Spy([p], lr=0.1)
    s._per_optimizer_states[id(opt)]["found_inf_per_device"] = {}
    s.step(opt)
    assert float(seen["found_inf"]) == 1.0 and float(seen["grad_scale"]) == 2.0**16
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_scaler_backends_agree(backend):
    """The same short loop on every available backend gives identical scale, skips and params."""
    results = []
    for b in ("torch", backend):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n, dtype=dt)) for n, dt in ((33, torch.float32), (8, torch.bfloat16))]
        opt = torch.optim.SGD(ps, lr=0.01)
        s = fastamp.Scaler("cpu", init_scale=2.0**8, growth_interval=2, backend=b)
        seq = []
        gen = torch.Generator().manual_seed(1)
        for i in range(12):
            s.scale(torch.ones(()))
            for p in ps:
                g = torch.randn(p.shape, generator=gen) * 256
                if i % 4 == 2:
                    g[0] = math.inf
                p.grad = g.to(p.dtype)
            n = s.clip_grad_norm_(opt, 1e4)  # coef clamps to exactly 1: params comparable bit for bit
            s.step(opt)
            s.update()
            seq.append((s.get_scale(), float(n) if math.isfinite(float(n)) else "nonfinite"))
        results.append((seq, [p.detach().clone() for p in ps]))
    (seq_a, pa), (seq_b, pb) = results
    assert [x[0] for x in seq_a] == [x[0] for x in seq_b]
    for x, y in zip(seq_a, seq_b):
        if x[1] != "nonfinite":
            assert math.isclose(x[1], y[1], rel_tol=NORM_RTOL)
    for a, b in zip(pa, pb):
        assert torch.equal(a, b)
