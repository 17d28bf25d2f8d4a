"""``fastamp.Scaler``: a drop-in for ``torch.amp.GradScaler`` with its logic in fused kernels.

The contract is torch's (``torch/amp/grad_scaler.py`` as of 2.13): the same constructor
order and defaults (except ``device=None``), the same per-optimizer state machine and error
messages, the same ``update()`` trajectory bit for bit with default options, the same
``state_dict`` keys, and the private hooks other libraries call. Where fastamp differs it
is on purpose and listed in docs/scaler.md (the long form of the class docstring).

This module is that contract and its state machine. The work, stage by stage of one
iteration (scale, check pass, device scalars, step, update), lives beside it in this
package (see fastamp/scaler/__init__.py for the map): grad_check, device_scalars, dist,
checks, compiled, and the extras over torch's class mixed into it, clip (clip_grad_norm_)
and diagnostics (the skip counters, watch and grad_stats).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections import abc, defaultdict
from typing import Any, Union

import torch
from torch import Tensor

# torch's own enum, so that code inspecting ``scaler._per_optimizer_states[id(opt)]["stage"]``
# (Lightning, Accelerate, torch's optimizers) compares against the object it imports.
from torch.amp.grad_scaler import OptState

from fastamp import _compile_errors, health
from fastamp.ops import backends, functional
from fastamp.scaler.checks import (
    _backoff_factor,
    _check_new_scale,
    _check_scale_settings,
    _check_state_dict,
    _clamp,
    _growth_factor,
    _growth_interval,
    _hysteresis,
    _refuse_released,
    _scale_bounds,
)
from fastamp.scaler.clip import _ClipMixin
from fastamp.scaler.compiled import (
    _eager_ready,
    _eager_under_compile,
    _maybe_prepare_eager_entries,
    _prepare_eager_entries,
    _refresh_per_optimizer_state,
    _traced_check_inf_per_device,
    _traced_step,
    _traced_unscale_,
    _traced_update,
    _without_entry,
)
from fastamp.scaler.device_scalars import (
    _any_found,
    _combined_found_inf,
    _fold_found_inf,
    _inv_scale,
    _new_found_inf,
    _PerDevice,
    _step_grad_scale,
)
from fastamp.scaler.diagnostics import _DiagnosticsMixin
from fastamp.scaler.dist import _all_reduce_flags, _check_process_group
from fastamp.scaler.grad_check import _check_grads, _grads_by_device

__all__ = ["OptState", "Scaler"]


_MISSING = object()
# the check pass of torch's _check_inf_per_device: grads read, not written
_CHECK_INF = {"allow_fp16": True, "write_back": False, "compute_sumsq": False, "stats": True}
_SCALE_NONE_FIX = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."


class Scaler(_ClipMixin, _DiagnosticsMixin, torch.amp.GradScaler):
    """Dynamic loss scaling for mixed-precision training; a drop-in for ``torch.amp.GradScaler``.

    A subclass of ``torch.amp.GradScaler`` (``isinstance`` checks in libraries pass) that
    overrides every one of its methods and keeps torch's per-optimizer state
    (``_per_optimizer_states[id(opt)]``: ``"stage"``, a ``torch.amp.grad_scaler.OptState``,
    and ``"found_inf_per_device"``). Replace ``torch.amp.GradScaler("cuda")`` with
    ``fastamp.Scaler("cuda")`` (or just ``fastamp.Scaler()``); every call of the usual loop
    works unchanged::

        scaler = fastamp.Scaler()
        for x, y in data:
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.clip_grad_norm_(opt, 1.0)   # optional: fused unscale + check + norm + clip
            scaler.step(opt)
            scaler.update()

    Args:
        device: ``None`` (default) takes the device of the first tensor passed to
            :meth:`scale`. ``"cuda"`` on a machine without CUDA warns and disables the
            scaler, as torch does.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as torch, but
            checked: the scale and factors finite, > 0 and representable in fp32,
            ``growth_factor > 1``, ``backoff_factor < 1``, ``growth_interval`` an int >= 0
            (0: never grow). A refused value raises before anything is changed.
        hysteresis: consecutive overflow steps that back the scale off once (1 = torch's behaviour).
        min_scale, max_scale: optional bounds on the scale, from construction on.
        backend: force a kernel backend (``"native"``, ``"triton"``, ``"torch"``); default AUTO.
        track_stats: per-tensor gradient health statistics in the check pass, read by
            :meth:`grad_stats`. ``False`` (default): the stats op is never called.
        process_group: a ``torch.distributed`` process group over which every ``found_inf``
            is all-reduced (no host sync), so every rank skips the same steps; every rank must
            then call :meth:`unscale_` / :meth:`clip_grad_norm_` / :meth:`step` in the same order.
        sharded: ``True`` when each rank holds a shard of the grads (ZeRO / FSDP): the clip
            norm is summed over ``process_group`` too. Leave ``False`` for DDP.

    No host sync in :meth:`scale`, :meth:`unscale_`, :meth:`clip_grad_norm_`, :meth:`update`,
    nor in :meth:`step` with amp-aware optimizers; :meth:`step` with an ordinary optimizer reads
    ``found_inf`` once per device, as torch. The full rules of each argument, the pitfall
    guards, every deliberate difference from torch and ``torch.compile``: docs/scaler.md.
    """

    def __init__(
        self,
        device: Union[str, torch.device] | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        backend: str | None = None,
        track_stats: bool = False,
        process_group: Any | None = None,
        sharded: bool = False,
    ) -> None:
        # torch.amp.GradScaler.__init__ is deliberately not called: it would fix the device
        # type now ("cuda" by default); every attribute it sets is set here with its meaning.
        self._device: str | None = torch.device(device).type if device is not None else None
        self._enabled = enabled
        if self._device == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn("fastamp.Scaler is enabled, but CUDA is not available.  Disabling.", stacklevel=2)
            self._enabled = False
        if not _eager_ready[0]:
            # the twins and the traced path's constants, ready before any compiled call meets
            # this scaler (imports torch._dynamo, as any torch.optim optimizer does)
            _prepare_eager_entries()
        if not self._enabled:
            # torch's disabled scaler keeps none of the settings and its public methods do nothing;
            # the check pass's own state is kept so that torch's private hook _unscale_grads_
            # (a pure function of its arguments in torch) works as it does there
            self._backend = backend
            self._init_diagnostics(track_stats)
            return
        if growth_factor <= 1.0:
            raise AssertionError("The growth factor must be > 1.0.")
        if backoff_factor >= 1.0:
            raise AssertionError("The backoff factor must be < 1.0.")
        where = "fastamp.Scaler"
        init_scale, growth_factor, backoff_factor, growth_interval = _check_scale_settings(
            where, "init_scale", init_scale, growth_factor, backoff_factor, growth_interval
        )
        hysteresis = _hysteresis(where, hysteresis)
        min_scale, max_scale = _scale_bounds(where, min_scale, max_scale)
        if backend is not None:
            backends._check_name(backend)
        self._init_scale = _clamp(init_scale, min_scale, max_scale)
        self._scale: Tensor | None = None
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._init_growth_tracker = 0
        self._growth_tracker: Tensor | None = None
        self._hysteresis = hysteresis
        self._init_hysteresis_tracker = hysteresis
        self._hysteresis_tracker: Tensor | None = None
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._backend = backend
        self._process_group = _check_process_group(process_group, sharded)
        self._sharded = sharded
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_refresh_per_optimizer_state)
        # id(optimizer) -> (its per-optimizer state dict, grad_scale): set by a fused clip on a
        # grads-untouched path; step() hands it to an amp-aware optimizer as its grad_scale
        # (scale / clip_coef, on device). Valid only while that state dict is the current one.
        self._per_optimizer_clip_scales: dict[int, tuple[dict[str, Any], Tensor]] = {}
        # set by fastamp.release's h.backward after the update() it makes, cleared by every other one
        self._updated_by_release = False
        self._init_diagnostics(track_stats)

    # ------------------------------------------------------------------ lazy state

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[Tensor, Tensor]:
        # called by the traced twins too (fastamp/scaler/compiled.py): fail() raises as eager there
        if self._scale is None:
            _compile_errors.fail(AssertionError, f"Attempted {funcname} but _scale is None.  " + _SCALE_NONE_FIX)
        if self._growth_tracker is None:
            _compile_errors.fail(
                AssertionError, f"Attempted {funcname} but _growth_tracker is None.  " + _SCALE_NONE_FIX
            )
        return self._scale, self._growth_tracker

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        if self._growth_tracker is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=dev)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=dev)
        self._skipped_steps = torch.full((), self._init_skipped_steps, dtype=torch.int64, device=dev)
        self._last_step_skipped = torch.full((), self._init_last_step_skipped, dtype=torch.bool, device=dev)
        if self._device is None:
            self._device = dev.type

    # ------------------------------------------------------------------ scale

    def scale(self, outputs):
        """Multiply a tensor or a (nested) list/tuple of tensors by the scale factor.

        Out of place, with torch's type promotion (a 0-dim fp16 loss becomes fp32). The
        scale is created on the device of the first tensor seen. No host sync.
        """
        if not self._enabled:
            return outputs
        if not _eager_ready[0] and not torch.compiler.is_compiling():
            # the usual place to notice that torch._dynamo got imported (torch.compile)
            # before a compiled function meets an entry point: see _eager_under_compile
            _maybe_prepare_eager_entries()
        if isinstance(outputs, Tensor):
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            return outputs * self._scale.to(device=outputs.device, non_blocking=True)

        per_device: list[_PerDevice | None] = [None]

        def apply_scale(val):
            if isinstance(val, Tensor):
                if per_device[0] is None:
                    if self._scale is None:
                        self._lazy_init_scale_growth_tracker(val.device)
                    per_device[0] = _PerDevice(self._scale)
                return val * per_device[0].get(val.device)
            if isinstance(val, abc.Iterable):
                iterable = map(apply_scale, val)
                if isinstance(val, (list, tuple)):
                    return type(val)(iterable)
                return iterable
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        if isinstance(outputs, (str, bytes)):
            # iterating a str yields strs forever: reject it now, not when the map is consumed
            raise ValueError(f"outputs must be a Tensor or an iterable of Tensors, got {type(outputs).__name__}")

        return apply_scale(outputs)

    # ------------------------------------------------------------------ the fused check

    def _grads_by_device(self, optimizer, allow_fp16: bool, owners=None) -> dict[torch.device, list[Tensor]]:
        # the per-grad path of the check pass gathers through here (see fastamp.scaler.grad_check)
        return _grads_by_device(optimizer, allow_fp16, owners)

    @_eager_under_compile
    def _unscale_grads_(self, optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool):
        """torch's hook: unscale every grad of ``optimizer`` in place; per-device found_inf."""
        return _check_grads(
            self,
            optimizer,
            inv_scale,
            found_inf,
            allow_fp16=allow_fp16,
            write_back=True,
            compute_sumsq=False,
            stats=True,
        )[0]

    @_eager_under_compile(traced=_traced_unscale_)
    def unscale_(self, optimizer) -> None:
        """Divide ``optimizer``'s grads by the scale in place (one fused pass), recording overflow.

        Call it before clipping or inspecting grads; at most once per optimizer per
        iteration, before :meth:`step`. Grads are unscaled even when they hold inf/NaN.
        fp16 grads are accepted. No host sync.
        """
        if not self._enabled:
            return
        _refuse_released(optimizer, "unscale_")
        self._check_scale_growth_tracker("unscale_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        self._check_can_unscale(optimizer_state)
        inv_scale = _inv_scale(self._scale)
        optimizer_state["found_inf_per_device"] = _all_reduce_flags(
            self._process_group,
            self._scale,
            _without_entry(self._unscale_grads_)(optimizer, inv_scale, _new_found_inf(self._scale), True),
        )[0]
        optimizer_state["stage"] = OptState.UNSCALED

    @staticmethod
    def _check_can_unscale(optimizer_state) -> None:
        if optimizer_state["stage"] is OptState.UNSCALED:
            _compile_errors.fail(
                RuntimeError, "unscale_() has already been called on this optimizer since the last update()."
            )
        if optimizer_state["stage"] is OptState.STEPPED:
            _compile_errors.fail(RuntimeError, "unscale_() is being called after step().")

    @_eager_under_compile(traced=_traced_check_inf_per_device)
    def _check_inf_per_device(self, optimizer) -> dict[torch.device, Tensor]:
        """Check (without touching) ``optimizer``'s grads; records and returns per-device found_inf.

        Unlike torch (which checks with ``inv_scale=1``), the check multiplies by the real
        inverse scale in registers, so overflow created by unscaling is caught too.
        """
        self._check_scale_growth_tracker("_check_inf_per_device")
        found, _ = _check_grads(self, optimizer, _inv_scale(self._scale), _new_found_inf(self._scale), **_CHECK_INF)
        found = _all_reduce_flags(self._process_group, self._scale, found)[0]
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return found

    def _found_inf_per_device(self, optimizer) -> dict[torch.device, Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    # ------------------------------------------------------------------ step / update

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        retval = None
        if not sum(v.item() for v in optimizer_state["found_inf_per_device"].values()):
            with health._ScalerStep():
                retval = optimizer.step(*args, **kwargs)
        return retval

    @_eager_under_compile(traced=_traced_step)
    def step(self, optimizer, *args, **kwargs):
        """Call ``optimizer.step()`` unless this iteration's grads overflowed.

        Ordinary optimizers: unscale (if not done), then skip the step on overflow (one
        host read per device, as torch). Amp-aware optimizers (``_step_supports_amp_scaling``):
        hand them ``grad_scale`` and ``found_inf`` as attributes and let them skip on the
        device: no host sync. Returns what ``optimizer.step`` returns (None when skipped).
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        _refuse_released(optimizer, "step")
        self._check_scale_growth_tracker("step")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            kwargs_ = kwargs
            has_grad_scaler_kwarg = "grad_scaler" in inspect.signature(optimizer.step).parameters
            if has_grad_scaler_kwarg:
                warnings.warn(
                    "GradScaler is going to stop passing itself as a keyword argument to the passed "
                    "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                    "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
                    FutureWarning,
                    stacklevel=2,
                )
                kwargs_.update({"grad_scaler": self})
            else:
                scale = self._scale
                if optimizer_state["stage"] is OptState.READY:
                    hook = self._check_inf_per_device
                    if getattr(hook, "__func__", None) is not Scaler._check_inf_per_device:
                        hook(optimizer)  # overridden: torch's step calls the hook
                    else:  # the hook's own pass, without its eager entry: step runs eagerly already
                        found, _ = _check_grads(self, optimizer, _inv_scale(scale), _new_found_inf(scale), **_CHECK_INF)
                        found = _all_reduce_flags(self._process_group, scale, found)[0]
                        optimizer_state["found_inf_per_device"] = found
                found_inf = _fold_found_inf(optimizer_state["found_inf_per_device"], scale)
                user_scale = getattr(optimizer, "grad_scale", None)
                clip_scale = self._clip_grad_scale(optimizer, optimizer_state)
                grad_scale = _step_grad_scale(
                    scale, clip_scale, user_scale, optimizer_state["stage"] is OptState.UNSCALED
                )
                return self._step_with_attributes(optimizer, optimizer_state, grad_scale, found_inf, args, kwargs_)
            retval = optimizer.step(*args, **kwargs_)
            optimizer_state["stage"] = OptState.STEPPED
            return retval

        if optimizer_state["stage"] is OptState.READY:
            _without_entry(self.unscale_)(optimizer)
        if len(optimizer_state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        retval = self._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        optimizer_state["stage"] = OptState.STEPPED
        return retval

    @staticmethod
    def _step_with_attributes(optimizer, optimizer_state, grad_scale, found_inf, args, kwargs):
        """torch's contract with amp-aware optimizers: ``grad_scale``/``found_inf`` set for one step.

        On success both are deleted, as torch does (a ``grad_scale`` the user had set is
        consumed). If anything raises, the optimizer's attributes are put back as they were:
        left behind, they would make a later plain ``optimizer.step()`` divide by a stale
        scale or skip silently.
        """
        saved = {k: getattr(optimizer, k, _MISSING) for k in ("grad_scale", "found_inf")}
        done = False
        try:
            optimizer.grad_scale = grad_scale
            optimizer.found_inf = found_inf
            retval = optimizer.step(*args, **kwargs)
            optimizer_state["stage"] = OptState.STEPPED
            done = True
        finally:
            for k, v in saved.items():
                if done or v is _MISSING:
                    try:
                        delattr(optimizer, k)
                    except AttributeError:  # the optimizer's step removed it itself
                        pass
                else:
                    setattr(optimizer, k, v)
        return retval

    @_eager_under_compile(traced=_traced_update)
    def update(self, new_scale: Union[float, Tensor] | None = None) -> None:
        """Update the scale for the next iteration (on device, no host sync).

        Without ``new_scale``: backoff if any optimizer recorded an overflow this
        iteration, else count towards growth (torch's rule, plus hysteresis and bounds
        when configured); also updates :attr:`skipped_steps` and :attr:`last_step_skipped`.
        With ``new_scale`` (a real number, numpy scalars included, or a 1-element tensor on
        the scaler's device type): set the scale to it, clamped into ``[min_scale,
        max_scale]``; the growth tracker is left alone, as in torch. ``new_scale`` must be
        finite, > 0 and representable in fp32, else nothing changes and ValueError is raised;
        a tensor ``new_scale`` is read once on the host for that check (one sync).
        """
        if not self._enabled:
            return
        _scale, _growth_tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            value = _check_new_scale(new_scale, self._device)
        found_infs = [
            found_inf.to(device=_scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        if new_scale is not None:
            # fill_ from the host value read above: the same fp32 rounding as torch's copy_
            self._scale.fill_(_clamp(value, self._min_scale, self._max_scale))
        else:
            if len(found_infs) == 0:
                hint = ""
                if getattr(self, "_updated_by_release", False) and not self._per_optimizer_states:
                    hint = (
                        " This scaler's last update() was made by h.backward of fastamp.release, which calls it "
                        "itself: drop this scaler.update() from the loop."
                    )
                raise AssertionError("No inf checks were recorded prior to update." + hint)
            functional.update_scale_(
                _scale,
                _growth_tracker,
                self._hysteresis_tracker,
                _combined_found_inf(found_infs),
                self._growth_factor,
                self._backoff_factor,
                self._growth_interval,
                self._hysteresis,
                0.0 if self._min_scale is None else self._min_scale,
                math.inf if self._max_scale is None else self._max_scale,
                backend=self._backend,
            )
        if found_infs:
            skipped = _any_found(found_infs)
            self._last_step_skipped.copy_(skipped)
            self._skipped_steps.add_(skipped.to(torch.int64))
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._per_optimizer_clip_scales = {}
        self._updated_by_release = False
        if found_infs:
            self._health.on_update(self)

    # ------------------------------------------------------------------ getters / setters

    def _get_scale_async(self) -> Tensor | None:
        return self._scale

    def get_scale(self) -> float:
        """The current scale as a Python float (syncs). 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else self._scale.item()

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (finite, > 1, representable in fp32; else ValueError, nothing changed)."""
        self._growth_factor = _growth_factor("fastamp.Scaler.set_growth_factor", new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1), representable in fp32; else ValueError, nothing changed)."""
        self._backoff_factor = _backoff_factor("fastamp.Scaler.set_backoff_factor", new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (an int >= 0, numpy ints too; 0: never grow). As in torch, a
        tracker already past a lowered interval never reaches it again until the next backoff."""
        self._growth_interval = _growth_interval("fastamp.Scaler.set_growth_interval", new_interval)

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._growth_tracker is None else self._growth_tracker.item()

    def _get_hysteresis_tracker(self) -> int:
        if self._hysteresis_tracker is None:
            return self._init_hysteresis_tracker
        return int(self._hysteresis_tracker.item())

    def is_enabled(self) -> bool:
        return self._enabled

    # ------------------------------------------------------------------ checkpoints

    @_eager_under_compile
    def state_dict(self) -> dict[str, Any]:
        """torch's five keys with torch's types, plus fastamp's extra keys (syncs).

        A ``torch.amp.GradScaler`` loads it (it reads only its own keys); every value is a
        Python scalar or None, so it loads with ``torch.load(weights_only=True)``. Empty when
        disabled.
        """
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
            "hysteresis": self._hysteresis,
            "_hysteresis_tracker": self._get_hysteresis_tracker(),
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "skipped_steps": int(self.skipped_steps),
            "last_step_skipped": self.last_step_skipped,
        }

    @_eager_under_compile
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of a ``fastamp.Scaler`` or a ``torch.amp.GradScaler``.

        Extra fastamp keys are optional (a torch state dict leaves hysteresis, bounds and
        counters as configured / at their initial values). Everything is validated as the
        constructor validates it (scale, factors, interval, hysteresis, bounds with
        ``min_scale <= max_scale``; ``_growth_tracker`` an int in [0, 2^31); ``_hysteresis_tracker``
        in [0, hysteresis]; ``skipped_steps`` >= 0; ``last_step_skipped`` a bool) before anything
        is changed. The loaded scale is clamped into the (loaded, else configured) bounds.
        """
        if not self._enabled:
            return
        # everything is checked before anything is assigned (a bad dict leaves the scaler as it was)
        for name, value in _check_state_dict(state_dict, self._hysteresis, self._min_scale, self._max_scale).items():
            setattr(self, name, value)
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(self._init_growth_tracker)
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)
        if self._skipped_steps is not None:
            self._skipped_steps.fill_(self._init_skipped_steps)
        if self._last_step_skipped is not None:
            self._last_step_skipped.fill_(self._init_last_step_skipped)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError(
                    "A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update()."
                )
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_init_hysteresis_tracker"] = self._get_hysteresis_tracker()
            state["_init_skipped_steps"] = int(self.skipped_steps)
            state["_init_last_step_skipped"] = self.last_step_skipped
            for k in ("_scale", "_growth_tracker", "_hysteresis_tracker", "_skipped_steps", "_last_step_skipped"):
                state[k] = None
            state["_per_optimizer_clip_scales"] = {}
        if "_stats" in state:
            # device statistics and weak references do not travel; the names and guards restart
            state["_stats"] = {}
            state["_param_names"] = {}
            state["_health"] = health._Monitor()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
