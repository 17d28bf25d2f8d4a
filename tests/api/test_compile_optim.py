"""fastamp's optimizers' ``step`` under ``torch.compile(fullgraph=True)`` (fastamp/optim/engine/traced.py).

Each test runs a compiled optimizer and an eager twin over the same grads for 20+ steps
and asserts bit-identical params and state, the number of compiles (torch's
``CompileCounterWithBackend`` around the real backend) and no graph breaks. The amp
protocol is driven as torch's GradScaler and fastamp.Scaler drive it: ``grad_scale`` /
``found_inf`` set as attributes before ``step`` and deleted after, with overflows injected
(an inf grad and ``found_inf = 1``).

Every test runs through real backends, never a counting backend alone: ``aot_eager``
(AOTAutograd: functionalization of the kernels' declared mutations, and the pass that makes
dynamic floats graph inputs, which specialised a float lr at every new value where a
``CompileCounter`` saw one graph) and inductor (code generation: where the step scalars
could be re-derived with another rounding). The inductor cases are marked ``slow``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import COMPILE_BACKENDS
from torch._dynamo.testing import CompileCounterWithBackend

import fastamp

STEPS = 24
OVERFLOW = {3, 10, 17}  # steps whose grads hold an inf and whose found_inf is 1
SHAPES = [(7, 5), (13,), (3, 4, 2), (1,)]  # odd sizes; one single element

# (param dtype, optimizer kwargs): fp32, fp32 masters of bf16 / fp16 params, int16 remainders,
# stochastic rounding (bf16 without master: the rng counters advance in the graph)
CONFIGS = {
    "fp32": (torch.float32, {}),
    "bf16_master": (torch.bfloat16, {"master_weights": True}),
    "fp16_master": (torch.float16, {"master_weights": True}),
    "bf16_remainder": (torch.bfloat16, {"master_weights": "remainder"}),
    "bf16_sr": (torch.bfloat16, {"master_weights": False, "stochastic_rounding": True, "seed": 7}),
}
OPTIMIZERS = {
    "adamw": (fastamp.optim.AdamW, {"weight_decay": 1e-2}),
    "sgd": (fastamp.optim.SGD, {"momentum": 0.9, "weight_decay": 1e-2}),
    "lion": (fastamp.optim.Lion, {"weight_decay": 1e-2}),
}


# the real backends every compile test runs through (see the module doc)
BACKENDS = COMPILE_BACKENDS


@pytest.fixture(autouse=True)
def _fresh_dynamo(fresh_dynamo):
    pass


def _params(dtype, device, shapes=SHAPES):
    g = torch.Generator().manual_seed(1)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype)) for s in shapes]


def _twins(opt_name, config, lr, device="cpu", **extra):
    dtype, kw = CONFIGS[config]
    cls, okw = OPTIMIZERS[opt_name]
    pa, pb = _params(dtype, device), _params(dtype, device)
    kwargs = {**okw, **kw, **extra}
    return (pa, cls(pa, lr=copy.deepcopy(lr), **kwargs)), (pb, cls(pb, lr=copy.deepcopy(lr), **kwargs))


def _set_grads(i, pairs, scale=1.0, skip=()):
    g = torch.Generator().manual_seed(100 + i)
    for j, ps in enumerate(zip(*pairs)):
        grad = torch.randn(ps[0].shape, generator=g) * scale
        if i in OVERFLOW and j == 0:
            grad.view(-1)[0] = float("inf")
        for p in ps:
            p.grad = None if j in skip else grad.to(device=p.device, dtype=p.dtype)


def _set_lr(opt, i):
    lr = 1e-3 * (1 + 0.05 * i)
    for group in opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def _amp_step(opt, step, grad_scale, found_inf):
    # as torch.amp.GradScaler (and fastamp.Scaler) hand them to a _step_supports_amp_scaling optimizer
    opt.grad_scale, opt.found_inf = grad_scale, found_inf
    try:
        step()
    finally:
        del opt.grad_scale, opt.found_inf


def _drive_amp(compiled, eager, step, scale=3.0, device="cpu", skip=()):
    """STEPS amp steps of both twins (the compiled one through ``step``), lr changed every step, overflows injected."""
    for i in range(STEPS):  # the first step is compiled too: the state is created at trace time
        _set_grads(i, (compiled[0], eager[0]), scale, skip)
        found_inf = torch.tensor(1.0 if i in OVERFLOW else 0.0, device=device)
        for (_, opt), fn in ((compiled, step), (eager, eager[1].step)):
            _set_lr(opt, i)
            _amp_step(opt, fn, torch.tensor(scale, device=device), found_inf.clone())


def _assert_same(a, b):
    (pa, oa), (pb, ob) = a, b
    for i, (x, y) in enumerate(zip(pa, pb)):
        assert torch.equal(x, y), f"param {i} differs"
        assert oa.state[x].keys() == ob.state[y].keys()
        for key, t in ob.state[y].items():
            assert torch.equal(oa.state[x][key], t), f"state {key!r} of param {i} differs"


def _no_graph_breaks():
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_amp_steps_bit_identical_one_compile(opt_name, config, backend):
    """Tensor lr changed every step, grad scale 3 (an inexact reciprocal), overflows: one compile, eager's bits."""
    compiled, eager = _twins(opt_name, config, torch.tensor(1e-3))
    cc = CompileCounterWithBackend(backend)
    step = torch.compile(compiled[1].step, fullgraph=True, backend=cc)
    _drive_amp(compiled, eager, step)
    _assert_same(compiled, eager)
    assert cc.frame_count == 1
    _no_graph_breaks()
    step_count = compiled[1].state[compiled[0][1]].get("step")
    if step_count is not None:  # skipped steps do not count
        assert float(step_count) == STEPS - len(OVERFLOW)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pitfall_guard_hook_does_not_recompile(backend):
    """fastamp.cast_model(fp16) installs a global optimizer pre-hook; a compiled step must still compile once."""
    fastamp.health.install_optimizer_guard()  # process-wide, as after any cast_model(..., torch.float16)
    compiled, eager = _twins("adamw", "fp16_master", torch.tensor(1e-3))
    cc = CompileCounterWithBackend(backend)
    step = torch.compile(compiled[1].step, fullgraph=True, backend=cc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fastamp.AmpPitfallWarning)  # the eager twin's own first-step check
        _drive_amp(compiled, eager, step)
    _assert_same(compiled, eager)
    assert cc.frame_count == 1
    _no_graph_breaks()


# torch releases that specialise every float (torch._dynamo.config.specialize_float = True) compile
# once per lr value: there, use a tensor lr
_FLOATS_SPECIALISED = pytest.mark.skipif(
    torch._dynamo.config.specialize_float, reason="this torch specialises floats: a float lr recompiles per value"
)


@_FLOATS_SPECIALISED
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("opt_name", "config"), [("adamw", "bf16_master"), ("sgd", "fp16_master")])
def test_float_lr_dynamic_one_compile(opt_name, config, backend):
    """A float lr changed every step, no grad scaler: with ``dynamic=True`` the lr is a graph input from the start."""
    compiled, eager = _twins(opt_name, config, 1e-3)
    cc = CompileCounterWithBackend(backend)
    step = torch.compile(compiled[1].step, fullgraph=True, backend=cc, dynamic=True)
    frames = []
    for i in range(STEPS):
        _set_grads(i, (compiled[0], eager[0]), skip=())
        for opt in (compiled[1], eager[1]):
            _set_lr(opt, i)
        if i in OVERFLOW:  # no scaler: an inf grad is applied, as eager applies it; keep the run finite
            for p in compiled[0] + eager[0]:
                p.grad.nan_to_num_(posinf=1.0)
        step()
        eager[1].step()
        frames.append(cc.frame_count)
    _assert_same(compiled, eager)
    # one graph, never recompiled. dynamic=True makes every float of the groups dynamic; AOTAutograd
    # then specialises those that reach an op as numbers (betas, eps) and restarts the analysis
    # once, which calls the backend a second time within the first compile
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert frames == [frames[0]] * STEPS, frames
    _no_graph_breaks()


@_FLOATS_SPECIALISED
@pytest.mark.parametrize("backend", BACKENDS)
def test_float_lr_default_settles_after_first_change(backend):
    """Without ``dynamic=True`` dynamo specialises a float lr once, then makes it dynamic: no recompile after that."""
    compiled, eager = _twins("adamw", "fp32", 1e-3)
    cc = CompileCounterWithBackend(backend)
    step = torch.compile(compiled[1].step, fullgraph=True, backend=cc)
    counts = []
    for i in range(STEPS):
        _set_grads(i, (compiled[0], eager[0]))
        for p in compiled[0] + eager[0]:
            p.grad.nan_to_num_(posinf=1.0)
        for opt in (compiled[1], eager[1]):
            _set_lr(opt, i)
        step()
        eager[1].step()
        counts.append(cc.frame_count)
    _assert_same(compiled, eager)
    assert counts[2:] == [counts[2]] * (STEPS - 2), counts
    assert counts[-1] <= 2
    _no_graph_breaks()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_scaler_attributes_set_inside_the_compiled_function(opt_name, backend):
    """A fullgraph function that hands grad_scale/found_inf over and steps, as a compiled Scaler.step would."""
    compiled, eager = _twins(opt_name, "fp16_master", torch.tensor(1e-3))
    opt = compiled[1]
    scale = torch.tensor(1024.0)

    def scaled_step(found_inf):
        opt.grad_scale, opt.found_inf = scale, found_inf
        opt.step()
        del opt.grad_scale, opt.found_inf

    cc = CompileCounterWithBackend(backend)
    fn = torch.compile(scaled_step, fullgraph=True, backend=cc)
    for i in range(STEPS):
        _set_grads(i, (compiled[0], eager[0]), 1024.0)
        found_inf = torch.tensor(1.0 if i in OVERFLOW else 0.0)
        fn(found_inf)
        _amp_step(eager[1], eager[1].step, scale, found_inf.clone())
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    _assert_same(compiled, eager)
    assert cc.frame_count == 1
    _no_graph_breaks()


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_pattern_changes_and_eager_steps_in_between(backend):
    """Eager and compiled steps mixed, a param without grad for a while, remainder masters.

    A param skipped by some steps keeps its own count; its launch takes one row of step
    scalars per param, so the compiled step of the old pattern is reused with the counts
    apart: one graph per grad pattern (2), whatever the counts. No spurious remainder re-sync warning either (compiled
    writes are not foreign writes).
    """
    compiled, eager = _twins("adamw", "bf16_remainder", torch.tensor(1e-3))
    cc = CompileCounterWithBackend(backend)
    step = torch.compile(compiled[1].step, fullgraph=True, backend=cc)
    schedule = ["c", "c", "e", "c", "cB", "cB", "c", "c", "e", "cB", "c", "eB", "c", "cB", "c"] + ["c"] * 6
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for i, what in enumerate(schedule):
            _set_grads(i, (compiled[0], eager[0]), skip=(1,) if "B" in what else ())
            for p in compiled[0] + eager[0]:
                if p.grad is not None:
                    p.grad.nan_to_num_(posinf=1.0)
            (step if what[0] == "c" else compiled[1].step)()
            eager[1].step()
            _assert_same(compiled, eager)
    counts = [float(compiled[1].state[p]["step"]) for p in compiled[0]]
    assert counts[1] == counts[0] - sum("B" in w for w in schedule)
    assert cc.frame_count == 2
    _no_graph_breaks()


def test_tensor_betas_refused_at_trace_time():
    # refused at trace time, before any graph reaches a backend: aot_eager is never called
    p = _params(torch.float32, "cpu")
    opt = fastamp.optim.AdamW(p, betas=(torch.tensor(0.9), torch.tensor(0.999)))
    for q in p:
        q.grad = torch.ones_like(q)
    before = [q.detach().clone() for q in p]
    with pytest.raises(NotImplementedError, match="tensor betas"):
        torch.compile(opt.step, fullgraph=True, backend="aot_eager")()
    assert all(torch.equal(a, b) for a, b in zip(p, before))
    opt.step()  # eager still takes them


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_inductor_bit_identical(device):
    """inductor: the fp64 pow of the bias corrections and the grad scaler's reciprocal stay eager's bits."""
    compiled, eager = _twins("adamw", "fp16_master", torch.tensor(1e-3, device=device), device=device, amsgrad=True)
    cc = CompileCounterWithBackend("inductor")
    step = torch.compile(compiled[1].step, fullgraph=True, backend=cc)
    _drive_amp(compiled, eager, step, device=device)
    _assert_same(compiled, eager)
    assert cc.frame_count == 1
    _no_graph_breaks()


@pytest.mark.parametrize("compiler", BACKENDS)
@pytest.mark.parametrize("backend", ["native", "triton", "torch"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_forced_backend_is_kept(opt_name, backend, compiler):
    """The backend eager picks (here forced per optimizer) is the one the compiled step calls, with eager's bits."""
    ok, why = fastamp.backends.available(backend, "optim_", "cpu")
    if not ok:
        pytest.skip(why)
    compiled, eager = _twins(opt_name, "bf16_remainder", torch.tensor(1e-3), backend=backend)
    cc = CompileCounterWithBackend(compiler)
    step = torch.compile(compiled[1].step, fullgraph=True, backend=cc)
    _drive_amp(compiled, eager, step, 8.0)
    _assert_same(compiled, eager)
    assert cc.frame_count == 1
    _no_graph_breaks()


def test_step_scalar_ops_opcheck():
    # one op for every rule (it replaced adamw_/sgd_/lion_step_scalars, which this checked the same way)
    import fastamp.optim  # noqa: F401  (the rules register their step scalars)
    from fastamp.optim.engine import traced as _traced

    lr = torch.tensor(1e-3, dtype=torch.float64)
    for step in (torch.tensor(4.0), torch.tensor([0.0, 4.0, 9.0])):
        for found_inf, grad_scale in ((None, None), (torch.tensor(0.0), torch.tensor(3.0))):
            for rule, args in (("adamw", [0.9, 0.999, 0.01]), ("sgd", []), ("lion", [0.01])):
                torch.library.opcheck(_traced.step_scalars, (rule, step, found_inf, grad_scale, lr, args))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scaler_name", ["torch", "fastamp"])
def test_scaler_drives_a_compiled_step(scaler_name, backend):
    """``opt.step = torch.compile(opt.step, fullgraph=True)`` driven by an eager GradScaler / fastamp.Scaler."""

    def make_scaler():
        if scaler_name == "torch":
            return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
        return fastamp.Scaler("cpu", init_scale=2.0**10, growth_interval=4)

    compiled, eager = _twins("adamw", "fp16_master", torch.tensor(1e-3))
    cc = CompileCounterWithBackend(backend)
    compiled[1].step = torch.compile(compiled[1].step, fullgraph=True, backend=cc)
    scalers = [make_scaler(), make_scaler()]
    for scaler in scalers:
        scaler.scale(torch.ones(()))  # creates the scale, as the first scaler.scale(loss) does
    for i in range(STEPS):
        _set_grads(i, (compiled[0], eager[0]), 2.0**10)
        for (_, opt), scaler in zip((compiled, eager), scalers):
            scaler.step(opt)
            scaler.update()
    _assert_same(compiled, eager)
    assert scalers[0].get_scale() == scalers[1].get_scale()
    assert float(compiled[1].state[compiled[0][0]]["step"]) == STEPS - len(OVERFLOW)  # the overflows were skipped
    assert cc.frame_count == 1
    _no_graph_breaks()


def _mixed_groups(device="cpu"):
    # two groups, one mixing fp32 and bf16 params (two launches sharing the step scalars), a frozen param (3)
    p = _params(torch.float32, device) + _params(torch.bfloat16, device, [(9,), (2, 3)])
    p[3].requires_grad_(False)
    p[0] = torch.nn.Parameter(p[0].detach().t().contiguous().t())  # a strided param (its grad comes contiguous)
    assert not p[0].is_contiguous()
    return p, [{"params": p[:2] + p[4:5]}, {"params": p[2:4] + p[5:], "lr": torch.tensor(2e-3), "weight_decay": 0.0}]


VARIANTS = {
    "sgd_plain": (fastamp.optim.SGD, {"momentum": 0.0}),
    "sgd_nesterov": (fastamp.optim.SGD, {"momentum": 0.9, "nesterov": True, "maximize": True}),
    "sgd_dampening": (fastamp.optim.SGD, {"momentum": 0.9, "dampening": 0.1, "master_weights": "remainder"}),
    "adamw_amsgrad": (fastamp.optim.AdamW, {"amsgrad": True, "maximize": True}),
    "lion_remainder_maximize": (
        fastamp.optim.Lion,
        {"betas": (0.95, 0.98), "maximize": True, "master_weights": "remainder"},
    ),
    "adamw_bf16_moments": (
        fastamp.optim.AdamW,
        {"master_weights": "remainder", "state_dtype": torch.bfloat16, "stochastic_rounding": True},
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_and_groups_bit_identical(variant, backend):
    """Options that change the launches (no momentum state, nesterov, bf16 moments ...), two groups, mixed dtypes."""
    cls, kw = VARIANTS[variant]
    (pa, ga), (pb, gb) = _mixed_groups(), _mixed_groups()
    compiled, eager = (pa, cls(ga, lr=torch.tensor(1e-3), **kw)), (pb, cls(gb, lr=torch.tensor(1e-3), **kw))
    cc = CompileCounterWithBackend(backend)
    _drive_amp(compiled, eager, torch.compile(compiled[1].step, fullgraph=True, backend=cc), skip=(3,))
    _assert_same(compiled, eager)
    assert not compiled[1].state[pa[3]]  # the frozen param was never stepped
    assert cc.frame_count == 1
    _no_graph_breaks()


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_lr_schedule_does_not_recompile(backend):
    """fastamp.DeviceLR writes a 0-dim tensor lr in place every step: the compiled step follows it, one compile."""
    compiled, eager = _twins("sgd", "bf16_master", 1e-2)
    cc = CompileCounterWithBackend(backend)
    step = torch.compile(compiled[1].step, fullgraph=True, backend=cc)
    scheds = [fastamp.DeviceLR(opt, fastamp.schedule.warmup_cosine(5, STEPS)) for opt in (compiled[1], eager[1])]
    for i in range(STEPS):
        _set_grads(i, (compiled[0], eager[0]))
        for p in compiled[0] + eager[0]:
            p.grad.nan_to_num_(posinf=1.0)
        step()
        eager[1].step()
        for sched in scheds:
            sched.step()
    _assert_same(compiled, eager)
    assert cc.frame_count == 1
    _no_graph_breaks()


def test_the_compiled_step_reads_the_state_through_a_list():
    """A compiled call does not walk ``opt.state``'s keys to find each param's state; a state reset traces again.

    dynamo fetches a value of a dict keyed by tensors by its key's position, a walk from the
    first key (``torch._dynamo.utils.dict_keys_getitem``): a traced step reading each param's
    state as ``opt.state[p]`` paid that walk per param at every call, O(n^2) per call (2,000
    params: ~7 ms of ~32; benchmarks/results/NOTES.md). It reads them through a list by
    position (``fastamp.optim.engine.traced.traced_states``), which a state dict assigned in
    ``opt.state`` drops: that call traces again and stays bit-identical with eager.
    """
    from unittest import mock

    utils = torch._dynamo.utils
    if not hasattr(utils, "dict_keys_getitem"):
        pytest.skip("this torch's dynamo has no dict_keys_getitem to count")
    real = utils.dict_keys_getitem
    walks: list[int] = []

    def counting(d, n):
        walks.append(n)
        return real(d, n)

    compiled, eager = _twins("adamw", "fp32", 1e-2)
    cc = CompileCounterWithBackend("aot_eager")
    step = torch.compile(compiled[1].step, fullgraph=True, backend=cc)
    replayed = 0
    for i in range(8):
        _set_grads(i, (compiled[0], eager[0]))
        for p in compiled[0] + eager[0]:
            p.grad.nan_to_num_(posinf=1.0)
        if i == 5:  # a layer's state reset between steps (torch: its moments start again)
            for ps, opt in (compiled, eager):
                opt.state[ps[2]] = {}
        frames = cc.frame_count
        with mock.patch.object(utils, "dict_keys_getitem", counting):
            step()
        if cc.frame_count == frames:  # a replay, not a trace
            replayed += 1
            # one walk at most: torch's OptimizerVariable realizes the state of the first param
            # with a grad through its key's position (map_sources_and_install_guards); the old
            # traced step walked once per param (4 here)
            assert len(walks) <= 1, f"step {i}: the compiled call walked the state table's keys to {walks}"
        walks.clear()
        eager[1].step()
    _assert_same(compiled, eager)
    assert cc.frame_count == 2  # the first step and the reset
    assert replayed == 6
    _no_graph_breaks()
