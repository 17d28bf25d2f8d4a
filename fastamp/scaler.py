"""``fastamp.Scaler``: a drop-in for ``torch.amp.GradScaler`` with its logic in fused kernels.

The contract is torch's (``torch/amp/grad_scaler.py`` as of 2.13): the same constructor
order and defaults (except ``device=None``), the same per-optimizer state machine and error
messages, the same ``update()`` trajectory bit for bit with default options, the same
``state_dict`` keys, and the private hooks other libraries call. Where fastamp differs it
is on purpose and listed in the class docstring.
"""

from __future__ import annotations

import inspect
import math
import operator
import warnings
import weakref
from collections import abc, defaultdict
from enum import Enum
from itertools import repeat
from typing import Any, Union

import torch
from torch import Tensor

from fastamp import backends, functional, health
from fastamp.optim._common import local_of

__all__ = ["OptState", "Scaler"]


class OptState(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _refresh_per_optimizer_state() -> dict[str, Any]:
    # "grad_scale_after_clip": set by a fused clip on a grads-untouched path; step() then
    # hands it to an amp-aware optimizer as its grad_scale (scale / clip_coef, on device).
    return {"stage": OptState.READY, "found_inf_per_device": {}, "grad_scale_after_clip": None}


class _PerDevice:
    """Lazily copies one tensor to each device it is asked for (non-blocking)."""

    def __init__(self, master: Tensor) -> None:
        self.master = master
        self.copies: dict[torch.device, Tensor] = {}

    def get(self, device: torch.device) -> Tensor:
        t = self.copies.get(device)
        if t is None:
            t = self.master.to(device=device, non_blocking=True, copy=True)
            self.copies[device] = t
        return t


_SCALE_NONE_FIX = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."


class Scaler:
    """Dynamic loss scaling for mixed-precision training; a drop-in for ``torch.amp.GradScaler``.

    Replace ``torch.amp.GradScaler("cuda")`` with ``fastamp.Scaler("cuda")`` (or just
    ``fastamp.Scaler()``); every call of the usual loop works unchanged::

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
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as torch.
        hysteresis: number of consecutive overflow steps that back the scale off once
            (1 = torch's behaviour: every overflow backs off). Overflow steps are always
            skipped; the counter refills on every clean step.
        min_scale, max_scale: optional bounds on the scale after backoff / growth.
        backend: force a kernel backend (``"native"``, ``"triton"``, ``"torch"``); default AUTO.
        track_stats: compute per-tensor gradient health statistics (non-finite, zero and
            fp16-underflow counts, max |g|) inside the existing check pass, kept on the device
            until :meth:`grad_stats` reads them. ``False`` (default): the stats op is never called.
        process_group: a ``torch.distributed`` process group (e.g. ``dist.group.WORLD``) for
            data-parallel or sharded training; ``None`` (default) = no communication. Every
            recorded ``found_inf`` is all-reduced over the group on the scale's device (one
            small collective, no host sync) before any skip decision or scale update, so
            every rank skips the same steps and keeps the same scale, also for amp-aware
            optimizers (where torch's ``ShardedGradScaler`` forgets to reduce). Every rank
            must then call :meth:`unscale_` / :meth:`clip_grad_norm_` / :meth:`step` in the
            same order, even a rank without grads. A scaler holding a group cannot be pickled
            or deep-copied (a ProcessGroup cannot be); checkpoint it with :meth:`state_dict`.
        sharded: ``True`` when each rank holds a different shard of the grads (ZeRO / FSDP):
            :meth:`clip_grad_norm_` then also sums the squared norm over ``process_group``
            (same collective), so the clip uses the global norm. Leave ``False`` for DDP,
            whose grads are already replicated. Needs ``process_group``.

    Pitfall guards (:class:`fastamp.health.AmpPitfallWarning`, each at most once per scaler):
    the loss scale collapsing below 1; fp16 grads that underflowed (needs ``track_stats``);
    bf16 grads that never overflowed in the first updates (the scaler is not needed). They
    read a few device scalars at health probes (the first update, then every 32), copied
    without blocking on CUDA, so no probe adds a sync.

    Differences from ``torch.amp.GradScaler`` (all deliberate):
      * fp16 gradients are accepted by :meth:`unscale_` (torch raises "Attempting to unscale
        FP16 gradients."); an unscaled value that overflows fp16 is flagged.
      * Overflow created by unscaling itself (a scale below 1, or 0) raises ``found_inf``;
        torch misses it and lets NaN reach the params.
      * With several devices, the ``found_inf`` handed to amp-aware optimizers is 0 or 1
        (torch sums the per-device flags, and its fused kernels skip only on exactly 1).
      * Extras: :meth:`clip_grad_norm_`, :attr:`last_step_skipped`, :attr:`skipped_steps`,
        extra ``state_dict`` keys (ignored by torch's ``load_state_dict``).

    Host syncs: none in :meth:`scale`, :meth:`unscale_`, :meth:`update`, :meth:`clip_grad_norm_`
    and :meth:`step` with amp-aware optimizers (``_step_supports_amp_scaling``, e.g.
    ``fastamp.optim.AdamW`` or ``torch.optim.AdamW(fused=True)``). :meth:`step` with an
    ordinary optimizer reads ``found_inf`` once per device (Python must decide whether to call
    ``optimizer.step()``), exactly as torch. ``get_scale()``, ``state_dict()`` and reading
    ``last_step_skipped`` as a bool sync.
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
        self._device: str | None = torch.device(device).type if device is not None else None
        self._enabled = enabled
        if self._device == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn("torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.", stacklevel=2)
            self._enabled = False
        if not self._enabled:
            return
        if growth_factor <= 1.0:
            raise AssertionError("The growth factor must be > 1.0.")
        if backoff_factor >= 1.0:
            raise AssertionError("The backoff factor must be < 1.0.")
        _check_scale_settings("fastamp.Scaler", init_scale, growth_factor, backoff_factor, growth_interval)
        if isinstance(hysteresis, bool) or not isinstance(hysteresis, int) or hysteresis < 1:
            raise ValueError(f"fastamp.Scaler: hysteresis must be an int >= 1, got {hysteresis!r}")
        for name, v in (("min_scale", min_scale), ("max_scale", max_scale)):
            if v is not None and not (isinstance(v, (int, float)) and v > 0 and not math.isnan(v)):
                raise ValueError(f"fastamp.Scaler: {name} must be a positive number or None, got {v!r}")
        if min_scale is not None and max_scale is not None and min_scale > max_scale:
            raise ValueError(f"fastamp.Scaler: min_scale ({min_scale}) must be <= max_scale ({max_scale})")
        if backend is not None:
            backends._check_name(backend)
        self._init_scale = init_scale
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
        self._init_skipped_steps = 0
        self._skipped_steps: Tensor | None = None
        self._init_last_step_skipped = False
        self._last_step_skipped: Tensor | None = None
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_refresh_per_optimizer_state)
        self._track_stats = bool(track_stats)
        # (id(optimizer), device) -> the last check's statistics buffers for it
        self._stats: dict[tuple[int, torch.device], health._StatsRows] = {}
        self._param_names: dict[int, tuple[Any, str]] = {}
        self._health = health._Monitor()
        self._last_stats_update = 0

    # ------------------------------------------------------------------ lazy state

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[Tensor, Tensor]:
        if self._scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + _SCALE_NONE_FIX)
        if self._growth_tracker is None:
            raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + _SCALE_NONE_FIX)
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
        per_device: dict[torch.device, list[Tensor]] = defaultdict(list)
        position = -1
        for group in optimizer.param_groups:
            for param in group["params"]:
                position += 1
                if not isinstance(param, Tensor):
                    raise AssertionError(f"expected param to be torch.Tensor, got {type(param).__name__}")
                grad = param.grad
                if grad is None:
                    continue
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                if grad.is_sparse and grad.dtype is torch.float16:
                    # duplicate indices are summed by coalescing, which can itself overflow:
                    # check what the optimizer will really see (as torch does).
                    grad = param.grad = grad.coalesce()
                # FSDP2 grads are DTensors: each rank checks (and unscales in place) its own shard;
                # process_group then makes the flag and, with sharded=True, the norm global.
                if type(grad) is not Tensor:
                    grad = local_of(grad)
                device = grad.device
                per_device[device].append(grad)
                if owners is not None:
                    owners[device].append((param, position))
        return per_device

    def _check_grads(
        self,
        optimizer,
        inv_scale: Tensor,
        found_inf: Tensor,
        *,
        allow_fp16: bool,
        write_back: bool,
        compute_sumsq: bool,
        stats: bool = False,
    ) -> tuple[dict[torch.device, Tensor], dict[torch.device, Tensor]]:
        """One fused pass per device: non-finite check, optional unscale, optional sum of squares.

        ``stats`` (with ``track_stats``): the same pass also writes the per-tensor health
        statistics into this optimizer's buffers for that device.
        """
        inv_rep, found_rep = _PerDevice(inv_scale), _PerDevice(found_inf)
        stats = stats and self._track_stats
        with torch.no_grad():
            plain = self._check_plain(
                optimizer,
                inv_rep,
                found_rep,
                allow_fp16=allow_fp16,
                write_back=write_back,
                compute_sumsq=compute_sumsq,
                stats=stats,
            )
            if plain is not None:
                return found_rep.copies, plain
        sumsq: dict[torch.device, Tensor] = {}
        owners: dict[torch.device, list] | None = defaultdict(list) if stats else None
        with torch.no_grad():
            for device, grads in self._grads_by_device(optimizer, allow_fp16, owners).items():
                if self._health.wants_dtypes():
                    self._health.note_grads(grads)
                counts = absmax = None
                if stats:
                    own = owners[device]
                    counts, absmax = self._stats_buffers(
                        optimizer,
                        device,
                        [p for p, _ in own],
                        [i for _, i in own],
                        [g.dtype for g in grads],
                        [tuple((g._values() if g.is_sparse else g).shape) for g in grads],
                        inv_rep.get(device),
                    )
                sumsq[device] = functional.unscale_check_(
                    grads,
                    found_rep.get(device),
                    inv_rep.get(device),
                    write_back=write_back,
                    compute_sumsq=compute_sumsq,
                    counts=counts,
                    absmax=absmax,
                    backend=self._backend,
                )
        return found_rep.copies, sumsq

    def _check_plain(
        self, optimizer, inv_rep, found_rep, *, allow_fp16: bool, write_back: bool, compute_sumsq: bool, stats: bool
    ) -> dict[torch.device, Tensor] | None:
        """The common case: one native kernel call and no Python work per grad beyond reading it.

        Dense ``torch.Tensor`` grads on one device with the native backend. The kernel checks
        every grad (device, layout, dtype, contiguity) before it touches anything, so grads on
        several devices, sparse, strided or fp64 grads make it refuse and the per-grad path of
        ``_check_grads`` runs instead (which handles them or raises its error). With many
        small tensors that per-grad Python would cost more than the kernel. Returns the sum
        of squares per device, or None for the per-grad path.
        """
        plain = _plain_grads(optimizer, allow_fp16)
        if plain is None:
            return None
        params, positions, grads = plain
        if not grads:
            return {}
        device = grads[0].device
        op = "unscale_check_stats_" if stats else "unscale_check_"
        if backends.resolve(op, device, self._backend) != "native":
            return None
        if self._health.wants_dtypes():
            self._health.note_grads(grads)
        args = [grads, found_rep.get(device), inv_rep.get(device), write_back, compute_sumsq]
        if stats:
            # dense grads have their param's dtype and shape: the rows read them from the params
            args += self._stats_buffers(optimizer, device, params, positions, None, None, inv_rep.get(device))
        try:
            return {device: backends.get_impl(op, "native")(*args)}
        except (RuntimeError, TypeError):
            return None

    def _stats_buffers(
        self, optimizer, device, params, positions, dtypes, shapes, inv_scale: Tensor
    ) -> tuple[Tensor, Tensor]:
        """This optimizer's statistics buffers on ``device`` (reused while the row count is unchanged).

        ``params``: the param of each row; ``positions``, ``dtypes``, ``shapes``: see
        :class:`fastamp.health._StatsRows` (None: derived from the params).
        """
        key = (id(optimizer), device)
        old = self._stats.get(key)
        n = len(params)
        if old is not None and old.counts.shape[0] == n and old.optimizer() is optimizer:
            counts, absmax = old.counts, old.absmax
        else:
            counts = torch.zeros((n, 3), dtype=torch.int64, device=device)
            absmax = torch.zeros((n,), dtype=torch.float32, device=device)
        self._stats[key] = health._StatsRows(
            weakref.ref(optimizer), params, positions, dtypes, shapes, counts, absmax, inv_scale
        )
        self._last_stats_update = self._health.updates
        return counts, absmax

    def _unscale_grads_(self, optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool):
        """torch's hook: unscale every grad of ``optimizer`` in place; per-device found_inf."""
        return self._check_grads(
            optimizer, inv_scale, found_inf, allow_fp16=allow_fp16, write_back=True, compute_sumsq=False, stats=True
        )[0]

    def _all_reduce_flags(
        self, found: dict[torch.device, Tensor], sumsq: Tensor | None = None
    ) -> tuple[dict[torch.device, Tensor], Tensor | None]:
        """All-reduce this rank's overflow flags (and a partial squared norm) over the process group.

        One collective on the scale's device, no host sync: the per-device flags are combined
        into one, summed over the ranks with ``sumsq`` in the same fp64 buffer, and clamped to
        0/1 (so a fused kernel that skips only on exactly 1 still skips). Returns the global
        flag on every device ``found`` had (on the scale's device when it had none) and the
        global ``sumsq`` (fp32). Without a process group, returns its inputs unchanged.
        """
        if self._process_group is None:
            return found, sumsq
        import torch.distributed as dist

        dev = self._scale.device
        wide = torch.float32 if dev.type == "mps" else torch.float64
        flags = [f.to(dev, non_blocking=True).reshape(()) for f in found.values()]
        flag = torch.stack(flags).ne(0).any().to(wide) if flags else torch.zeros((), dtype=wide, device=dev)
        buf = flag.reshape(1) if sumsq is None else torch.stack([flag, sumsq.to(dev).reshape(()).to(wide)])
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self._process_group)
        global_flag = buf[0].clamp(max=1.0).to(torch.float32)
        out = {d: global_flag.to(d, non_blocking=True) for d in found} if found else {dev: global_flag}
        return out, (None if sumsq is None else buf[1].to(torch.float32))

    def _inv_scale(self) -> Tensor:
        # fp64 reciprocal rounded to fp32, as torch ("FP32 division can be imprecise").
        if self._scale.device.type == "mps":
            return self._scale.reciprocal()
        return self._scale.double().reciprocal().float()

    def _new_found_inf(self) -> Tensor:
        return torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)

    def unscale_(self, optimizer) -> None:
        """Divide ``optimizer``'s grads by the scale in place (one fused pass), recording overflow.

        Call it before clipping or inspecting grads; at most once per optimizer per
        iteration, before :meth:`step`. Grads are unscaled even when they hold inf/NaN.
        fp16 grads are accepted. No host sync.
        """
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        self._check_can_unscale(optimizer_state)
        inv_scale = self._inv_scale()
        optimizer_state["found_inf_per_device"] = self._all_reduce_flags(
            self._unscale_grads_(optimizer, inv_scale, self._new_found_inf(), True)
        )[0]
        optimizer_state["stage"] = OptState.UNSCALED

    @staticmethod
    def _check_can_unscale(optimizer_state) -> None:
        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")

    def _check_inf_per_device(self, optimizer) -> dict[torch.device, Tensor]:
        """Check (without touching) ``optimizer``'s grads; records and returns per-device found_inf.

        Unlike torch (which checks with ``inv_scale=1``), the check multiplies by the real
        inverse scale in registers, so overflow created by unscaling is caught too.
        """
        self._check_scale_growth_tracker("_check_inf_per_device")
        found, _ = self._check_grads(
            optimizer,
            self._inv_scale(),
            self._new_found_inf(),
            allow_fp16=True,
            write_back=False,
            compute_sumsq=False,
            stats=True,
        )
        found = self._all_reduce_flags(found)[0]
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return found

    def _found_inf_per_device(self, optimizer) -> dict[torch.device, Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    # ------------------------------------------------------------------ fused clipping

    def clip_grad_norm_(
        self,
        optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> Tensor:
        """Unscale (if not done yet), check and clip ``optimizer``'s grads by their global norm.

        Returns the total norm of the *unscaled* grads, as ``torch.nn.utils.clip_grad_norm_``
        would after ``unscale_``. For the 2-norm the norm is computed in the same read as the
        overflow check: with an amp-aware optimizer the grads are never rewritten (the clip
        coefficient is folded into the ``grad_scale`` handed to its step, on device); with an
        ordinary optimizer unscale and clip are one write pass. Other norms fall back to
        ``unscale_`` + ``torch.nn.utils.clip_grad_norm_``. Counts as this iteration's
        ``unscale_``. No host sync unless ``error_if_nonfinite``.
        """
        max_norm = float(max_norm)
        norm_type = float(norm_type)
        if not max_norm >= 0:
            # a negative max_norm would give a negative clip coefficient (flipping every grad)
            raise ValueError(f"fastamp.Scaler.clip_grad_norm_: max_norm must be >= 0, got {max_norm}")
        if not self._enabled:
            return torch.nn.utils.clip_grad_norm_(
                _params_with_grads(optimizer), max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
            )
        self._check_scale_growth_tracker("clip_grad_norm_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("clip_grad_norm_() is being called after step().")
        if norm_type != 2.0:
            if optimizer_state["stage"] is OptState.READY:
                self.unscale_(optimizer)
            return torch.nn.utils.clip_grad_norm_(
                _params_with_grads(optimizer), max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
            )
        if optimizer_state["grad_scale_after_clip"] is not None:
            raise RuntimeError("clip_grad_norm_() has already been called on this optimizer since the last update().")

        ready = optimizer_state["stage"] is OptState.READY
        amp_aware = getattr(optimizer, "_step_supports_amp_scaling", False)
        # READY: grads still scaled; read them once with the real inverse scale.
        # UNSCALED: the user already unscaled them; read them as they are.
        inv_scale = self._inv_scale() if ready else torch.ones((), dtype=torch.float32, device=self._scale.device)
        found_inf = self._new_found_inf()
        found, sumsq = self._check_grads(
            optimizer, inv_scale, found_inf, allow_fp16=True, write_back=False, compute_sumsq=True, stats=ready
        )
        if self._process_group is not None:
            # Every rank joins the collective, even one without grads. Sharded: the global
            # squared norm is the sum of the ranks' partial sums (same collective as the flag).
            local_sq = torch.zeros((), dtype=torch.float32, device=self._scale.device)
            for part in sumsq.values():
                local_sq = local_sq + part.to(local_sq.device, non_blocking=True)
            found, global_sq = self._all_reduce_flags(found, local_sq if self._sharded else None)
            sumsq = {local_sq.device: global_sq if self._sharded else local_sq}
        if ready:
            optimizer_state["found_inf_per_device"] = found
        if not sumsq:
            return torch.zeros((), dtype=torch.float32, device=self._scale.device)
        devices = list(sumsq)
        total_sq = sumsq[devices[0]]
        for d in devices[1:]:
            total_sq = total_sq + sumsq[d].to(devices[0], non_blocking=True)
        total_norm = total_sq.sqrt()
        if error_if_nonfinite and not bool(torch.isfinite(total_norm)):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
                "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
        clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        if amp_aware:
            # Fold the clip into the optimizer's grad_scale: it divides raw grads by it.
            base = self._scale.to(devices[0]) if ready else torch.ones_like(total_norm)
            optimizer_state["grad_scale_after_clip"] = base / clip_coef
        else:
            mul = (inv_scale.to(devices[0]) * clip_coef).float()
            refound, _ = self._check_grads(
                optimizer, mul, self._new_found_inf(), allow_fp16=True, write_back=True, compute_sumsq=False
            )
            if ready:
                # the write pass can flag more (a value that overflows fp16 when rounded back)
                merged = {d: torch.maximum(f, refound[d]) if d in refound else f for d, f in found.items()}
                optimizer_state["found_inf_per_device"] = self._all_reduce_flags(merged)[0]
        optimizer_state["stage"] = OptState.UNSCALED
        return total_norm

    # ------------------------------------------------------------------ step / update

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        retval = None
        if not sum(v.item() for v in optimizer_state["found_inf_per_device"].values()):
            with health._ScalerStep():
                retval = optimizer.step(*args, **kwargs)
        return retval

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
                if optimizer_state["stage"] is OptState.READY:
                    self._check_inf_per_device(optimizer)
                scale = self._scale
                flags = [
                    t.to(scale.device, non_blocking=True) for t in optimizer_state["found_inf_per_device"].values()
                ]
                found_inf = torch.stack(flags).amax() if flags else torch.zeros_like(scale)
                user_scale = getattr(optimizer, "grad_scale", None)
                if optimizer_state["grad_scale_after_clip"] is not None:
                    grad_scale = optimizer_state["grad_scale_after_clip"]
                    if user_scale is not None:
                        grad_scale = grad_scale * user_scale
                elif optimizer_state["stage"] is OptState.UNSCALED:
                    grad_scale = user_scale
                else:
                    grad_scale = scale * (user_scale if user_scale is not None else 1)
                optimizer.grad_scale = grad_scale
                optimizer.found_inf = found_inf
            retval = optimizer.step(*args, **kwargs_)
            optimizer_state["stage"] = OptState.STEPPED
            if not has_grad_scaler_kwarg:
                del optimizer.grad_scale
                del optimizer.found_inf
            return retval

        if optimizer_state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(optimizer_state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        retval = self._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        optimizer_state["stage"] = OptState.STEPPED
        return retval

    def update(self, new_scale: Union[float, Tensor] | None = None) -> None:
        """Update the scale for the next iteration (on device, no host sync).

        Without ``new_scale``: backoff if any optimizer recorded an overflow this
        iteration, else count towards growth (torch's rule, plus hysteresis and bounds
        when configured); also updates :attr:`skipped_steps` and :attr:`last_step_skipped`.
        With ``new_scale`` (a float, or a 1-element tensor on the scaler's device type): set
        the scale to it; the growth tracker is left alone, as in torch.
        """
        if not self._enabled:
            return
        _scale, _growth_tracker = self._check_scale_growth_tracker("update")
        found_infs = [
            found_inf.to(device=_scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        if new_scale is not None:
            if isinstance(new_scale, (float, int)) and not isinstance(new_scale, bool):
                if not (math.isfinite(new_scale) and new_scale >= 0):
                    raise ValueError(f"fastamp.Scaler.update: new_scale must be finite and >= 0, got {new_scale!r}")
                self._scale.fill_(float(new_scale))
            else:
                reason = (
                    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                    "torch.FloatTensor with requires_grad=False."
                )
                if not isinstance(new_scale, Tensor):
                    raise AssertionError(reason)
                if new_scale.device.type != self._device:
                    raise AssertionError(reason)
                if new_scale.numel() != 1:
                    raise AssertionError(reason)
                if new_scale.requires_grad is True:
                    raise AssertionError(reason)
                self._scale.copy_(new_scale.reshape(()))
        else:
            if len(found_infs) == 0:
                raise AssertionError("No inf checks were recorded prior to update.")
            found_inf_combined = found_infs[0]
            for extra in found_infs[1:]:
                found_inf_combined = found_inf_combined + extra
            functional.update_scale_(
                _scale,
                _growth_tracker,
                self._hysteresis_tracker,
                found_inf_combined.reshape(()),
                self._growth_factor,
                self._backoff_factor,
                self._growth_interval,
                self._hysteresis,
                0.0 if self._min_scale is None else self._min_scale,
                math.inf if self._max_scale is None else self._max_scale,
                backend=self._backend,
            )
        if found_infs:
            skipped = torch.stack([f.reshape(()) for f in found_infs]).ne(0).any()
            self._last_step_skipped.copy_(skipped)
            self._skipped_steps.add_(skipped.to(torch.int64))
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        if found_infs:
            self._health.on_update(self)

    # ------------------------------------------------------------------ extras

    @property
    def last_step_skipped(self) -> bool:
        """Whether the iteration closed by the last :meth:`update` skipped a step (syncs when read).

        Use :attr:`last_step_skipped_tensor` to keep it on the device.
        """
        t = self.last_step_skipped_tensor
        return bool(t) if isinstance(t, Tensor) else t

    @property
    def last_step_skipped_tensor(self) -> Union[Tensor, bool]:
        if not self._enabled:
            return False
        if self._last_step_skipped is None:
            return self._init_last_step_skipped
        return self._last_step_skipped

    @property
    def skipped_steps(self) -> Union[Tensor, int]:
        """Number of iterations with a skipped step so far, as a device int64 tensor (no sync)."""
        if not self._enabled:
            return 0
        if self._skipped_steps is None:
            return self._init_skipped_steps
        return self._skipped_steps

    # ------------------------------------------------------------------ gradient health

    def watch(self, model: torch.nn.Module, prefix: str = "") -> Scaler:
        """Name ``model``'s params in :meth:`grad_stats` (``prefix`` + their ``named_parameters`` names).

        Also checks the model once for BatchNorm layers in fp16/bf16 (an
        :class:`fastamp.health.AmpPitfallWarning`). Returns the scaler. Names are held by param
        id with a weak reference, so a freed param is never mistaken for a new one.
        """
        health.check_model(model)
        if not self._enabled:
            return self
        for name, p in model.named_parameters():
            self._param_names[id(p)] = (weakref.ref(p), prefix + name)
        return self

    def grad_stats(self, model: torch.nn.Module | None = None) -> health.GradStats | None:
        """Per-tensor gradient statistics of the last checked iteration (syncs: reads the device buffers).

        Needs ``track_stats=True``. Values are of the unscaled gradients, computed in the first
        check of the iteration (``unscale_``, ``clip_grad_norm_`` or ``step``). Params are
        named by ``model`` if given, else by :meth:`watch`, else by optimizer position. Returns
        None before the first check (and when the scaler is disabled). See
        :class:`fastamp.health.GradStats` (``.summary()``, ``.worst()``, ``.first_nonfinite``).
        """
        if not self._enabled:
            return None
        if not self._track_stats:
            raise RuntimeError(
                "fastamp.Scaler.grad_stats: statistics are off; construct the scaler with track_stats=True"
            )
        skipped = None
        if self._last_step_skipped is not None and self._last_stats_update < self._health.updates:
            skipped = bool(self._last_step_skipped)
        for key in [k for k, r in self._stats.items() if r.optimizer() is None]:
            del self._stats[key]
        return health.read_stats(list(self._stats.values()), self._param_names, model, self._health.updates, skipped)

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
        self._growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = new_interval

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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of a ``fastamp.Scaler`` or a ``torch.amp.GradScaler``.

        Extra fastamp keys are optional (a torch state dict leaves hysteresis, bounds and
        counters as configured / at their initial values). Everything is validated before
        anything is changed.
        """
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
            )
        missing = [
            k
            for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
            if k not in state_dict
        ]
        if missing:
            raise KeyError(missing[0])
        hysteresis = state_dict.get("hysteresis", self._hysteresis)
        if isinstance(hysteresis, bool) or not isinstance(hysteresis, int) or hysteresis < 1:
            raise ValueError(f"fastamp.Scaler.load_state_dict: hysteresis must be an int >= 1, got {hysteresis!r}")
        # everything is checked before anything is assigned (a bad dict leaves the scaler as it was)
        where = "fastamp.Scaler.load_state_dict"
        _check_scale_settings(
            where,
            state_dict["scale"],
            state_dict["growth_factor"],
            state_dict["backoff_factor"],
            state_dict["growth_interval"],
        )
        for key in ("_growth_tracker", "_hysteresis_tracker", "skipped_steps"):
            v = state_dict.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{where}: {key} must be an int >= 0, got {v!r}")
        for key in ("min_scale", "max_scale"):
            v = state_dict.get(key)
            if v is not None and not (isinstance(v, (int, float)) and v > 0 and not math.isnan(v)):
                raise ValueError(f"{where}: {key} must be a positive number or None, got {v!r}")
        self._init_scale = state_dict["scale"]
        self._growth_factor = state_dict["growth_factor"]
        self._backoff_factor = state_dict["backoff_factor"]
        self._growth_interval = state_dict["growth_interval"]
        self._init_growth_tracker = state_dict["_growth_tracker"]
        self._hysteresis = hysteresis
        self._init_hysteresis_tracker = state_dict.get("_hysteresis_tracker", hysteresis)
        self._min_scale = state_dict.get("min_scale", self._min_scale)
        self._max_scale = state_dict.get("max_scale", self._max_scale)
        self._init_skipped_steps = int(state_dict.get("skipped_steps", 0))
        self._init_last_step_skipped = bool(state_dict.get("last_step_skipped", False))
        if self._scale is not None:
            self._scale.fill_(state_dict["scale"])
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(state_dict["_growth_tracker"])
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
            # device statistics and weak references do not travel; the names and guards restart
            state["_stats"] = {}
            state["_param_names"] = {}
            state["_health"] = health._Monitor()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _check_scale_settings(where: str, scale, growth_factor, backoff_factor, growth_interval) -> None:
    """Host-side checks of the scale settings torch leaves unchecked (a negative backoff, a NaN scale)."""
    for name, v in (
        ("init_scale" if where == "fastamp.Scaler" else "scale", scale),
        ("growth_factor", growth_factor),
        ("backoff_factor", backoff_factor),
    ):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{where}: {name} must be a real number, got {type(v).__name__}")
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{where}: {name} must be finite and >= 0, got {v!r}")
    if not 0 < backoff_factor < 1:
        raise ValueError(f"{where}: backoff_factor must be in (0, 1), got {backoff_factor!r}")
    if not growth_factor > 1:
        raise ValueError(f"{where}: growth_factor must be > 1, got {growth_factor!r}")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 0:
        raise ValueError(f"{where}: growth_interval must be an int >= 0 (0: never grow), got {growth_interval!r}")


def _plain_grads(optimizer, allow_fp16: bool) -> tuple[list[Tensor], list[int] | None, list[Tensor]] | None:
    """``(params with a grad, their positions, their grads)`` without a Python call per param.

    ``positions`` (in the optimizer's flattened param order) is None when every param has a
    grad. None when the per-param loop of ``Scaler._grads_by_device`` is needed: a
    non-tensor param, a grad that is not a plain ``torch.Tensor`` (DTensor), or fp16 grads
    where they are refused (that loop raises the error).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not all(map(isinstance, params, repeat(Tensor))):
        return None
    grads = [p.grad for p in params]
    positions = None
    if any(map(operator.is_, grads, repeat(None))):
        positions = [i for i, g in enumerate(grads) if g is not None]
        params = [params[i] for i in positions]
        grads = [grads[i] for i in positions]
    if grads and set(map(type, grads)) != {Tensor}:
        return None
    if not allow_fp16 and torch.float16 in {g.dtype for g in grads}:
        return None
    return params, positions, grads


def _check_process_group(process_group: Any, sharded: Any) -> Any:
    if not isinstance(sharded, bool):
        raise TypeError(f"fastamp.Scaler: sharded must be a bool, got {sharded!r}")
    if process_group is None:
        if sharded:
            raise ValueError("fastamp.Scaler: sharded=True needs a process_group to sum the squared norm over")
        return None
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("fastamp.Scaler: a process_group was given but torch.distributed is not available")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"fastamp.Scaler: process_group must be a torch.distributed ProcessGroup (e.g. dist.group.WORLD after "
            f"init_process_group), got {type(process_group).__name__}"
        )
    return process_group


def _params_with_grads(optimizer) -> list[Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if isinstance(p, Tensor) and p.grad is not None]
