"""The reference of the optimizer ops: their step scalars and element maths, per tensor.

:func:`optim_` is the one optimizer op: an update rule of :data:`RULES` (AdamW, SGD, Lion: the
element maths on fp32 values, written once each) run on the value optimised, kept in a master
format (fp32 master, bf16 + int16 remainder, 16-bit param + int8 ulp8 correction, or the param
itself, with optional stochastic rounding), and on the rule's states, kept in a state format
(fp32, bf16, or 8-bit block-scaled q8 codes, :mod:`fastamp.reference.q8`). The per-rule ops
``adamw_``, ``adamw_bf16_``, ``adamw_q8_``, ``sgd_``, ``sgd_q8_``, ``lion_``, ``lion_q8_`` are
the same op with their older argument lists (wrappers of :func:`optim_`). The step scalars
(``adamw_step_scalars``, ``sgd_step_scalars``, ``lion_step_scalars``) are computed once per
launch on the device, shared (``[k]``) or one row per tensor (``[n, k]``, see
:func:`scalar_rows`). The low-bit storage helpers are in :mod:`fastamp.reference.formats`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from fastamp.reference.formats import _store_lowp, join_master, split_master, sr_random16
from fastamp.reference.numerics import _f32, sqrt_rn
from fastamp.reference.q8 import q8_decode_m, q8_decode_v, q8_encode_m, q8_encode_v
from fastamp.reference.ulp8 import ulp8_decode, ulp8_encode

# torch's CPU loops compute a vector's full SIMD blocks with one pow and its tail (and a 0-dim
# call) with another, whose fp64 results differ in the last bit (79 of 4,000 counts on a Xeon
# here). Padding the counts with ones to a multiple of 64 puts every count in a full block, so a
# count's row does not depend on where it sits in the vector: a bucket's step
# (FusedOptimizer.step_bucket) sees a count in a shorter vector than the whole step does.
# Chunks of at most _LANE_CHUNK stay below torch's grain size (one thread, no chunk seam inside).
_LANE_PAD = 64
_LANE_CHUNK = 16384


def _pow(base: Tensor, st: Tensor) -> Tensor:
    """``torch.pow(base, st)``, each count of a 1-D ``st`` computed as a SIMD lane of a full block."""
    if st.dim() == 0 or st.device.type != "cpu":
        return torch.pow(base, st)
    n = st.numel()
    padded = torch.ones(-(-max(n, 1) // _LANE_PAD) * _LANE_PAD, dtype=st.dtype)
    padded[:n] = st
    return torch.cat([torch.pow(base, chunk) for chunk in padded.split(_LANE_CHUNK)])[:n]


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
    wide, lr_t, gm = _widened(dev, lr, grad_mul)
    st = (step if step.dim() == 1 else step.reshape(())).to(wide)
    bc1 = 1 - _pow(torch.full((), beta1, dtype=wide, device=dev), st)
    bc2 = 1 - _pow(torch.full((), beta2, dtype=wide, device=dev), st)
    step_size = lr_t / bc1
    bc2_sqrt = bc2.sqrt()
    decay = 1 - lr_t * weight_decay
    return torch.stack(torch.broadcast_tensors(step_size, bc2_sqrt, decay, gm), dim=-1).float()


def _widened(dev: torch.device, lr, grad_mul: Tensor | None) -> tuple[torch.dtype, Tensor, Tensor]:
    """The wide dtype of the step-scalar maths on ``dev`` (fp64; fp32 on MPS), and ``lr`` and ``grad_mul`` (1 if None) in it."""
    wide = torch.float32 if dev.type == "mps" else torch.float64
    lr_t = (
        lr.reshape(()).to(device=dev, dtype=wide)
        if isinstance(lr, Tensor)
        else torch.full((), lr, dtype=wide, device=dev)
    )
    gm = (
        grad_mul.reshape(()).to(device=dev, dtype=wide)
        if grad_mul is not None
        else torch.ones((), dtype=wide, device=dev)
    )
    return wide, lr_t, gm


def _lerp_low(beta1: float) -> bool:
    # torch.lerp's branch (weight < 0.5), decided on the fp32 weight as the kernels do.
    return float(torch.tensor(1.0 - beta1, dtype=torch.float32)) < 0.5


def scalar_rows(step_scalars: Tensor, n: int, k: int) -> Callable[[int], tuple[Tensor, ...]]:
    """The step scalars of tensor ``i`` of a launch of ``n`` tensors: ``rows(i)`` -> ``k`` fp32 0-dim tensors.

    ``step_scalars`` holds either one set shared by every tensor (shape ``[k]``) or one set
    per tensor (shape ``[n, k]``: row ``i`` for tensor ``i``, e.g. bias corrections from
    each param's own step count). Every backend reads it the same way.
    """
    shape = tuple(step_scalars.shape)
    if shape not in ((k,), (n, k)):
        raise ValueError(f"step_scalars of shape {list(shape)} for {n} tensors: expected [{k}] or [{n}, {k}]")
    s = step_scalars.to(torch.float32)
    if s.dim() == 2:
        return lambda i: tuple(s[i].unbind(0))
    shared = tuple(s.unbind(0))
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
    args = (params, grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step_scalars, found_inf, beta1,
            beta2, eps, amsgrad, maximize)  # fmt: skip
    optim_(*to_optim("adamw_", args))


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
    args = (params, grads, remainders, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step_scalars, found_inf, rng,
            rng_base, beta1, beta2, eps, amsgrad, maximize)  # fmt: skip
    optim_(*to_optim("adamw_bf16_", args))


def _master_kind(masters: Sequence[Tensor]) -> str:
    """The master format of a ``masters`` list: "none", "remainder" (int16), "ulp8" (int8; ``adamw_q8_``) or "fp32"."""
    if len(masters) == 0:
        return "none"
    return {torch.int16: "remainder", torch.int8: "ulp8"}.get(masters[0].dtype, "fp32")


def _load_master(kind: str, p: Tensor, masters: Sequence[Tensor], i: int) -> Tensor:
    """The fp32 value optimised for ``params[i]``: its fp32 master, its exact bf16 + remainder join, or itself."""
    if kind == "fp32":
        return masters[i]
    if kind == "remainder":
        return join_master(p, masters[i])
    if kind == "ulp8":
        return ulp8_decode(p, masters[i])
    return p.float()


def _store_master(
    kind: str, pv: Tensor, p: Tensor, masters: Sequence[Tensor], i: int, rng, rng_base: int, keep
) -> None:
    """Write the new fp32 value ``pv`` of ``params[i]`` in the format ``kind`` (the param rounded to
    nearest-even, split into bf16 + remainder, or, without a master, bf16 rounded stochastically with
    the random bits of stream ``4 * (rng_base + i)`` when ``rng`` is given); nothing changes where
    ``keep`` (the skip) is set."""
    new_master = None
    if kind == "fp32":
        new_p, new_master = pv.to(p.dtype), pv
    elif kind == "remainder":
        new_p, new_master = split_master(pv)
    elif kind == "ulp8":
        rand = None
        if rng is not None:
            r = rng.reshape(-1)
            rand = sr_random16(r[0], r[1], 4 * (rng_base + i), p.numel(), p.device)
        new_p, new_master = ulp8_encode(pv.float().contiguous(), p.dtype, rand)
    else:
        rand = None
        if rng is not None and p.dtype == torch.bfloat16:
            r = rng.reshape(-1)
            rand = sr_random16(r[0], r[1], 4 * (rng_base + i), p.numel(), p.device)
        new_p = _store_lowp(pv, p.dtype, rand)
    if keep is not None:
        new_p = torch.where(keep, p, new_p)
        if new_master is not None:
            new_master = torch.where(keep, masters[i], new_master)
    p.copy_(new_p)
    if new_master is not None:
        masters[i].copy_(new_master)


def adamw_q8_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor],
    exp_avg_codes: Sequence[Tensor],
    exp_avg_scales: Sequence[Tensor],
    exp_avg_sq_codes: Sequence[Tensor],
    exp_avg_sq_scales: Sequence[Tensor],
    step_scalars: Tensor,
    found_inf: Tensor | None,
    rng: Tensor | None,
    rng_base: int,
    beta1: float,
    beta2: float,
    eps: float,
    maximize: bool,
    sr_param: bool,
    sr_codes: bool,
) -> None:
    """AdamW with 8-bit block-scaled moments (the ``q8`` format of :mod:`fastamp.reference.q8`).

    The element maths is :func:`adamw_`'s, on the moments decoded to fp32
    (:func:`~fastamp.reference.q8.q8_decode_m` / :func:`~fastamp.reference.q8.q8_decode_v`); the
    updated fp32 moments drive this step's update and are then encoded again, block by block
    (32 elements of the flattened tensor per scale byte). ``exp_avg_codes[i]`` /
    ``exp_avg_sq_codes[i]`` are uint8 shaped like ``params[i]`` (contiguous), the scales uint8
    ``[ceil(n / 32)]``. ``masters``: fp32 masters (params of any float dtype), int16 remainders
    (bf16 params), int8 ``ulp8`` corrections (bf16 / fp16 params: the master is
    ``ulp8_decode(param, correction)``, stored back by :func:`~fastamp.reference.ulp8.ulp8_encode`),
    or empty (the param is updated in place).

    ``rng`` (int64 ``[seed, counter]``) is read when ``sr_codes`` or ``sr_param`` is set:
    ``sr_codes`` rounds the codes stochastically (streams ``4 * (rng_base + i) + 1`` for m and
    ``+ 2`` for v), else to nearest even; ``sr_param`` rounds a bf16 param without a master, or
    an ulp8 correction, stochastically (stream ``4 * (rng_base + i)``). A non-zero (or NaN) ``found_inf`` writes
    nothing. Only integer maths, ``+ - * /`` and :func:`sqrt_rn`: every backend is bit-exact
    with this function on the CPU.
    """
    args = (params, grads, masters, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales,
            step_scalars, found_inf, rng, rng_base, beta1, beta2, eps, maximize, sr_param, sr_codes)  # fmt: skip
    optim_(*to_optim("adamw_q8_", args))


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
    args = (params, grads, masters, momentum_buffers, step_scalars, found_inf, rng, rng_base, momentum,
            dampening, weight_decay, nesterov, maximize)  # fmt: skip
    optim_(*to_optim("sgd_", args))


def lion_step_scalars(lr, weight_decay: float, grad_mul: Tensor | None = None, device=None) -> Tensor:
    """``[lr, decay, grad_mul]`` (fp32, on ``device``; default: ``lr``'s or ``grad_mul``'s, else the CPU) for :func:`lion_`.

    ``decay = 1 - lr * weight_decay`` is computed in fp64 (where the device has it) and
    rounded once to fp32, as :func:`adamw_step_scalars` does; ``lr`` is rounded to fp32.
    Lion has no bias correction, so the scalars do not depend on a step count and are
    shared by every tensor of a launch (``[3]``; the kernels also take ``[n, 3]``).
    No host sync.
    """
    if device is None:
        device = lr.device if isinstance(lr, Tensor) else (grad_mul.device if grad_mul is not None else "cpu")
    _, lr_t, gm = _widened(torch.device(device), lr, grad_mul)
    decay = 1 - lr_t * weight_decay
    return torch.stack((lr_t, decay, gm)).float()


def lion_sign(c: Tensor) -> Tensor:
    """Lion's ``sign``: 1 where ``c > 0``, -1 where ``c < 0``, ``c`` itself elsewhere (±0 keep their sign, NaN stays NaN).

    Every backend writes it as these two comparisons, so the signed zero and NaN cases agree bit for bit.
    """
    one = torch.ones((), dtype=c.dtype, device=c.device)
    return torch.where(c > 0, one, torch.where(c < 0, -one, c))


def lion_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    step_scalars: Tensor,
    found_inf: Tensor | None,
    rng: Tensor | None,
    rng_base: int,
    beta1: float,
    beta2: float,
    maximize: bool,
) -> None:
    """Fused Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") with optional masters.

    ``masters`` and ``rng`` as in :func:`sgd_`: fp32 masters (params of any float dtype), int16
    remainders (bf16 params: the exact fp32 master, see :func:`split_master`), or empty (the
    param is updated directly; bf16 params rounded stochastically when ``rng`` is given, with
    the random bits of stream ``4 * (rng_base + i)``). ``exp_avgs``: fp32, one per param.
    ``step_scalars`` = :func:`lion_step_scalars`, ``[3]`` or ``[n, 3]``. A non-zero (or NaN)
    ``found_inf`` writes nothing. Maths (fp32, one rounding per operation, no FMA)::

        g = grad * grad_mul;  g = -g if maximize
        p = p * decay                                    # decay = 1 - lr * weight_decay
        c = m * beta1 + g * (1 - beta1)
        p = p - lr * lion_sign(c)                        # sign: +-1, or c itself for +-0 and NaN
        m = m * beta2 + g * (1 - beta2)

    Only + - * and comparisons: every backend, a GPU's Triton included, is bit-exact with this.
    """
    args = (params, grads, masters, exp_avgs, step_scalars, found_inf, rng, rng_base, beta1, beta2, maximize)
    optim_(*to_optim("lion_", args))


# Elements per slice of the codec in :func:`one_state_q8`: a multiple of the q8 block (32), small
# enough that the codec's int64 temporaries (~100 B per element) stay in cache and bound the
# step's scratch memory (measured 4x faster than whole 16M-element tensors on a CPU). On a GPU
# every slice costs ~20 kernel launches, so slices there are 64x larger (~400 MB of scratch).
Q8_SLICE = 1 << 16
Q8_SLICE_DEVICE = 1 << 22


def one_state_q8(
    dense: Callable,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor],
    codes: Sequence[Tensor],
    scales: Sequence[Tensor],
    step_scalars: Tensor,
    found_inf: Tensor | None,
    rng: Tensor | None,
    rng_base: int,
    *hyper_and_flags,
    slice_numel: int | None = None,
) -> None:
    """A one-state rule (``dense``: :func:`sgd_` or :func:`lion_`, or a backend's kernel of it) on a q8 state.

    What :func:`sgd_q8_` and :func:`lion_q8_` are, and how the backends without a fused kernel
    run them. ``hyper_and_flags``: the dense op's hyperparameters, then ``sr_param`` and
    ``sr_codes``. Per tensor ``i``: the state decoded exactly from ``codes[i]`` and ``scales[i]``
    (:func:`~fastamp.reference.q8.q8_decode_m`), ``dense`` run on it with the param, its master
    and grad (and ``rng`` only when ``sr_param``: a bf16 param without a master rounded with the
    random bits of stream ``4 * (rng_base + i)``), the new state encoded again
    (:func:`~fastamp.reference.q8.q8_encode_m`), rounded stochastically with the random bits of
    stream ``4 * (rng_base + i) + 1`` at the elements' flat indices when ``sr_codes`` (AdamW's
    q8 kernel uses the same stream for ``exp_avg``), else to nearest even. A non-zero (or NaN)
    ``found_inf`` writes nothing: ``dense`` skips, and every code and scale byte is kept (a
    ``where``, not a re-encode: encoding a decoded block need not give its scale byte back).
    The codec runs on slices of ``slice_numel`` elements (default :data:`Q8_SLICE` on the CPU,
    :data:`Q8_SLICE_DEVICE` elsewhere; whole blocks): the bytes do not depend on it.
    """
    *hyper, sr_param, sr_codes = hyper_and_flags
    if len(params) == 0:
        return
    if slice_numel is None:
        slice_numel = Q8_SLICE if params[0].device.type == "cpu" else Q8_SLICE_DEVICE
    if (sr_codes or sr_param) and rng is None:
        raise ValueError("one_state_q8: sr_codes / sr_param need rng ([seed, counter], int64)")
    if slice_numel <= 0 or slice_numel % 32:
        raise ValueError(f"one_state_q8: slice_numel must be a positive multiple of 32, got {slice_numel}")
    keep = None if found_inf is None else (found_inf.reshape(()) != 0)
    seed = counter = None
    if rng is not None:
        seed, counter = rng.reshape(-1)[0], rng.reshape(-1)[1]
    rows = step_scalars.dim() == 2
    for i, p in enumerate(params):
        n = p.numel()
        flat_codes, flat_scales = codes[i].view(-1), scales[i].view(-1)
        spans = [(start, min(n, start + slice_numel)) for start in range(0, n, slice_numel)]
        state = torch.empty(n, dtype=torch.float32, device=p.device)
        for start, end in spans:
            state[start:end] = q8_decode_m(flat_codes[start:end], flat_scales[start // 32 : -(-end // 32)])
        dense(
            [p], [grads[i]], [masters[i]] if len(masters) else [], [state.view(p.shape)],
            step_scalars[i : i + 1] if rows else step_scalars, found_inf, rng if sr_param else None, rng_base + i,
            *hyper,
        )  # fmt: skip
        for start, end in spans:
            rand = None
            if sr_codes:
                rand = sr_random16(seed, counter, 4 * (rng_base + i) + 1, end - start, p.device, offset=start)
            new_codes, new_scales = q8_encode_m(state[start:end], rand)
            for dst, new in (
                (flat_codes[start:end], new_codes),
                (flat_scales[start // 32 : -(-end // 32)], new_scales),
            ):
                dst.copy_(new if keep is None else torch.where(keep, dst, new))


def sgd_q8_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor],
    momentum_buffer_codes: Sequence[Tensor],
    momentum_buffer_scales: Sequence[Tensor],
    step_scalars: Tensor,
    found_inf: Tensor | None,
    rng: Tensor | None,
    rng_base: int,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    sr_param: bool,
    sr_codes: bool,
) -> None:
    """:func:`sgd_` with the momentum buffer held as q8 codes (uint8 shaped like the param) and scales (``[ceil(n / 32)]``).

    Bit for bit :func:`sgd_` on the decoded buffer, then the buffer encoded again (see
    :func:`one_state_q8`); ``momentum`` must be non-zero. Only integer maths and ``+ - *``:
    every backend is bit-exact with this function on the CPU.
    """
    args = (params, grads, masters, momentum_buffer_codes, momentum_buffer_scales, step_scalars, found_inf,
            rng, rng_base, momentum, dampening, weight_decay, nesterov, maximize, sr_param, sr_codes)  # fmt: skip
    optim_(*to_optim("sgd_q8_", args))


def lion_q8_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor],
    exp_avg_codes: Sequence[Tensor],
    exp_avg_scales: Sequence[Tensor],
    step_scalars: Tensor,
    found_inf: Tensor | None,
    rng: Tensor | None,
    rng_base: int,
    beta1: float,
    beta2: float,
    maximize: bool,
    sr_param: bool,
    sr_codes: bool,
) -> None:
    """:func:`lion_` with ``exp_avg`` held as q8 codes and scales: :func:`lion_` on the decoded state, encoded again (see :func:`one_state_q8`)."""
    args = (params, grads, masters, exp_avg_codes, exp_avg_scales, step_scalars, found_inf, rng, rng_base,
            beta1, beta2, maximize, sr_param, sr_codes)  # fmt: skip
    optim_(*to_optim("lion_q8_", args))


# ------------------------------------------------------------------------------------------
# The generic optimizer op: one update rule x one master format x one state format.
#
# ``optim_`` is every optimizer op above in one: an update rule (:data:`RULES`: its element maths
# on fp32 values, its step-scalar row, its hyperparameters and its state streams), the format the
# value optimised is kept in (the master, read from the ``masters`` list's dtype: fp32 master,
# int16 remainder, int8 ulp8 correction, or none), and the format of the rule's states (read from
# the ``states`` list's dtype: fp32, bf16, or q8 codes + block scales). The element maths is
# written once per rule (the ``step`` functions below) and the codecs once per format
# (:func:`_load_master` / :func:`_store_master`, :func:`_load_state` / :func:`_store_state`).

MAXIMIZE = 1  # flags of optim_: minimise -loss
AMSGRAD = 2  # AdamW: keep max_exp_avg_sq (a third state) and divide by its root
NESTEROV = 4  # SGD: Nesterov momentum
SR_PARAM = 8  # round a bf16 param without a master, or an ulp8 correction, stochastically (stream 4 * id)
SR_STATE = 16  # round bf16 states, or q8 codes, stochastically (stream 4 * id + 1 + j for state j)
FLAG_NAMES = {
    MAXIMIZE: "MAXIMIZE",
    AMSGRAD: "AMSGRAD",
    NESTEROV: "NESTEROV",
    SR_PARAM: "SR_PARAM",
    SR_STATE: "SR_STATE",
}
ALL_FLAGS = MAXIMIZE | AMSGRAD | NESTEROV | SR_PARAM | SR_STATE


class StateDef(NamedTuple):
    """One state stream of a rule: its state-dict key, and the q8 code it is stored with ("m": signed, "v": a root)."""

    key: str
    q8_code: str


class RuleDef(NamedTuple):
    """An update rule of :func:`optim_`.

    ``scalars``: the names of a step-scalar row (``step_scalars`` is ``[k]`` or ``[n, k]``);
    ``hyper``: the names of the ``hyper`` list; ``flags``: the rule's own flags it reads (besides
    MAXIMIZE, SR_PARAM, SR_STATE); ``states(hyper, flags)``: its state streams for these settings;
    ``step(p, g, states, scalars, hyper, flags)``: the new fp32 value and states from the fp32
    value ``p``, the raw grad ``g`` (fp32, not yet multiplied by ``grad_mul``), the fp32 states and
    the row's 0-dim scalars; ``check(hyper, flags)`` raises ValueError on values the kernels
    cannot take.
    """

    name: str
    scalars: tuple[str, ...]
    hyper: tuple[str, ...]
    flags: int
    states: Callable[[Sequence[float], int], tuple[StateDef, ...]]
    step: Callable
    check: Callable[[Sequence[float], int], None]


def _adamw_rule_step(p, g, states, sc, hyper, flags):
    step_size, bc2_sqrt, decay, grad_mul = sc
    beta1, beta2, eps = hyper
    dev = p.device
    b1, omb1 = _f32(beta1, dev), _f32(1.0 - beta1, dev)
    b2, omb2 = _f32(beta2, dev), _f32(1.0 - beta2, dev)
    m, v = states[0], states[1]
    g = g * grad_mul
    if flags & MAXIMIZE:
        g = -g
    pv = p * decay
    diff = g - m
    mv = m + omb1 * diff if _lerp_low(beta1) else g - diff * b1
    vv = v * b2 + (omb2 * g) * g
    out = [mv, vv]
    d = vv
    if flags & AMSGRAD:
        d = torch.maximum(states[2], vv)
        out.append(d)
    denom = sqrt_rn(d) / bc2_sqrt + _f32(eps, dev)
    return pv - (step_size * mv) / denom, out


def _adamw_check(hyper, flags) -> None:
    beta1, beta2, eps = hyper
    for name, b in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {b}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def _sgd_rule_step(p, g, states, sc, hyper, flags):
    lr, grad_mul, first = sc
    momentum, dampening, weight_decay = hyper
    dev = p.device
    g = g * grad_mul
    if flags & MAXIMIZE:
        g = -g
    if weight_decay != 0:
        g = g + _f32(weight_decay, dev) * p
    out = []
    if momentum != 0:
        mom = _f32(momentum, dev)
        buf = torch.where(first != 0, g, states[0] * mom + _f32(1.0 - dampening, dev) * g)
        out.append(buf)
        g = g + mom * buf if flags & NESTEROV else buf
    return p - lr * g, out


def _sgd_check(hyper, flags) -> None:
    # torch.optim.SGD's own checks are the optimizer's (fastamp.optim.SGD); the kernels take any value
    return None


def _lion_rule_step(p, g, states, sc, hyper, flags):
    lr, decay, grad_mul = sc
    beta1, beta2 = hyper
    dev = p.device
    m = states[0]
    g = g * grad_mul
    if flags & MAXIMIZE:
        g = -g
    pv = p * decay
    c = m * _f32(beta1, dev) + g * _f32(1.0 - beta1, dev)
    pv = pv - lr * lion_sign(c)
    return pv, [m * _f32(beta2, dev) + g * _f32(1.0 - beta2, dev)]


def _lion_check(hyper, flags) -> None:
    for name, b in zip(("beta1", "beta2"), hyper):
        if not 0.0 <= b <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {b}")


RULES: dict[str, RuleDef] = {
    "adamw": RuleDef(
        "adamw",
        ("step_size", "bc2_sqrt", "decay", "grad_mul"),
        ("beta1", "beta2", "eps"),
        AMSGRAD,
        lambda hyper, flags: (
            (StateDef("exp_avg", "m"), StateDef("exp_avg_sq", "v"))
            + ((StateDef("max_exp_avg_sq", "v"),) if flags & AMSGRAD else ())
        ),
        _adamw_rule_step,
        _adamw_check,
    ),
    "sgd": RuleDef(
        "sgd",
        ("lr", "grad_mul", "is_first"),
        ("momentum", "dampening", "weight_decay"),
        NESTEROV,
        lambda hyper, flags: (StateDef("momentum_buffer", "m"),) if hyper[0] != 0 else (),
        _sgd_rule_step,
        _sgd_check,
    ),
    "lion": RuleDef(
        "lion",
        ("lr", "decay", "grad_mul"),
        ("beta1", "beta2"),
        0,
        lambda hyper, flags: (StateDef("exp_avg", "m"),),
        _lion_rule_step,
        _lion_check,
    ),
}


def state_format(states: Sequence[Tensor]) -> str:
    """The format of an ``optim_`` states list, from its first tensor: "fp32", "bf16", "q8" (uint8), or "none" (empty)."""
    if len(states) == 0:
        return "none"
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.uint8: "q8"}.get(states[0].dtype, str(states[0].dtype))


def streams_per_state(fmt: str) -> int:
    """Tensors per param per state in an ``optim_`` states list: 2 for q8 (codes, block scales), else 1."""
    return 2 if fmt == "q8" else 1


def _load_state(fmt: str, tensors: list[Tensor], code: str) -> Tensor:
    """One state of one param as fp32 (flattened for q8): the tensor itself, its fp32 value, or its q8 decode."""
    if fmt == "q8":
        decode = q8_decode_v if code == "v" else q8_decode_m
        return decode(tensors[0], tensors[1]).reshape(-1)
    return tensors[0].float()


def _store_state(fmt: str, tensors: list[Tensor], code: str, new: Tensor, rand16: Tensor | None, keep) -> None:
    """Write the new fp32 value of one state in its format (bf16 / q8 rounded with ``rand16`` when given); ``keep``: skip."""
    if fmt == "q8":
        encode = q8_encode_v if code == "v" else q8_encode_m
        pairs = zip(tensors, encode(new.reshape(-1), rand16))
    else:
        pairs = ((tensors[0], _store_lowp(new, tensors[0].dtype, rand16)),)
    for dst, value in pairs:
        value = value.reshape(dst.shape)
        dst.copy_(value if keep is None else torch.where(keep, dst, value))


def optim_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor],
    states: Sequence[Tensor],
    step_scalars: Tensor,
    found_inf: Tensor | None,
    rng: Tensor | None,
    rng_base: int,
    rule: str,
    hyper: Sequence[float],
    flags: int,
) -> None:
    """One fused optimizer step of every tensor: the update ``rule`` on the value optimised and the rule's states.

    ``rule``: a name of :data:`RULES` (``"adamw"``, ``"sgd"``, ``"lion"``), with its ``hyper``
    list (AdamW ``[beta1, beta2, eps]``; SGD ``[momentum, dampening, weight_decay]``; Lion
    ``[beta1, beta2]``) and its step-scalar rows (``step_scalars``: ``[k]`` shared or ``[n, k]``,
    see :func:`adamw_step_scalars`, :func:`sgd_step_scalars`, :func:`lion_step_scalars`).

    The value optimised for ``params[i]``, by the dtype of ``masters`` (empty, or one per param):
    an fp32 master (params of any float dtype; the param receives it rounded to nearest-even), an
    int16 remainder (bf16 params: :func:`join_master` / :func:`split_master`, exact), an int8 ulp8
    correction (bf16 / fp16 params: :func:`~fastamp.reference.ulp8.ulp8_decode` /
    :func:`~fastamp.reference.ulp8.ulp8_encode`), or none (the param itself).

    ``states``: the rule's state streams (``RULES[rule].states(hyper, flags)``: AdamW ``exp_avg``,
    ``exp_avg_sq`` and with AMSGRAD ``max_exp_avg_sq``; SGD with a momentum its
    ``momentum_buffer``; Lion ``exp_avg``), stream by stream, each the ``n`` tensors of the
    params in order; all of one format, read from their dtype: fp32, bf16 (rounded to
    nearest-even, or stochastically under SR_STATE), or q8 (each state two lists: uint8 codes
    shaped like the param, then uint8 block scales ``[ceil(numel / 32)]``; the code of
    :mod:`fastamp.reference.q8` the rule names, ``m`` or ``v``; rounded stochastically under
    SR_STATE).

    ``flags``: MAXIMIZE, AMSGRAD (AdamW), NESTEROV (SGD), SR_PARAM (a bf16 param without a
    master, or an ulp8 correction, rounded stochastically with the bits of stream
    ``4 * (rng_base + i)``), SR_STATE (state ``j`` rounded stochastically with stream
    ``4 * (rng_base + i) + 1 + j``); ``rng`` (int64 ``[seed, counter]``) is read only under
    SR_PARAM or SR_STATE (see :func:`sr_random16`). A non-zero (or NaN) ``found_inf`` writes
    nothing. Element maths: the rule's ``step`` on fp32 values, one rounding per operation, no
    FMA; only ``+ - * /``, comparisons, integer maths and :func:`sqrt_rn`.
    """
    if len(params) == 0:
        return
    r = RULES.get(rule)
    if r is None:
        raise ValueError(f"optim_: unknown rule {rule!r}; expected one of {tuple(RULES)}")
    if (flags & (SR_PARAM | SR_STATE)) and rng is None:
        raise ValueError("optim_: SR_PARAM / SR_STATE need rng ([seed, counter], int64)")
    n = len(params)
    dev = params[0].device
    defs = r.states(hyper, flags)
    fmt = state_format(states)
    per = streams_per_state(fmt)
    if len(states) != n * per * len(defs):
        raise ValueError(
            f"optim_: rule {rule!r} with these settings keeps {len(defs)} state(s) ({per} list(s) each in {fmt}), "
            f"so {n * per * len(defs)} state tensors for {n} params, got {len(states)}"
        )
    rows = scalar_rows(step_scalars, n, len(r.scalars))
    keep = None if found_inf is None else (found_inf.reshape(()) != 0)
    kind = _master_kind(masters)
    seed = counter = None
    if rng is not None:
        seed, counter = rng.reshape(-1)[0], rng.reshape(-1)[1]
    for i, p in enumerate(params):
        numel = p.numel()
        mine = [[states[(j * per + k) * n + i] for k in range(per)] for j in range(len(defs))]
        p32 = _load_master(kind, p, masters, i)
        old = [_load_state(fmt, t, d.q8_code) for t, d in zip(mine, defs)]
        if fmt == "q8":
            p32 = p32.reshape(-1)
        g = grads[i].float().reshape(p32.shape)
        pv, new = r.step(p32, g, old, rows(i), hyper, flags)
        for j, (t, d, value) in enumerate(zip(mine, defs, new)):
            rand = None
            if flags & SR_STATE:
                rand = sr_random16(seed, counter, 4 * (rng_base + i) + 1 + j, numel, dev)
            _store_state(fmt, t, d.q8_code, value, rand, keep)
        _store_master(kind, pv.reshape(p.shape), p, masters, i, rng if flags & SR_PARAM else None, rng_base, keep)


def _bits(*pairs) -> int:
    return sum(flag for on, flag in pairs if on)


def to_optim(op: str, args: tuple) -> tuple:
    """The positional arguments of :func:`optim_` that compute the per-rule ``op`` (its positional ``args``).

    ``adamw_`` / ``adamw_bf16_`` / ``adamw_q8_`` run rule ``"adamw"``, ``sgd_`` / ``sgd_q8_``
    ``"sgd"``, ``lion_`` / ``lion_q8_`` ``"lion"``; their moment lists become the ``states`` list
    (q8: codes, then scales, per moment); ``adamw_bf16_``'s ``rng`` rounds both the param
    without a remainder and bf16 moments (SR_PARAM, SR_STATE), ``sgd_`` / ``lion_``'s a bf16
    param without a master (SR_PARAM); the q8 ops' ``sr_param`` / ``sr_codes`` are SR_PARAM /
    SR_STATE.
    """
    if op == "adamw_":
        params, grads, masters, m, v, vmax, sc, fi, b1, b2, eps, amsgrad, maximize = args
        flags = _bits((maximize, MAXIMIZE), (amsgrad, AMSGRAD))
        states = [*m, *v, *(vmax if amsgrad else ())]
        return params, grads, masters, states, sc, fi, None, 0, "adamw", (b1, b2, eps), flags
    if op == "adamw_bf16_":
        params, grads, rems, m, v, vmax, sc, fi, rng, base, b1, b2, eps, amsgrad, maximize = args
        sr = rng is not None
        flags = _bits((maximize, MAXIMIZE), (amsgrad, AMSGRAD), (sr, SR_STATE), (sr and not len(rems), SR_PARAM))
        states = [*m, *v, *(vmax if amsgrad else ())]
        return params, grads, rems, states, sc, fi, rng, base, "adamw", (b1, b2, eps), flags
    if op == "adamw_q8_":
        params, grads, masters, mq, ms, vq, vs, sc, fi, rng, base, b1, b2, eps, maximize, sr_param, sr_codes = args
        flags = _bits((maximize, MAXIMIZE), (sr_param, SR_PARAM), (sr_codes, SR_STATE))
        return params, grads, masters, [*mq, *ms, *vq, *vs], sc, fi, rng, base, "adamw", (b1, b2, eps), flags
    if op in ("sgd_", "sgd_q8_"):
        if op == "sgd_":
            params, grads, masters, bufs, sc, fi, rng, base, mom, damp, wd, nesterov, maximize = args
            states, sr_param, sr_codes = bufs, rng is not None, False
        else:
            params, grads, masters, codes, scales, sc, fi, rng, base, mom, damp, wd, nesterov, maximize = args[:14]
            sr_param, sr_codes = args[14:]
            if mom == 0:
                raise ValueError("sgd_q8_: momentum must be non-zero (the q8 codes hold the momentum buffer)")
            states = [*codes, *scales]
        flags = _bits((maximize, MAXIMIZE), (nesterov, NESTEROV), (sr_param, SR_PARAM), (sr_codes, SR_STATE))
        return params, grads, masters, states, sc, fi, rng, base, "sgd", (mom, damp, wd), flags
    if op in ("lion_", "lion_q8_"):
        if op == "lion_":
            params, grads, masters, states, sc, fi, rng, base, b1, b2, maximize = args
            sr_param, sr_codes = rng is not None, False
        else:
            params, grads, masters, codes, scales, sc, fi, rng, base, b1, b2, maximize, sr_param, sr_codes = args
            states = [*codes, *scales]
        flags = _bits((maximize, MAXIMIZE), (sr_param, SR_PARAM), (sr_codes, SR_STATE))
        return params, grads, masters, states, sc, fi, rng, base, "lion", (b1, b2), flags
    raise ValueError(f"to_optim: {op!r} is not a per-rule optimizer op")
