"""The ``q8`` moment format: 8-bit float codes over a power-of-two scale per block of 32 (issue 22).

This module is the specification every backend reproduces bit for bit. It uses integer maths
only (int64 tensors holding the fp32 bit patterns), plus :func:`~fastamp.reference.sqrt_rn`
for ``sqrt(v)`` and exact fp32 products of an integer and a power of two on decode.

Layout (n = numel of the moment, flattened in row-major order)
----------------------------------------------------------------
``codes``: uint8, one per element, the moment's shape. ``scales``: uint8 ``[ceil(n / 32)]``;
block ``b`` holds the elements ``32*b .. 32*b+31`` (the last block may be partial; the
missing elements count as zeros). Every function takes an optional ``block=`` (default 32) for
the format ablation (``benchmarks/ablation_q8.py``): the same rules over blocks of ``block``
elements. Only block 32 is the format: no kernel, optimizer or state dict takes another.

Scale byte
----------
``s = max(E(absmax), S_MIN)`` where ``E(absmax)`` is the 8-bit biased exponent field of the
block's absmax (fp32), taken as the maximum of ``bits & 0x7FFFFFFF`` over the block, so no
float comparison is involved. The block's scale is ``2^(s - 126)``, i.e. ``2^(floor(log2
absmax) + 1)``: E8M0 with bias 126 (not OCP's 127), so the byte is read from the fp32 bits
with no clamp, and ``s = 0xFF`` is exactly "the block holds an inf or a NaN".
``S_MIN`` = :data:`M_SCALE_MIN` (11) for m, :data:`W_SCALE_MIN` (75) for ``w = sqrt(v)``:

- a block whose absmax is 0 gets ``s = S_MIN`` and all codes 0 (a zero block), with no
  special case;
- with ``s >= 11`` every decoded m is 0 or a normal fp32 (``>= 2^-126``), and an fp32
  subnormal input needs no normalisation (no count-leading-zeros) to be coded;
- with ``s >= 75`` every decoded nonzero v is ``>= 2^-126``: no decoded v is subnormal, so a
  backend that flushes subnormals computes the same v.
  The price: blocks with ``|m| < 2^-116`` or ``v < 2^-104`` everywhere are coded on a
  coarser grid than ``floor(log2 absmax) + 1`` would give (values far below any eps).

``s = 0xFF`` (an inf or NaN in the block, or a negative v, whose sqrt is NaN): every code of
the block is written 0 and every element of the block decodes to NaN.

Codes
-----
A code's magnitude ``q`` (7 bits for m, 8 for w) is a small float with 3 exponent bits and
``P`` mantissa bits (m: signed E3M4, ``P = 4``, bit 7 the sign; w: unsigned E3M5, ``P = 5``),
subnormals, no inf/NaN, top binade ``[1/2, 1)`` of the scale. Its value, in units of
``2^(s - 126 - 7 - P)`` (2^-11 of the scale for m, 2^-12 for w), is the integer::

    K(q) = q                                     if q < 2^(P+1)
         = (2^P + (q & (2^P - 1))) << ((q >> P) - 1)   otherwise

so ``K`` is monotone in ``q``; max m magnitude 1984/2048 = 0.96875, max w 4032/4096 = 0.984375
of the scale.

Decode (exact): ``m = (-1)^sign * K * 2^(s - 137)`` (exact in fp32 for every byte pair);
``w = K * 2^(s - 138)``, ``v = fp32(w * w)`` (one rounding of the exact square; exact, with no
rounding at all, for ``s`` in [75, 190], which covers every byte encode writes: ``w <= sqrt(fp32
max) < 2^64`` bounds ``s <= 190``).

Encode, per finite element ``x`` (m: the value; v: ``w = sqrt_rn(v)``), with ``a = bits(x) &
0x7FFFFFFF``, ``e = a >> 23``, ``sig = (a & 0x7FFFFF) | (e > 0) << 23``, ``e' = max(e, 1)``::

    ec    = e' + 7 - s                        # the code binade x falls in (<= 0: subnormal)
    shift = min((23 - P) + max(1 - ec, 0), 40)
    k     = (sig >> shift) + up               # up: the rounding, below
    q     = min((max(ec - 1, 0) << P) + k, 2^(P+3) - 1)
    w only: q = max(q, 1) if a > 0            # a nonzero v never codes to 0

A carry (``k = 2^(P+1)``) moves into the next binade by itself; above the top code it
saturates (``q`` max: 0x7F for m, 0xFF for w), which only happens for values within half a
code step (RNE) or one step (SR) of the scale. ``shift >= 18`` always; clamping it at 40 changes
nothing (``sig < 2^24``: both roundings give ``k = 0`` for any shift >= 40, RNE already from 25),
and keeps every intermediate below 2^41 (a 32-bit backend computes ``sig >> min(shift, 31)`` and
``rem`` only for shift <= 24).

``up`` for round-to-nearest-even (``rand16=None``, ``state_rounding="nearest"``): ``rem = sig &
(2^shift - 1)``; up if ``rem > 2^(shift-1)``, or ``rem == 2^(shift-1)`` and ``sig >> shift`` odd.

``up`` for stochastic rounding (``rand16`` given, 16 bits per element, from
:func:`~fastamp.reference.sr_random16` with streams ``4*tensor_id + 1`` for m and ``+ 2`` for
v, element index = the flat index in the whole tensor)::

    up = (((sig >> (shift - 16)) & 0xFFFF) + rand16) >> 16

i.e. the 16 random bits are added just below the kept mantissa and the sum truncated. Bits of
``x`` more than 16 below the kept mantissa are ignored (truncated), so
``E[decode(encode(x))] - x`` lies in ``(-2^-16, 0]`` code steps in magnitude (exactly 0 when
``x`` has no bits there), besides saturation at the top and the nonzero floor of w. For v the
unbiased quantity is ``w = sqrt(v)``: the decoded v is ``w'^2`` with ``E[w'] = w``, so it is
biased up by the variance of ``w'`` (at most a quarter of a squared code step).

Sign (m): bit 7 is the sign bit of ``x``, also when the magnitude codes to 0, so ``-0.0`` and
negative values that round to zero decode to ``-0.0`` (as IEEE rounding does). w ignores the
sign (``sqrt_rn(-0.0) = -0.0`` codes to 0; a negative v makes a NaN block).

The code of an element depends only on its own bits, its block's scale byte and its own random
bits, so splitting a tensor at multiples of 32 (and drawing the random bits by global index)
gives the same bytes as one pass.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastamp.reference.numerics import sqrt_rn

BLOCK = 32
M_SCALE_MIN = 11
W_SCALE_MIN = 75
NONFINITE_SCALE = 0xFF
M_MANT_BITS = 4
W_MANT_BITS = 5

_M32 = 0xFFFFFFFF


def num_blocks(numel: int, *, block: int = BLOCK) -> int:
    """The number of scale bytes of a q8 moment of ``numel`` elements: ``ceil(numel / block)``, block 32 by default."""
    return -(-int(numel) // _check_block(block))


def _check_block(block: int) -> int:
    if isinstance(block, bool) or not isinstance(block, int):
        raise TypeError(f"q8: block must be an int (elements per scale byte), got {block!r}")
    if block < 1:
        raise ValueError(f"q8: block must be >= 1 (elements per scale byte), got {block}")
    return block


def _abs_bits(x: Tensor) -> Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64) & 0x7FFFFFFF


def _check_input(x: Tensor, rand16: Tensor | None, what: str) -> None:
    if not isinstance(x, Tensor) or x.dtype != torch.float32:
        got = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"{what}: expects an fp32 tensor, got {got}")
    if rand16 is not None:
        if not isinstance(rand16, Tensor) or rand16.is_floating_point() or rand16.dtype == torch.bool:
            raise TypeError(f"{what}: rand16 must be an integer tensor (sr_random16), got {rand16!r:.60}")
        if rand16.numel() != x.numel():
            raise ValueError(f"{what}: rand16 has {rand16.numel()} elements, the input {x.numel()}")
        if rand16.device != x.device:
            raise ValueError(f"{what}: rand16 is on {rand16.device}, the input on {x.device}")


def _blocks(x: Tensor, block: int) -> Tensor:
    """``x`` flattened and zero-padded to whole blocks, as ``[nb, block]``.

    Every codec works on this padded view with its scales as a ``[nb, 1]`` column, and
    slices the first ``n`` elements off at the end. Inductor (torch 2.13, CPU) miscompiled
    the flat forms under ``torch.compile``: with a per-element scale from
    ``repeat_interleave(block)[:n]`` (or a broadcast sliced to ``n``) fused into the codes'
    maths, it shrank the loop to the whole blocks and left a last partial block's elements
    unwritten; before that, a zeros + slice-assign padding garbled them
    (``tests/spec/test_formats_q8.py`` compiles every codec and compares).
    """
    flat = x.reshape(-1)
    n = flat.numel()
    nb = num_blocks(n, block=block)
    return torch.nn.functional.pad(flat, (0, nb * block - n)).view(nb, block)


def _block_scale(a: Tensor, scale_min: int) -> Tensor:
    """Scale bytes ``[nb, 1]`` (int64) from the abs bits ``[nb, block]`` of one moment."""
    return torch.clamp(a.amax(dim=1, keepdim=True) >> 23, min=scale_min)


def _encode_magnitude(a: Tensor, s: Tensor, mant_bits: int, rand16: Tensor | None) -> Tensor:
    """The code magnitude q (int64) of each finite element, given abs bits and its block's scale byte."""
    e = a >> 23
    sig = (a & 0x7FFFFF) | ((e > 0).to(torch.int64) << 23)
    ec = torch.clamp(e, min=1) + 7 - s
    shift = torch.clamp((23 - mant_bits) + torch.clamp(1 - ec, min=0), max=40)
    hi = sig >> shift
    if rand16 is None:
        half = torch.ones_like(shift) << (shift - 1)
        rem = sig & ((half << 1) - 1)
        up = (rem > half) | ((rem == half) & ((hi & 1) == 1))
        up = up.to(torch.int64)
    else:
        r = _blocks(rand16.to(device=a.device, dtype=torch.int64), a.shape[1]) & 0xFFFF
        up = (((sig >> (shift - 16)) & 0xFFFF) + r) >> 16
    q = (torch.clamp(ec - 1, min=0) << mant_bits) + hi + up
    return torch.clamp(q, max=(1 << (mant_bits + 3)) - 1)


def _code_units(q: Tensor, mant_bits: int) -> Tensor:
    """K(q): a code magnitude's value in units of 2^-(7+P) of the scale (int64)."""
    low = q & ((1 << mant_bits) - 1)
    normal = ((1 << mant_bits) + low) << torch.clamp((q >> mant_bits) - 1, min=0)
    return torch.where(q < (2 << mant_bits), q, normal)


def _pow2_f32(k: Tensor) -> Tensor:
    """2^k as fp32 for int64 k in [-149, 127] (subnormal powers included), built from bits."""
    # both branches are computed: the subnormal one's shift (not taken for a normal k) is kept
    # below 64, so no lowering meets an int64 shift of 64 or more (undefined in C; torch and
    # inductor define it as 0 today, this does not rely on it)
    sub = torch.ones_like(k) << torch.clamp(k + 149, min=0, max=62)
    bits = torch.where(k >= -126, (k + 127) << 23, sub)
    return bits.to(torch.int32).view(torch.float32)


def q8_encode_m(m: Tensor, rand16: Tensor | None = None, *, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """Encode a first moment (fp32) as q8: signed E3M4 codes over one E8M0 scale byte per 32.

    Args:
        m: fp32 tensor, any shape (flattened row-major into blocks of 32).
        rand16: 16 random bits per element (``sr_random16(seed, step, 4 * tensor_id + 1, n)``)
            for stochastic rounding; ``None`` rounds to nearest even (``state_rounding="nearest"``).
        block: elements per scale byte (default 32, the format). Another value is for the
            format ablation only: the same rules over blocks of ``block`` elements; no kernel
            or optimizer takes it.

    Returns:
        ``(codes, scales)``: uint8 of ``m``'s shape, uint8 ``[ceil(n / block)]``. See the module
        doc for the exact bits. Nothing is read on the host.
    """
    _check_input(m, rand16, "q8_encode_m")
    _check_block(block)
    n = m.numel()
    bits = _blocks(m.contiguous().view(torch.int32).to(torch.int64), block)
    a = bits & 0x7FFFFFFF
    s = _block_scale(a, M_SCALE_MIN)
    q = _encode_magnitude(a, s, M_MANT_BITS, rand16)
    code = q | (((bits >> 31) & 1) << 7)
    code = torch.where(s == NONFINITE_SCALE, torch.zeros_like(code), code)
    return code.to(torch.uint8).reshape(-1)[:n].reshape(m.shape), s.reshape(-1).to(torch.uint8)


def q8_decode_m(codes: Tensor, scales: Tensor, *, block: int = BLOCK) -> Tensor:
    """Decode q8 first-moment codes to fp32, exactly: ``(-1)^sign * K(q) * 2^(s - 137)``; NaN where ``s == 0xFF``.

    ``block``: elements per scale byte, as given to :func:`q8_encode_m` (default 32).
    """
    _check_codes(codes, scales, "q8_decode_m", block)
    c = _blocks(codes.to(torch.int64), block)
    s = scales.to(torch.int64).reshape(-1, 1)
    k = _code_units(c & 0x7F, M_MANT_BITS)
    mag = k.to(torch.float32) * _pow2_f32(torch.clamp(s - 137, min=-149))
    out = torch.where((c & 0x80) != 0, -mag, mag)
    out = torch.where(s == NONFINITE_SCALE, torch.full_like(out, float("nan")), out)
    return out.reshape(-1)[: codes.numel()].reshape(codes.shape)


def q8_encode_v(v: Tensor, rand16: Tensor | None = None, *, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """Encode a second moment (fp32) as q8: ``w = sqrt_rn(v)`` as unsigned E3M5 codes over w's block scale.

    A nonzero v never codes to 0 (the smallest nonzero code instead). A negative v (never
    produced by Adam) has a NaN root and makes its block non-finite, as inf and NaN do.

    Args:
        v: fp32 tensor, any shape.
        rand16: 16 random bits per element (``sr_random16(seed, step, 4 * tensor_id + 2, n)``);
            ``None`` rounds to nearest even.
        block: elements per scale byte, as in :func:`q8_encode_m` (default 32).

    Returns:
        ``(codes, scales)`` as :func:`q8_encode_m`.
    """
    _check_input(v, rand16, "q8_encode_v")
    _check_block(block)
    a = _blocks(_abs_bits(sqrt_rn(v.reshape(-1))), block)
    s = _block_scale(a, W_SCALE_MIN)
    q = _encode_magnitude(a, s, W_MANT_BITS, rand16)
    q = torch.where((a > 0) & (q == 0), torch.ones_like(q), q)
    q = torch.where(s == NONFINITE_SCALE, torch.zeros_like(q), q)
    return q.to(torch.uint8).reshape(-1)[: v.numel()].reshape(v.shape), s.reshape(-1).to(torch.uint8)


def q8_decode_v(codes: Tensor, scales: Tensor, *, block: int = BLOCK) -> Tensor:
    """Decode q8 second-moment codes to fp32: ``v = fp32(w * w)``, ``w = K(q) * 2^(s - 138)``; NaN where ``s == 0xFF``.

    ``w`` is exact in fp32 for every byte pair and ``w * w`` is exact for ``s`` in [75, 190]
    (everything encode writes), so there v is exactly ``K^2 * 2^(2s - 276)``. ``block`` as in
    :func:`q8_decode_m`.
    """
    _check_codes(codes, scales, "q8_decode_v", block)
    c = _blocks(codes.to(torch.int64), block)
    s = scales.to(torch.int64).reshape(-1, 1)
    w = _code_units(c, W_MANT_BITS).to(torch.float32) * _pow2_f32(torch.clamp(s - 138, min=-149))
    out = w * w
    out = torch.where(s == NONFINITE_SCALE, torch.full_like(out, float("nan")), out)
    return out.reshape(-1)[: codes.numel()].reshape(codes.shape)


def _check_codes(codes: Tensor, scales: Tensor, what: str, block: int = BLOCK) -> None:
    _check_block(block)
    for name, t in (("codes", codes), ("scales", scales)):
        if not isinstance(t, Tensor) or t.dtype != torch.uint8:
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(f"{what}: {name} must be uint8, got {got}")
    nb = num_blocks(codes.numel(), block=block)
    if scales.dim() != 1 or scales.numel() != nb:
        raise ValueError(
            f"{what}: {codes.numel()} codes need {nb} scale bytes (1-D, one per {block} codes), "
            f"got shape {tuple(scales.shape)}"
        )
    if scales.device != codes.device:
        raise ValueError(f"{what}: scales are on {scales.device}, codes on {codes.device}")
