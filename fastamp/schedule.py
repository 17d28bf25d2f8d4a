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
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["DeviceLR", "SkipAwareLR", "warmup_cosine", "warmup_linear", "exponential", "constant"]

ScheduleFn = Callable[[Tensor], Tensor]


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
    """

    def __init__(self, optimizer, fn: ScheduleFn, scaler=None) -> None:
        if not callable(fn):
            raise TypeError(f"fastamp.DeviceLR: fn must be callable, got {type(fn).__name__}")
        self.optimizer = optimizer
        self.fn = fn
        self.scaler = scaler
        self.base_lrs: list[float] = []
        device = None
        for _gi, group in enumerate(optimizer.param_groups):
            lr = group.get("initial_lr", group["lr"])
            if isinstance(lr, Tensor):
                lr = float(lr)  # construction time: one read
            self.base_lrs.append(float(lr))
            params = [p for p in group["params"] if isinstance(p, Tensor)]
            if device is None and params:
                device = params[0].device
        self.device = device if device is not None else torch.device("cpu")
        self._count = torch.zeros((), dtype=torch.float32, device=self.device)
        self._lrs: list[Tensor] = []
        for group, base in zip(optimizer.param_groups, self.base_lrs):
            params = [p for p in group["params"] if isinstance(p, Tensor)]
            dev = params[0].device if params else self.device
            group["initial_lr"] = base
            group["lr"] = torch.zeros((), dtype=torch.float32, device=dev)
            self._lrs.append(group["lr"])
        self._write()

    def _write(self) -> None:
        factor = self.fn(self._count).to(torch.float32).reshape(())
        for base, lr in zip(self.base_lrs, self._lrs):
            lr.copy_(factor * base, non_blocking=True)

    def step(self) -> None:
        """Count the last iteration if its step was applied, and write the new lrs (no host sync)."""
        skipped = None
        if self.scaler is not None and self.scaler.is_enabled():
            flag = self.scaler.last_step_skipped_tensor
            if isinstance(flag, Tensor):
                skipped = flag
        if skipped is None:
            self._count.add_(1.0)
        else:
            self._count.add_((~skipped.to(self._count.device, non_blocking=True)).to(torch.float32))
        self._write()

    @property
    def applied_steps(self) -> Tensor:
        """The number of applied steps counted so far (a device tensor; ``int()`` of it syncs)."""
        return self._count

    def get_last_lr(self) -> list[Tensor]:
        """The current lrs, as the device tensors the optimizer reads."""
        return list(self._lrs)

    def state_dict(self) -> dict[str, Any]:
        return {"applied_steps": int(self._count.item()), "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state.get("base_lrs", [])) != len(self.base_lrs):
            raise ValueError(
                f"fastamp.DeviceLR.load_state_dict: {len(state.get('base_lrs', []))} base lrs for "
                f"{len(self.base_lrs)} param groups"
            )
        self.base_lrs = [float(b) for b in state["base_lrs"]]
        self._count.fill_(float(state["applied_steps"]))
        self._write()


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
        self.scheduler.load_state_dict(state["scheduler"])
        self.skipped = int(state.get("skipped", 0))

    def __getattr__(self, name: str):
        if name in ("scheduler", "scaler", "skipped"):
            raise AttributeError(name)
        return getattr(self.scheduler, name)
