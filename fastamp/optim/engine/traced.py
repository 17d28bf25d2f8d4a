"""The step of fastamp's fused optimizers as torch.compile traces it (``fullgraph=True``).

The eager step (:meth:`FusedOptimizer.step <fastamp.optim.engine.base.FusedOptimizer.step>`)
keeps host time low with a cached launch plan checked by identity, storage addresses and
version counters, which dynamo cannot trace (``data_ptr`` comparisons) and should not
guard on. Under ``torch.compiler.is_compiling()`` the step takes this path instead:

* **At trace time, eagerly.** dynamo runs an optimizer's ``_init_group`` with the real
  objects instead of tracing it (``torch._dynamo.variables.optimizer.OptimizerVariable``,
  the hook torch's own optimizers use to create their state), then guards on the param
  groups and the state it finds afterwards. :meth:`FusedOptimizer._init_group` runs the
  eager step's own validation and planning there (every check of an eager step, missing
  state and masters created, launches grouped exactly as eager groups them) and returns the plan as constants: which kernel, which backend, which param
  positions, which state keys. Nothing of this is re-run when the compiled step replays.
* **In the graph.** Per group and device: every ``step`` count of the launches, read from
  ``state`` at every call and stacked into one vector, one opaque op that computes one row
  of step scalars per count; per launch the params, grads and state tensors (read from
  ``param_groups`` and the state at every call, so dynamo guards them; the state through
  :func:`traced_states`, a list of each group's state dicts by param position), the same kernel op
  eager calls (``torch.ops.fastamp.adamw_`` ...) with the launch's rows (``[n, k]``), the
  step counts advanced with tensor ops by ``found_inf == 0``, and the group's ``rng`` counter
  (one tensor that every state of the group on the device holds, see :mod:`fastamp.optim.engine.rng`)
  once, after the group's launches on the device, as eager advances it.

Bit-identity with eager: the kernels are the same ops, and the step scalars are computed by
``fastamp_optim::step_scalars``, the op of the op table (:data:`fastamp.ops.registry.OPTIM_OPS`)
whose kernel is each rule's eager code (e.g. :func:`fastamp.reference.adamw_step_scalars`, with
the grad scaler's ``1/grad_scale`` reciprocal in fp64 and the increment ``step + (found_inf ==
0)``, :mod:`fastamp.optim.engine.context`), so inductor cannot
re-derive the fp64 ``pow`` with another rounding. The op gets the same count vector as
eager's for the same launches (the counts of eager's step buffer of the group and device,
same length, same order: the trace-time plan hands their positions over) and each launch
takes the same rows (a slice at the same offset): torch's CPU fp64 ``pow`` gives a vector's
lanes and its scalar tail other last bits than a 0-dim call (41 of 2,062 sampled counts at
fp64, before the rounding to fp32), so equal results rest on equal vectors, not on luck.
The ``step`` and ``rng`` increments are exact (fp32 / int64 adds of 0 or 1).

Writes between compiled steps: the graph reads every tensor of the state at run time, so a
``step`` count replaced (``state[p]["step"] = torch.tensor(0.)``) or written in place
(``.zero_()``, ``.fill_()``, ``+=``) is honoured by the next run, as are moments written in
place or replaced; neither retraces (each param's bias correction comes from its own count,
so the counts of a launch may differ). What a compiled step does not re-check (dynamo
guards dtypes, shapes, devices, strides, which params have a grad, the group settings and
the state's keys; not values nor version counters): the values written from outside (an
eager step validates them: a negative or NaN count is refused there, not in a compiled
step), an ``rng`` counter replaced in one param's state (``state[p]["rng"] = t``: the graph
reads each group's counter through the first param of its launches; the next eager step or
load merges it into the group's), a remainder-mode param written outside the optimizer between a compiled step and
the next (eager re-syncs its master with a warning), and the backend: it is resolved at
trace time, so ``FASTAMP_BACKEND`` / :func:`fastamp.backends.set_backend` changed later do
not apply to an already compiled step.

Grad patterns: a change of which params have a grad recompiles (dynamo guards ``p.grad is
None``) and plans again as eager does; a param skipped by some steps keeps its own count,
read by every run. The cost: one graph per grad pattern (k patterns, k graphs), whatever
the counts. Every compiled step marks ``_compiled["ran"]`` (a side effect dynamo replays
after each run; an attribute store on the optimizer would be dropped); the next eager
step then reads (validates) the counts once, plans again with the same ``step`` tensors,
and forgets the params' recorded versions (see ``_forget_compiled_steps``).

Not supported under compile (refused at trace time, with the reason): tensor ``betas`` (the
kernels take them as numbers, read on the host at every step), betas or momentum cycled by an
LR scheduler (OneCycleLR, CyclicLR with ``cycle_momentum=True``: each value would be a new
graph) and DTensor params. The refusals and every check of ``_init_group`` raise eager's
error class and message (:mod:`fastamp._compile_errors`).

torch versions: needs ``torch.library.register_fake`` and ``torch.compiler.is_compiling`` (both
in torch >= 2.4) and the ``_init_group`` hook of ``OptimizerVariable`` (>= 2.2); checked
with torch 2.13 (CPU). A float lr is a graph input only where dynamo leaves floats
unspecialised (``torch._dynamo.config.specialize_float = False``, the default of recent
releases): it is specialised at the first compile and made dynamic at the first change
(one recompile), or dynamic from the start with ``torch.compile(..., dynamic=True)``; a
0-dim tensor lr (:class:`fastamp.DeviceLR`, or any torch scheduler over a tensor lr, which
fills it in place) never recompiles.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from fastamp.ops import backends, registry
from fastamp.optim.engine.context import StepContext


def lr_tensor(lr: Any) -> Tensor:
    """The lr as the step-scalar ops take it: a tensor lr as is, a float as the exact fp64 0-dim tensor.

    A float lr must not reach an op as a ``float`` argument: dynamo would specialise the
    graph on its value (a recompile per lr change). As a tensor, a float that dynamo made
    dynamic (after the first change, or from the start with ``dynamic=True``) stays a
    graph input; ``fp64`` holds every Python float exactly, as eager's ``torch.full`` does.
    """
    if isinstance(lr, Tensor):
        return lr.detach()
    # A product, not torch.full: AOTAutograd's pass that turns dynamic floats into tensor inputs
    # (torch.fx.passes._tensorify_python_scalars) rewrites arithmetic on them, but specialises
    # a float that reaches any other op (torch.full's fill value), and the guard it then adds
    # recompiles at every new lr. ``1.0 * lr`` is exact in fp64, signed zero included.
    return torch.ones((), dtype=torch.float64) * lr


# rule name -> its step-scalar function ``(counts, found_inf, grad_scale, lr, args) -> Tensor``: the kernel of
# the one op ``fastamp_optim::step_scalars`` for that rule (each module of fastamp/optim/rules/ registers its own
# with :func:`rule_step_scalars`)
STEP_SCALARS: dict[str, Callable[..., Tensor]] = {}


def rule_step_scalars(rule: str) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    """Register the decorated function as ``rule``'s step scalars (a decorator for the rule's module).

    It gets ``counts`` (each param's count before this step: 1-D for one row each, 0-dim for one
    set), the grad scaler's ``found_inf`` / ``grad_scale`` as handed over (or None), ``lr`` (see
    :func:`lr_tensor`) and the rule's own numbers ``args``; it returns fp32 rows of the width of
    the rule's ``RuleDef.scalars``, computed as eager code (the op is opaque to inductor).
    """

    def register(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        STEP_SCALARS[rule] = fn
        return fn

    return register


def _step_scalars(
    rule: str, counts: Tensor, found_inf: Tensor | None, grad_scale: Tensor | None, lr: Tensor, args: list[float]
) -> Tensor:
    fn = STEP_SCALARS.get(rule)
    if fn is None:
        raise ValueError(
            f"fastamp_optim::step_scalars: no step scalars registered for rule {rule!r} (known: {sorted(STEP_SCALARS)})"
        )
    return fn(counts, found_inf, grad_scale, lr, list(args))


# its schema and fake: the op table (fastamp/ops/registry.py, OPTIM_OPS)
step_scalars = registry.register_optim("step_scalars", _step_scalars)


def rng_parts(ids: list[int], n: int) -> list[tuple[int, int, int]]:
    """``(start, stop, rng_base)`` of each stretch of consecutive stochastic-rounding ids (one kernel call each).

    The kernel numbers a launch's tensors ``rng_base + i`` (as :meth:`_Run.split`); a launch
    without stochastic rounding is one part with base 0.
    """
    if not ids:
        return [(0, n, 0)]
    parts, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            parts.append((start, i, ids[start]))
            start = i
    return parts


_NO_STATE: dict[str, Tensor] = {}


def traced_states(opt: Any) -> list[list[dict[str, Any]]]:
    """Per group, the state dict of each param by position (an empty one where it has none).

    Made at trace time for :func:`traced_step`, which reads the state through it rather
    than through ``opt.state[p]``: dynamo fetches a value of a dict keyed by tensors by the
    key's position (``dict_keys_getitem``, a walk from the first key), so that reading every
    param's state costs O(n^2) per compiled call (2,000 params, cProfile: ~7 ms of ~32), where a list
    index costs O(1). The list holds the same dict objects as ``opt.state``: a tensor
    replaced or written in one of them is read by the next run, as before. A dict assigned,
    removed or cleared in ``opt.state`` drops the list (:class:`~fastamp.optim.engine.plan.StateTable`
    tells the optimizer), so the next compiled call fails its guard on it and traces again,
    which builds it anew.
    """
    state = opt.state
    return [[state.get(p, _NO_STATE) for p in group["params"]] for group in opt.param_groups]


class Launch(NamedTuple):
    """One kernel call (eager or compiled): what ``FusedOptimizer._kernel_args`` turns into the op's arguments."""

    op: str
    backend: str
    kind: str
    params: list
    grads: list
    state: dict  # state key -> the tensors of the launch's params, in order
    found_inf: Tensor | None
    rng: Tensor | None
    rng_base: int


def traced_step(opt: Any, closure: Any = None) -> Any:
    """``opt.step(closure)`` as dynamo traces it (see the module doc)."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    # checked as eager checks them (dynamo guards what the checks read: type, shape, dtype)
    ctx = StepContext.of(opt)
    grad_scale, found_inf = ctx.grad_scale, ctx.found_inf
    plan = opt._init_group()
    # each group's state dicts by param position (see traced_states): a list read by index,
    # where ``opt.state[p]`` makes dynamo fetch the dict by its key's position in the table
    states_of = opt._traced_states
    for gi, buckets in plan:
        group = opt.param_groups[gi]
        params = group["params"]
        group_states = states_of[gi]
        for counted, launches in buckets:
            dev = params[launches[0][4][0]].device
            # Read at every run: a count replaced or written in place between runs is honoured.
            # The vector holds the counts of eager's buffer for this bucket, in its order, and
            # each launch slices its rows as eager does (see FusedOptimizer._execute): the
            # step-scalar op then runs eager's code over the same vector.
            steps = [group_states[i]["step"] for i in counted]
            rows = opt._step_scalars(group, torch.stack(steps), found_inf, grad_scale, dev) if steps else None
            shared = None
            counter = None  # the group's rng counter on this device: one tensor in every state (see _rng)
            for op, backend, kind, keys, positions, rng_base, strided, row0 in launches:
                ps = [params[i] for i in positions]
                if row0 >= 0:
                    scalars = rows[row0 : row0 + len(ps)]
                else:
                    if shared is None:
                        shared = opt._step_scalars(group, None, found_inf, grad_scale, dev)
                    scalars = shared
                sts = [group_states[i] for i in positions]
                grads = [p.grad for p in ps]
                grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
                launch_params = [p.contiguous() if i in strided else p for i, p in enumerate(ps)]
                tensors = {key: [st[key] for st in sts] for key in keys}
                rng = tensors["rng"][0] if "rng" in tensors else None
                launch = Launch(op, backend, kind, launch_params, grads, tensors, ctx.found_inf_on(dev), rng, rng_base)
                backends.kernel(op, backend)(*opt._kernel_args(group, launch, scalars))
                for i in strided:
                    ps[i].copy_(launch_params[i])
                if counter is None:
                    counter = rng
            if counter is not None:
                # once per group and device, after its launches (as eager: every launch reads the same count)
                counter.add_(ctx.rng_delta_on(dev))
            if steps:
                inc = ctx.increment_on(dev)
                if inc is None:
                    torch._foreach_add_(steps, 1.0)
                else:
                    torch._foreach_add_(steps, [inc] * len(steps))
    # a side effect dynamo replays after every run of the graph: the host's records are stale now
    # (a dict item: see FusedOptimizer._forget_compiled_steps)
    opt._compiled["ran"] = True
    return loss
