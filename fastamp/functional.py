"""Stateless fused ops that every backend implements (in-place ones end in ``_``).

Each function validates its arguments, picks a backend with :func:`fastamp.backends.resolve`
and calls it. Semantics are those of :mod:`fastamp.reference`; no function here reads a
device value on the host.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from fastamp import backends

__all__ = ["unscale_check_", "update_scale_", "adamw_"]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_scalar_tensor(op: str, name: str, t, dtype=torch.float32) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {name} must be a Tensor, got {type(t).__name__}")
    if t.numel() != 1:
        raise ValueError(f"{op}: {name} must be a 1-element tensor, got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{op}: {name} must be a {dtype} tensor, got {t.dtype}")


def unscale_check_(
    grads: Sequence[Tensor],
    found_inf: Tensor,
    inv_scale: Tensor,
    *,
    write_back: bool = True,
    compute_sumsq: bool = False,
    backend: Optional[str] = None,
) -> Tensor:
    """Unscale ``grads`` in place by ``inv_scale``, flag non-finite values in ``found_inf``.

    One read (and, with ``write_back``, one write) of every grad, all tensors of any of
    fp32/fp16/bf16 in one call. Also catches overflow created by unscaling itself, which
    ``torch._amp_foreach_non_finite_check_and_unscale_`` misses. See
    :func:`fastamp.reference.unscale_check_` for the exact semantics.

    Args:
        grads: dense or sparse (their values are used) gradients, all on ``found_inf``'s device.
        found_inf: 1-element fp32 tensor; set to 1.0 on any non-finite value, never reset.
        inv_scale: 1-element fp32 tensor on the same device.
        write_back: False leaves the grads untouched (check only, for fused optimizers).
        compute_sumsq: also return the sum of squares of the unscaled values.
        backend: force a backend (see :mod:`fastamp.backends`).

    Returns:
        0-dim fp32 tensor on ``found_inf``'s device: the sum of squares, or 0.

    No host sync. fp64 grads always run on the torch reference (the kernels are fp32-maths).
    """
    op = "unscale_check_"
    _check_scalar_tensor(op, "found_inf", found_inf)
    _check_scalar_tensor(op, "inv_scale", inv_scale)
    dev = found_inf.device
    if inv_scale.device != dev:
        raise ValueError(f"{op}: inv_scale is on {inv_scale.device} but found_inf is on {dev}")
    dense: List[Tensor] = []
    strided_copies = []
    other: List[Tensor] = []
    for i, g in enumerate(grads):
        if not isinstance(g, Tensor):
            raise TypeError(f"{op}: grads[{i}] must be a Tensor, got {type(g).__name__}")
        if g.device != dev:
            raise ValueError(f"{op}: grads[{i}] is on {g.device} but found_inf is on {dev}")
        if not g.is_floating_point():
            raise TypeError(f"{op}: grads[{i}] must be floating point, got {g.dtype}")
        vals = g._values() if g.is_sparse else g
        if vals.layout != torch.strided:
            raise TypeError(f"{op}: grads[{i}] has unsupported layout {g.layout}")
        if vals.dtype not in _KERNEL_DTYPES:
            other.append(vals)
        elif vals.is_contiguous():
            dense.append(vals)
        else:
            tmp = vals.contiguous()
            dense.append(tmp)
            strided_copies.append((vals, tmp))
    impl = backends.get_impl(op, backends.resolve(op, dev, backend))
    total = impl(dense, found_inf, inv_scale, write_back, compute_sumsq)
    if write_back:
        for orig, tmp in strided_copies:
            orig.copy_(tmp)
    if other:
        from fastamp import reference

        total = total + reference.unscale_check_(other, found_inf, inv_scale, write_back, compute_sumsq)
    return total


def update_scale_(
    scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int = 1,
    min_scale: float = 0.0,
    max_scale: float = math.inf,
    *,
    backend: Optional[str] = None,
) -> None:
    """Backoff / hysteresis / growth / bounds of the loss scale, in place, on the device.

    Bit-exact with ``torch._amp_update_scale_`` when ``hysteresis=1`` and no bounds are set.
    See :func:`fastamp.reference.update_scale_`. No host sync.
    """
    op = "update_scale_"
    _check_scalar_tensor(op, "scale", scale)
    _check_scalar_tensor(op, "growth_tracker", growth_tracker, torch.int32)
    _check_scalar_tensor(op, "hysteresis_tracker", hysteresis_tracker, torch.int32)
    _check_scalar_tensor(op, "found_inf", found_inf)
    dev = scale.device
    for name, t in (("growth_tracker", growth_tracker), ("hysteresis_tracker", hysteresis_tracker), ("found_inf", found_inf)):
        if t.device != dev:
            raise ValueError(f"{op}: {name} is on {t.device} but scale is on {dev}")
    impl = backends.get_impl(op, backends.resolve(op, dev, backend))
    impl(
        scale, growth_tracker, hysteresis_tracker, found_inf, float(growth_factor), float(backoff_factor),
        int(growth_interval), int(hysteresis), float(min_scale), float(max_scale),
    )


def adamw_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor],
    step_scalars: Tensor,
    found_inf: Optional[Tensor],
    *,
    beta1: float,
    beta2: float,
    eps: float,
    amsgrad: bool = False,
    maximize: bool = False,
    backend: Optional[str] = None,
) -> None:
    """One fused AdamW pass over a group of tensors (see :func:`fastamp.reference.adamw_`).

    All ``params`` share one dtype and device, all ``grads`` one dtype; ``masters``,
    moments are fp32 and contiguous. ``masters`` empty means the params are updated
    directly. Skips everything on device when ``found_inf`` is non-zero. No host sync.
    """
    op = "adamw_"
    if len(params) == 0:
        return
    dev = params[0].device
    impl = backends.get_impl(op, backends.resolve(op, dev, backend))
    impl(
        list(params), list(grads), list(masters), list(exp_avgs), list(exp_avg_sqs), list(max_exp_avg_sqs),
        step_scalars, found_inf, float(beta1), float(beta2), float(eps), bool(amsgrad), bool(maximize),
    )
