"""Compiled steps in the loops people write: LR schedulers, a float lr, two optimizers, bad input (issue 20).

Each test runs a compiled function and an eager twin over the same grads and asserts
bit-identical params, optimizer state and scale after every step, through real backends
(``aot_eager``; inductor cases are marked ``slow``), and counts compiles with torch's
``CompileCounterWithBackend``. Loops run ``STEPS`` (14) steps, more than dynamo's recompile
limit (8): a step that recompiled at every new lr would fail there under ``fullgraph=True``,
and fall back to eager without it.

* A float lr changed every step compiles twice: dynamo specialises it at the first compile
  and makes it a graph input at its first change. (It recompiled at every value: the pass
  of AOTAutograd that turns dynamic floats into tensor inputs specialised it again, which a
  counting backend, running no AOTAutograd, never showed.)
* torch's LR schedulers (they replace ``opt.step`` with a wrapper dynamo refuses to trace),
  created before or after compiling, with ``torch.compile(opt.step)`` or the README's
  compiled ``clip_grad_norm_`` + ``step`` + ``update``. A scheduler that cycles the momentum
  (OneCycleLR, CyclicLR with ``cycle_momentum=True``) is refused with what to do.
* Two fastamp optimizers in one compiled function, each case in a fresh process.
* An error raised at trace time reaches the user with eager's class and message.
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from helpers import COMPILE_BACKENDS
from torch._dynamo.testing import CompileCounterWithBackend
from torch.optim import lr_scheduler

import fastamp

STEPS = 14
OVERFLOW = {4, 9}  # scaler loops: the first grad holds an inf on these steps
SHAPES = [(7, 5), (13,), (3, 4, 2), (1,)]
BACKENDS = COMPILE_BACKENDS


@pytest.fixture(autouse=True)
def _fresh_dynamo(fresh_dynamo):
    pass


def _no_graph_breaks():
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


class _World:
    """Params, a fastamp optimizer, optionally a fastamp.Scaler and an LR scheduler: one side of a comparison."""

    def __init__(self, lr, opt_name="adamw", dtype=torch.float16, scaler=True, **kw):
        g = torch.Generator().manual_seed(1)
        self.params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]
        if opt_name == "adamw":
            self.opt = fastamp.optim.AdamW(self.params, lr=copy.deepcopy(lr), master_weights=True, **kw)
        else:
            self.opt = fastamp.optim.SGD(self.params, lr=copy.deepcopy(lr), momentum=0.9, master_weights=True, **kw)
        self.scaler = fastamp.Scaler("cpu", init_scale=2.0**10, growth_interval=3) if scaler else None
        self.sched = None

    def backward(self, i):
        """The grads of a (scaled) backward, an inf in the first one on OVERFLOW steps under a scaler."""
        g = torch.Generator().manual_seed(100 + i)
        scale = 1.0 if self.scaler is None else float(self.scaler.scale(torch.ones(())))
        for j, p in enumerate(self.params):
            grad = torch.randn(p.shape, generator=g) * scale
            if self.scaler is not None and i in OVERFLOW and j == 0:
                grad.view(-1)[0] = math.inf
            p.grad = grad.to(p.dtype)

    def snapshot(self):
        out = {f"p{i}": p.detach().clone() for i, p in enumerate(self.params)}
        for i, p in enumerate(self.params):
            for k, v in self.opt.state.get(p, {}).items():
                out[f"p{i}.{k}"] = v.detach().clone()
        for gi, group in enumerate(self.opt.param_groups):
            out[f"lr{gi}"] = torch.as_tensor(group["lr"], dtype=torch.float64).clone()
        if self.scaler is not None and self.scaler._scale is not None:
            out["scale"] = self.scaler._scale.clone()
            out["skipped"] = self.scaler._skipped_steps.clone()
        return out


def _assert_same(a, b, where):
    assert a.keys() == b.keys(), where
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{where}: {k} differs: {a[k]} vs {b[k]}"


def _set_lr(opt, i):
    for group in opt.param_groups:
        lr = 1e-3 * (1 + 0.05 * i)
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


# ------------------------------------------------------------------------------------- float lr


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph_breaks_allowed"])
@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_float_lr_changed_every_step_compiles_twice(opt_name, fullgraph, backend):
    """A float lr changed at every step (what every torch scheduler does): two compiles, never more, eager's bits.

    Without the fix the 9th step raised ``FailOnRecompileLimitHit`` under ``fullgraph=True``;
    without ``fullgraph`` the step fell back to eager after 8 compiles (the count shows it).
    """
    compiled, eager = (_World(1e-3, opt_name, torch.bfloat16, scaler=False) for _ in range(2))
    cc = CompileCounterWithBackend(backend)
    step = torch.compile(compiled.opt.step, fullgraph=fullgraph, backend=cc)
    frames = []
    for i in range(STEPS):
        for world, fn in ((eager, eager.opt.step), (compiled, step)):
            world.backward(i)
            _set_lr(world.opt, i)
            fn()
        _assert_same(eager.snapshot(), compiled.snapshot(), f"step {i}")
        frames.append(cc.frame_count)
    # the first compile specialises the lr; its first change makes it a graph input
    assert frames == [1] + [2] * (STEPS - 1), frames
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    _no_graph_breaks()


# ------------------------------------------------------------------------------------- schedulers

# name -> a scheduler on ``opt`` (torch's; each replaces opt.step with its wrapper unless the step
# is marked as already tracked, which fastamp's is)
SCHEDULERS = {
    "LambdaLR": lambda opt: lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1.0 + 0.3 * i)),
    "StepLR": lambda opt: lr_scheduler.StepLR(opt, step_size=3, gamma=0.7),
    "CosineAnnealingLR": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-5),
    "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS + 1, cycle_momentum=False),
    "SequentialLR": lambda opt: lr_scheduler.SequentialLR(
        opt,
        [lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=4), lr_scheduler.ExponentialLR(opt, gamma=0.9)],
        milestones=[4],
    ),
}


def _clip_step_update(scaler, opt):
    """The README's compiled optimizer step."""
    scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()


def _run_with_scheduler(pattern, make_sched, lr, backend, created_at, steps=STEPS):
    """``steps`` iterations of a compiled world and an eager twin, the scheduler made before iteration ``created_at``.

    ``pattern``: ``"opt_step"``, ``opt.step = torch.compile(opt.step, fullgraph=True)`` called
    directly (bf16 params, fp32 masters, no scaler); ``"scaler"``, the README's
    ``clip_grad_norm_`` + ``step`` + ``update`` compiled with ``fullgraph=True`` (fp16 params,
    fp32 masters, fastamp.Scaler, overflows). ``scheduler.step()`` runs outside the compiled
    function after every iteration. Returns the compile count after each iteration.
    """
    use_scaler = pattern == "scaler"
    dtype = torch.float16 if use_scaler else torch.bfloat16
    compiled, eager = (_World(lr, "adamw", dtype, scaler=use_scaler) for _ in range(2))
    cc = CompileCounterWithBackend(backend)
    if use_scaler:
        fn = torch.compile(_clip_step_update, fullgraph=True, backend=cc)
        runs = (
            (eager, lambda: _clip_step_update(eager.scaler, eager.opt)),
            (compiled, lambda: fn(compiled.scaler, compiled.opt)),
        )
    else:
        runs = ((eager, lambda: eager.opt.step()), (compiled, lambda: compiled.opt.step()))
    frames = []
    with warnings.catch_warnings():
        # torch's "lr_scheduler.step() before optimizer.step()" and "optimizer.step() has been
        # overridden" warnings: neither may fire (fastamp's step records the call itself)
        warnings.filterwarnings("error", category=UserWarning, module="torch.optim.lr_scheduler")
        for i in range(steps):
            if i == created_at:
                for world in (eager, compiled):
                    world.sched = make_sched(world.opt)
            if i == 0 and not use_scaler:  # after the scheduler was made (created_at=0), or before it (3)
                compiled.opt.step = torch.compile(compiled.opt.step, fullgraph=True, backend=cc)
            for world, run in runs:
                world.backward(i)
                run()
                if world.sched is not None:
                    world.sched.step()
            _assert_same(eager.snapshot(), compiled.snapshot(), f"step {i}")
            frames.append(cc.frame_count)
    assert eager.sched.get_last_lr() == compiled.sched.get_last_lr()
    if use_scaler:
        assert int(compiled.scaler.skipped_steps) == len(OVERFLOW)
    _no_graph_breaks()
    return frames


def _assert_compiles(frames, lr_kind):
    """A tensor lr (filled in place by the scheduler) never recompiles; a float lr once, at its first change."""
    if lr_kind == "tensor":
        assert frames == [1] * len(frames), frames
    else:
        assert frames[0] == 1 and frames[-1] == 2 and frames == sorted(frames), frames


@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
@pytest.mark.parametrize("sched_name", list(SCHEDULERS))
def test_torch_schedulers_with_the_compiled_scaler_path(sched_name, lr_kind):
    """Every scheduler, float and tensor lr, the README's fullgraph optimizer step: eager's bits, at most 2 compiles.

    Before the fix: "Attempted to call function marked as skipped" at the first compiled step
    (the scheduler's ``opt.step`` wrapper lives in a file dynamo does not trace).
    """
    lr = 1e-3 if lr_kind == "float" else torch.tensor(1e-3)
    frames = _run_with_scheduler("scaler", SCHEDULERS[sched_name], lr, "aot_eager", created_at=0)
    _assert_compiles(frames, lr_kind)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("created", ["before", "after"])
@pytest.mark.parametrize("pattern", ["opt_step", "scaler"])
@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
def test_scheduler_created_before_or_after_compiling(lr_kind, pattern, created, backend):
    """LambdaLR made before the first compiled step or after three: eager's bits, compiles as documented.

    Before the fix, with ``opt.step = torch.compile(opt.step)``: made before, the first step
    failed at trace time (the scheduler's wrapper); made after, the scheduler's constructor
    failed (``'function' object has no attribute '__func__'``).
    """
    lr = 1e-3 if lr_kind == "float" else torch.tensor(1e-3)
    frames = _run_with_scheduler(
        pattern, SCHEDULERS["LambdaLR"], lr, backend, created_at=0 if created == "before" else 3
    )
    _assert_compiles(frames, lr_kind)


MOMENTUM_CYCLERS = {
    # optimizer -> a scheduler with cycle_momentum=True (the default): it rewrites betas[0] / momentum every step
    "adamw": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS + 1),
    "sgd": lambda opt: lr_scheduler.CyclicLR(opt, base_lr=1e-3, max_lr=1e-2, step_size_up=4),
}


@pytest.mark.parametrize("created", ["before", "after"])
@pytest.mark.parametrize("opt_name", list(MOMENTUM_CYCLERS))
def test_momentum_cycling_scheduler_refused_by_the_compiled_step(opt_name, created):
    """OneCycleLR / CyclicLR with cycle_momentum=True: the compiled step refuses, saying what to do, changing nothing.

    The kernels take betas / momentum as numbers (constants of the graph): every new value would
    compile a new graph until dynamo's recompile limit. Made after three compiled steps, the
    scheduler is refused at the first compiled step that meets a value it wrote (dynamo
    retraces on it): CyclicLR starts at the momentum the group has, so only after its first step.
    """
    world = _World(1e-3, opt_name, torch.bfloat16, scaler=False)
    world.opt.step = torch.compile(world.opt.step, fullgraph=True, backend="aot_eager")
    start = 0 if created == "before" else 3
    for i in range(start + 1):
        if i == start:
            world.sched = MOMENTUM_CYCLERS[opt_name](world.opt)
            if created == "after":
                world.sched.step()  # the end of the iteration that made it
        world.backward(i)
        if i < start:
            world.opt.step()
    before = world.snapshot()
    key = "betas" if opt_name == "adamw" else "momentum"
    with pytest.raises(NotImplementedError) as info:
        world.opt.step()
    message = str(info.value)
    assert f"has its {key} cycled by an LR scheduler" in message
    assert "pass cycle_momentum=False to the scheduler, or call opt.step() outside the compiled function" in message
    _assert_same(before, world.snapshot(), "after the refusal")


def test_momentum_cycling_scheduler_and_the_compiled_scaler_path():
    """The README's optimizer step with OneCycleLR(cycle_momentum=True): refused under fullgraph, eager without.

    Without ``fullgraph`` the scaler's calls for that optimizer run eagerly at graph breaks
    (as for tensor betas): eager's bits over STEPS steps.
    """
    world = _World(1e-3, "adamw")
    world.sched = MOMENTUM_CYCLERS["adamw"](world.opt)
    world.backward(0)
    before = world.snapshot()
    with pytest.raises(Exception) as info:
        torch.compile(_clip_step_update, fullgraph=True, backend="aot_eager")(world.scaler, world.opt)
    assert "an LR scheduler cycles the optimizer's betas or momentum" in str(info.value)
    assert "pass cycle_momentum=False to the scheduler" in str(info.value)
    _assert_same(before, world.snapshot(), "after the refusal")

    torch._dynamo.reset()
    compiled, eager = (_World(1e-3, "adamw") for _ in range(2))
    fn = torch.compile(_clip_step_update, backend="aot_eager")
    for world in (compiled, eager):
        world.sched = MOMENTUM_CYCLERS["adamw"](world.opt)
    for i in range(STEPS):
        for world, run in ((eager, _clip_step_update), (compiled, fn)):
            world.backward(i)
            run(world.scaler, world.opt)
            world.sched.step()
        _assert_same(eager.snapshot(), compiled.snapshot(), f"step {i}")
    assert compiled.opt.param_groups[0]["betas"] == eager.opt.param_groups[0]["betas"]


# ------------------------------------------------------------------------------------- two optimizers

_TWO_OPTIMIZERS = os.path.join(os.path.dirname(__file__), "_scripts", "compile_two_optimizers.py")


_PAIRS = [
    (pair, scaler, "aot_eager") for pair in ("adamw_sgd", "adamw_fp32_remainder") for scaler in ("none", "scaler")
]
# inductor in a fresh process compiles from a cold start (~10 s a case): one case per pair
_PAIRS += [pytest.param(pair, scaler, "inductor", marks=pytest.mark.slow) for pair, scaler, _ in _PAIRS[1:3]]


@pytest.mark.parametrize(("pair", "scaler", "backend"), _PAIRS)
def test_two_optimizers_in_one_compiled_function_fresh_process(pair, scaler, backend):
    """Two fastamp optimizers stepped in one fullgraph function (a GAN's two steps): one graph, eager's bits.

    Each case in a fresh process (``_scripts/compile_two_optimizers.py``): before the fix the
    trace failed with ``KeyError(('sgd_', 'native'))`` (or ``adamw_bf16_``) where nothing had
    run the second optimizer's kernel yet in the process. The kernels were looked up in a
    table filled at trace time, and dynamo reads a module's dict once per trace.
    """
    proc = subprocess.run(
        [sys.executable, _TWO_OPTIMIZERS, pair, scaler, backend], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok", proc.stdout[-2000:]


# ------------------------------------------------------------------------------------- errors


def _setter(key, value):
    def apply(world):
        world.opt.param_groups[0][key] = value

    return apply


def _bad_grad(make):
    def apply(world):
        world.params[0].grad.data = make(world.params[0])  # .data: a grad assignment would refuse it

    return apply


# name -> (what makes the input bad, good steps before it). A grad whose shape changed through
# .data is seen by a step that plans (the first one): eager's later steps reuse their plan, which
# checks grad dtypes but not shapes (see FusedOptimizer: writes through .data are not seen)
BAD_INPUTS = {
    "lr_negative": (_setter("lr", -1.0), 2),
    "eps_nan": (_setter("eps", math.nan), 2),
    "beta_one": (_setter("betas", (1.0, 0.999)), 2),
    "weight_decay_inf": (_setter("weight_decay", math.inf), 2),
    "grad_dtype": (_bad_grad(lambda p: torch.zeros(p.shape, dtype=torch.float64)), 2),
    "grad_shape": (_bad_grad(lambda p: torch.zeros(tuple(reversed(p.shape)), dtype=p.dtype)), 0),
}


def _assert_same_error(compiled_error, eager_error):
    assert type(compiled_error).__name__ == type(eager_error).__name__, (compiled_error, eager_error)
    assert isinstance(compiled_error, type(eager_error)), type(compiled_error).__mro__
    assert str(compiled_error) == str(eager_error)


def _error_of(fn, *args):
    try:
        fn(*args)
    except Exception as e:
        return e
    raise AssertionError("no error raised")


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph_breaks_allowed"])
@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_bad_input_raises_eagers_error_from_the_compiled_step(bad, fullgraph):
    """A bad hyperparameter set on the group between steps, a grad of the wrong shape or dtype: eager's class and message.

    Before the fix the compiled step raised dynamo's ``InternalTorchDynamoError`` (the check
    runs at trace time, in ``_init_group``). Nothing changes; after the input is repaired the
    compiled step goes on with eager's bits.
    """
    compiled, eager = (_World(1e-3, "adamw", torch.bfloat16, scaler=False) for _ in range(2))
    step = torch.compile(compiled.opt.step, fullgraph=fullgraph, backend="aot_eager")
    runs = ((eager, eager.opt.step), (compiled, step))
    good = copy.deepcopy(eager.opt.param_groups[0]["betas"]), eager.opt.param_groups[0]["eps"]
    make_bad, warm = BAD_INPUTS[bad]
    for i in range(warm):
        for world, run in runs:
            world.backward(i)
            run()
    errors = []
    for world, run in runs:
        world.backward(warm)
        make_bad(world)
        before = world.snapshot()
        errors.append(_error_of(run))
        _assert_same(before, world.snapshot(), "after the error")
    _assert_same_error(errors[1], errors[0])
    for world, run in runs:
        group = world.opt.param_groups[0]
        group.update(lr=1e-3, betas=good[0], eps=good[1], weight_decay=1e-2)
        world.backward(warm + 1)
        run()
    _assert_same(eager.snapshot(), compiled.snapshot(), "after the repair")


def _scale_never_created(scaler, opt):
    scaler.clip_grad_norm_(opt, 1.0)


def _unscale_twice(scaler, opt):
    scaler.unscale_(opt)
    scaler.unscale_(opt)


def _negative_max_norm(scaler, opt):
    scaler.clip_grad_norm_(opt, -1.0)


def _update_without_step(scaler, opt):
    scaler.update()


def _step_through_the_scaler(scaler, opt):
    scaler.step(opt)


SCALER_ERRORS = {
    "scale_never_created": _scale_never_created,
    "unscale_twice": _unscale_twice,
    "negative_max_norm": _negative_max_norm,
    "update_without_step": _update_without_step,
    "bad_lr_through_the_scaler": _step_through_the_scaler,  # lr set to -1 between steps
}


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph_breaks_allowed"])
@pytest.mark.parametrize("case", list(SCALER_ERRORS))
def test_scaler_path_errors_are_eagers(case, fullgraph):
    """The compiled scaler path's errors (misuse of the protocol, a bad group) have eager's class and message.

    Before the fix: dynamo's ``Unsupported`` ("Observed exception") for the checks in traced
    code, ``InternalTorchDynamoError`` for the optimizer's. Nothing changes.
    """
    fn = SCALER_ERRORS[case]
    errors = []
    for run in (fn, torch.compile(fn, fullgraph=fullgraph, backend="aot_eager")):
        world = _World(1e-3, "adamw")
        if case == "scale_never_created":
            for p in world.params:
                p.grad = torch.ones_like(p)
        else:
            world.backward(0)
        if case == "bad_lr_through_the_scaler":
            world.opt.param_groups[0]["lr"] = -1.0
        before = world.snapshot()
        errors.append(_error_of(run, world.scaler, world.opt))
        _assert_same(before, world.snapshot(), "after the error")
    _assert_same_error(errors[1], errors[0])
