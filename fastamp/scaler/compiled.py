"""torch.compile and the Scaler's entry points: traced where nothing needs the host, else eager.

:func:`_eager_under_compile` wraps every :class:`fastamp.Scaler` method that may decide on the
host what to run (unscale_, clip_grad_norm_, step, update, the checkpoint methods and the
torch hooks other libraries call). Met inside a compiled function:

* **Traced** (``unscale_``, ``clip_grad_norm_``, ``step``, ``update`` with an amp-aware
  optimizer, ``_step_supports_amp_scaling``, whose step traces: fastamp's; torch.optim's
  graph-break inside their own step): the method's traced twin below runs under dynamo. It makes every decision eager makes, on
  Python state only (the per-optimizer stage, which dynamo guards), and puts the kernels in
  the graph: the check pass (``fastamp::unscale_check_``), the device scalars, the
  optimizer's step with ``grad_scale`` / ``found_inf`` set as attributes, then
  ``fastamp::update_scale_`` and the skip counters. No host sync, no decision on a tensor
  value, so the whole path is one graph under ``fullgraph=True`` and bit-identical to eager.
* **Eager** (everything else: an ordinary optimizer, whose step needs a host read of
  ``found_inf`` to skip or step; torch.optim's fused ones; ``track_stats``, a ``process_group``, grads the fused check
  cannot take in a graph, ``error_if_nonfinite``, other norms, ``update(new_scale)``, the
  checkpoint methods): the call becomes a graph break into a dynamo-disabled twin of the
  method; ``fullgraph=True`` then fails at trace time, before anything ran, with the reason
  of :data:`_WHY` as the message (what to do instead).

Errors: a traced twin that refuses a misuse of the protocol (``unscale_`` twice, ``update``
without a step, no scale yet ...) raises eager's error, class and message, through
:func:`fastamp._compile_errors.fail` (dynamo would turn a ``raise`` in traced code into its
own ``Unsupported``), before anything ran.

What a traced call does not do: the pitfall guards' health probes (:meth:`_Monitor.on_update
<fastamp.health._Monitor.on_update>` reads device values on the host) and the grad-dtype
sampling do not run in compiled updates; the backend is resolved at trace time (a later
``FASTAMP_BACKEND`` / :func:`fastamp.backends.set_backend` does not apply to an already
compiled function, as for the optimizers' compiled steps).
"""

from __future__ import annotations

import functools
import math
import sys
from collections import defaultdict
from typing import Any, Callable

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState

from fastamp import _compile_errors
from fastamp.ops import backends
from fastamp.optim.engine.checks import cycles_momentum
from fastamp.scaler.device_scalars import (
    _any_found,
    _clip_coef,
    _combined_found_inf,
    _fold_found_inf,
    _grad_scale_after_clip,
    _inv_scale,
    _step_grad_scale,
    _total_norm,
)

_COMPILE_HELP = (
    "fastamp.Scaler.{name}() cannot be captured by torch.compile: it decides on the host what to run "
    "(skip or step, unscale or not) and hands grad_scale/found_inf to the optimizer as attributes. "
    "Outside fullgraph=True it runs eagerly at a graph break, with exactly the eager result. With "
    "fullgraph=True, compile the model and loss (or the forward and backward) and call "
    "scaler.unscale_ / clip_grad_norm_ / step / update outside the compiled function."
)
_EAGER_TAIL = (
    " Outside fullgraph=True it runs eagerly at a graph break, with exactly the eager result; with fullgraph=True, "
    "{fix}, or compile the model and loss (or the forward and backward) and call scaler.unscale_ / clip_grad_norm_ "
    "/ step / update outside the compiled function."
)
# why a traced entry runs eagerly -> (the cause, what makes it traceable)
_WHY = {
    "ordinary": (
        "the optimizer is not amp-aware (no _step_supports_amp_scaling): skipping its step on overflow needs a "
        "host read of found_inf",
        "use an amp-aware optimizer (fastamp.optim.AdamW / SGD, or torch.optim.AdamW / Adam / SGD with "
        "fused=True), which skips on the device",
    ),
    "foreign_step": (
        "the optimizer is amp-aware but its step is not fastamp's traced one: torch.optim's optimizers "
        "graph-break inside their own step (torch.optim.optimizer._use_grad_for_differentiable calls "
        "torch._dynamo.graph_break(), torch 2.13), so the step cannot share a graph with the scaler",
        "use fastamp.optim.AdamW / SGD, whose step traces",
    ),
    "tensor_betas": (
        "the optimizer has tensor betas, which its kernels take as numbers read on the host at every step",
        "use float betas",
    ),
    "cycled_momentum": (
        "an LR scheduler cycles the optimizer's betas or momentum (OneCycleLR or CyclicLR with cycle_momentum=True), "
        "which its kernels take as numbers, constants of a graph: every new value would compile a new graph",
        "pass cycle_momentum=False to the scheduler",
    ),
    "stats": ("track_stats=True keeps host-side statistics records", "construct the scaler with track_stats=False"),
    "process_group": (
        "a process_group all-reduces the flags outside the graph",
        "call the scaler outside the compiled function in distributed runs",
    ),
    "grads": (
        "a grad the fused check cannot take in a graph (sparse, DTensor, fp64, not contiguous, not a tensor param)",
        "give the optimizer dense contiguous fp32/fp16/bf16 grads",
    ),
    "norm": (
        "norm_type != 2 or error_if_nonfinite=True (a host read of the norm)",
        "clip with the 2-norm and error_if_nonfinite=False",
    ),
    "released": (
        "the optimizer is under gradient release (fastamp.release), whose h.backward makes the scaler's calls "
        "itself; the eager call refuses it",
        "drop the scaler calls (each step is h.backward(loss) alone)",
    ),
    "new_scale": ("update(new_scale) checks new_scale on the host", "call update(new_scale) outside the function"),
}


def _help(name: str, why: str | None) -> str:
    if why is None:
        return _COMPILE_HELP.format(name=name)
    cause, fix = _WHY[why]
    return f"fastamp.Scaler.{name}() cannot be captured by torch.compile here: {cause}." + _EAGER_TAIL.format(fix=fix)


# (slot, method, name) of every entry point that can run eagerly under torch.compile; slot[0]
# holds the dynamo-disabled twin of the method once torch._dynamo is imported, slot[1] the
# twins with a specific reason (by _WHY key) of an entry with a traced twin.
_EAGER_ENTRIES: list[tuple[list, Any, str]] = []
_eager_ready = [False]


def _disable(method, reason: str):
    try:
        return torch.compiler.disable(method, recursive=True, reason=reason)
    except TypeError:  # torch < 2.7: no reason argument
        return torch.compiler.disable(method, recursive=True)


def _prepare_eager_entries() -> None:
    """Build the dynamo-disabled twins of every entry point (torch._dynamo must be imported).

    Done outside any trace: dynamo refuses to trace ``torch.compiler.disable`` itself. Done at
    the first Scaler construction, not at import: importing torch._dynamo would double
    ``import fastamp``'s time (any ``torch.optim`` optimizer imports it anyway).
    """
    torch.compiler.assume_constant_result(_traced_backend)  # marks the function in place
    torch.compiler.assume_constant_result(_compile_errors.raise_traced)
    for slot, method, name in _EAGER_ENTRIES:
        if slot[0] is None:
            slot[0] = _disable(method, _help(name, None))
            if slot[1] is not None:
                slot[1] = {why: _disable(method, _help(name, why)) for why in _WHY}
    _eager_ready[0] = True


def _maybe_prepare_eager_entries() -> None:
    if not _eager_ready[0] and "torch._dynamo" in sys.modules:
        _prepare_eager_entries()


def _twin(slot: list, name: str, why: str | None):
    """The dynamo-disabled twin to call under compile (a graph break), or the refusal if none is built.

    No twin yet (torch._dynamo was imported after the last eager call): refuse before anything
    ran; outside fullgraph dynamo then runs the calling frame eagerly.
    """
    if slot[0] is None:
        raise RuntimeError(_help(name, why))
    return slot[0] if why is None else slot[1][why]


def _eager_under_compile(method=None, *, traced: Callable | None = None):
    """Make a Scaler method run eagerly, never traced, when torch.compile meets it (or traced by ``traced``).

    Under dynamo the call becomes a graph break into the dynamo-disabled twin (so the whole
    method, the optimizer's step included, runs as in eager mode; fullgraph=True then fails
    at trace time, before anything ran, with the reason as the message). With ``traced``
    (``traced(self, eager, *args, **kwargs)``), dynamo traces that instead; it calls
    ``eager(why)(self, *args, **kwargs)`` where the call must run eagerly (``why``: a key of
    :data:`_WHY`). In eager mode, once torch._dynamo is imported, the twin is called too: a
    frame that dynamo chose to run eagerly still has its callback installed, and would
    otherwise compile the method's own frame piecewise (the bug this prevents: attributes
    set for the optimizer lost across a graph break, an overflowed step applied). Costs ~1 us
    per call.
    """
    if method is None:
        return functools.partial(_eager_under_compile, traced=traced)
    slot: list = [None, None if traced is None else {}]
    name = method.__name__

    def eager(why: str | None = None):
        return _twin(slot, name, why)

    def entry(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            if traced is not None:
                return traced(self, eager, *args, **kwargs)
            return _twin(slot, name, None)(self, *args, **kwargs)
        if slot[0] is None:
            if "torch._dynamo" not in sys.modules:
                return method(self, *args, **kwargs)
            _prepare_eager_entries()
        return slot[0](self, *args, **kwargs)

    functools.update_wrapper(entry, method)
    entry._fastamp_eager_body = method
    _EAGER_ENTRIES.append((slot, method, name))
    return entry


def _without_entry(bound):
    """``bound`` (``self.<method>``) to call from inside an entry point, which already runs eagerly.

    One of fastamp's own entry points comes back as its method, without the entry (whose only
    work, running the method eagerly, is done: two Python frames and, once torch._dynamo is
    imported, torch's disable wrapper saved per nested call). Anything else (a subclass's
    override, an attribute patched on the instance) comes back as it is, and is called as
    before.
    """
    body = getattr(getattr(bound, "__func__", None), "_fastamp_eager_body", None)
    return bound if body is None else body.__get__(bound.__self__)


# ----------------------------------------------------------------------------- traced twins


def _refresh_per_optimizer_state() -> dict[str, Any]:
    # torch's form and keys only; fastamp's extras live in Scaler._per_optimizer_clip_scales
    return {"stage": OptState.READY, "found_inf_per_device": {}}


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _traced_backend(op: str, device: str, backend: str | None) -> str:
    """The backend of ``op`` on ``device``, resolved eagerly at trace time (a constant of the graph).

    Marked ``torch.compiler.assume_constant_result`` by :func:`_prepare_eager_entries`: marking
    it here would import torch._dynamo with ``import fastamp``.

    The kernel is looked up here too: a Triton one registers its ``fastamp_triton`` op when
    its module is imported, which dynamo would not trace.
    """
    chosen = backends.resolve(op, device, backend)
    backends.get_impl(op, chosen)
    return chosen


def _eager_reason(scaler, optimizer) -> str | None:
    """Why ``scaler``'s traced entries must leave ``optimizer`` to the eager twin (None: traceable).

    Read from Python state dynamo guards: the optimizer's type and attributes, the params'
    grads (type, dtype, layout, contiguity), the scaler's settings.
    """
    if getattr(optimizer, "_release", None) is not None:
        return "released"
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return "ordinary"
    if getattr(type(optimizer), "_kernel_args", None) is None:  # not a fastamp.optim optimizer
        return "foreign_step"
    # what the optimizers' _check_traceable refuses at trace time (there a hard error even
    # without fullgraph), checked first so that the scaler's call runs eagerly instead
    if any(isinstance(b, Tensor) for group in optimizer.param_groups for b in group.get("betas", ())):
        return "tensor_betas"
    # (see FusedOptimizer._check_traceable)
    if any(cycles_momentum(group) for group in optimizer.param_groups):
        return "cycled_momentum"
    if scaler._track_stats:
        return "stats"
    if scaler._process_group is not None:
        return "process_group"
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, Tensor):
                return "grads"
            g = p.grad
            if g is None:
                continue
            if type(g) is not Tensor or g.layout != torch.strided or g.dtype not in _KERNEL_DTYPES:
                return "grads"
            if not g.is_contiguous():
                return "grads"
    return None


def _traced_check(scaler, optimizer, inv_scale: Tensor, write_back: bool, compute_sumsq: bool):
    """The check pass as the graph holds it: one ``unscale_check_`` call per device.

    Grads are gathered in the optimizer's order and grouped by device, as the eager pass
    groups them; ``found_inf`` and ``inv_scale`` are per-device copies of the scale's, as
    eager's. Returns ``found_inf`` and the sum of squares, per device.
    """
    per_device: dict[torch.device, list[Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                per_device.setdefault(p.grad.device, []).append(p.grad)
    found: dict[torch.device, Tensor] = {}
    sumsq: dict[torch.device, Tensor] = {}
    for device, grads in per_device.items():
        fi = torch.zeros((), dtype=torch.float32, device=device)
        inv = inv_scale if inv_scale.device == device else inv_scale.to(device)
        backend = _traced_backend("unscale_check_", str(device), scaler._backend)
        sumsq[device] = backends.kernel("unscale_check_", backend)(grads, fi, inv, write_back, compute_sumsq)
        found[device] = fi
    return found, sumsq


def _traced_unscale_(scaler, eager, optimizer) -> None:
    """:meth:`Scaler.unscale_` in a graph (amp-aware optimizers)."""
    if not scaler._enabled:
        return None
    why = _eager_reason(scaler, optimizer)
    if why is not None:
        return eager(why)(scaler, optimizer)
    scale, _ = scaler._check_scale_growth_tracker("unscale_")
    optimizer_state = scaler._per_optimizer_states[id(optimizer)]
    scaler._check_can_unscale(optimizer_state)
    found, _ = _traced_check(scaler, optimizer, _inv_scale(scale), True, False)
    optimizer_state["found_inf_per_device"] = found
    optimizer_state["stage"] = OptState.UNSCALED
    return None


def _traced_clip_grad_norm_(
    scaler, eager, optimizer, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> Tensor:
    """:meth:`Scaler.clip_grad_norm_` in a graph (amp-aware optimizers, the 2-norm): nothing written but the flags."""
    if not scaler._enabled:
        return eager(None)(scaler, optimizer, max_norm, norm_type, error_if_nonfinite)
    why = _eager_reason(scaler, optimizer)
    if why is None and (float(norm_type) != 2.0 or error_if_nonfinite):
        why = "norm"
    if why is not None:
        return eager(why)(scaler, optimizer, max_norm, norm_type, error_if_nonfinite)
    max_norm = float(max_norm)
    if not max_norm >= 0:
        _compile_errors.fail(ValueError, f"fastamp.Scaler.clip_grad_norm_: max_norm must be >= 0, got {max_norm}")
    scale, _ = scaler._check_scale_growth_tracker("clip_grad_norm_")
    optimizer_state = scaler._per_optimizer_states[id(optimizer)]
    if optimizer_state["stage"] is OptState.STEPPED:
        _compile_errors.fail(RuntimeError, "clip_grad_norm_() is being called after step().")
    if scaler._clip_grad_scale(optimizer, optimizer_state) is not None:
        _compile_errors.fail(
            RuntimeError, "clip_grad_norm_() has already been called on this optimizer since the last update()."
        )
    ready = optimizer_state["stage"] is OptState.READY
    inv_scale = _inv_scale(scale) if ready else torch.ones((), dtype=torch.float32, device=scale.device)
    found, sumsq = _traced_check(scaler, optimizer, inv_scale, False, True)
    if ready:
        optimizer_state["found_inf_per_device"] = found
    if not sumsq:
        return torch.zeros((), dtype=torch.float32, device=scale.device)
    total_norm = _total_norm(sumsq)
    grad_scale = _grad_scale_after_clip(scale if ready else None, _clip_coef(max_norm, total_norm))
    scaler._per_optimizer_clip_scales[id(optimizer)] = (optimizer_state, grad_scale)
    optimizer_state["stage"] = OptState.UNSCALED
    return total_norm


def _traced_check_inf_per_device(scaler, eager, optimizer) -> dict[torch.device, Tensor]:
    """:meth:`Scaler._check_inf_per_device` in a graph: the check pass, grads read, not written."""
    why = _eager_reason(scaler, optimizer)
    if why is not None:
        return eager(why)(scaler, optimizer)
    scale, _ = scaler._check_scale_growth_tracker("_check_inf_per_device")
    found, _ = _traced_check(scaler, optimizer, _inv_scale(scale), False, False)
    scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
    return found


def _traced_step(scaler, eager, optimizer, *args, **kwargs):
    """:meth:`Scaler.step` in a graph (amp-aware optimizers): the optimizer skips on the device."""
    if not scaler._enabled:
        return optimizer.step(*args, **kwargs)
    why = _eager_reason(scaler, optimizer)
    if why is not None:
        return eager(why)(scaler, optimizer, *args, **kwargs)
    if "closure" in kwargs:
        _compile_errors.fail(RuntimeError, "Closure use is not currently supported if GradScaler is enabled.")
    scale, _ = scaler._check_scale_growth_tracker("step")
    optimizer_state = scaler._per_optimizer_states[id(optimizer)]
    if optimizer_state["stage"] is OptState.STEPPED:
        _compile_errors.fail(RuntimeError, "step() has already been called since the last update().")
    if optimizer_state["stage"] is OptState.READY:
        scaler._check_inf_per_device(optimizer)  # torch's step calls the hook (traced below unless overridden)
    found_inf = _fold_found_inf(optimizer_state["found_inf_per_device"], scale)
    clip_scale = scaler._clip_grad_scale(optimizer, optimizer_state)
    user_scale = getattr(optimizer, "grad_scale", None)
    grad_scale = _step_grad_scale(scale, clip_scale, user_scale, optimizer_state["stage"] is OptState.UNSCALED)
    # eager's _step_with_attributes without its try/finally: a failing step fails the trace,
    # before anything ran
    optimizer.grad_scale = grad_scale
    optimizer.found_inf = found_inf
    retval = optimizer.step(*args, **kwargs)
    optimizer_state["stage"] = OptState.STEPPED
    for k in ("grad_scale", "found_inf"):
        if hasattr(optimizer, k):
            delattr(optimizer, k)
    return retval


def _traced_update(scaler, eager, new_scale=None) -> None:
    """:meth:`Scaler.update` in a graph: ``update_scale_`` and the skip counters on the device."""
    if not scaler._enabled:
        return None
    if new_scale is not None:
        return eager("new_scale")(scaler, new_scale)
    scale, growth_tracker = scaler._check_scale_growth_tracker("update")
    found_infs = [
        found_inf if found_inf.device == scale.device else found_inf.to(scale.device)
        for state in scaler._per_optimizer_states.values()
        for found_inf in state["found_inf_per_device"].values()
    ]
    if len(found_infs) == 0:
        _compile_errors.fail(AssertionError, "No inf checks were recorded prior to update.")
    backend = _traced_backend("update_scale_", str(scale.device), scaler._backend)
    backends.kernel("update_scale_", backend)(
        scale,
        growth_tracker,
        scaler._hysteresis_tracker,
        _combined_found_inf(found_infs),
        float(scaler._growth_factor),
        float(scaler._backoff_factor),
        int(scaler._growth_interval),
        int(scaler._hysteresis),
        0.0 if scaler._min_scale is None else float(scaler._min_scale),
        math.inf if scaler._max_scale is None else float(scaler._max_scale),
    )
    skipped = _any_found(found_infs)
    scaler._last_step_skipped.copy_(skipped)
    scaler._skipped_steps.add_(skipped.to(torch.int64))
    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
    scaler._per_optimizer_clip_scales = {}
    return None
