"""The reference of the grad scaler's ops: the check pass (unscale, non-finite flag, sum of
squares, per-tensor health statistics) and the scale update.

Bit-exact with torch's ``_amp_foreach_non_finite_check_and_unscale_`` and
``_amp_update_scale_`` (tests/spec/test_reference.py); every backend matches these.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from fastamp.reference.numerics import _compute_dtype, _round_f32


def inv_scale(scale: Tensor) -> Tensor:
    """``1 / scale`` as ``torch.amp.GradScaler`` computes it: the fp64 reciprocal rounded once to fp32.

    On the scale's device, its shape kept; MPS has no fp64, so there it is the fp32 reciprocal.
    A power-of-two scale gives an exact reciprocal, so unscaling by it is exact. The one rule
    for every ``1/scale`` of fastamp: the scaler's ``inv_scale`` and the optimizers' ``1/grad_scale``.
    """
    if scale.device.type == "mps":
        return scale.to(torch.float32).reciprocal()
    return scale.double().reciprocal().float()


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
        vals, y, bad_g = _unscale_one(g, inv_scale, write_back)
        bad = bad | bad_g.to(dev)
        if compute_sumsq:
            acc = acc + _sumsq_partial(y).to(dev)
    found_inf.masked_fill_(bad, 1.0)
    return acc.float()


def _unscale_one(g: Tensor, inv_scale: Tensor, write_back: bool) -> tuple[Tensor, Tensor, Tensor]:
    """One grad of :func:`unscale_check_`: its values, the unscaled ``y`` and its 0-dim non-finite flag."""
    vals = g._values() if g.is_sparse else g
    cdt = _compute_dtype(vals)
    x = vals.to(cdt)
    y = x * inv_scale.reshape(()).to(device=vals.device, dtype=cdt)
    bad_g = (~torch.isfinite(x)).any() | (~torch.isfinite(y)).any()
    if write_back:
        stored = y.to(vals.dtype)
        bad_g = bad_g | (~torch.isfinite(stored)).any()
        vals.copy_(stored)
    return vals, y, bad_g


def _sumsq_partial(y: Tensor) -> Tensor:
    """One grad's share of :func:`unscale_check_`'s sum of squares: an fp64 0-dim tensor."""
    return y.double().square().sum()


def unscale_check_partials_(
    grads: Sequence[Tensor], found_inf: Tensor, inv_scale: Tensor, partials: Tensor, offsets: Sequence[int]
) -> None:
    """The check pass of :func:`unscale_check_` (``write_back=False``, ``compute_sumsq=True``), its fold left undone.

    Grad ``i``'s fp64 share of the sum of squares goes to ``partials[offsets[i]]`` (one
    partial per grad here: :func:`sumsq_partial_count`); ``found_inf`` is set as
    :func:`unscale_check_` sets it. :func:`sumsq_fold` of the partials of a list of grads, in
    that list's order, is bit for bit what :func:`unscale_check_` returns for that list, so
    gradient release (:func:`fastamp.release`) can check its buckets in the order backward
    produces them and still get the ordinary sum. Each backend does the same with its own
    partials (the native CPU kernel: one per chunk of 16384 elements; Triton: one per chunk
    of its launch), and matches the reference where :func:`unscale_check_` does.
    """
    dev = found_inf.device
    bad = torch.zeros((), dtype=torch.bool, device=dev)
    for g, off in zip(grads, offsets):
        _, y, bad_g = _unscale_one(g, inv_scale, False)
        bad = bad | bad_g.to(dev)
        partials[off].copy_(_sumsq_partial(y))
    found_inf.masked_fill_(bad, 1.0)


def sumsq_partial_count(numel: int) -> int:
    """How many slots :func:`unscale_check_partials_` fills for a grad of ``numel`` elements (one)."""
    return 1


def sumsq_fold(partials: Tensor, index: Sequence[int]) -> Tensor:
    """:func:`unscale_check_`'s fold of ``partials[index]``, in that order: fp64 from 0, rounded once to fp32."""
    acc = torch.zeros((), dtype=torch.float64, device=partials.device)
    for i in index:
        acc = acc + partials[i]
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
    lo = torch.full((), _round_f32(min_scale), dtype=torch.float32, device=s.device)
    backed = torch.where(backed < lo, lo, backed)
    successful = growth_tracker.reshape(()) + 1
    grow_step = (~overflow) & (successful.long() == growth_interval)
    grown = (s.double() * growth_factor).float()
    hi = torch.full((), _round_f32(max_scale), dtype=torch.float32, device=s.device)
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


# ---------------------------------------------------------------------------------------
# Gradient health statistics (issue: gradient health in the fused pass)
# ---------------------------------------------------------------------------------------

FP16_MIN_NORMAL = 2.0**-14


def unscale_check_stats_(
    grads: Sequence[Tensor],
    found_inf: Tensor,
    inv_scale: Tensor,
    write_back: bool,
    compute_sumsq: bool,
    counts: Tensor,
    absmax: Tensor,
) -> Tensor:
    """:func:`unscale_check_` that also writes per-tensor health statistics, same pass.

    ``counts`` (int64 ``[len(grads), 3]``) and ``absmax`` (fp32 ``[len(grads)]``) are
    overwritten. With ``y = x * inv_scale`` in fp32, per tensor:
      counts[:, 0] non-finite: elements that raise found_inf (same rule as unscale_check_);
      counts[:, 1] zeros: finite x with y == 0 (either sign);
      counts[:, 2] fp16 underflow: 0 < |y| < 2^-14 (what an fp16 grad would lose to subnormals);
      absmax: max |y| over elements whose y is finite (0 when there are none).
    """
    dev = found_inf.device
    for i, g in enumerate(grads):
        vals = g._values() if g.is_sparse else g
        cdt = _compute_dtype(vals)
        x = vals.to(cdt)
        y = x * inv_scale.reshape(()).to(device=vals.device, dtype=cdt)
        bad = ~torch.isfinite(x) | ~torch.isfinite(y)
        if write_back:
            bad = bad | ~torch.isfinite(y.to(vals.dtype))
        ay = y.abs()
        counts[i, 0] = bad.sum().to(dev)
        counts[i, 1] = (torch.isfinite(x) & (y == 0)).sum().to(dev)
        counts[i, 2] = ((ay > 0) & (ay < FP16_MIN_NORMAL)).sum().to(dev)
        fin = torch.isfinite(y)
        absmax[i] = torch.where(fin, ay, torch.zeros_like(ay)).amax().float().to(dev) if y.numel() else 0.0
    return unscale_check_(grads, found_inf, inv_scale, write_back, compute_sumsq)
