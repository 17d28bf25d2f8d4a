"""The step context: one step's device scalars, as every launch of the step takes them.

A grad scaler hands an amp-aware optimizer two device values for one ``step()``: ``grad_scale``
(what the raw grads are divided by: the loss scale, ``scale / clip_coef`` after a fused clip,
times a ``grad_scale`` the user set) and ``found_inf`` (the step is skipped where it is not 0).
torch's protocol (``torch.amp.GradScaler``, path B2 of its ``step``, and :class:`fastamp.Scaler`)
sets them as the attributes ``optimizer.grad_scale`` / ``optimizer.found_inf`` around the call;
:meth:`StepContext.of` is the adapter from those attributes. The scaler side, where the values
are made (the fp64 reciprocal of the scale, the fold of the per-device flags, the clip
coefficient), is :mod:`fastamp.scaler.device_scalars`.

Everything a step derives from them lives here, for the eager step
(:meth:`FusedOptimizer._execute <fastamp.optim.engine.base.FusedOptimizer._execute>`), the
compiled one (:func:`fastamp.optim.engine.traced.traced_step`) and the step-scalar ops both
call, so the two paths cannot drift apart:

* :meth:`StepContext.found_inf_on`: the flag a launch on a device skips on (fp32, on that device);
* :meth:`StepContext.increment_on` and :meth:`StepContext.rng_delta_on`: what a step adds to
  the ``step`` counts and to the ``rng`` counters (``found_inf == 0``: a skipped step, NaN flag
  included, does not count; 1 without a scaler);
* :func:`grad_mul` and :func:`counts_after`: the grads' multiplier ``1/grad_scale`` (the fp64
  reciprocal rounded to fp32, :func:`fastamp.reference.inv_scale`, the scaler's own rule) and
  the counts the bias corrections use, inside the step-scalar ops.

No host sync: every value stays on its device; copies to another device are queued.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import Tensor

from fastamp import reference


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``: queued (non-blocking) where the target is not the CPU.

    A copy to the CPU must be blocking because the CPU kernel reads it right away.
    """
    if t.device == device:
        return t
    return t.to(device, non_blocking=device.type != "cpu")


def as_scalar_tensor(opt_name: str, name: str, value: Any) -> Tensor | None:
    """A handed-over ``grad_scale`` / ``found_inf`` checked and made a 0-dim tensor (None stays None).

    torch.amp.GradScaler hands over the Python int 0 when no param of the optimizer has a
    grad (the sum of an empty list): plain real numbers are accepted as fp32 tensors.
    """
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{opt_name}: {name} must be a 1-element tensor, got shape {tuple(value.shape)}")
        if not value.is_floating_point():
            raise TypeError(f"{opt_name}: {name} must be a floating point tensor, got {value.dtype}")
        return value.detach().reshape(())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float32)
    raise TypeError(f"{opt_name}: {name} must be a Tensor or None, got {type(value).__name__}")


def flag_on(found_inf: Tensor, device: torch.device) -> Tensor:
    """``found_inf`` as the kernels on ``device`` read it: fp32, on that device."""
    return to_device(found_inf.to(torch.float32), device)


def increment(flag: Tensor, dtype: torch.dtype) -> Tensor:
    """What a step adds to a count, from its device's flag: 1 where ``flag == 0`` (applied), else 0 (NaN: 0)."""
    return (flag == 0).to(dtype)


class StepContext:
    """A grad scaler's ``grad_scale`` / ``found_inf`` for one step, and what the step's launches derive from them.

    Built once per ``step()`` (or ``step_bucket()``); the per-device values are made at their
    first use and shared by every launch on that device. Traceable: the compiled step builds
    one the same way and gets the same ops (a plain class, no ``__slots__``: dynamo traces its
    creation and its dict caches as it traces any user object).
    """

    def __init__(self, opt_name: str, grad_scale: Any = None, found_inf: Any = None) -> None:
        self.grad_scale = as_scalar_tensor(opt_name, "grad_scale", grad_scale)
        self.found_inf = as_scalar_tensor(opt_name, "found_inf", found_inf)
        self._found: dict[torch.device, Tensor] = {}
        self._inc: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        self._delta: dict[torch.device, Tensor] = {}

    @classmethod
    def of(cls, optimizer: Any) -> StepContext:
        """The adapter from torch's protocol: the ``grad_scale`` / ``found_inf`` attributes set on ``optimizer``."""
        return cls(optimizer._NAME, getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None))

    def found_inf_on(self, device: torch.device) -> Tensor | None:
        """The flag the launches on ``device`` skip on: fp32, on that device (None without a scaler)."""
        if self.found_inf is None:
            return None
        t = self._found.get(device)
        if t is None:
            t = self._found[device] = flag_on(self.found_inf, device)
        return t

    def increment_on(self, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor | None:
        """What this step adds to the counts on ``device``: ``found_inf == 0`` as ``dtype`` (None: no scaler, add 1)."""
        if self.found_inf is None:
            return None
        key = (device, dtype)
        t = self._inc.get(key)
        if t is None:
            t = self._inc[key] = increment(self.found_inf_on(device), dtype)
        return t

    def rng_delta_on(self, device: torch.device) -> Tensor:
        """What this step adds to a stochastic-rounding ``rng`` counter ``[seed, counter]`` on ``device``: ``[0, inc]``.

        ``inc`` is 1 without a scaler, else ``found_inf == 0`` (see :mod:`fastamp.optim.engine.rng`).
        """
        t = self._delta.get(device)
        if t is None:
            inc = self.increment_on(device, torch.int64)
            if inc is None:
                inc = torch.ones((), dtype=torch.int64, device=device)
            t = self._delta[device] = torch.stack([torch.zeros_like(inc), inc])
        return t


def grad_mul(grad_scale: Tensor | None, device: torch.device) -> Tensor | None:
    """What the kernels multiply raw grads by: ``1/grad_scale`` by the scaler's reciprocal rule, on ``device``
    (None without a scaler: the step-scalar functions then use 1)."""
    if grad_scale is None:
        return None
    gm = reference.inv_scale(grad_scale.reshape(()))
    return gm if gm.device == device else gm.to(device)


def counts_after(step: Tensor, found_inf: Tensor | None) -> Tensor:
    """The counts the bias corrections use: ``step + 1``, or ``step + (found_inf == 0)`` under a scaler."""
    if found_inf is None:
        return step + 1.0
    return step + increment(flag_on(found_inf, step.device), torch.float32)
