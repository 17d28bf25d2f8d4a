"""The executable specification of every fastamp op, in plain torch.

Every backend (C++ CPU, CUDA, Triton) must agree with these functions; the per-op notes
say whether the agreement is bit for bit or within a tolerance (see
``tests/tolerances.py``). They are also the ``torch`` backend, used where nothing faster is
available. All maths is fp32 (fp64 for fp64 tensors), rounded once on store; no function
here reads a device value on the host.

The per-element C++ twin of this file is ``csrc/fastamp_math.h``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

__all__ = ["unscale_check_", "update_scale_", "adamw_", "adamw_step_scalars"]


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def unscale_check_(
    grads: Sequence[Tensor],
    found_inf: Tensor,
    inv_scale: Tensor,
    write_back: bool = True,
    compute_sumsq: bool = False,
) -> Tensor:
    """Multiply every grad by ``inv_scale`` in place and flag non-finite values.

    ``found_inf`` (1-element fp32) is set to 1.0 when any element is non-finite, and is
    never reset (the caller zeroes it, as with torch). An element raises the flag when
    the scaled value ``x`` is inf/nan (torch's rule), when ``x * inv_scale`` is inf/nan in
    fp32 (overflow created by unscaling with a scale below 1 or equal to 0, which torch
    misses), or, with ``write_back``, when the unscaled value rounded to the grad's dtype
    overflows (fp16 60000 unscaled by 2).

    With ``write_back=False`` the grads are only read (the check pass of a fused
    optimizer). With ``compute_sumsq`` the sum of squares of the unscaled fp32 values is
    returned (for the global 2-norm); otherwise the returned 0-dim fp32 tensor is 0.

    Agreement: found_inf and written grads are bit-exact across backends; the sum of
    squares is accumulated in fp64 here and in a fixed chunk order by the kernels, so it
    agrees within ``tolerances.SUMSQ``.
    """
    dev = found_inf.device
    bad = torch.zeros((), dtype=torch.bool, device=dev)
    acc = torch.zeros((), dtype=torch.float64, device=dev)
    for g in grads:
        vals = g._values() if g.is_sparse else g
        cdt = _compute_dtype(vals)
        x = vals.to(cdt)
        y = x * inv_scale.reshape(()).to(device=vals.device, dtype=cdt)
        bad_g = (~torch.isfinite(x)).any() | (~torch.isfinite(y)).any()
        if write_back:
            stored = y.to(vals.dtype)
            bad_g = bad_g | (~torch.isfinite(stored)).any()
            vals.copy_(stored)
        bad = bad | bad_g.to(dev)
        if compute_sumsq:
            acc = acc + y.double().square().sum().to(dev)
    found_inf.masked_fill_(bad, 1.0)
    return acc.float()


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
) -> None:
    """Update the loss scale in place from ``found_inf``, on the device.

    With ``hysteresis=1, min_scale=0, max_scale=inf`` this is bit-exact with
    ``torch._amp_update_scale_``: any non-zero ``found_inf`` (NaN included) multiplies the
    scale by ``backoff_factor`` (in fp64, rounded to fp32) and zeroes the growth tracker;
    otherwise the tracker counts up and on reaching exactly ``growth_interval`` the scale
    is multiplied by ``growth_factor`` unless that is not finite, and the tracker resets.

    ``hysteresis=N``: an overflow decrements ``hysteresis_tracker`` and the scale backs off
    only when it reaches 0, so N-1 consecutive overflow steps are tolerated (their steps
    are still skipped). Every clean step refills the tracker to N; once it is exhausted
    each further consecutive overflow backs off. ``min_scale``/``max_scale`` clamp the
    backed-off and grown scale.
    """
    overflow = found_inf.reshape(()) != 0
    s = scale.reshape(())
    h_dec = hysteresis_tracker.reshape(()) - 1
    do_backoff = overflow & (h_dec <= 0)
    backed = (s.double() * backoff_factor).float()
    backed = torch.where(backed < torch.tensor(min_scale, dtype=torch.float32, device=s.device),
                         torch.tensor(min_scale, dtype=torch.float32, device=s.device), backed)
    successful = growth_tracker.reshape(()) + 1
    grow_step = (~overflow) & (successful.long() == growth_interval)
    grown = (s.double() * growth_factor).float()
    hi = torch.tensor(max_scale, dtype=torch.float32, device=s.device)
    grown = torch.where(grown > hi, hi, grown)
    grow_ok = grow_step & torch.isfinite(grown)
    new_scale = torch.where(do_backoff, backed, torch.where(grow_ok, grown, s))
    zero_i = torch.zeros((), dtype=growth_tracker.dtype, device=s.device)
    new_gt = torch.where(overflow | grow_step, zero_i, successful.to(growth_tracker.dtype))
    new_h = torch.where(
        overflow,
        torch.where(h_dec <= 0, torch.zeros_like(h_dec), h_dec),
        torch.full_like(h_dec, hysteresis),
    )
    scale.copy_(new_scale.reshape(scale.shape))
    growth_tracker.copy_(new_gt.reshape(growth_tracker.shape))
    hysteresis_tracker.copy_(new_h.to(hysteresis_tracker.dtype).reshape(hysteresis_tracker.shape))


def adamw_step_scalars(
    lr, step: Tensor, beta1: float, beta2: float, weight_decay: float, grad_mul: Optional[Tensor] = None
) -> Tensor:
    """The per-step fp32 scalars ``[step_size, bc2_sqrt, decay, grad_mul]`` of ``adamw_``.

    ``step`` is the (already incremented) step count as a tensor, ``lr`` a float or a
    tensor, ``grad_mul`` the factor applied to raw grads (``1/scale`` times the clip
    coefficient) or None for 1. Computed in fp64 on ``step``'s device (where the device
    supports fp64), rounded once to fp32: no host sync.
    """
    dev = step.device
    wide = torch.float32 if dev.type == "mps" else torch.float64
    st = step.reshape(()).to(wide)
    lr_t = lr.reshape(()).to(device=dev, dtype=wide) if isinstance(lr, Tensor) else torch.tensor(lr, dtype=wide, device=dev)
    bc1 = 1 - torch.pow(torch.tensor(beta1, dtype=wide, device=dev), st)
    bc2 = 1 - torch.pow(torch.tensor(beta2, dtype=wide, device=dev), st)
    step_size = lr_t / bc1
    bc2_sqrt = bc2.sqrt()
    decay = 1 - lr_t * weight_decay
    gm = grad_mul.reshape(()).to(device=dev, dtype=wide) if grad_mul is not None else torch.ones((), dtype=wide, device=dev)
    return torch.stack([step_size, bc2_sqrt, decay, gm]).float()


def _f32(x: float, dev) -> Tensor:
    return torch.tensor(x, dtype=torch.float32, device=dev)


def adamw_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor],
    step_scalars: Tensor,
    found_inf: Optional[Tensor],
    beta1: float,
    beta2: float,
    eps: float,
    amsgrad: bool,
    maximize: bool,
) -> None:
    """One fused AdamW update of every tensor, with optional fp32 master weights.

    For each i: the fp32 value being optimised is ``masters[i]`` when ``masters`` is not
    empty (then ``params[i]`` receives it rounded to nearest-even in its own dtype),
    otherwise ``params[i]`` itself (read as fp32, written back in its dtype). ``grads[i]``
    may be fp32/fp16/bf16 and is multiplied by ``grad_mul`` in fp32, never written.
    Moments are fp32. When ``found_inf`` is given and non-zero (NaN included), nothing is
    written at all. ``step_scalars`` is ``adamw_step_scalars(...)``.

    Element maths (fp32, one rounding per operation, no FMA), as torch's fused CPU AdamW::

        g = grad * grad_mul;  g = -g if maximize
        p = p * decay                                   # decay = 1 - lr * wd
        m = m + (1-beta1) * (g - m)    if 1-beta1 < 0.5 else  g - (g - m) * beta1
        v = v * beta2 + ((1-beta2) * g) * g
        vmax = maximum(vmax, v); d = vmax if amsgrad else v
        p = p - (step_size * m) / (sqrt(d) / bc2_sqrt + eps)

    Agreement: native CPU and CUDA bit-exact with this function; Triton bit-exact under
    the interpreter, within ``tolerances.ADAMW_GPU`` on a GPU (its sqrt/div may differ).
    """
    if len(params) == 0:
        return
    dev = params[0].device
    step_size, bc2_sqrt, decay, grad_mul = step_scalars.to(torch.float32).unbind(0)
    b1, omb1 = _f32(beta1, dev), _f32(1.0 - beta1, dev)
    b2, omb2 = _f32(beta2, dev), _f32(1.0 - beta2, dev)
    eps_t = _f32(eps, dev)
    keep = None if found_inf is None else (found_inf.reshape(()) != 0)
    use_master = len(masters) > 0
    for i, p in enumerate(params):
        p32 = masters[i] if use_master else p.float()
        m, v = exp_avgs[i], exp_avg_sqs[i]
        g = grads[i].float() * grad_mul
        if maximize:
            g = -g
        pv = p32 * decay
        diff = g - m
        mv = m + omb1 * diff if (1.0 - beta1) < 0.5 else g - diff * b1
        vv = v * b2 + (omb2 * g) * g
        if amsgrad:
            vmax = torch.maximum(max_exp_avg_sqs[i], vv)
            d = vmax
        else:
            d = vv
        # torch's CPU fp32 sqrt is not correctly rounded (~0.7% of inputs 1 ulp off with the
        # AVX-512 build); an fp64 sqrt rounded once to fp32 is, like sqrtf in the kernels.
        denom = d.double().sqrt().float() / bc2_sqrt + eps_t
        pv = pv - (step_size * mv) / denom
        if keep is not None:
            pv = torch.where(keep, p32, pv)
            mv = torch.where(keep, m, mv)
            vv = torch.where(keep, v, vv)
            if amsgrad:
                vmax = torch.where(keep, max_exp_avg_sqs[i], vmax)
        m.copy_(mv)
        v.copy_(vv)
        if amsgrad:
            max_exp_avg_sqs[i].copy_(vmax)
        new_p = pv.to(p.dtype)
        if keep is not None:
            new_p = torch.where(keep, p, new_p)
        if use_master:
            masters[i].copy_(pv)
        p.copy_(new_p)
