"""Learning-rate schedules that advance only on applied (not skipped) optimizer steps.

With loss scaling, an overflow step is skipped, but ``lr_scheduler.step()`` still runs: the
schedule drifts ahead of the real number of updates, and when the *first* step is skipped
torch warns "Detected call of ``lr_scheduler.step()`` before ``optimizer.step()``"
(pytorch#44511). Two remedies, by cost:

* :class:`DeviceLR` (no host sync): the lr is a function of the applied-step count, which is
  kept on the device and advanced by ``1 - last_step_skipped``; the lr is written into a
  0-dim tensor ``group["lr"]`` on the device. Needs an optimizer that accepts a tensor lr
  (``fastamp.optim.AdamW``; ``torch.optim.Adam/AdamW(fused=True)`` or ``capturable=True``).
  The schedule function must be written with torch ops (:func:`warmup_cosine`,
  :func:`warmup_linear`, :func:`exponential`, :func:`constant` are provided).
* :class:`SkipAwareLR` (one host read per step): wraps any ``torch.optim.lr_scheduler``
  and calls its ``step()`` only after an applied step. It must know *now* whether the step
  was skipped, so it reads ``scaler.last_step_skipped`` (a sync; with a plain optimizer the
  scaler already read ``found_inf`` in ``step()``, so the extra wait is near zero; with an
  amp-aware optimizer it ends the step's asynchrony). Use it for schedulers that depend on
  their own history (``ReduceLROnPlateau``, ``CyclicLR`` momentum, chained schedulers).

Checkpoints: both save with ``state_dict()`` into plain Python numbers and tensors
(``torch.load(..., weights_only=True)`` reads them back) and resume in either order with
``optimizer.load_state_dict``; a resumed run follows the same lrs, and with the same model,
optimizer and scaler states, the same params bit for bit as an uninterrupted one.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["DeviceLR", "SkipAwareLR", "warmup_cosine", "warmup_linear", "exponential", "constant"]

ScheduleFn = Callable[[Tensor], Tensor]

_MAX_COUNT = 2**24  # DeviceLR counts in fp32: exact up to here


def _as_float(step) -> Tensor:
    return torch.as_tensor(step).to(torch.float32)


def constant() -> ScheduleFn:
    """Factor 1 for every step."""

    def fn(step):
        return torch.ones_like(_as_float(step))

    return fn


def warmup_linear(warmup_steps: int, total_steps: int, min_factor: float = 0.0) -> ScheduleFn:
    """Linear warm-up from 0 over ``warmup_steps``, then linear decay to ``min_factor`` at ``total_steps``."""
    _check_steps(warmup_steps, total_steps)

    def fn(step):
        s = _as_float(step)
        warm = s / max(warmup_steps, 1)
        frac = ((s - warmup_steps) / max(total_steps - warmup_steps, 1)).clamp(0.0, 1.0)
        decay = 1.0 - (1.0 - min_factor) * frac
        return torch.where(s < warmup_steps, warm, decay)

    return fn


def warmup_cosine(warmup_steps: int, total_steps: int, min_factor: float = 0.0) -> ScheduleFn:
    """Linear warm-up from 0 over ``warmup_steps``, then half a cosine down to ``min_factor`` at ``total_steps``."""
    _check_steps(warmup_steps, total_steps)

    def fn(step):
        s = _as_float(step)
        warm = s / max(warmup_steps, 1)
        frac = ((s - warmup_steps) / max(total_steps - warmup_steps, 1)).clamp(0.0, 1.0)
        cos = min_factor + (1.0 - min_factor) * 0.5 * (1.0 + torch.cos(math.pi * frac))
        return torch.where(s < warmup_steps, warm, cos)

    return fn


def exponential(gamma: float) -> ScheduleFn:
    """``gamma ** step`` (as ``torch.optim.lr_scheduler.ExponentialLR``)."""

    def fn(step):
        return torch.pow(float(gamma), _as_float(step))

    return fn


def _check_steps(warmup_steps: int, total_steps: int) -> None:
    if not (isinstance(warmup_steps, int) and isinstance(total_steps, int) and 0 <= warmup_steps <= total_steps):
        raise ValueError(
            f"fastamp.schedule: need ints 0 <= warmup_steps <= total_steps, got {warmup_steps!r}, {total_steps!r}"
        )


class DeviceLR:
    """``lr = base_lr * fn(applied_steps)``, with the step count and the lr kept on the device.

    Example::

        >>> opt = fastamp.optim.AdamW(model.parameters(), lr=3e-4)
        >>> scaler = fastamp.Scaler()
        >>> sched = fastamp.DeviceLR(opt, fastamp.schedule.warmup_cosine(100, 10_000), scaler)
        >>> for x, y in loader:
        ...     ...
        ...     scaler.step(opt)
        ...     scaler.update()
        ...     sched.step()          # + (1 - last_step_skipped) on the device, no sync
        >>> torch.save({"opt": opt.state_dict(), "sched": sched.state_dict(), ...}, path)
        >>> # resume: build model, opt, scaler and sched as above, then in either order
        >>> ckpt = torch.load(path, weights_only=True)
        >>> opt.load_state_dict(ckpt["opt"])
        >>> sched.load_state_dict(ckpt["sched"])

    Args:
        optimizer: an optimizer that accepts a 0-dim tensor ``lr`` in its param groups.
        fn: ``fn(step: Tensor) -> Tensor`` (fp32 factor), written with torch ops so that it
            runs on the device; ``step`` is the number of applied steps (0 before the first).
            A ``LambdaLR`` with the same function gives the same lrs when no step is skipped.
        scaler: a :class:`fastamp.Scaler` (or None: every step counts, e.g. bf16 without scaler).

    At construction each group's float lr becomes its ``base_lr`` and ``group["lr"]`` is
    replaced by a 0-dim fp32 tensor on the device of the group's first param, set to
    ``base_lr * fn(0)``; :meth:`step` updates it in place. The count is fp32-exact up to 2**24
    steps. Reading :attr:`applied_steps` as an int or :meth:`state_dict` syncs.

    The scheduler owns ``group["lr"]``, as torch's schedulers do: whatever replaced its tensor
    there (``optimizer.load_state_dict`` puts the checkpoint's copy in, a user assigns a
    float) is replaced by the scheduler's tensor again, right after
    ``optimizer.load_state_dict`` (a load post-hook) and at every :meth:`step`, so the
    optimizer reads the schedule's value. Checkpoints therefore resume in torch's order
    (optimizer, then scheduler) and in the other one. If the optimizer's state is loaded
    and the scheduler's is not, the schedule continues from the scheduler's own count (0 for
    a new one); when that lr differs from the checkpoint's, the next ``optimizer.step()``
    warns once (one sync). One DeviceLR per optimizer; build it after the last
    ``add_param_group`` (:meth:`step` refuses a changed number of groups).
    """

    def __init__(self, optimizer, fn: ScheduleFn, scaler=None) -> None:
        if not callable(fn):
            raise TypeError(f"fastamp.DeviceLR: fn must be callable, got {type(fn).__name__}")
        groups = getattr(optimizer, "param_groups", None)
        if not isinstance(groups, list) or not all(isinstance(g, dict) and "lr" in g for g in groups):
            raise TypeError(
                f"fastamp.DeviceLR: optimizer must have param_groups with an 'lr' (a torch.optim.Optimizer), "
                f"got {type(optimizer).__name__}"
            )
        base_lrs = []
        for gi, group in enumerate(groups):
            lr = group.get("initial_lr", group["lr"])
            base_lrs.append(_base_lr(lr, f"fastamp.DeviceLR: param group {gi}'s lr"))  # construction: one read
        self.optimizer = optimizer
        self.fn = fn
        self.scaler = scaler
        self.base_lrs: list[float] = base_lrs
        device = None
        for group in groups:
            params = [p for p in group["params"] if isinstance(p, Tensor)]
            if params:
                device = params[0].device
                break
        self.device = device if device is not None else torch.device("cpu")
        self._count = torch.zeros((), dtype=torch.float32, device=self.device)
        self._lrs: list[Tensor] = []
        for group in groups:
            params = [p for p in group["params"] if isinstance(p, Tensor)]
            dev = params[0].device if params else self.device
            self._lrs.append(torch.zeros((), dtype=torch.float32, device=dev))
        self._install()
        self._write()
        self._loaded_lrs: list[Any] | None = None
        self._check_handle = None
        register = getattr(optimizer, "register_load_state_dict_post_hook", None)
        if register is not None:
            handle = register(functools.partial(_after_optimizer_load, weakref.ref(self)))
            # the hook holds the scheduler weakly; drop it with the scheduler
            weakref.finalize(self, handle.remove)

    def _install(self) -> None:
        """Put this scheduler's lr tensors (and base lrs) into the optimizer's groups where something else is."""
        for group, lr, base in zip(self.optimizer.param_groups, self._lrs, self.base_lrs):
            if group.get("lr") is not lr:
                group["lr"] = lr
            group["initial_lr"] = base

    def _check_groups(self) -> None:
        n = len(self.optimizer.param_groups)
        if n != len(self._lrs):
            raise ValueError(
                f"fastamp.DeviceLR: the optimizer has {n} param groups, this scheduler was built for "
                f"{len(self._lrs)}; build DeviceLR after the last add_param_group"
            )

    def _write(self) -> None:
        factor = self.fn(self._count).to(torch.float32).reshape(())
        for base, lr in zip(self.base_lrs, self._lrs):
            lr.copy_(factor * base, non_blocking=True)

    def step(self) -> None:
        """Count the last iteration if its step was applied, and write the new lrs (no host sync)."""
        self._check_groups()
        if self._check_handle is not None and self._loaded_lrs is None:
            self._cancel_load_check()
        skipped = None
        if self.scaler is not None and self.scaler.is_enabled():
            flag = self.scaler.last_step_skipped_tensor
            if isinstance(flag, Tensor):
                skipped = flag
        if skipped is None:
            self._count.add_(1.0)
        else:
            self._count.add_((~skipped.to(self._count.device, non_blocking=True)).to(torch.float32))
        self._install()
        self._write()

    @property
    def applied_steps(self) -> Tensor:
        """The number of applied steps counted so far (a device tensor; ``int()`` of it syncs)."""
        return self._count

    def get_last_lr(self) -> list[Tensor]:
        """The current lrs, as the device tensors the optimizer reads."""
        return list(self._lrs)

    def state_dict(self) -> dict[str, Any]:
        """``{"applied_steps": int, "base_lrs": [float, ...]}`` (one sync): plain Python numbers,
        so ``torch.load(..., weights_only=True)`` reads it. The schedule function is not saved:
        pass the same ``fn`` when you rebuild the scheduler."""
        return {"applied_steps": int(self._count.item()), "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the count and base lrs, and put the resulting lrs into the optimizer's groups.

        Works before or after ``optimizer.load_state_dict``. The whole dict is checked first:
        anything wrong raises and changes nothing.
        """
        where = "fastamp.DeviceLR.load_state_dict"
        if not isinstance(state, Mapping):
            raise TypeError(f"{where}: expected a dict from DeviceLR.state_dict(), got {type(state).__name__}")
        missing = [k for k in ("applied_steps", "base_lrs") if k not in state]
        if missing:
            hint = (
                " (a torch LRScheduler's state dict? it does not load into DeviceLR)" if "last_epoch" in state else ""
            )
            raise ValueError(f"{where}: missing {missing}; got keys {sorted(map(str, state))}{hint}")
        bases = state["base_lrs"]
        if not isinstance(bases, (list, tuple)):
            raise TypeError(f"{where}: base_lrs must be a list, got {type(bases).__name__}")
        if len(bases) != len(self._lrs):
            raise ValueError(f"{where}: {len(bases)} base lrs for {len(self._lrs)} param groups")
        bases = [_base_lr(b, f"{where}: base_lrs[{i}]") for i, b in enumerate(bases)]
        count = _step_count(state["applied_steps"], f"{where}: applied_steps")
        self._check_groups()
        self.base_lrs = bases
        self._count.fill_(float(count))
        self._cancel_load_check()  # the scheduler's own state now decides the lr
        self._install()
        self._write()

    # ---- after optimizer.load_state_dict ---------------------------------------------------
    def _on_optimizer_load(self) -> None:
        groups = self.optimizer.param_groups
        if len(groups) != len(self._lrs):
            return  # step() refuses it with a clear error
        self._loaded_lrs = [g.get("lr") for g in groups]
        self._install()
        self._cancel_load_check(keep_loaded=True)
        register = getattr(self.optimizer, "register_step_pre_hook", None)
        if register is not None:
            self._check_handle = register(functools.partial(_check_after_load, weakref.ref(self)))

    def _cancel_load_check(self, keep_loaded: bool = False) -> None:
        if self._check_handle is not None:
            self._check_handle.remove()
            self._check_handle = None
        if not keep_loaded:
            self._loaded_lrs = None

    def _warn_if_schedule_differs_from_checkpoint(self) -> None:
        # runs inside the optimizer's step pre-hooks: the handle is removed later (step(),
        # load_state_dict), not while torch iterates over the hooks
        loaded, self._loaded_lrs = self._loaded_lrs, None
        if loaded is None:
            return
        for gi, (old, lr) in enumerate(zip(loaded, self._lrs)):
            try:
                old_value = float(old)
            except (TypeError, ValueError, RuntimeError):
                continue
            new_value = float(lr)  # once per optimizer load
            if not math.isclose(old_value, new_value, rel_tol=1e-6, abs_tol=0.0):
                warnings.warn(
                    f"fastamp.DeviceLR: optimizer.load_state_dict() brought param group {gi}'s lr "
                    f"{old_value:.6g}, but the scheduler's state was not loaded: the schedule continues from "
                    f"its own count ({int(self._count.item())} applied steps, lr {new_value:.6g}). To resume the "
                    "schedule, also call sched.load_state_dict(checkpoint's sched.state_dict()); to restart it "
                    "on purpose, ignore this warning.",
                    UserWarning,
                    stacklevel=4,
                )
                return


def _after_optimizer_load(sched_ref: weakref.ref, _optimizer) -> None:
    sched = sched_ref()
    if sched is not None:
        sched._on_optimizer_load()


def _check_after_load(sched_ref: weakref.ref, _optimizer, _args, _kwargs) -> None:
    sched = sched_ref()
    if sched is not None:
        sched._warn_if_schedule_differs_from_checkpoint()


def _base_lr(value: Any, what: str) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{what} must be a number or a 1-element real tensor, got {value!r:.60}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{what} must be finite and >= 0, got {value}")
    return value


def _step_count(value: Any, what: str) -> int:
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{what} must be an integer or a 1-element tensor, got {value!r:.60}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be an integer, got {type(value).__name__}")
    if not (math.isfinite(value) and float(value).is_integer() and 0 <= value <= _MAX_COUNT):
        raise ValueError(f"{what} must be an integer in [0, 2**24] (fp32-exact), got {value}")
    return int(value)


class SkipAwareLR:
    """Wrap any ``torch.optim.lr_scheduler`` so it steps only after applied optimizer steps.

    Example::

        >>> sched = fastamp.SkipAwareLR(torch.optim.lr_scheduler.StepLR(opt, 100), scaler)
        >>> ...; scaler.step(opt); scaler.update(); sched.step()

    :meth:`step` reads ``scaler.last_step_skipped`` on the host (one sync per step; see the
    module docstring for the sync-free :class:`DeviceLR`). Skipped iterations never reach
    the wrapped scheduler, so its ``last_epoch`` counts applied steps, and a skipped first
    step does not trigger torch's "``lr_scheduler.step()`` before ``optimizer.step()``"
    warning (the wrapped scheduler's first ``step()`` comes after a real ``optimizer.step()``).
    Other attributes are forwarded to the wrapped scheduler.
    """

    def __init__(self, scheduler, scaler) -> None:
        self.scheduler = scheduler
        self.scaler = scaler
        self.skipped = 0

    def step(self, *args, **kwargs) -> bool:
        """Step the wrapped scheduler unless the last optimizer step was skipped; returns whether it stepped."""
        if self.scaler is not None and self.scaler.is_enabled() and self.scaler.last_step_skipped:
            self.skipped += 1
            return False
        self.scheduler.step(*args, **kwargs)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load the wrapped scheduler's state and the skip count; a malformed dict raises before anything changes.

        The wrapped torch scheduler writes ``group["lr"]`` of the optimizer's current groups
        at each step (filling a tensor lr in place), so it keeps working after
        ``optimizer.load_state_dict`` in either order.
        """
        where = "fastamp.SkipAwareLR.load_state_dict"
        if not isinstance(state, Mapping) or not isinstance(state.get("scheduler"), Mapping):
            got = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(
                f"{where}: expected a dict with a 'scheduler' dict (from SkipAwareLR.state_dict()), got {got}"
            )
        skipped = state.get("skipped", 0)
        if isinstance(skipped, Tensor) and skipped.numel() == 1 and not skipped.is_complex():
            skipped = skipped.item()
        if (
            isinstance(skipped, bool)
            or not isinstance(skipped, numbers.Real)
            or not (math.isfinite(skipped) and float(skipped).is_integer() and skipped >= 0)
        ):
            raise ValueError(f"{where}: skipped must be an integer >= 0, got {skipped!r}")
        self.scheduler.load_state_dict(state["scheduler"])
        self.skipped = int(skipped)

    def __getattr__(self, name: str):
        if name in ("scheduler", "scaler", "skipped"):
            raise AttributeError(name)
        return getattr(self.scheduler, name)
