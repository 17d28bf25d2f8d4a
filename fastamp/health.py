"""Gradient health: per-tensor statistics from the fused check pass, and mixed-precision pitfall guards.

Statistics (``fastamp.Scaler(track_stats=True)``): the scaler's existing unscale/check pass
also writes, per gradient tensor, the number of non-finite elements, of exact zeros, of
values that an fp16 gradient would lose to subnormals (``0 < |g| < 2**-14`` after
unscaling) and the largest finite ``|g|`` (see :func:`fastamp.reference.unscale_check_stats_`).
They stay on the device until :meth:`fastamp.Scaler.grad_stats` reads them (one sync) into
a :class:`GradStats`.

Guards: :class:`AmpPitfallWarning`, each raised at most once per scaler (or per optimizer, or
per model), with the explanation and the fix. None adds a host sync to the training step;
see :data:`GUARDS` for what each one watches and when it can fire.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "AmpPitfallWarning",
    "TensorStats",
    "GradStats",
    "GUARDS",
    "check_model",
    "install_optimizer_guard",
]

FP16_MIN_NORMAL = 2.0**-14


class AmpPitfallWarning(UserWarning):
    """A mixed-precision setup or training-loop mistake detected by fastamp (message says the fix)."""


GUARDS = {
    "fp16_without_scaler": "an optimizer steps fp16 params while no grad scaler drives the step "
    "(checked at the first step of each optimizer, once fastamp.cast_model(..., float16) or "
    "install_optimizer_guard() ran)",
    "fp16_without_master": "a scaled step updates fp16 params with an optimizer that keeps no fp32 master "
    "weights (same hook)",
    "norm_in_low_precision": "a BatchNorm/InstanceNorm with fp16/bf16 params or running stats (cast_model, "
    "Scaler.watch, check_model)",
    "grad_underflow": "fp16 grads mostly zero or entirely below fp16's normal range (Scaler(track_stats=True), "
    "read at the scaler's health probes)",
    "scale_collapse": "the loss scale fell below 1 (health probes)",
    "bf16_scaler_unneeded": "K updates with bf16 grads, no fp16 grad and no overflow (health probes)",
}


def _warn(key: str, message: str, stacklevel: int = 3) -> None:
    warnings.warn(f"fastamp [{key}]: {message}", AmpPitfallWarning, stacklevel=stacklevel)


# ----------------------------------------------------------------------------- statistics


@dataclass
class TensorStats:
    """Health of one gradient tensor at the last check (values after unscaling).

    ``dtype`` is the gradient's own dtype, which may differ from its param's (torch allows
    fp32 grads on fp16 params through ``param.grad_dtype``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int
    nonfinite: int
    zeros: int
    fp16_underflow: int
    absmax: float

    @property
    def frac_zero(self) -> float:
        return self.zeros / self.numel if self.numel else 0.0

    @property
    def frac_fp16_underflow(self) -> float:
        return self.fp16_underflow / self.numel if self.numel else 0.0


@dataclass
class GradStats:
    """Per-tensor gradient statistics of the last checked iteration, keyed by param name.

    ``tensors`` is in optimizer order (params of the first optimizer, group by group, then
    the next optimizer's). Names come from :meth:`fastamp.Scaler.watch` or the ``model`` given
    to :meth:`fastamp.Scaler.grad_stats`; unnamed params are called ``"opt{i}.group{j}.param{k}"``.

    ``first_nonfinite`` is the non-finite tensor met first by backward, taken to be the last
    one in optimizer order (backward runs from the loss towards the inputs, and parameters are
    normally registered in forward order); ``nonfinite`` lists all of them, in optimizer order.
    """

    tensors: dict[str, TensorStats]
    scale: float
    update: int
    skipped: bool | None = None
    nonfinite: list[str] = field(default_factory=list)

    @property
    def first_nonfinite(self) -> str | None:
        return self.nonfinite[-1] if self.nonfinite else None

    def __getitem__(self, name: str) -> TensorStats:
        return self.tensors[name]

    def __iter__(self):
        return iter(self.tensors.values())

    def __len__(self) -> int:
        return len(self.tensors)

    def worst(self, k: int = 5, by: str = "frac_zero") -> list[TensorStats]:
        """The ``k`` tensors with the largest ``by`` (``frac_zero``, ``frac_fp16_underflow``, ``nonfinite``,
        ``absmax``) first; ``"absmin"`` sorts by smallest ``absmax``."""
        if by == "absmin":
            return sorted(self.tensors.values(), key=lambda t: t.absmax)[:k]
        if by not in ("frac_zero", "frac_fp16_underflow", "nonfinite", "absmax", "zeros", "fp16_underflow"):
            raise ValueError(f"GradStats.worst: unknown key {by!r}")
        return sorted(self.tensors.values(), key=lambda t: getattr(t, by), reverse=True)[:k]

    def totals(self) -> dict[str, float]:
        n = sum(t.numel for t in self)
        return {
            "tensors": len(self),
            "elements": n,
            "nonfinite": sum(t.nonfinite for t in self),
            "frac_zero": sum(t.zeros for t in self) / n if n else 0.0,
            "frac_fp16_underflow": sum(t.fp16_underflow for t in self) / n if n else 0.0,
            "absmax": max((t.absmax for t in self), default=0.0),
        }

    def summary(self, k: int = 3) -> str:
        """A short human-readable report: totals, the overflow origin, the worst tensors."""
        tot = self.totals()
        state = {None: "", True: ", step SKIPPED", False: ", step applied"}[self.skipped]
        lines = [
            f"grad stats (update {self.update}, scale {self.scale:g}{state}): {tot['tensors']} tensors, "
            f"{tot['elements']} elements, {tot['nonfinite']} non-finite, {100 * tot['frac_zero']:.1f}% zero, "
            f"{100 * tot['frac_fp16_underflow']:.1f}% below fp16 normal (2^-14), max |g| {tot['absmax']:.3g}"
        ]
        if self.nonfinite:
            if len(self.nonfinite) == len(self):
                lines.append(
                    f"  every tensor is non-finite: the loss itself is likely inf/NaN (forward overflow or bad data); "
                    f"backward met it first in {self.first_nonfinite!r}"
                )
            else:
                lines.append(
                    f"  non-finite in {len(self.nonfinite)} tensor(s); first met by backward: {self.first_nonfinite!r}"
                    f" (all: {', '.join(self.nonfinite[-5:][::-1])}{', ...' if len(self.nonfinite) > 5 else ''})"
                )
        picks: list[tuple[str, str]] = []

        def pick(ts, why):
            for t in ts:
                if len([n for n, _ in picks if n == t.name]) == 0:
                    picks.append((t.name, why))

        pick([t for t in self.worst(k, "nonfinite") if t.nonfinite], "non-finite")
        pick([t for t in self.worst(k, "frac_zero") if t.zeros], "most zeros")
        pick([t for t in self.worst(k, "frac_fp16_underflow") if t.fp16_underflow], "most < 2^-14")
        pick(self.worst(k, "absmin"), "smallest max|g|")
        pick(self.worst(1, "absmax"), "largest max|g|")
        width = max((len(n) for n, _ in picks), default=6)
        lines.append(
            f"  {'tensor':<{width}}  {'dtype':>8}  {'numel':>9}  {'nonfin':>6}  {'zero%':>6}  {'<2^-14%':>7}  "
            f"{'max|g|':>9}  why"
        )
        for name, why in picks:
            t = self.tensors[name]
            lines.append(
                f"  {t.name:<{width}}  {str(t.dtype).replace('torch.', ''):>8}  {t.numel:>9}  {t.nonfinite:>6}  "
                f"{100 * t.frac_zero:>6.1f}  {100 * t.frac_fp16_underflow:>7.1f}  {t.absmax:>9.3g}  {why}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


@dataclass
class _StatsRows:
    """One fused check's statistics buffers: one optimizer on one device (lives on the device)."""

    optimizer: Any  # weakref.ref to the optimizer
    params: list[Tensor]
    # index of each row's param in the optimizer's flattened param order; None: row i is param i
    positions: list[int] | None
    # of what was checked (a DTensor grad's local shard, a sparse grad's values). dtypes are
    # always the grads' own (an fp16 param may hold an fp32 grad: p.grad_dtype), since the
    # guards judge a row by its dtype; None: the params' (only right when they match).
    # shapes None: the params' own (a dense grad has its param's shape), read when needed
    grad_dtypes: list[torch.dtype] | None
    shapes: list[tuple[int, ...]] | None
    counts: Tensor
    absmax: Tensor
    inv_scale: Tensor  # the inverse scale this check used (a fresh tensor, never mutated later)

    def position(self, row: int) -> int:
        return row if self.positions is None else self.positions[row]

    def dtype(self, row: int) -> torch.dtype:
        return self.params[row].dtype if self.grad_dtypes is None else self.grad_dtypes[row]

    def shape(self, row: int) -> tuple[int, ...]:
        return tuple(self.params[row].shape) if self.shapes is None else self.shapes[row]


def _param_names(model: nn.Module | None) -> dict[int, str]:
    return {} if model is None else {id(p): n for n, p in model.named_parameters()}


def read_stats(
    rows: Sequence[_StatsRows],
    names: dict[int, tuple[Any, str]],
    model: nn.Module | None,
    update: int,
    skipped: bool | None,
) -> GradStats | None:
    """Read the device buffers (one sync per device) into a :class:`GradStats`."""
    live = [r for r in rows if r.optimizer() is not None]
    if not live:
        return None
    extra = _param_names(model)
    opt_index: dict[int, int] = {}
    for r in live:
        opt_index.setdefault(id(r.optimizer()), len(opt_index))
    host = [(r, r.counts.cpu(), r.absmax.cpu(), float(r.inv_scale)) for r in live]
    records = []
    for r, counts, absmax, _inv in host:
        opt = r.optimizer()
        where = {}
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                where[id(p)] = (gi, pi)
        oi = opt_index[id(opt)]
        for row, p in enumerate(r.params):
            name = extra.get(id(p))
            if name is None:
                ref_name = names.get(id(p))
                if ref_name is not None and ref_name[0]() is p:
                    name = ref_name[1]
            if name is None:
                gi, pi = where.get(id(p), (-1, -1))
                name = f"opt{oi}.group{gi}.param{pi}"
            c = counts[row].tolist()
            shape = r.shape(row)
            records.append(
                (
                    (oi, r.position(row)),
                    TensorStats(
                        name,
                        shape,
                        r.dtype(row),
                        math.prod(shape),
                        c[0],
                        c[1],
                        c[2],
                        float(absmax[row]),
                    ),
                )
            )
    records.sort(key=lambda kv: kv[0])
    tensors: dict[str, TensorStats] = {}
    for _, t in records:
        base, k = t.name, 1
        while t.name in tensors:
            k += 1
            t.name = f"{base}#{k}"
        tensors[t.name] = t
    scale = 1.0 / host[0][3] if host[0][3] else math.inf
    return GradStats(tensors, scale, update, skipped, [t.name for t in tensors.values() if t.nonfinite])


# ----------------------------------------------------------------------------- model / optimizer guards


def _low_precision_norms(model: nn.Module) -> list[tuple[str, torch.dtype]]:
    found = []
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._NormBase):
            tensors = list(m.parameters(recurse=False)) + [b for b in m.buffers(recurse=False) if b.is_floating_point()]
            low = [t.dtype for t in tensors if t.dtype in (torch.float16, torch.bfloat16)]
            if low:
                found.append((name or type(m).__name__, low[0]))
    return found


def warn_norm_in_low_precision(names: Sequence[str], dtype: torch.dtype, stacklevel: int = 3) -> None:
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    dt = str(dtype).replace("torch.", "")
    _warn(
        "norm_in_low_precision",
        f"{len(names)} BatchNorm/InstanceNorm layer(s) hold {dt} params or running statistics ({shown}). "
        "Their running mean/variance need fp32: in fp16 a variance above 65504 becomes inf (the layer then "
        "outputs a constant in eval mode), and small momentum updates are rounded away. Fix: "
        "fastamp.cast_model(model, dtype) keeps normalisation layers in fp32 (with casts at their boundaries), "
        "or use torch.autocast with an fp32 model.",
        stacklevel=stacklevel + 1,
    )


_checked_models: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def check_model(model: nn.Module) -> None:
    """Warn (once per model) about setup pitfalls visible on the model: BatchNorm in fp16/bf16."""
    if model in _checked_models:
        return
    _checked_models.add(model)
    norms = _low_precision_norms(model)
    if norms:
        warn_norm_in_low_precision([n for n, _ in norms], norms[0][1], stacklevel=3)


_optimizer_guard = None
_checked_optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
_scaler_stepping = [0]  # > 0 while a fastamp.Scaler calls a plain optimizer's step()


class _ScalerStep:
    def __enter__(self):
        _scaler_stepping[0] += 1

    def __exit__(self, *exc):
        _scaler_stepping[0] -= 1


def _keeps_fp32_master(optimizer, p: Tensor) -> bool:
    from fastamp.optim.formats import masters as _masters

    if not getattr(type(optimizer), "__module__", "").startswith("fastamp.optim"):
        return False
    for g in optimizer.param_groups:
        if any(q is p for q in g["params"]):
            return _masters.uses_master(g.get("master_weights"), p.dtype, bool(g.get("stochastic_rounding", False)))
    return False


def _optimizer_step_pre_hook(optimizer, args, kwargs) -> None:
    # A traced step skips the check: dynamo would guard on the weak set and recompile the
    # step once the set changes. An eager step of the same optimizer still checks it.
    if torch.compiler.is_compiling() or optimizer in _checked_optimizers:
        return
    _checked_optimizers.add(optimizer)
    fp16 = [
        p
        for g in optimizer.param_groups
        for p in g["params"]
        if isinstance(p, Tensor) and p.dtype == torch.float16 and p.grad is not None
    ]
    if not fp16:
        return
    scaled = _scaler_stepping[0] > 0 or getattr(optimizer, "found_inf", None) is not None
    name = type(optimizer).__name__
    if not scaled:
        _warn(
            "fp16_without_scaler",
            f"{name}.step() updates {len(fp16)} fp16 param(s) but no grad scaler drives this step. fp16 gradients "
            "below 6e-8 flush to zero and those above 65504 become inf, so training silently stalls or the loss "
            "turns NaN. Fix: scaler = fastamp.Scaler(); scaler.scale(loss).backward(); scaler.step(opt); "
            "scaler.update() (or train in bfloat16, which needs no scaler).",
            stacklevel=4,
        )
    plain = [p for p in fp16 if not _keeps_fp32_master(optimizer, p)]
    if plain:
        _warn(
            "fp16_without_master",
            f"{name} updates {len(plain)} fp16 param(s) in place, without fp32 master weights: an update smaller "
            "than half an fp16 ulp of the weight (about 1e-3 relative) is rounded away, so small learning rates "
            "stall. Fix: fastamp.optim.AdamW (keeps fp32 masters), or keep the params fp32 and use torch.autocast.",
            stacklevel=4,
        )


def install_optimizer_guard() -> None:
    """Register (once per process) a global optimizer step pre-hook that checks each optimizer's first step.

    At the first ``step()`` of every ``torch.optim.Optimizer`` it warns if fp16 params are
    updated without a grad scaler (``fp16_without_scaler``), or by an optimizer without fp32
    master weights (``fp16_without_master``); later steps cost one weak-set lookup.
    :func:`fastamp.cast_model` with ``torch.float16`` calls it. An optimizer whose first step
    ran before the hook was installed is checked at its next step.
    """
    global _optimizer_guard
    if _optimizer_guard is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _optimizer_guard = register_optimizer_step_pre_hook(_optimizer_step_pre_hook)


# ----------------------------------------------------------------------------- the scaler's monitor


class _Monitor:
    """The pitfall guards a :class:`fastamp.Scaler` runs, from asynchronous health probes.

    Every ``interval`` updates (and at the first), :meth:`on_update` snapshots a few device
    scalars (scale, skip counters and, with ``track_stats``, fp16 underflow counts) into one
    small tensor. On CUDA it is copied without blocking into pinned memory and an event is
    recorded; the values are read at a later probe once the event has completed, so no probe
    waits for the device. On other devices it is read at once (on CPU that costs nothing).
    """

    def __init__(self, interval: int = 32, bf16_after: int = 100) -> None:
        self.interval = interval
        self.bf16_after = bf16_after
        self.updates = 0
        self.warned: set = set()
        self.watch_dtypes = True
        self.dtypes_seen: set = set()
        self._pending: tuple[Tensor, Any, dict[str, Any]] | None = None

    def wants_dtypes(self) -> bool:
        """Whether this check should report its grad dtypes (note_grads).

        Sampled, not every step (a dtype read per grad costs as much as the check with many
        small tensors): the first two updates and every ``interval``-th, until fp16 is seen.
        """
        return self.watch_dtypes and (self.updates < 2 or self.updates % self.interval == 0)

    def note_grads(self, grads: Iterable[Tensor]) -> None:
        self.dtypes_seen.update({g.dtype for g in grads})
        if torch.float16 in self.dtypes_seen:
            self.watch_dtypes = False

    def on_update(self, scaler) -> None:
        self.updates += 1
        if self.updates != 1 and self.updates % self.interval:
            return
        if self._pending is not None:
            host, event, meta = self._pending
            if event is not None and not event.query():
                return
            self._pending = None
            self._evaluate(host, meta)
        self._issue(scaler)

    def _issue(self, scaler) -> None:
        scale = scaler._scale
        dev = scale.device
        parts = [scale.float(), scaler._skipped_steps.float(), scaler._last_step_skipped.float()]
        meta: dict[str, Any] = {
            "update": self.updates,
            "dtypes": set(self.dtypes_seen),
            "fp16_elems": 0,
            "fp16_tensors": 0,
        }
        if scaler._track_stats:
            zeros = []
            under = []
            for rows in scaler._stats.values():
                sel = [i for i in range(len(rows.params)) if rows.dtype(i) == torch.float16]
                if not sel:
                    continue
                meta["fp16_elems"] += sum(math.prod(rows.shape(i)) for i in sel)
                meta["fp16_tensors"] += len(sel)
                idx = torch.tensor(sel, dtype=torch.int64).to(rows.counts.device, non_blocking=True)
                zeros.append(rows.counts.index_select(0, idx)[:, 1].sum().float().to(dev))
                # stored (still scaled) |g| below fp16's smallest normal: the tensor is all zeros/subnormals
                thresh = FP16_MIN_NORMAL * rows.inv_scale.reshape(())
                under.append((rows.absmax.index_select(0, idx) < thresh).sum().float().to(dev))
            if zeros:
                parts += [torch.stack(zeros).sum(), torch.stack(under).sum()]
        snap = torch.stack([p.reshape(()) for p in parts])
        if dev.type == "cuda":
            host = torch.empty(snap.shape, dtype=snap.dtype, pin_memory=True)
            host.copy_(snap, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (host, event, meta)
        else:
            self._evaluate(snap.cpu(), meta)

    def _evaluate(self, host: Tensor, meta: dict[str, Any]) -> None:
        v = host.tolist()
        scale, skipped_total, last_skipped = v[0], int(v[1]), bool(v[2])
        if scale < 1.0 and "scale_collapse" not in self.warned:
            self.warned.add("scale_collapse")
            _warn(
                "scale_collapse",
                f"the loss scale fell to {scale:g} (< 1) after {skipped_total} skipped steps in {meta['update']} "
                "updates: gradients are non-finite at almost every step, so the scaler keeps backing off and no "
                "update is applied. Loss scaling cannot fix this. Find where inf/NaN starts: "
                "fastamp.Scaler(track_stats=True) then scaler.grad_stats().summary() names the first non-finite "
                "grad; if all are non-finite the loss itself is (fp16 overflow in the forward pass: keep that "
                "layer in fp32 via cast_model(keep_fp32=...) or train in bf16; or NaN in the data; or too high a "
                "learning rate). Scaler(min_scale=1.0) stops the collapse but not its cause.",
                stacklevel=4,
            )
        if len(v) > 3 and not last_skipped and "grad_underflow" not in self.warned:
            zero_frac = v[3] / meta["fp16_elems"] if meta["fp16_elems"] else 0.0
            under_frac = v[4] / meta["fp16_tensors"] if meta["fp16_tensors"] else 0.0
            if zero_frac >= 0.5 or under_frac >= 0.5:
                self.warned.add("grad_underflow")
                _warn(
                    "grad_underflow",
                    f"at update {meta['update']} {100 * zero_frac:.0f}% of fp16 gradient elements are exactly zero "
                    f"and {100 * under_frac:.0f}% of fp16 gradient tensors lie entirely below fp16's normal range "
                    f"(2^-14) while the scale is {scale:g}: the gradients underflowed. Usual cause: backward() on "
                    "the unscaled loss (call scaler.scale(loss).backward()); otherwise the scale is too low for "
                    "these gradients (raise init_scale / min_scale, or train in bf16). "
                    "scaler.grad_stats().summary() lists the worst tensors.",
                    stacklevel=4,
                )
        if self.watch_dtypes and meta["update"] >= self.bf16_after:
            self.watch_dtypes = False
            dts = meta["dtypes"]
            if skipped_total == 0 and torch.bfloat16 in dts and torch.float16 not in dts:
                self.warned.add("bf16_scaler_unneeded")
                _warn(
                    "bf16_scaler_unneeded",
                    f"{meta['update']} updates with bf16 gradients and not one overflow: bf16 has fp32's exponent "
                    "range, so loss scaling only adds work here (a multiply, an unscale pass, a scale update per "
                    "step). Fix: drop the scaler (loss.backward(); opt.step()), or construct it with "
                    "enabled=False. fastamp.optim.AdamW needs no scaler for bf16.",
                    stacklevel=4,
                )
