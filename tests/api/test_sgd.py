"""fastamp.optim.SGD: parity with torch.optim.SGD, masters, amp skip, validation, state_dict."""

import copy
import itertools

import pytest
import tolerances
import torch
from helpers import save_load, set_grads

import fastamp
from fastamp.optim import SGD

BACKENDS = [b for b in fastamp.backends.BACKENDS if fastamp.backends.available(b, "optim_", "cpu")[0]]
SHAPES = [(7, 5), (13,), (1,)]


def _leaves(tensors, dtype=None):
    return [t.detach().clone().to(dtype or t.dtype).requires_grad_() for t in tensors]


def _close(a, b):
    torch.testing.assert_close(a, b, atol=tolerances.SGD_VS_TORCH_ATOL, rtol=tolerances.SGD_VS_TORCH_RTOL)


OPTIONS = [
    dict(momentum=m, dampening=d, nesterov=n, weight_decay=wd, maximize=mx)
    for m, d, n, wd, mx in itertools.product((0.0, 0.9), (0.0, 0.3), (False, True), (0.0, 0.1), (False, True))
    if not (n and (m == 0 or d != 0))
]


@pytest.mark.parametrize("kw", OPTIONS, ids=str)
def test_fp32_matches_torch_every_option(kw):
    backend = BACKENDS[0] if BACKENDS[0] != "triton" else "torch"
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    ours, theirs = _leaves(init), _leaves(init)
    opt = SGD([{"params": ours[:2]}, {"params": ours[2:], "lr": 0.01}], lr=0.05, backend=backend, **kw)
    ref = torch.optim.SGD([{"params": theirs[:2]}, {"params": theirs[2:], "lr": 0.01}], lr=0.05, **kw)
    for _ in range(100):
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        set_grads(ours, grads)
        set_grads(theirs, grads)
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        _close(p, q)
        if kw["momentum"]:
            _close(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])
            assert opt.state[p]["step"].item() == 100
        else:
            assert len(opt.state.get(p, {})) == 0 and len(ref.state.get(q, {})) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_lr_and_params_without_grad(backend):
    g = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    ours, theirs = _leaves(init), _leaves(init)
    opt = SGD(ours, lr=torch.tensor(0.02), momentum=0.9, backend=backend)
    ref = torch.optim.SGD(theirs, lr=torch.tensor(0.02), momentum=0.9)
    for i in range(6):
        grads = [torch.randn(s, generator=g) if not (j == 1 and i < 3) else None for j, s in enumerate(SHAPES)]
        set_grads(ours, grads)
        set_grads(theirs, grads)
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        _close(p, q)
    assert [opt.state[p]["step"].item() for p in ours] == [6, 3, 6]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_trajectory_bit_identical_to_fp32(backend, dtype):
    g = torch.Generator().manual_seed(3)
    shapes = [(33,), (4, 5)]
    init = [torch.randn(s, generator=g).to(dtype).float() for s in shapes]
    low = [t.to(dtype).requires_grad_() for t in init]
    full = [t.clone().requires_grad_() for t in init]
    kw = dict(lr=3e-3, momentum=0.9, weight_decay=0.05, backend=backend)
    opt_low, opt_full = SGD(low, **kw), SGD(full, **kw)
    for _ in range(200 if backend != "triton" else 10):
        grads = [(torch.randn(s, generator=g) * 0.1).to(dtype).float() for s in shapes]
        set_grads(low, grads)
        set_grads(full, grads)
        opt_low.step()
        opt_full.step()
        for p in low:
            assert torch.equal(p, opt_low.state[p]["master_param"].to(dtype))
    for p, q in zip(low, full):
        assert torch.equal(opt_low.state[p]["master_param"], q)
        assert torch.equal(opt_low.state[p]["momentum_buffer"], opt_full.state[q]["momentum_buffer"])


# ---- amp ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dampening", [0.0, 0.5])
def test_skipped_first_step_keeps_buffer_uninitialised(backend, dampening):
    g = torch.Generator().manual_seed(5)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    ours, theirs = _leaves(init), _leaves(init)
    opt = SGD(ours, lr=0.1, momentum=0.9, dampening=dampening, backend=backend)
    ref = torch.optim.SGD(theirs, lr=0.1, momentum=0.9, dampening=dampening)
    # first step overflows: skipped on device, everything bit-identical
    set_grads(ours, [torch.randn(s, generator=g) * 1e3 for s in SHAPES])
    opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(1.0)
    before = [p.detach().clone() for p in ours]
    opt.step()
    del opt.grad_scale, opt.found_inf
    for p, b in zip(ours, before):
        assert torch.equal(p, b)
        assert opt.state[p]["step"].item() == 0
    for _ in range(4):
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        set_grads(ours, [x * 1024 for x in grads])
        set_grads(theirs, grads)
        opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(0.0)
        opt.step()
        del opt.grad_scale, opt.found_inf
        ref.step()
    for p, q in zip(ours, theirs):
        _close(p, q)
        _close(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])


@pytest.mark.parametrize("amp_dtype", [torch.float16, torch.bfloat16])
def test_torch_gradscaler_drives_ours_like_torch(amp_dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    ref_model = copy.deepcopy(model)
    opt = SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    s1 = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
    s2 = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
    x, y = torch.randn(32, 8), torch.randn(32, 2)
    scales = ([], [])
    for i in range(12):
        for m, o, s, sc in ((model, opt, s1, scales[0]), (ref_model, ref, s2, scales[1])):
            o.zero_grad()
            with torch.autocast("cpu", dtype=amp_dtype):
                loss = torch.nn.functional.mse_loss(m(x).float(), y)
            if i == 4:
                loss = loss * float("inf")  # an overflow step: skipped by both
            s.scale(loss).backward()
            s.step(o)
            s.update()
            sc.append(s.get_scale())
    assert scales[0] == scales[1]
    skipped = sum(b < a for a, b in zip([2.0**20] + scales[0][:-1], scales[0]))
    assert skipped >= 1
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-4)  # autocast matmuls identical; fp32 update ulps
        assert opt.state[p]["step"].item() == 12 - skipped


# ---- validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lr=-1.0),
        dict(momentum=-0.1),
        dict(weight_decay=-0.1),
        dict(nesterov=True),
        dict(nesterov=True, momentum=0.9, dampening=0.1),
        dict(lr=torch.tensor([0.1, 0.2])),
    ],
)
def test_bad_hyperparameters_raise_like_torch(kwargs):
    p = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError) as theirs:
        torch.optim.SGD([p], **kwargs)
    with pytest.raises(ValueError) as ours:
        SGD([p], **kwargs)
    assert str(ours.value) == str(theirs.value)


def test_bad_inputs_change_nothing():
    p = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match="nesterov"):
        SGD([p], momentum=0.9, nesterov=1)
    with pytest.raises(TypeError, match="float64"):
        SGD([torch.randn(3, dtype=torch.float64, requires_grad=True)])
    opt = SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(3).to_sparse()
    p0 = p.detach().clone()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(p, p0) and len(opt.state) == 0


# ---- state_dict --------------------------------------------------------------------------


def test_state_dict_interoperates_with_torch():
    g = torch.Generator().manual_seed(9)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    a, b = _leaves(init), _leaves(init)
    ours = SGD(a, lr=0.1, momentum=0.9)
    theirs = torch.optim.SGD(b, lr=0.1, momentum=0.9)
    grads = [torch.randn(s, generator=g) for s in SHAPES]
    set_grads(a, grads)
    set_grads(b, grads)
    ours.step()
    theirs.step()
    # torch -> ours: a present buffer is initialised (step 1); the trajectories continue alike
    c = _leaves(b)
    ours2 = SGD(c, lr=0.1, momentum=0.9)
    ours2.load_state_dict(save_load(theirs.state_dict()))
    assert all(ours2.state[p]["step"].item() == 1 for p in c)
    # ours -> torch
    d = _leaves(a)
    theirs2 = torch.optim.SGD(d, lr=0.1, momentum=0.9)
    theirs2.load_state_dict(save_load(ours.state_dict()))
    for _ in range(3):
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        for ps, o in ((a, ours), (b, theirs), (c, ours2), (d, theirs2)):
            set_grads(ps, grads)
            o.step()
    for x, y, z, w in zip(a, b, c, d):
        _close(x, y)
        _close(z, y)
        _close(w, y)
    # a round trip of ours is exact; torch's None buffers (no momentum step yet) load as uninitialised
    e = _leaves(a)
    ours3 = SGD(e, lr=0.1, momentum=0.9)
    ours3.load_state_dict(save_load(ours.state_dict()))
    for p, q in zip(a, e):
        assert torch.equal(ours.state[p]["momentum_buffer"], ours3.state[q]["momentum_buffer"])
        assert torch.equal(ours.state[p]["step"], ours3.state[q]["step"])
    none_sd = {"state": {0: {"momentum_buffer": None}}, "param_groups": theirs.state_dict()["param_groups"]}
    f = _leaves(init)
    ours4 = SGD(f, lr=0.1, momentum=0.9)
    ours4.load_state_dict(none_sd)
    set_grads(f, grads)
    ours4.step()
    assert torch.equal(ours4.state[f[0]]["momentum_buffer"], grads[0])  # first step: buf = grad


def test_torch_adamw_state_dict_rejected():
    p = torch.randn(3, requires_grad=True)
    adam = torch.optim.AdamW([p.detach().clone().requires_grad_()])
    with pytest.raises(ValueError, match="another optimizer"):
        SGD([p], momentum=0.9).load_state_dict(adam.state_dict())
