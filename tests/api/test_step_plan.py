"""The cached launch plan of fastamp's optimizers (``FusedOptimizer._plan``).

``step()`` groups params into kernel launches once and reuses that plan while it fits. The
oracle here is the same optimizer forced to plan every step from scratch (``_plan = None``
before each step, the path every first step takes): after every step of a run that
changes things between steps (grads appearing and disappearing, hyperparameters, layout
settings, replaced state tensors, new param groups, non-contiguous grads, loads, skipped
steps, foreign writes to remainder-master params), params and every state tensor must be
bit-identical.
"""

import copy
import gc
import io
import warnings
import weakref

import pytest
import torch

import fastamp
from fastamp.optim import SGD, AdamW, Lion

BACKENDS = [b for b in ("native", "torch") if fastamp.backends.available(b, "optim_", "cpu")[0]]

CONFIGS = {
    "adamw": (AdamW, dict(lr=0.01, weight_decay=0.1)),
    "adamw_amsgrad_maximize": (AdamW, dict(lr=0.01, amsgrad=True, maximize=True)),
    "adamw_remainder_sr_bf16_state": (
        AdamW,
        dict(lr=0.01, master_weights="remainder", stochastic_rounding=True, state_dtype=torch.bfloat16),
    ),
    "sgd_momentum": (SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "sgd_plain_sr": (SGD, dict(lr=0.05, master_weights=False, stochastic_rounding=True)),
    "lion_remainder": (Lion, dict(lr=0.01, weight_decay=0.1, master_weights="remainder")),
}

SHAPES = [(6, 5), (13,), (4, 3), (7,), (1,), (5, 4)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16, torch.float32, torch.bfloat16]


def _make(cls, kw, backend, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g).to(dt).requires_grad_() for s, dt in zip(SHAPES, DTYPES)]
    groups = [{"params": params[:3]}, {"params": params[3:], "lr": kw["lr"] * 0.5}]
    return params, cls(groups, backend=backend, **kw)


def _grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]


def _assert_same(opt_a, params_a, opt_b, params_b, where):
    for i, (a, b) in enumerate(zip(params_a, params_b)):
        assert torch.equal(a, b), f"{where}: param {i} differs"
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["state"].keys() == sb["state"].keys(), where
    for k in sa["state"]:
        assert sa["state"][k].keys() == sb["state"][k].keys(), f"{where}: state keys of param {k}"
        for key, va in sa["state"][k].items():
            vb = sb["state"][k][key]
            assert torch.equal(va, vb), f"{where}: state {key!r} of param {k} differs: {va} vs {vb}"


def _mutate(step, opt, params, extra):
    """The same change to either optimizer before step ``step`` (returns the grads to set)."""
    grads = _grads(params, step)
    if step in (3, 4):
        grads[1] = None  # a param without grad: its step count stops, the plan changes
    if step == 5:
        opt.param_groups[0]["lr"] *= 0.5  # read at every step, no new plan needed
        opt.param_groups[1]["weight_decay"] = 0.2
        opt.param_groups[0]["maximize"] = not opt.param_groups[0]["maximize"]
    if step == 6:
        st = opt.state[params[0]]
        key = "exp_avg" if "exp_avg" in st else "momentum_buffer"
        if key in st:
            st[key] = st[key] * 0.5  # replaced by assignment: the next launch must use the new tensor
    if step == 7:
        group = opt.param_groups[1]  # another master kind: state is converted, the plan rebuilt
        mw = group["master_weights"]
        group["master_weights"] = False if mw == "remainder" else (None if mw is True else True)
        if group["master_weights"] is True:
            group["stochastic_rounding"] = False
    if step == 8:
        opt.add_param_group({"params": [extra]})
    if step == 9:
        rows, cols = SHAPES[0]
        grads[0] = _grads([torch.empty(cols, rows)], 99)[0].t().to(params[0].dtype)  # non-contiguous
    if step == 10:
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    if step == 11:
        opt.found_inf = torch.tensor(1.0)  # a skipped step, as a grad scaler hands it over
    if step == 12:
        del opt.found_inf
    if step in (2, 12):
        with torch.no_grad():
            params[3 if step == 2 else 1].mul_(0.5)  # a foreign write (bumps the version counter)
    return grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_cached_plan_matches_planning_every_step(config, backend):
    cls, kw = CONFIGS[config]
    params_a, opt_a = _make(cls, kw, backend)
    params_b, opt_b = _make(cls, kw, backend)
    extra_a = torch.randn(3, 3, generator=torch.Generator().manual_seed(5)).bfloat16().requires_grad_()
    extra_b = extra_a.detach().clone().requires_grad_()
    for step in range(16):
        for opt, params, extra in ((opt_a, params_a, extra_a), (opt_b, params_b, extra_b)):
            grads = _mutate(step, opt, params, extra)
            for p, g in zip(params, grads):
                p.grad = g
            extra.grad = _grads([extra], 500 + step)[0] if step >= 8 else None
        opt_b._plan = None
        with warnings.catch_warnings(record=True) as wa:
            warnings.simplefilter("always")
            opt_a.step()
        with warnings.catch_warnings(record=True) as wb:
            warnings.simplefilter("always")
            opt_b.step()
        assert [str(w.message) for w in wa] == [str(w.message) for w in wb], f"step {step}: warnings differ"
        if kw.get("master_weights") == "remainder" and step in (2, 12):
            assert any("written outside the optimizer" in str(w.message) for w in wa), f"step {step}: no re-sync"
        _assert_same(opt_a, params_a + [extra_a], opt_b, params_b + [extra_b], f"{config} step {step}")


def test_steady_steps_reuse_the_plan_and_changes_replace_it():
    params, opt = _make(AdamW, dict(lr=0.01), "native")
    for step in range(3):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()
        if step == 0:
            plan = opt._plan
        assert opt._plan is plan and plan is not None, "a step without changes must reuse the plan"
    params[2].grad = None
    opt.step()
    assert opt._plan is not plan, "a param losing its grad must replace the plan"


def _four_steps_with_a_missing_grad(params, opt):
    for step in range(4):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        if step == 2:
            params[1].grad = None  # param 1 sits out one step: its count falls behind
        opt.step()


def test_steps_of_a_launch_share_one_buffer_and_export_as_separate_counts():
    params, opt = _make(AdamW, dict(lr=0.01), "native")
    _four_steps_with_a_missing_grad(params, opt)
    assert [float(opt.state[p]["step"]) for p in params] == [4.0, 3.0, 4.0, 4.0, 4.0, 4.0]
    # torch.optim.AdamW increments each param's own count: loading our state must not tie them together
    ours32 = [p.detach().float().clone().requires_grad_() for p in params]
    theirs = [p.detach().clone().requires_grad_() for p in ours32]
    opt32 = AdamW([{"params": ours32[:3]}, {"params": ours32[3:], "lr": 0.005}], lr=0.01, backend="native")
    _four_steps_with_a_missing_grad(ours32, opt32)
    buf = io.BytesIO()
    torch.save(opt32.state_dict(), buf)
    buf.seek(0)
    ref = torch.optim.AdamW([{"params": theirs[:3]}, {"params": theirs[3:], "lr": 0.005}], lr=0.01)
    ref.load_state_dict(torch.load(buf, weights_only=True))
    for p, g in zip(theirs, _grads(theirs, 7)):
        p.grad = g
    ref.step()
    assert [float(ref.state[p]["step"]) for p in theirs] == [5.0, 4.0, 5.0, 5.0, 5.0, 5.0]


def test_the_plan_keeps_no_grad_alive():
    """zero_grad(set_to_none=True) must free the grads (and contiguous copies) of the last step."""
    params, opt = _make(AdamW, dict(lr=0.01), "native")
    params[0].data = params[0].data.t()  # a strided param: its launch uses a contiguous copy

    def set_grads(step):  # no grad left in a local variable here
        for p, g in zip(params, _grads(params, step)):
            p.grad = g

    for step in range(2):
        set_grads(step)
        opt.step()
    assert opt._plan is not None
    refs = [weakref.ref(p.grad) for p in params]
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert all(r() is None for r in refs), "a grad outlived zero_grad through the cached plan"
