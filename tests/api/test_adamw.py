"""fastamp.optim.AdamW: parity with torch.optim.AdamW, master weights, validation, state_dict."""

import copy
import os
import warnings

import pytest
import tolerances
import torch
from helpers import save_load, set_grads, spy_optim

import fastamp
from fastamp.optim import AdamW

CPU_BACKENDS = [b for b in fastamp.backends.BACKENDS if fastamp.backends.available(b, "optim_", "cpu")[0]]
SHAPES = [(7, 5), (13,), (3, 4, 2), (1,)]


def _leaves(tensors, dtype=None):
    return [t.detach().clone().to(dtype or t.dtype).requires_grad_() for t in tensors]


def _assert_close_to_torch(ours, theirs):
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(
            a, b, atol=tolerances.ADAMW_VS_TORCH_ATOL, rtol=tolerances.ADAMW_VS_TORCH_RTOL, msg="param vs torch"
        )


# The Triton backend runs under the (slow, ~60 ms a step) interpreter on CPU: it gets the
# same checks with far fewer steps; its per-element maths is compared with the reference
# by the kernel tests.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _steps(backend, n, slow=6):
    return min(n, slow) if backend == "triton" and INTERPRETED else n


def _slow_backend_skip(backend, reason="covered by the shorter cases of this test"):
    if backend == "triton" and INTERPRETED:
        pytest.skip(f"Triton interpreter: {reason}")


REGIMES = {
    "ordinary": dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8),
    "magnify": dict(lr=1.0, betas=(0.1, 0.25), eps=1e-8),
}


def _run_vs_torch(backend, torch_flags, kw, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    ours, theirs = _leaves(init), _leaves(init)
    torch_kw = dict(kw)
    if kw["lr"] == "tensor":
        kw = dict(kw, lr=torch.tensor(3e-3))
        torch_kw["lr"] = torch.tensor(3e-3)
    # two param groups, the second with its own lr and weight decay
    lr2 = kw["lr"] * 2 if isinstance(kw["lr"], torch.Tensor) else kw["lr"] / 2
    opt = AdamW([{"params": ours[:2]}, {"params": ours[2:], "lr": lr2, "weight_decay": 0.3}], backend=backend, **kw)
    ref = torch.optim.AdamW(
        [{"params": theirs[:2]}, {"params": theirs[2:], "lr": lr2, "weight_decay": 0.3}], **torch_kw, **torch_flags
    )
    for _ in range(steps):
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        set_grads(ours, grads)
        set_grads(theirs, grads)
        opt.step()
        ref.step()
    _assert_close_to_torch(ours, theirs)
    for p, q in zip(ours, theirs):
        for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if kw.get("amsgrad") else ()):
            assert opt.state[p][key].dtype == torch.float32
            torch.testing.assert_close(opt.state[p][key], ref.state[q][key], atol=1e-5, rtol=1e-5)
        assert opt.state[p]["step"].dtype == torch.float32 and opt.state[p]["step"].item() == steps


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("regime", list(REGIMES))
def test_fp32_matches_torch_500_steps(backend, regime):
    _run_vs_torch(backend, dict(foreach=False), dict(REGIMES[regime]), _steps(backend, 500))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_fp32_matches_torch_every_option(backend, regime, amsgrad, maximize, weight_decay, tensor_lr):
    if not (amsgrad and maximize and weight_decay and tensor_lr):
        _slow_backend_skip(backend)
    kw = dict(REGIMES[regime], amsgrad=amsgrad, maximize=maximize, weight_decay=weight_decay)
    if tensor_lr:
        kw["lr"] = "tensor"
    _run_vs_torch(backend, dict(foreach=False), kw, _steps(backend, 150), seed=1)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "torch_flags, kw",
    [
        (dict(foreach=True), dict(lr=0.01)),
        (dict(foreach=True), dict(lr=1.0, betas=(0.1, 0.25), amsgrad=True, maximize=True)),
        (dict(fused=True), dict(lr=0.01)),
        (dict(fused=True), dict(lr=1.0, betas=(0.1, 0.25), amsgrad=True, maximize=True)),
        (dict(fused=True), dict(lr="tensor", weight_decay=0.0)),
    ],
    ids=["foreach", "foreach-magnify-all", "fused", "fused-magnify-all", "fused-tensor-lr"],
)
def test_fp32_matches_torch_foreach_and_fused(backend, torch_flags, kw):
    # torch's fused CPU AdamW costs ~30 ms a step on tiny tensors on a busy 2-core machine.
    _run_vs_torch(backend, torch_flags, dict(kw), _steps(backend, 100 if "foreach" in torch_flags else 25), seed=2)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_lr_scheduler_no_warning_and_matches_torch(backend):
    _slow_backend_skip(backend, "the scheduler path does not depend on the backend")
    g = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    ours, theirs = _leaves(init), _leaves(init)
    opt = AdamW(ours, lr=0.05, backend=backend)
    ref = torch.optim.AdamW(theirs, lr=0.05, foreach=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s1 = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=60)
        s2 = torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=0.05, total_steps=60)
        for _ in range(60):
            grads = [torch.randn(s, generator=g) for s in SHAPES]
            set_grads(ours, grads)
            set_grads(theirs, grads)
            opt.step()
            ref.step()
            s1.step()
            s2.step()
    _assert_close_to_torch(ours, theirs)
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_params_without_grad_keep_their_own_step_like_torch(backend):
    _slow_backend_skip(backend, "the step bookkeeping does not depend on the backend")
    # A param stepped less often has a smaller step count (bias correction), as in torch.
    g = torch.Generator().manual_seed(2)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    ours, theirs = _leaves(init), _leaves(init)
    opt = AdamW(ours, lr=0.01, backend=backend)
    ref = torch.optim.AdamW(theirs, lr=0.01, foreach=False)
    for i in range(40):
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        grads[1] = grads[1] if i % 3 == 0 else None
        grads[2] = grads[2] if i >= 10 else None
        set_grads(ours, grads)
        set_grads(theirs, grads)
        opt.step()
        ref.step()
    _assert_close_to_torch(ours, theirs)
    assert [opt.state[p]["step"].item() for p in ours] == [40.0, 14.0, 30.0, 40.0]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_non_contiguous_param_and_grad(backend):
    p = torch.randn(3, 5).t().requires_grad_()
    assert not p.is_contiguous()
    q = p.detach().clone().requires_grad_()
    opt = AdamW([p], lr=0.1, backend=backend)
    ref = torch.optim.AdamW([q], lr=0.1, foreach=False)
    for _ in range(5):
        grad = torch.randn(3, 5).t()
        p.grad, q.grad = grad.clone(memory_format=torch.preserve_format), grad.clone()
        assert not p.grad.is_contiguous()
        opt.step()
        ref.step()
    assert not p.is_contiguous()
    _assert_close_to_torch([p], [q])


def test_hooks_zero_grad_add_param_group():
    p, q = torch.randn(4, requires_grad=True), torch.randn(3, requires_grad=True)
    opt = AdamW([p], lr=0.1)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    p.grad = torch.ones(4)
    opt.step()
    assert calls == ["pre", "post"]
    opt.add_param_group({"params": [q], "lr": 0.5})
    q.grad = torch.ones(3)
    q0 = q.detach().clone()
    opt.step()
    assert not torch.equal(q, q0)
    assert opt.state[q]["step"].item() == 1 and opt.state[p]["step"].item() == 2
    opt.zero_grad()
    assert p.grad is None and q.grad is None
    assert opt.step(closure=lambda: 3.0) == 3.0


# ---- master weights ----------------------------------------------------------------------


def _representable(shape, dtype, generator, scale=1.0):
    return (torch.randn(shape, generator=generator) * scale).to(dtype).float()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("master_weights", [None, True])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_master_trajectory_bit_identical_to_fp32(backend, dtype, master_weights, amsgrad):
    if amsgrad or master_weights is not None:
        _slow_backend_skip(backend)
    steps = _steps(backend, 1000 if not amsgrad and master_weights is None else 200, slow=10)
    g = torch.Generator().manual_seed(3)
    shapes = [(33,), (4, 5)]
    init = [_representable(s, dtype, g) for s in shapes]
    low = [t.to(dtype).requires_grad_() for t in init]
    full = [t.clone().requires_grad_() for t in init]
    kw = dict(lr=3e-3, weight_decay=0.05, amsgrad=amsgrad, backend=backend)
    opt_low = AdamW(low, master_weights=master_weights, **kw)
    opt_full = AdamW(full, **kw)
    for _ in range(steps):
        grads = [_representable(s, dtype, g, scale=0.1) for s in shapes]
        set_grads(low, grads)
        set_grads(full, grads)
        opt_low.step()
        opt_full.step()
        for p in low:
            master = opt_low.state[p]["master_param"]
            assert torch.equal(p, master.to(dtype)), "param drifted from its rounded master"
    for p, q in zip(low, full):
        st, sq = opt_low.state[p], opt_full.state[q]
        assert st["master_param"].dtype == torch.float32
        assert "master_param" not in sq
        assert torch.equal(st["master_param"], q), "master trajectory differs from the fp32 run"
        for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
            assert st[key].dtype == torch.float32
            assert torch.equal(st[key], sq[key])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights_false_rounds_fp32_update_once(backend, dtype):
    g = torch.Generator().manual_seed(4)
    init = _representable((50,), dtype, g)
    low = init.to(dtype).requires_grad_()
    full = init.clone().requires_grad_()
    opt_low = AdamW([low], lr=1e-2, master_weights=False, backend=backend)
    opt_full = AdamW([full], lr=1e-2, backend=backend)
    for _ in range(_steps(backend, 30, slow=4)):
        grad = _representable((50,), dtype, g)
        set_grads([low], [grad])
        set_grads([full], [grad])
        with torch.no_grad():
            full.copy_(low.float())  # same starting point each step: one fp32 update, rounded once
        opt_low.step()
        opt_full.step()
        assert "master_param" not in opt_low.state[low]
        assert torch.equal(low, full.to(dtype))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bf16_small_lr_param_moves_where_torch_freezes(backend):
    steps = _steps(backend, 100, slow=30)
    ours = torch.ones(8, dtype=torch.bfloat16, requires_grad=True)
    theirs = torch.ones(8, dtype=torch.bfloat16, requires_grad=True)
    fp32 = torch.ones(8, requires_grad=True)
    opt = AdamW([ours], lr=1e-4, weight_decay=0.0, backend=backend)
    ref = torch.optim.AdamW([theirs], lr=1e-4, weight_decay=0.0, fused=True)
    ref32 = torch.optim.AdamW([fp32], lr=1e-4, weight_decay=0.0, foreach=False)
    for _ in range(steps):
        set_grads([ours, theirs, fp32], [torch.full((8,), 0.5)] * 3)
        opt.step()
        ref.step()
        ref32.step()
    assert torch.equal(theirs, torch.ones_like(theirs)), "torch's bf16 AdamW was expected to stay frozen"
    master = opt.state[ours]["master_param"]
    _assert_close_to_torch([master], [fp32])  # the master follows torch's fp32 run
    assert (ours < 1).all()
    assert torch.equal(ours, master.bfloat16())


def test_mixed_dtypes_in_one_group_one_call_per_dtype_group(monkeypatch):
    calls = []

    def spy(params, grads, masters, *args, **kwargs):
        calls.append((params[0].dtype, grads[0].dtype, len(masters) > 0, len(params)))

    spy_optim(monkeypatch, spy)
    params = [
        torch.randn(3, dtype=dt, requires_grad=True)
        for dt in (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.float16)
    ]
    opt = AdamW(params, lr=0.1)
    set_grads(params, [torch.ones(3)] * len(params))
    opt.step()
    assert sorted(calls, key=str) == sorted(
        [
            (torch.float32, torch.float32, False, 2),
            (torch.bfloat16, torch.bfloat16, True, 2),
            (torch.float16, torch.float16, True, 1),
        ],
        key=str,
    )


# ---- validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lr=-1.0),
        dict(eps=-1e-8),
        dict(betas=(1.0, 0.999)),
        dict(betas=(0.9, -0.1)),
        dict(weight_decay=-0.1),
        dict(lr=torch.tensor([0.1, 0.2])),
    ],
)
def test_bad_hyperparameters_raise_like_torch(kwargs):
    p = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError) as theirs:
        torch.optim.AdamW([p], **kwargs)
    with pytest.raises(ValueError) as ours:
        AdamW([p], **kwargs)
    assert str(ours.value) == str(theirs.value)


def test_bad_group_hyperparameters_and_options():
    p, q = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="Invalid learning rate: -2"):
        AdamW([{"params": [p]}, {"params": [q], "lr": -2.0}])
    opt = AdamW([p])
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        opt.add_param_group({"params": [q], "betas": (0.9, 1.5)})
    assert len(opt.param_groups) == 1
    with pytest.raises(TypeError, match="master_weights"):
        AdamW([p], master_weights="yes")
    with pytest.raises(ValueError, match="unknown backend"):
        AdamW([p], backend="cudnn")
    opt.param_groups[0]["lr"] = -1.0
    p.grad = torch.ones(3)
    p0 = p.detach().clone()
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.step()
    assert torch.equal(p, p0) and len(opt.state) == 0


@pytest.mark.parametrize(
    "param, match",
    [
        (torch.randn(3, dtype=torch.complex64, requires_grad=True), "complex"),
        (torch.randn(3, dtype=torch.float64, requires_grad=True), "float64"),
        (torch.arange(3), "floating point"),
    ],
)
def test_unsupported_params_rejected(param, match):
    with pytest.raises(TypeError, match=match):
        AdamW([param])


def test_failing_step_changes_nothing():
    a = torch.randn(4, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    opt = AdamW([a, b], lr=0.1)
    a.grad = torch.ones(4)
    b.grad = torch.ones(5)
    opt.step()
    snapshot = copy.deepcopy(opt.state_dict())
    a0, b0 = a.detach().clone(), b.detach().clone()
    a.grad = torch.ones(4)
    b.grad = torch.ones(5).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()
    assert torch.equal(a, a0) and torch.equal(b, b0)
    _assert_state_dicts_equal(opt.state_dict(), snapshot)


def test_unavailable_forced_backend_raises_before_mutating(monkeypatch):
    real = fastamp.backends.available

    def native_missing(backend, op, device):
        return (False, "pretend it is not built") if backend == "native" else real(backend, op, device)

    monkeypatch.setattr(fastamp.backends, "available", native_missing)
    p = torch.randn(3, requires_grad=True)
    opt = AdamW([p], backend="native")
    p.grad = torch.ones(3)
    p0 = p.detach().clone()
    with pytest.raises(fastamp.backends.BackendUnavailableError, match="pretend it is not built"):
        opt.step()
    assert torch.equal(p, p0) and len(opt.state) == 0


# ---- state_dict --------------------------------------------------------------------------


def _assert_state_dicts_equal(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert a["state"][k].keys() == b["state"][k].keys()
        for key, v in a["state"][k].items():
            w = b["state"][k][key]
            assert v.dtype == w.dtype and torch.equal(v, w), (k, key)


def _train(opt, params, grads_fn, steps):
    for _ in range(steps):
        set_grads(params, grads_fn())
        opt.step()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_state_dict_round_trip_is_exact(backend, dtype):
    g = torch.Generator().manual_seed(5)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    a = _leaves(init, dtype)
    opt = AdamW([{"params": a[:2]}, {"params": a[2:], "lr": 0.01, "amsgrad": True}], lr=0.02, backend=backend)
    n = _steps(backend, 10, slow=3)
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(2 * n)]
    it = iter(grads)
    _train(opt, a, lambda: next(it), n)
    sd = save_load(opt.state_dict())
    b = [p.detach().clone().requires_grad_() for p in a]
    opt2 = AdamW([{"params": b[:2]}, {"params": b[2:]}], lr=0.5, backend=backend)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 0.02 and opt2.param_groups[1]["amsgrad"] is True
    for p in b:
        for key, v in opt2.state[p].items():
            assert v.dtype == torch.float32, (key, v.dtype)
        assert ("master_param" in opt2.state[p]) == (dtype != torch.float32)
    rest = grads[n:]
    it1, it2 = iter(rest), iter(rest)
    _train(opt, a, lambda: next(it1), n)
    _train(opt2, b, lambda: next(it2), n)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    _assert_state_dicts_equal(opt.state_dict(), opt2.state_dict())
    # deepcopy (pickling) keeps the state and the backend
    opt3 = copy.deepcopy(opt2)
    assert opt3.backend == opt2.backend
    _assert_state_dicts_equal(opt3.state_dict(), opt2.state_dict())


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_torch_state_dict_loads_into_ours_and_back(backend, amsgrad):
    if amsgrad:
        _slow_backend_skip(backend)
    g = torch.Generator().manual_seed(6)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(30)]
    kw = dict(lr=0.01, weight_decay=0.02, amsgrad=amsgrad)
    # torch -> ours
    t_params = _leaves(init)
    t_opt = torch.optim.AdamW(t_params, foreach=False, **kw)
    it = iter(grads)
    _train(t_opt, t_params, lambda: next(it), 10)
    o_params = _leaves([p.detach() for p in t_params])
    o_opt = AdamW(o_params, lr=1.0, backend=backend)
    o_opt.load_state_dict(save_load(t_opt.state_dict()))
    assert o_opt.param_groups[0]["amsgrad"] is amsgrad
    it1, it2 = iter(grads[10:20]), iter(grads[10:20])
    _train(t_opt, t_params, lambda: next(it1), 10)
    _train(o_opt, o_params, lambda: next(it2), 10)
    _assert_close_to_torch(o_params, t_params)
    assert all(o_opt.state[p]["step"].item() == 20 for p in o_params)
    # ours -> torch (fp32 params)
    t2_params = _leaves([p.detach() for p in o_params])
    t2_opt = torch.optim.AdamW(t2_params, lr=1.0, foreach=False)
    t2_opt.load_state_dict(save_load(o_opt.state_dict()))
    it1, it2 = iter(grads[20:]), iter(grads[20:])
    _train(t2_opt, t2_params, lambda: next(it1), 10)
    _train(o_opt, o_params, lambda: next(it2), 10)
    _assert_close_to_torch(o_params, t2_params)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_torch_bf16_state_dict_builds_masters_from_params(backend):
    g = torch.Generator().manual_seed(7)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    t_params = _leaves(init, torch.bfloat16)
    t_opt = torch.optim.AdamW(t_params, lr=0.01, fused=True)
    _train(t_opt, t_params, lambda: [torch.randn(s, generator=g) for s in SHAPES], 5)
    o_params = [p.detach().clone().requires_grad_() for p in t_params]
    o_opt = AdamW(o_params, lr=0.01, backend=backend)
    o_opt.load_state_dict(save_load(t_opt.state_dict()))
    for p, q in zip(o_params, t_params):
        st = o_opt.state[p]
        assert st["exp_avg"].dtype == torch.float32
        assert torch.equal(st["exp_avg"], t_opt.state[q]["exp_avg"].float())
        assert "master_param" not in st
    _train(o_opt, o_params, lambda: [torch.randn(s, generator=g) for s in SHAPES], 1)
    for p in o_params:
        assert o_opt.state[p]["step"].item() == 6
        assert torch.equal(p, o_opt.state[p]["master_param"].bfloat16())


def test_bad_state_dicts_rejected_and_change_nothing():
    a = [torch.randn(s, requires_grad=True) for s in SHAPES]
    opt = AdamW(a, lr=0.01)
    _train(opt, a, lambda: [torch.ones(s) for s in SHAPES], 3)
    before = copy.deepcopy(opt.state_dict())

    sgd_params = [torch.randn(s, requires_grad=True) for s in SHAPES]
    sgd = torch.optim.SGD(sgd_params, lr=0.1, momentum=0.9)
    _train(sgd, sgd_params, lambda: [torch.ones(s) for s in SHAPES], 2)
    with pytest.raises(ValueError, match="another optimizer"):
        opt.load_state_dict(sgd.state_dict())

    missing = copy.deepcopy(before)
    del missing["state"][2]["exp_avg_sq"]
    with pytest.raises(ValueError, match="exp_avg_sq"):
        opt.load_state_dict(missing)

    bad_shape = copy.deepcopy(before)
    bad_shape["state"][1]["exp_avg"] = torch.zeros(14)
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(bad_shape)

    bad_group = copy.deepcopy(before)
    bad_group["param_groups"][0]["eps"] = -1.0
    with pytest.raises(ValueError, match="Invalid epsilon value"):
        opt.load_state_dict(bad_group)

    fewer = copy.deepcopy(before)
    fewer["param_groups"][0]["params"] = fewer["param_groups"][0]["params"][:-1]
    with pytest.raises(ValueError, match="doesn't match the size"):
        opt.load_state_dict(fewer)

    with pytest.raises(ValueError, match="'state' and 'param_groups'"):
        opt.load_state_dict({"state": {}})

    _assert_state_dicts_equal(opt.state_dict(), before)
