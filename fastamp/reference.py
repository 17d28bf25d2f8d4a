"""The executable specification of every fastamp op, in plain torch.

Every backend (C++ CPU, CUDA, Triton) must agree with these functions; the per-op notes
say whether the agreement is bit for bit or within a tolerance (see
``tests/tolerances.py``). They are also the ``torch`` backend, used where nothing faster is
available. All maths is fp32 (fp64 for fp64 tensors), rounded once on store; no function
here reads a device value on the host.

The per-element results are the same on every CPU: they use only operations that are exact
or correctly rounded whatever torch dispatches to (IEEE ``+ - * /`` as separate kernels, never
``add(alpha=)``/``addcdiv``/``lerp``, which may fuse a multiply-add on some instruction sets;
conversions; comparisons; integer maths) and :func:`sqrt_rn` for square roots (torch's own
CPU ``sqrt`` varies with the CPU vendor). Not covered: the sum of squares (a torch
reduction, whose order follows the instruction set and thread count; within
``tolerances.SUMSQ_RTOL``) and the fp32 step scalars of :func:`adamw_step_scalars` (see there).

The per-element C++ twin of this file is ``csrc/fastamp_math.h``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

# the low-bit helpers live in fastamp._lowbit_reference; they are part of this spec, re-exported
from fastamp._lowbit_reference import (
    _store_lowp,
    join_master,
    round_bf16_stochastic,
    split_master,
    sr_random16,
)

__all__ = [
    "unscale_check_",
    "update_scale_",
    "adamw_",
    "adamw_step_scalars",
    "adamw_bf16_",
    "sgd_",
    "sgd_step_scalars",
    "unscale_check_stats_",
    "split_master",
    "join_master",
    "sr_random16",
    "round_bf16_stochastic",
    "sqrt_rn",
]


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def sqrt_rn(x: Tensor) -> Tensor:
    """Correctly rounded square root of an fp32 (or fp16/bf16) tensor, the same on every CPU.

    torch's CPU ``sqrt`` is not correctly rounded and its error depends on the CPU: its
    vectorised kernels go through vendor-dispatched libraries (measured with torch 2.13:
    fp32 one ulp off on ~17% of inputs on an AMD EPYC, ~0.7% on a Xeon; fp64 one ulp off on
    ~1.3% on the EPYC; ``benchmarks/portable_ops_check.py``). So the root is taken in fp64
    and rounded once. That is correctly rounded whenever the fp64 sqrt is merely faithful
    (error below one fp64 ulp), not only when it is exact: the square root of an fp32 value
    is never within 2 fp64 ulps of an fp32 rounding midpoint (a midpoint ``m`` has 25
    significant bits, so ``m * m`` has 49-50 and differs from any 24-bit fp32 by at least
    ``2**-50 * m * m``, which puts ``sqrt`` at least ``2**-51 * m`` from ``m``), so an error
    of one fp64 ulp cannot move it across. ``tests/spec/test_reference.py`` checks this on the
    hardest inputs with the fp64 root pushed one ulp either way. This is what ``sqrtf``
    (the native kernels) and ``tl.sqrt_rn`` (Triton) compute.

    fp64 input is returned as ``x.sqrt()`` (fp64 has no wider type to round from); on MPS,
    which has no fp64, fp32 ``sqrt`` is used.
    """
    if x.dtype == torch.float64 or x.device.type == "mps":
        return x.sqrt()
    return x.double().sqrt().to(x.dtype)


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


def _round_f32(x: float) -> float:
    # Python float -> nearest fp32 value on the host (inf past fp32's range, as the kernels'
    # static_cast<float>), so torch.full never sees an out-of-range value.
    return float(torch.tensor(float(x), dtype=torch.float64).float())


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


def adamw_step_scalars(
    lr, step: Tensor, beta1: float, beta2: float, weight_decay: float, grad_mul: Tensor | None = None
) -> Tensor:
    """The per-step fp32 scalars ``[step_size, bc2_sqrt, decay, grad_mul]`` of ``adamw_``.

    ``step`` is the (already incremented) step count as a tensor, or a 1-D tensor of
    counts, one per tensor of a launch (the result is then ``[n, 4]``, row ``i`` computed
    from ``step[i]``: see :func:`scalar_rows`), ``lr`` a float or a tensor, ``grad_mul`` the factor applied to raw grads (``1/scale`` times the clip
    coefficient) or None for 1. Computed in fp64 on ``step``'s device (where the device
    supports fp64), rounded once to fp32: no host sync.

    Every backend receives this one tensor, so their bit-exact agreement does not depend on
    how it is computed. Across machines it can differ, rarely: torch's fp64 ``pow`` and
    ``sqrt`` are not correctly rounded and their last bit varies with the CPU and library
    (``pow(beta, step)`` here differs from a correctly rounded one on ~1 call in 1,800), and such a
    difference survives the rounding to fp32 only when the fp64 value lies within an fp64
    ulp of an fp32 rounding midpoint (``1 - beta**step`` amplifies it on early steps). It
    was measured at 0 of 80,000 steps on an AMD EPYC (``benchmarks/portable_ops_check.py``).
    A correctly rounded ``pow`` on the device would need far more than one kernel per step.
    """
    dev = step.device
    wide = torch.float32 if dev.type == "mps" else torch.float64
    st = (step if step.dim() == 1 else step.reshape(())).to(wide)
    lr_t = (
        lr.reshape(()).to(device=dev, dtype=wide)
        if isinstance(lr, Tensor)
        else torch.full((), lr, dtype=wide, device=dev)
    )
    bc1 = 1 - torch.pow(torch.full((), beta1, dtype=wide, device=dev), st)
    bc2 = 1 - torch.pow(torch.full((), beta2, dtype=wide, device=dev), st)
    step_size = lr_t / bc1
    bc2_sqrt = bc2.sqrt()
    decay = 1 - lr_t * weight_decay
    gm = (
        grad_mul.reshape(()).to(device=dev, dtype=wide)
        if grad_mul is not None
        else torch.ones((), dtype=wide, device=dev)
    )
    return torch.stack(torch.broadcast_tensors(step_size, bc2_sqrt, decay, gm), dim=-1).float()


def _lerp_low(beta1: float) -> bool:
    # torch.lerp's branch (weight < 0.5), decided on the fp32 weight as the kernels do.
    return float(torch.tensor(1.0 - beta1, dtype=torch.float32)) < 0.5


def _f32(x: float, dev) -> Tensor:
    # torch.full, not torch.tensor: the latter copies from host memory (a sync on CUDA)
    return torch.full((), x, dtype=torch.float32, device=dev)


def scalar_rows(step_scalars: Tensor, n: int, k: int) -> Callable[[int], tuple[Tensor, ...]]:
    """The step scalars of tensor ``i`` of a launch of ``n`` tensors: ``rows(i)`` -> ``k`` fp32 0-dim tensors.

    ``step_scalars`` holds either one set shared by every tensor (shape ``[k]``) or one set
    per tensor (shape ``[n, k]``: row ``i`` for tensor ``i``, e.g. bias corrections from
    each param's own step count). Every backend reads it the same way.
    """
    s = step_scalars.to(torch.float32)
    if s.dim() == 2:
        if tuple(s.shape) != (n, k):
            raise ValueError(f"step_scalars of shape {tuple(s.shape)} for {n} tensors: expected [{k}] or [{n}, {k}]")
        return lambda i: tuple(s[i].unbind(0))
    shared = tuple(s.reshape(k).unbind(0))
    return lambda i: shared


def adamw_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor],
    step_scalars: Tensor,
    found_inf: Tensor | None,
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
    rows = scalar_rows(step_scalars, len(params), 4)
    b1, omb1 = _f32(beta1, dev), _f32(1.0 - beta1, dev)
    b2, omb2 = _f32(beta2, dev), _f32(1.0 - beta2, dev)
    eps_t = _f32(eps, dev)
    keep = None if found_inf is None else (found_inf.reshape(()) != 0)
    use_master = len(masters) > 0
    for i, p in enumerate(params):
        step_size, bc2_sqrt, decay, grad_mul = rows(i)
        p32 = masters[i] if use_master else p.float()
        m, v = exp_avgs[i], exp_avg_sqs[i]
        g = grads[i].float() * grad_mul
        if maximize:
            g = -g
        pv = p32 * decay
        diff = g - m
        mv = m + omb1 * diff if _lerp_low(beta1) else g - diff * b1
        vv = v * b2 + (omb2 * g) * g
        if amsgrad:
            vmax = torch.maximum(max_exp_avg_sqs[i], vv)
            d = vmax
        else:
            d = vv
        denom = sqrt_rn(d) / bc2_sqrt + eps_t
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


# ---------------------------------------------------------------------------------------
# Low-bit master state (issue: bf16 master remainders, stochastic rounding, fused SGD)
# ---------------------------------------------------------------------------------------
# (the bit helpers, sr_random16, round_bf16_stochastic, split/join_master: fastamp/_lowbit_reference.py)


def adamw_bf16_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    remainders: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor],
    step_scalars: Tensor,
    found_inf: Tensor | None,
    rng: Tensor | None,
    rng_base: int,
    beta1: float,
    beta2: float,
    eps: float,
    amsgrad: bool,
    maximize: bool,
) -> None:
    """AdamW for bf16 params with a low-bit master: remainders and/or stochastic rounding.

    ``params`` are bf16. ``remainders`` (int16, same shapes) hold the exact fp32 master as
    ``join_master(param, remainder)``; after the update the master is split again, so the
    trajectory is bit-identical to :func:`adamw_` with fp32 masters. With ``remainders``
    empty there is no master: the fp32 result is rounded to bf16, stochastically when
    ``rng`` is given. Moments are fp32, or bf16 (rounded stochastically when ``rng`` is
    given, to nearest-even otherwise). ``rng`` is an int64 tensor ``[seed, counter]`` on the
    device; the random bits of tensor ``i`` use ``tensor_id = rng_base + i`` (see
    :func:`sr_random16`). ``found_inf`` non-zero: nothing is written.
    """
    if len(params) == 0:
        return
    dev = params[0].device
    rows = scalar_rows(step_scalars, len(params), 4)
    b1, omb1 = _f32(beta1, dev), _f32(1.0 - beta1, dev)
    b2, omb2 = _f32(beta2, dev), _f32(1.0 - beta2, dev)
    eps_t = _f32(eps, dev)
    keep = None if found_inf is None else (found_inf.reshape(()) != 0)
    use_rem = len(remainders) > 0
    seed = counter = None
    if rng is not None:
        seed, counter = rng.reshape(-1)[0], rng.reshape(-1)[1]
    for i, p in enumerate(params):
        step_size, bc2_sqrt, decay, grad_mul = rows(i)
        n = p.numel()

        def rand(k: int, i: int = i, n: int = n) -> Tensor | None:
            if rng is None:
                return None
            return sr_random16(seed, counter, 4 * (rng_base + i) + k, n, dev)

        p32 = join_master(p, remainders[i]) if use_rem else p.float()
        m, v = exp_avgs[i].float(), exp_avg_sqs[i].float()
        g = grads[i].float() * grad_mul
        if maximize:
            g = -g
        pv = p32 * decay
        diff = g - m
        mv = m + omb1 * diff if _lerp_low(beta1) else g - diff * b1
        vv = v * b2 + (omb2 * g) * g
        if amsgrad:
            vmax = torch.maximum(max_exp_avg_sqs[i].float(), vv)
            d = vmax
        else:
            d = vv
        denom = sqrt_rn(d) / bc2_sqrt + eps_t
        pv = pv - (step_size * mv) / denom
        if use_rem:
            new_p, new_rem = split_master(pv)
        else:
            new_p, new_rem = _store_lowp(pv, p.dtype, rand(0)), None
        new_m = _store_lowp(mv, exp_avgs[i].dtype, rand(1))
        new_v = _store_lowp(vv, exp_avg_sqs[i].dtype, rand(2))
        new_vmax = _store_lowp(vmax, max_exp_avg_sqs[i].dtype, rand(3)) if amsgrad else None
        if keep is not None:
            new_p = torch.where(keep, p, new_p)
            new_m = torch.where(keep, exp_avgs[i], new_m)
            new_v = torch.where(keep, exp_avg_sqs[i], new_v)
            if use_rem:
                new_rem = torch.where(keep, remainders[i], new_rem)
            if amsgrad:
                new_vmax = torch.where(keep, max_exp_avg_sqs[i], new_vmax)
        p.copy_(new_p)
        exp_avgs[i].copy_(new_m)
        exp_avg_sqs[i].copy_(new_v)
        if use_rem:
            remainders[i].copy_(new_rem)
        if amsgrad:
            max_exp_avg_sqs[i].copy_(new_vmax)


def sgd_step_scalars(lr, step: Tensor, grad_mul: Tensor | None = None) -> Tensor:
    """``[lr, grad_mul, is_first]`` (fp32, on ``step``'s device) for :func:`sgd_`.

    ``step`` is the number of steps applied *before* this one (a device tensor), so
    ``is_first = (step == 0)``: a first step skipped on overflow stays the first. No sync.
    A 1-D ``step`` (one count per tensor of a launch) gives ``[n, 3]``, row ``i`` from ``step[i]``.
    """
    dev = step.device
    lr_t = lr.reshape(()).to(device=dev, dtype=torch.float32) if isinstance(lr, Tensor) else _f32(lr, dev)
    gm = grad_mul.reshape(()).to(device=dev, dtype=torch.float32) if grad_mul is not None else _f32(1.0, dev)
    counts = step if step.dim() == 1 else step.reshape(())
    first = (counts == 0).to(torch.float32)
    return torch.stack(torch.broadcast_tensors(lr_t, gm, first), dim=-1)


def sgd_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor],
    step_scalars: Tensor,
    found_inf: Tensor | None,
    rng: Tensor | None,
    rng_base: int,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
) -> None:
    """Fused SGD (torch.optim.SGD's update) with optional masters, on device skip.

    ``masters``: fp32 tensors (fp32 master weights, params of any float dtype), int16
    remainders (bf16 params, see :func:`split_master`), or empty (params updated directly;
    bf16 params rounded stochastically when ``rng`` is given). ``momentum_buffers``: fp32,
    empty when ``momentum == 0``. ``step_scalars`` = :func:`sgd_step_scalars`. Maths (fp32,
    one rounding per operation)::

        g = grad * grad_mul;  g = -g if maximize
        g = g + weight_decay * p                       (if weight_decay != 0)
        buf = g  if is_first else  buf * momentum + (1 - dampening) * g     (if momentum != 0)
        g = g + momentum * buf  if nesterov else  buf                       (if momentum != 0)
        p = p - lr * g
    """
    if len(params) == 0:
        return
    dev = params[0].device
    rows = scalar_rows(step_scalars, len(params), 3)
    mom, omd, wd = _f32(momentum, dev), _f32(1.0 - dampening, dev), _f32(weight_decay, dev)
    keep = None if found_inf is None else (found_inf.reshape(()) != 0)
    masters_kind = "none" if len(masters) == 0 else ("remainder" if masters[0].dtype == torch.int16 else "fp32")
    for i, p in enumerate(params):
        lr, grad_mul, first = rows(i)
        if masters_kind == "fp32":
            p32 = masters[i]
        elif masters_kind == "remainder":
            p32 = join_master(p, masters[i])
        else:
            p32 = p.float()
        g = grads[i].float() * grad_mul
        if maximize:
            g = -g
        if weight_decay != 0:
            g = g + wd * p32
        new_buf = None
        if momentum != 0:
            buf = momentum_buffers[i]
            new_buf = torch.where(first != 0, g, buf * mom + omd * g)
            g = g + mom * new_buf if nesterov else new_buf
        pv = p32 - lr * g
        new_master = None
        if masters_kind == "fp32":
            new_p, new_master = pv.to(p.dtype), pv
        elif masters_kind == "remainder":
            new_p, new_master = split_master(pv)
        else:
            rand = None
            if rng is not None and p.dtype == torch.bfloat16:
                r = rng.reshape(-1)
                rand = sr_random16(r[0], r[1], 4 * (rng_base + i), p.numel(), dev)
            new_p = _store_lowp(pv, p.dtype, rand)
        if keep is not None:
            new_p = torch.where(keep, p, new_p)
            if new_master is not None:
                new_master = torch.where(keep, masters[i], new_master)
            if new_buf is not None:
                new_buf = torch.where(keep, momentum_buffers[i], new_buf)
        p.copy_(new_p)
        if new_master is not None:
            masters[i].copy_(new_master)
        if new_buf is not None:
            momentum_buffers[i].copy_(new_buf)


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
