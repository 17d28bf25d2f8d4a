"""The Scaler's device scalars: what sits between the check pass and the step pass.

inv_scale, found_inf (per device, folded into the one flag an optimizer skips on), the
global grad norm, the clip coefficient and the ``grad_scale`` an amp-aware optimizer divides
by: 0-dim fp32 tensors computed on the device, never read on the host in the hot path.
Rounding is torch's where torch defines it (the fp64 reciprocal of the scale) and correct
on every machine where torch's is not (the fp32 square root of the norm).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from fastamp import reference


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


def _inv_scale(scale: Tensor) -> Tensor:
    # fp64 reciprocal rounded to fp32, as torch ("FP32 division can be imprecise").
    if scale.device.type == "mps":
        return scale.reciprocal()
    return scale.double().reciprocal().float()


def _new_found_inf(scale: Tensor) -> Tensor:
    return torch.full((), 0.0, dtype=torch.float32, device=scale.device)


def _fold_found_inf(found_per_device: Mapping[torch.device, Tensor], scale: Tensor) -> Tensor:
    """One 0/1 flag on the scale's device from an optimizer's per-device flags (their max).

    torch sums them instead, and its fused kernels skip only on exactly 1.
    """
    flags = [t.to(scale.device, non_blocking=True) for t in found_per_device.values()]
    return torch.stack(flags).amax() if flags else torch.zeros_like(scale)


def _step_grad_scale(scale: Tensor, clip_scale: Tensor | None, user_scale, unscaled: bool):
    """The ``grad_scale`` handed to an amp-aware optimizer's step (None: grads are already unscaled).

    A fused clip's ``scale / clip_coef`` wins; a ``grad_scale`` the user set on the optimizer
    multiplies whatever applies.
    """
    if clip_scale is not None:
        grad_scale = clip_scale
        if user_scale is not None:
            grad_scale = grad_scale * user_scale
    elif unscaled:
        grad_scale = user_scale
    else:
        grad_scale = scale * (user_scale if user_scale is not None else 1)
    return grad_scale


def _combined_found_inf(found_infs: Sequence[Tensor]) -> Tensor:
    """The sum of every recorded flag, as torch's ``update`` combines them (backoff on any > 0)."""
    found_inf_combined = found_infs[0]
    for extra in found_infs[1:]:
        found_inf_combined = found_inf_combined + extra
    return found_inf_combined.reshape(())


def _any_found(found_infs: Sequence[Tensor]) -> Tensor:
    """Whether any recorded flag is set: the iteration skipped a step (0-dim bool)."""
    return torch.stack([f.reshape(()) for f in found_infs]).ne(0).any()


def _total_norm(sumsq: Mapping[torch.device, Tensor]) -> Tensor:
    """The 2-norm from the per-device sums of squares (summed on the first device)."""
    devices = list(sumsq)
    total_sq = sumsq[devices[0]]
    for d in devices[1:]:
        total_sq = total_sq + sumsq[d].to(devices[0], non_blocking=True)
    # correctly rounded on every CPU (torch's CPU fp32 sqrt is not): see reference.sqrt_rn
    return reference.sqrt_rn(total_sq)


def _clip_coef(max_norm: float, total_norm: Tensor) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s coefficient, clamped to 1 (on the norm's device)."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def _grad_scale_after_clip(scale: Tensor | None, clip_coef: Tensor) -> Tensor:
    """What an amp-aware optimizer divides raw grads by to get unscaled, clipped ones.

    ``scale`` is None when the grads are already unscaled.
    """
    base = scale.to(clip_coef.device) if scale is not None else torch.ones_like(clip_coef)
    return base / clip_coef


def _unscale_clip_mul(inv_scale: Tensor, clip_coef: Tensor) -> Tensor:
    """The one multiplier of a pass that unscales and clips in place."""
    return (inv_scale.to(clip_coef.device) * clip_coef).float()


def _merge_found(found: dict[torch.device, Tensor], refound: dict[torch.device, Tensor]) -> dict[torch.device, Tensor]:
    """Per device, the flags of two passes over the same grads (set if either pass flagged)."""
    return {d: torch.maximum(f, refound[d]) if d in refound else f for d, f in found.items()}
