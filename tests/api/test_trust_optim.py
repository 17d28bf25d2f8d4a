"""Trust in fastamp's fused optimizers where real training habits meet the cached launch plan.

Each test is written as a user hits the problem (issue 12): a layer's optimizer state reset
mid-run, a partial state dict, a param group added later (1); tied weights as two
Parameters over one storage (4); a step that fails validation in its last group (5); bad
or tensor hyperparameters (8); a model switched to channels_last mid-training, and grads
laid out unlike their params (10). Where torch has a behaviour, the result is compared
with torch.optim (within tests/tolerances.py's budgets, the same as test_adamw/test_sgd);
where it does not, with the same optimizer planning every step from scratch (bit for bit).
"""

import copy
import io
import math
import pickle
import random

import pytest
import tolerances
import torch
from torch import nn

import fastamp
from fastamp.optim import SGD, AdamW, Lion

BACKENDS = [b for b in ("native", "torch") if fastamp.backends.available(b, "optim_", "cpu")[0]]


def _close_adamw(a, b, msg):
    torch.testing.assert_close(
        a, b, atol=tolerances.ADAMW_VS_TORCH_ATOL, rtol=tolerances.ADAMW_VS_TORCH_RTOL, msg=lambda m: f"{msg}: {m}"
    )


def _close_sgd(a, b, msg):
    torch.testing.assert_close(
        a, b, atol=tolerances.SGD_VS_TORCH_ATOL, rtol=tolerances.SGD_VS_TORCH_RTOL, msg=lambda m: f"{msg}: {m}"
    )


def _snapshot(opt, params):
    """Every param, grad and state tensor (and Python value) of the optimizer, copied."""
    state = {}
    for gi, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            st = opt.state.get(p)
            if st:
                state[(gi, i)] = {
                    k: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in st.items()
                }
    return {
        "params": [p.detach().clone() for p in params],
        "grads": [None if p.grad is None else p.grad.detach().clone() for p in params],
        "state": state,
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
    }


def _same_bits(a, b):
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _assert_unchanged(before, after):
    for i, (a, b) in enumerate(zip(before["params"], after["params"])):
        assert _same_bits(a, b), f"param {i} changed"
    for i, (a, b) in enumerate(zip(before["grads"], after["grads"])):
        assert (a is None) == (b is None) and (a is None or _same_bits(a, b)), f"grad {i} changed"
    assert before["state"].keys() == after["state"].keys(), "state entries changed"
    for k in before["state"]:
        assert before["state"][k].keys() == after["state"][k].keys(), f"state keys of {k} changed"
        for key, v in before["state"][k].items():
            w = after["state"][k][key]
            if isinstance(v, torch.Tensor):
                assert _same_bits(v, w), f"state {key!r} of {k} changed"
            else:
                assert v == w, f"state {key!r} of {k} changed"
    assert before["groups"] == after["groups"]


# ---- 1: each param's own step count ----------------------------------------------------


def _reset(opt, p, how, rng):
    """One way a user re-initialises a layer's optimizer state (the same on either optimizer)."""
    st = opt.state[p]
    if how == "replace step":
        st["step"] = torch.tensor(0.0)
        st["exp_avg"].zero_()
        st["exp_avg_sq"].zero_()
    elif how == "zero_ step":
        st["step"].zero_()
        st["exp_avg"] = torch.zeros_like(st["exp_avg"])
        st["exp_avg_sq"].zero_()
    elif how == "new state dict":
        opt.state[p] = {}
    elif how == "del state":
        del opt.state[p]
    elif how == "clear state":
        opt.state[p].clear()
    elif how == "fill step":  # a count set to some other value, moments kept
        st["step"].fill_(float(rng))
    elif how == "add to step":
        st["step"] += float(rng)
    else:
        raise AssertionError(how)


RESETS = ["replace step", "zero_ step", "new state dict", "del state", "clear state", "fill step", "add to step"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adamw_resets_partial_loads_and_new_groups_match_torch(backend, seed):
    """Random schedules of state resets, partial state dicts, dropped grads and new groups, vs torch."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    shapes = [(6, 5), (13,), (4, 3), (7,), (1,), (5, 4)]
    init = [torch.randn(s, generator=g) for s in shapes]
    ours = [t.clone().requires_grad_() for t in init]
    theirs = [t.clone().requires_grad_() for t in init]
    extra_init = [torch.randn(3, 3, generator=g), torch.randn(8, generator=g)]
    extra_ours = [t.clone().requires_grad_() for t in extra_init]
    extra_theirs = [t.clone().requires_grad_() for t in extra_init]
    groups = lambda ps: [{"params": ps[:3]}, {"params": ps[3:], "lr": 0.02, "weight_decay": 0.1}]  # noqa: E731
    opt = AdamW(groups(ours), lr=0.01, backend=backend)
    ref = torch.optim.AdamW(groups(theirs), lr=0.01, foreach=False)
    added = 0
    for step in range(40):
        live = list(zip(ours, theirs)) + list(zip(extra_ours[:added], extra_theirs[:added]))
        event = rng.choice(["none", "none", "reset", "reset", "reset", "drop grads", "partial load", "add group"])
        if event == "reset":
            candidates = [(p, q) for p, q in live if len(opt.state.get(p, {})) > 0]
            if candidates:
                p, q = rng.choice(candidates)
                how, value = rng.choice(RESETS), rng.randint(0, 9)
                _reset(opt, p, how, value)
                _reset(ref, q, how, value)
        elif event == "partial load":
            # a checkpoint holding the state of only some params (the others start afresh)
            keep = {i for i in range(len(live)) if rng.random() < 0.5}
            sd_ours, sd_theirs = opt.state_dict(), ref.state_dict()
            for sd in (sd_ours, sd_theirs):
                sd["state"] = {k: v for k, v in sd["state"].items() if k in keep}
            opt.load_state_dict(copy.deepcopy(sd_ours))
            ref.load_state_dict(copy.deepcopy(sd_theirs))
        elif event == "add group" and added < len(extra_init):
            opt.add_param_group({"params": [extra_ours[added]], "lr": 0.005})
            ref.add_param_group({"params": [extra_theirs[added]], "lr": 0.005})
            added += 1
            live = list(zip(ours, theirs)) + list(zip(extra_ours[:added], extra_theirs[:added]))
        drop = {i for i in range(len(live)) if event == "drop grads" and rng.random() < 0.4}
        for i, (p, q) in enumerate(live):
            grad = None if i in drop else torch.randn(p.shape, generator=g)
            p.grad = grad
            q.grad = None if grad is None else grad.clone()
        opt.step()
        ref.step()
        for i, (p, q) in enumerate(live):
            _close_adamw(p, q, f"seed {seed} step {step} ({event}): param {i}")
            if len(ref.state.get(q, {})):
                assert float(opt.state[p]["step"]) == float(ref.state[q]["step"]), f"step {step}: count of param {i}"
    assert added > 0 or seed != 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_adamw_reset_is_seen_then_the_plan_is_reused(backend):
    """A layer re-initialised mid-run gets its own bias correction, and the fast path comes back."""
    g = torch.Generator().manual_seed(3)
    init = [torch.randn(64, generator=g) for _ in range(8)]
    ours = [t.clone().requires_grad_() for t in init]
    theirs = [t.clone().requires_grad_() for t in init]
    opt = AdamW(ours, lr=0.01, backend=backend)
    ref = torch.optim.AdamW(theirs, lr=0.01, foreach=False)

    def step():
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(64, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()

    for _ in range(5):
        step()
    for o, p in ((opt, ours[5]), (ref, theirs[5])):  # the usual re-init: zero count and moments in place
        o.state[p]["step"].zero_()
        o.state[p]["exp_avg"].zero_()
        o.state[p]["exp_avg_sq"].zero_()
    step()
    plan = opt._plan
    for _ in range(3):
        step()
        assert opt._plan is plan, "steady steps after a reset must reuse the launch plan"
    for i, (p, q) in enumerate(zip(ours, theirs)):
        _close_adamw(p, q, f"param {i}")
    assert [float(opt.state[p]["step"]) for p in ours] == [9.0] * 5 + [4.0] + [9.0] * 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_sgd_state_reset_matches_torch(backend):
    g = torch.Generator().manual_seed(4)
    init = [torch.randn(s, generator=g) for s in [(5, 4), (9,), (3,)]]
    ours = [t.clone().requires_grad_() for t in init]
    theirs = [t.clone().requires_grad_() for t in init]
    kw = dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01)
    opt = SGD(ours, backend=backend, **kw)
    ref = torch.optim.SGD(theirs, **kw)
    for step in range(12):
        if step == 4:
            opt.state[ours[1]] = {}  # torch: an empty state starts a new momentum buffer
            ref.state[theirs[1]] = {}
        if step == 8:
            del opt.state[ours[0]]
            del ref.state[theirs[0]]
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
        for i, (p, q) in enumerate(zip(ours, theirs)):
            _close_sgd(p, q, f"step {step}: param {i}")


# ---- 4: params sharing memory ------------------------------------------------------------


def _tied_transposed():
    a = nn.Parameter(torch.randn(3, 4))
    b = nn.Parameter(a.data.t())  # a second Parameter over the same storage (transposed)
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    return a, b


@pytest.mark.parametrize("cls", [AdamW, SGD, Lion])
def test_tied_params_over_one_storage_are_refused(cls):
    a, b = _tied_transposed()
    with pytest.raises(
        ValueError,
        match=r"param 0 of param group 0 \(shape \(3, 4\)\) and param 1 of param group 0 "
        r"\(shape \(4, 3\)\) share memory",
    ):
        cls([a, b], lr=0.1)
    with pytest.raises(ValueError, match=r"param 0 of param group 0 .* and param 0 of param group 1 .* share memory"):
        cls([{"params": [a]}, {"params": [b]}], lr=0.1)
    opt = cls([a], lr=0.1)
    with pytest.raises(ValueError, match="share memory"):
        opt.add_param_group({"params": [b]})
    assert len(opt.param_groups) == 1
    # the usual tie (one Parameter object in two modules) stays torch's duplicate check
    with pytest.warns(UserWarning, match="duplicate parameters"), pytest.raises(ValueError, match="duplicate"):
        cls([a, a], lr=0.1)


@pytest.mark.parametrize("cls", [AdamW, SGD, Lion])
def test_overlapping_views_refused_disjoint_views_accepted(cls):
    flat = torch.zeros(40)
    with pytest.raises(ValueError, match=r"param 0 of param group 0 \(shape \(12,\)\) and param 1 .* share memory"):
        cls([nn.Parameter(flat[:12]), nn.Parameter(flat[10:])], lr=0.1)
    # a flat parameter buffer split into disjoint views, and interleaved columns: fine, as in torch
    flat = torch.randn(40, generator=torch.Generator().manual_seed(0))
    ref_flat = flat.clone()
    grid = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    ref_grid = grid.clone()

    def params(buf, grid_buf):
        return [
            nn.Parameter(buf[:12]),
            nn.Parameter(buf[12:].view(4, 7)),
            nn.Parameter(grid_buf[:, 0::2]),
            nn.Parameter(grid_buf[:, 1::2]),
        ]

    ours, theirs = params(flat, grid), params(ref_flat, ref_grid)
    opt = cls(ours, lr=0.1, weight_decay=0.01, backend="torch")
    if cls is Lion:  # torch has no Lion: the same optimizer over private contiguous copies, bit for bit
        theirs = [nn.Parameter(q.detach().clone()) for q in theirs]
        ref = Lion(theirs, lr=0.1, weight_decay=0.01, backend="torch")
    else:
        ref = getattr(torch.optim, cls.__name__)(theirs, lr=0.1, weight_decay=0.01)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    if cls is Lion:
        for p, q in zip(ours, theirs):
            assert torch.equal(p.detach(), q.detach())
        return
    close = _close_adamw if cls is AdamW else _close_sgd
    close(flat, ref_flat, "flat buffer")
    close(grid, ref_grid, "interleaved views")


@pytest.mark.parametrize("backend", BACKENDS)
def test_params_made_to_share_memory_later_are_refused_at_step(backend):
    a = nn.Parameter(torch.randn(3, 4))
    b = nn.Parameter(torch.randn(4, 3))
    c = nn.Parameter(torch.randn(5))
    opt = AdamW([{"params": [c]}, {"params": [a, b]}], lr=0.1, backend=backend)
    for p in (a, b, c):
        p.grad = torch.ones_like(p)
    opt.step()
    b.data = a.data.t()  # tied after construction, behind the optimizer's back
    for p in (a, b, c):
        p.grad = torch.ones_like(p)
    before = _snapshot(opt, [c, a, b])
    with pytest.raises(ValueError, match=r"param 0 of param group 1 .* and param 1 of param group 1 .* share memory"):
        opt.step()
    _assert_unchanged(before, _snapshot(opt, [c, a, b]))


# ---- 5: a failing step changes nothing, in any group ---------------------------------------


def _three_groups(cls, backend, **kw):
    g = torch.Generator().manual_seed(7)
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.bfloat16, torch.bfloat16]
    shapes = [(4, 3), (5,), (2, 2), (6,), (3, 4), (7, 2)]
    params = [nn.Parameter(torch.randn(s, generator=g).to(dt)) for s, dt in zip(shapes, dtypes)]
    groups = [{"params": params[0:2]}, {"params": params[2:4], "lr": 0.02}, {"params": params[4:6], "lr": 0.03}]
    opt = cls(groups, lr=0.01, backend=backend, **kw)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    return params, opt


def _resize(opt, p):
    p.data = torch.zeros(9, 2, dtype=p.dtype)  # e.g. an embedding grown for new tokens
    p.grad = torch.ones(9, 2, dtype=p.dtype)


def _grad_shape(opt, p):
    p.data = torch.zeros(9, 2, dtype=p.dtype)  # resized after backward: the grad is the old shape


def _master_dtype(opt, p):
    opt.state[p]["master_param"] = opt.state[p]["master_param"].half()


def _moment_shape(opt, p):
    key = "exp_avg" if "exp_avg" in opt.state[p] else "momentum_buffer"
    opt.state[p][key] = torch.zeros(3)


def _moment_not_tensor(opt, p):
    key = "exp_avg_sq" if "exp_avg_sq" in opt.state[p] else "momentum_buffer"
    opt.state[p][key] = 0.0


def _nan_step(opt, p):
    opt.state[p]["step"] = torch.tensor(float("nan"))


def _negative_step_in_place(opt, p):
    opt.state[p]["step"].fill_(-1.0)


def _two_element_step(opt, p):
    opt.state[p]["step"] = torch.tensor([1.0, 2.0])


FAILURES = {
    "param resized (state shape)": (_resize, ValueError, r"has shape \(7, 2\), expected \(9, 2\)"),
    "grad shape": (
        _grad_shape,
        RuntimeError,
        r"grad of param 1 of param group 2 \(shape \(9, 2\)\) has shape \(7, 2\)",
    ),
    "master dtype": (_master_dtype, ValueError, r"'master_param' must be torch.float32, got torch.float16"),
    "moment shape": (_moment_shape, ValueError, r"has shape \(3,\), expected \(7, 2\)"),
    "moment not a tensor": (_moment_not_tensor, ValueError, r"must be a tensor, got float"),
    "step nan": (_nan_step, ValueError, r"'step' must be finite and >= 0, got nan"),
    "step negative (in place)": (_negative_step_in_place, ValueError, r"'step' must be finite and >= 0, got -1"),
    "step two elements": (_two_element_step, ValueError, r"'step' must be a number or a 1-element real tensor"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", [AdamW, SGD])
@pytest.mark.parametrize("case", sorted(FAILURES))
def test_failing_step_changes_nothing_in_any_group(case, cls, backend):
    breaks, exc, match = FAILURES[case]
    kw = dict(momentum=0.9) if cls is SGD else {}
    params, opt = _three_groups(cls, backend, **kw)
    bad = params[5]  # param 1 of the last group
    breaks(opt, bad)
    before = _snapshot(opt, params)
    with pytest.raises(exc, match=match) as err:
        opt.step()
    assert "param 1 of param group 2" in str(err.value), str(err.value)
    _assert_unchanged(before, _snapshot(opt, params))


# ---- 8: hyperparameters ------------------------------------------------------------------

BAD_HYPER = [
    (AdamW, "lr", math.inf, "Invalid learning rate"),
    (AdamW, "eps", math.inf, "Invalid epsilon value"),
    (AdamW, "eps", 1e39, "Invalid epsilon value"),  # finite in fp64, inf in the kernels' fp32
    (AdamW, "weight_decay", math.inf, "Invalid weight_decay value"),
    (SGD, "lr", math.inf, "Invalid learning rate"),
    (SGD, "momentum", math.nan, "Invalid momentum value"),
    (SGD, "momentum", math.inf, "Invalid momentum value"),
    (SGD, "dampening", math.nan, "Invalid dampening value"),
    (SGD, "dampening", math.inf, "Invalid dampening value"),
    (SGD, "dampening", -0.5, "Invalid dampening value"),
    (SGD, "weight_decay", math.nan, "Invalid weight_decay value"),
    (SGD, "weight_decay", math.inf, "Invalid weight_decay value"),
    (Lion, "lr", math.inf, "Invalid learning rate"),
    (Lion, "weight_decay", math.nan, "Invalid weight_decay value"),
    (Lion, "weight_decay", 1e39, "Invalid weight_decay value"),
]


@pytest.mark.parametrize("cls, name, value, message", BAD_HYPER, ids=lambda v: getattr(v, "__name__", str(v)))
def test_bad_hyperparameters_refused_at_construction_add_group_and_step(cls, name, value, message):
    p, q = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match=message):
        cls([p], **{name: value})
    opt = cls([p], lr=0.1, momentum=0.5) if cls is SGD else cls([p], lr=0.1)
    with pytest.raises(ValueError, match=f"{message}.*param group 1"):
        opt.add_param_group({"params": [q], name: value})
    assert len(opt.param_groups) == 1
    p.grad = torch.ones(3)
    opt.step()
    opt.param_groups[0][name] = value  # a user (or a scheduler) writing the group between steps
    p.grad = torch.ones(3)
    before = _snapshot(opt, [p])
    with pytest.raises(ValueError, match=f"{message}.*param group 0"):
        opt.step()
    _assert_unchanged(before, _snapshot(opt, [p]))


def test_mixed_float_and_tensor_betas_refused_as_torch_refuses_them():
    p = nn.Parameter(torch.randn(3))
    for betas in [(torch.tensor(0.9), 0.999), (0.9, torch.tensor(0.999))]:
        with pytest.raises(ValueError) as theirs:
            torch.optim.AdamW([p], betas=betas)
        with pytest.raises(ValueError) as ours:
            AdamW([p], betas=betas)
        assert str(ours.value) == str(theirs.value)
        opt = AdamW([p])
        with pytest.raises(ValueError, match="betas must be either both floats or both Tensors"):
            opt.add_param_group({"params": [nn.Parameter(torch.randn(2))], "betas": betas})
    with pytest.raises(ValueError, match="Tensor betas\\[1\\] must be 1-element"):
        AdamW([p], betas=(torch.tensor(0.9), torch.tensor([0.99, 0.999])))
    with pytest.raises(ValueError, match="Invalid beta parameter at index 0"):
        AdamW([p], betas=(torch.tensor(1.0), torch.tensor(0.999)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_betas_are_honoured_like_torch_including_in_place_changes(backend):
    g = torch.Generator().manual_seed(5)
    init = [torch.randn(s, generator=g) for s in [(6, 4), (9,)]]
    ours = [t.clone().requires_grad_() for t in init]
    theirs = [t.clone().requires_grad_() for t in init]
    b_ours = (torch.tensor(0.9), torch.tensor(0.999))
    b_theirs = (torch.tensor(0.9), torch.tensor(0.999))
    opt = AdamW(ours, lr=0.01, betas=b_ours, backend=backend)
    ref = torch.optim.AdamW(theirs, lr=0.01, betas=b_theirs, foreach=False)
    for step in range(10):
        if step == 5:  # a beta schedule writing the tensors in place
            for b in (b_ours, b_theirs):
                b[0].fill_(0.5)
                b[1].fill_(0.9)
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
        for i, (p, q) in enumerate(zip(ours, theirs)):
            _close_adamw(p, q, f"step {step}: param {i}")
    b_ours[1].fill_(1.0)  # an invalid value written in place is caught before anything changes
    for p in ours:
        p.grad = torch.ones_like(p)
    before = _snapshot(opt, ours)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        opt.step()
    _assert_unchanged(before, _snapshot(opt, ours))


# ---- 10: layouts changing under the plan ---------------------------------------------------


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


def _nets(dtype):
    torch.manual_seed(11)
    net = _Net()
    return [copy.deepcopy(net).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", [AdamW, SGD])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layout_changes_mid_training_match_a_fresh_plan_and_torch(dtype, cls, backend):
    """``model.to(memory_format=torch.channels_last)`` mid-run, and grads laid out unlike their params."""
    cached, fresh, ref_net = _nets(dtype)
    kw = dict(lr=0.01, weight_decay=0.05) if cls is AdamW else dict(lr=0.05, momentum=0.9, weight_decay=0.01)
    opt_c = cls(cached.parameters(), backend=backend, **kw)
    opt_f = cls(fresh.parameters(), backend=backend, **kw)
    ref = getattr(torch.optim, cls.__name__)(ref_net.parameters(), **kw, **({"foreach": False}))
    g = torch.Generator().manual_seed(12)
    for step in range(8):
        x = torch.randn(2, 3, 6, 6, generator=g).to(dtype)
        if step == 3:
            for net in (cached, fresh, ref_net):
                net.to(memory_format=torch.channels_last)
            assert not cached.conv.weight.is_contiguous()
        nets = (cached, fresh, ref_net) if dtype == torch.float32 else (cached, fresh)
        for net in nets:
            net.zero_grad(set_to_none=True)
            net(x.contiguous(memory_format=torch.channels_last) if step >= 3 else x).float().square().mean().backward()
        if step == 1:  # a channels_last grad on a contiguous param
            for net in nets:
                net.conv.weight.grad = net.conv.weight.grad.contiguous(memory_format=torch.channels_last)
        if step in (3, 6):  # contiguous grads on channels_last params (e.g. copied out of a flat grad bucket)
            for net in nets:
                for p in net.parameters():
                    p.grad = p.grad.contiguous()
        opt_f._plan = None
        opt_c.step()
        opt_f.step()
        if dtype == torch.float32:
            ref.step()
        for name, p in cached.named_parameters():
            q = dict(fresh.named_parameters())[name]
            assert torch.equal(p, q), f"step {step}: {name} differs from a fresh plan"
            assert p.stride() == q.stride(), f"step {step}: {name} layout"
            if dtype == torch.float32:
                r = dict(ref_net.named_parameters())[name]
                close = _close_adamw if cls is AdamW else _close_sgd
                close(p, r, f"step {step}: {name} vs torch")
        for p, q in zip(cached.parameters(), fresh.parameters()):
            for key, v in opt_c.state[p].items():
                assert torch.equal(v, opt_f.state[q][key]), f"step {step}: state {key!r}"


def test_grads_laid_out_unlike_their_params_keep_the_cached_plan():
    net = _Net().to(memory_format=torch.channels_last)
    opt = AdamW(net.parameters(), lr=0.01, backend=BACKENDS[0])
    g = torch.Generator().manual_seed(13)
    plans = []
    for _ in range(4):
        net.zero_grad(set_to_none=True)
        x = torch.randn(2, 3, 6, 6, generator=g).contiguous(memory_format=torch.channels_last)
        net(x).square().mean().backward()
        assert not net.conv.weight.grad.is_contiguous()  # autograd lays the grad out like the param
        opt.step()
        plans.append(opt._plan)
    assert plans[1] is not None and all(p is plans[1] for p in plans[1:]), "a strided-grad step must reuse the plan"


# ---- the state table stays a plain, portable optimizer state ---------------------------------


def test_optimizer_state_pickles_copies_and_saves_as_torch_state():
    p = nn.Parameter(torch.randn(4))
    opt = AdamW([p], lr=0.1)
    p.grad = torch.ones(4)
    opt.step()
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert type(clone.state) is type(opt.state) and len(clone.state) == 1
        q = clone.param_groups[0]["params"][0]
        q.grad = torch.ones(4)
        clone.step()
        assert float(clone.state[q]["step"]) == 2.0
    assert type(copy.deepcopy(opt.state)).__name__ == "defaultdict"
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert float(sd["state"][0]["step"]) == 1.0


@pytest.mark.parametrize("roundtrip", ["pickle", "deepcopy", "load_state_dict"])
def test_step_written_right_after_a_reload_is_seen(roundtrip):
    """A count written right after a reload (the stored counts adopted as the optimizer's own) is seen."""
    g = torch.Generator().manual_seed(9)
    init = [torch.randn(5, generator=g) for _ in range(3)]
    ours = [t.clone().requires_grad_() for t in init]
    theirs = [t.clone().requires_grad_() for t in init]
    opt = AdamW(ours, lr=0.01, backend=BACKENDS[0])
    ref = torch.optim.AdamW(theirs, lr=0.01, foreach=False)
    grads = [[torch.randn(5, generator=g) for _ in range(3)] for _ in range(5)]
    for k in range(3):
        for p, q, grad in zip(ours, theirs, grads[k]):
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    if roundtrip == "pickle":
        opt = pickle.loads(pickle.dumps(opt))
        ours = opt.param_groups[0]["params"]
    elif roundtrip == "deepcopy":
        opt = copy.deepcopy(opt)
        ours = opt.param_groups[0]["params"]
    else:
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for o, ps in ((opt, ours), (ref, theirs)):
        o.state[ps[1]]["step"].zero_()
        o.state[ps[1]]["exp_avg"].zero_()
        o.state[ps[1]]["exp_avg_sq"].zero_()
    for k in range(3, 5):
        for p, q, grad in zip(ours, theirs, grads[k]):
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    for i, (p, q) in enumerate(zip(ours, theirs)):
        _close_adamw(p, q, f"param {i}")
    assert [float(opt.state[p]["step"]) for p in ours] == [5.0, 2.0, 5.0]
