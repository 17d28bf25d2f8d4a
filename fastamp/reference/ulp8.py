"""The ``ulp8`` master: a 16-bit param plus an int8 holding its rounding error (issue 22).

This module is the specification every backend reproduces bit for bit (integer maths on the
fp32 bit patterns; the one float step is the correctly rounded int -> fp32 conversion of the
fp16 decode).

Encode (fp32 master ``M`` -> param ``p``, int8 ``c``)
----------------------------------------------------
``p = M.to(dtype)``: the master rounded to nearest even (bf16 or fp16), exactly what the model
would get without a master. ``c`` is the rounding error ``M - p`` as a fraction of *half an
ULP of the 16-bit format at M* (the spacing of bf16/fp16 values in M's binade), times 127::

    c = round(127 * (M - p) / (ulp16(M) / 2))        in [-127, 127]; -128 is never written

``|M - p| <= ulp16(M) / 2`` (round to nearest), so ``|c| <= 127``. Using the spacing at M
rather than at p keeps the full range of c when p is a power of two and M lies just below it.
In integers, with ``a``/``pa`` the magnitude bits of ``M``/``p`` (fp32) and the error measured
in ``D`` units of ``ulp16(M) / 2^16`` (toward larger magnitude positive)::

    bf16:                   D = a - pa                  (an fp32 ulp is 2^-16 of a bf16 ulp)
    fp16, |M| >= 2^-14:     D = (a - pa) * 8            (2^-13)
    fp16, |M| <  2^-14:     D = floor(|M| * 2^40) - (bits16(p) & 0x7FFF) * 2^16
                                                        (ulp16 = 2^-24 there, D unit 2^-40)
    t = 127 * D;  c_mag = round(t / 2^15);  c = -c_mag if M is negative else c_mag

(bits differences count fp32 ulps of M's binade even when p is the power of two just above M).
``|D| <= 2^15``. Only fp16 masters below 2^-17 lose bits in ``floor(|M| * 2^40)`` (truncation,
below 2^-16 of an fp16 ulp).

Rounding of ``t / 2^15``: to nearest, ties to even (``rand16=None``); or stochastic,
``c_mag = (t + (rand16 >> 1)) >> 15`` (arithmetic shift = floor; the 15 top random bits
match the 15 fraction bits of ``t / 2^15`` exactly, so ``E[c] = 127 * (M - p) / (ulp16/2)``
with no bias at all). Random bits: :func:`~fastamp.reference.sr_random16` with stream
``4 * tensor_id + 0`` (the param's stream), element index = flat index.

Decode (``p``, ``c`` -> fp32 estimate of M)
-----------------------------------------
In magnitude terms (``c_mag = -c`` for a negative p): ``D' = round(c_mag * 2^15 / 127)``
(``floor((c_mag * 2^16 + 127) / 254)``, never a tie), then::

    bf16:  |M'| bits = pa + D'                                   (exact, no rounding)
    fp16:  p in the normal range, not (|p| == 2^-14 and c_mag < 0):
           |M'| bits = pa + round_half_even(D' / 8)
           otherwise |M'| = fp32(N) * 2^-40, N = (bits16(p) & 0x7FFF) * 2^16 + D'
                                                                 (int -> fp32, to nearest even)

with p's sign (a magnitude of 0 keeps it, so ±0 decodes to ±0). This is ``p + c * ulp16(M) /
254`` rounded to fp32 once, where the decoder reads M's binade from p and the direction of c
(below a power of two whose lower binade is twice as fine, the spacing halves). A negative
magnitude (only at p = ±0 with c pointing toward zero, which encode never writes) flips the sign.

Round trip: ``ulp8_encode(ulp8_decode(p, c))`` gives back ``(p, c)`` exactly under round to
nearest, for every c in [-126, 126], and for ±127 when p is even (±127 is half an ULP, a tie,
which goes to the even neighbour). Stochastically it gives c or a neighbour: the decoded value
lies within 0.002 (bf16) / 0.0175 (fp16) of a correction step of c.

Error bound (``tests/spec/test_formats_q8.py`` checks it on every case): with ``u = ulp16(M)``
and ``r32`` the fp32 rounding of the decode (0 for bf16, ``ulp32(M')/2`` for fp16)::

    round to nearest:  |M' - M| <= u/508 + u/2^17 + r32       (half a c step + half a D unit)
    stochastic:        |M' - M| <  u/254 + u/2^17 + r32       (one c step)

plus, for fp16 masters below 2^-17, the truncation ``2^-40``. As a fraction of ``|M|``: about
2^-15 (bf16) and 2^-18 (fp16) with round to nearest, twice that stochastically.

Edges: NaN master -> NaN param (as ``.to(dtype)``), ``c = 0``, decodes to NaN; ±inf -> ±inf,
``c = 0``; a finite master that rounds to inf (bf16: ``|M| >= 0x7F7F8000`` bits; fp16: ``|M|
>= 65520``) -> ±inf param, ``c = 0``, decodes to ±inf (the master is lost, as the param is);
the max finite 16-bit value with the rest of its rounding interval is coded normally; ±0 ->
±0, ``c = 0``, decodes to ±0; masters too small for the 16-bit format (bf16 below 2^-134,
fp16 below 2^-25) give p = ±0 and their value in c (bf16 subnormal masters are exact to
half a c step like any other; fp16 ones down to 2^-17 too, below that see the truncation).
"""

from __future__ import annotations

import torch
from torch import Tensor

_FP16_MIN_NORMAL_BITS = 0x38800000  # 2^-14 as fp32 bits
_DTYPES = (torch.bfloat16, torch.float16)


def _abs_bits32(x: Tensor) -> Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64) & 0x7FFFFFFF


def _bits16(p: Tensor) -> Tensor:
    return p.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def _rne_rshift(t: Tensor, k: int) -> Tensor:
    """round(t / 2^k), ties to even, for signed int64 t."""
    fl = t >> k
    rem = t - (fl << k)
    half = 1 << (k - 1)
    up = (rem > half) | ((rem == half) & ((fl & 1) == 1))
    return fl + up.to(torch.int64)


def ulp8_encode(master: Tensor, dtype: torch.dtype, rand16: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """fp32 master -> (16-bit param rounded to nearest even, int8 correction).

    Args:
        master: fp32 tensor, any shape.
        dtype: ``torch.bfloat16`` or ``torch.float16``, the param's dtype.
        rand16: 16 random bits per element (``sr_random16(seed, step, 4 * tensor_id, n)``) for
            a stochastically rounded correction; ``None`` rounds it to nearest even.

    Returns:
        ``(param, correction)``: ``dtype`` and int8, both of ``master``'s shape. See the module
        doc for the exact bits.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"ulp8_encode: dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    if not isinstance(master, Tensor) or master.dtype != torch.float32:
        got = master.dtype if isinstance(master, Tensor) else type(master).__name__
        raise TypeError(f"ulp8_encode: expects an fp32 master, got {got}")
    if rand16 is not None:
        if not isinstance(rand16, Tensor) or rand16.is_floating_point() or rand16.dtype == torch.bool:
            raise TypeError("ulp8_encode: rand16 must be an integer tensor (sr_random16)")
        if rand16.numel() != master.numel() or rand16.device != master.device:
            raise ValueError(
                f"ulp8_encode: rand16 must have the master's {master.numel()} elements on {master.device}, "
                f"got {rand16.numel()} on {rand16.device}"
            )
    flat = master.reshape(-1)
    param = flat.to(dtype)
    a = _abs_bits32(flat)
    pa = _abs_bits32(param.float())
    if dtype == torch.bfloat16:
        d = a - pa
    else:
        e = a >> 23
        sig = (a & 0x7FFFFF) | ((e > 0).to(torch.int64) << 23)
        sh = torch.clamp(e, min=1) - 110
        fixed40 = torch.where(sh >= 0, sig << torch.clamp(sh, min=0), sig >> torch.clamp(-sh, max=40))
        d = torch.where(a >= _FP16_MIN_NORMAL_BITS, (a - pa) * 8, fixed40 - ((_bits16(param) & 0x7FFF) << 16))
    d = torch.where(torch.isfinite(param), d, torch.zeros_like(d))
    t = d * 127
    if rand16 is None:
        c_mag = _rne_rshift(t, 15)
    else:
        c_mag = (t + ((rand16.reshape(-1).to(torch.int64) & 0xFFFF) >> 1)) >> 15
    neg = (flat.view(torch.int32) < 0) if flat.numel() else torch.zeros(0, dtype=torch.bool, device=flat.device)
    c = torch.where(neg, -c_mag, c_mag)
    return param.reshape(master.shape), c.to(torch.int8).reshape(master.shape)


def ulp8_decode(param: Tensor, correction: Tensor) -> Tensor:
    """(16-bit param, int8 correction) -> the fp32 master estimate (see the module doc for the bits and the bound)."""
    if param.dtype not in _DTYPES:
        raise TypeError(f"ulp8_decode: param must be bf16 or fp16, got {param.dtype}")
    if correction.dtype != torch.int8 or correction.shape != param.shape or correction.device != param.device:
        raise ValueError(
            f"ulp8_decode: correction must be int8 of the param's shape {tuple(param.shape)} on {param.device}, "
            f"got {correction.dtype} {tuple(correction.shape)} on {correction.device}"
        )
    p = param.reshape(-1)
    pf = p.float()
    pa = _abs_bits32(pf)
    neg = (_bits16(p) >> 15) == 1
    c = correction.reshape(-1).to(torch.int64)
    c_mag = torch.where(neg, -c, c)
    d_est = torch.div(c_mag * 65536 + 127, 254, rounding_mode="floor")
    if param.dtype == torch.bfloat16:
        mag_bits = pa + d_est
        mag = torch.where(mag_bits < 0, -mag_bits, mag_bits).to(torch.int32).view(torch.float32)
        flip = mag_bits < 0
    else:
        normal = (pa > _FP16_MIN_NORMAL_BITS) | ((pa == _FP16_MIN_NORMAL_BITS) & (c_mag >= 0))
        n40 = ((_bits16(p) & 0x7FFF) << 16) + d_est
        small = n40.abs().to(torch.float32) * (2.0**-40)
        big = (pa + _rne_rshift(d_est, 3)).to(torch.int32).view(torch.float32)
        mag = torch.where(normal, big, small)
        flip = ~normal & (n40 < 0)
    out = torch.where(neg ^ flip, -mag, mag)
    out = torch.where(torch.isfinite(pf), out, pf)
    return out.reshape(param.shape)
