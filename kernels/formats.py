"""The storage formats of the generic optimizer kernel (``optim.py``), each decoded to and encoded from fp32 once.

Twins of :func:`fastamp.reference.optim._load_master` / ``_store_master`` (the master formats) and
``_load_state`` / ``_store_state`` (the state formats), for one block of elements:

* master (constexpr ``MASTER``): :data:`MASTER_NONE` (the param itself; a bf16 one rounded
  stochastically under ``SR_P``), :data:`MASTER_FP32` (an fp32 master, the param its rounding to
  nearest-even), :data:`MASTER_REMAINDER` (bf16 param + int16 remainder: the exact fp32 master,
  :func:`fastamp.reference.join_master`), :data:`MASTER_ULP8` (a bf16 / fp16 param + an int8
  correction in 1/127 ulps, :mod:`fastamp.reference.ulp8`; rounded stochastically under ``SR_P``);
* state (constexpr ``STATE``): :data:`STATE_FP32`, :data:`STATE_BF16` (rounded to nearest-even, or
  stochastically under ``SR``), :data:`STATE_Q8` (uint8 codes over one scale byte per 32 elements,
  :mod:`fastamp.reference.q8`; the ``m`` code, or the ``v`` code of ``w = sqrt(v)``).

A q8 state needs the block seen as ``[BLOCK // 32, 32]`` (one row per q8 block: a row's absmax is
the scale byte); the kernel lays out every stream of a launch that way then (:func:`q8_index`), and
the other formats take either shape.

Every integer operation is uint32 / int32 with the reference's results (shifts clamped below 32
where the reference's int64 shifts further: the same bits, see q8.py), the q8 decode products are
exact and the fp16 ulp8 decode's one int -> fp32 conversion rounds to nearest: every byte is
bit-exact with the reference under ``TRITON_INTERPRET=1`` and on a GPU.

Memory helpers: each holds its ``tl.load`` / ``tl.store`` itself (as ``_common``'s), so the PTX
line info names the calling line; ``tests/tools/test_triton_aot.py`` reads it to tell the streams
apart: the 1-byte streams (q8 codes, ulp8 corrections: :func:`load_bytes`, :func:`store_bytes`,
4 bytes a thread) and the scale bytes (:func:`load_scales`, :func:`store_scales`, one per 32
elements: counted with the per-program control accesses).
"""

import triton
import triton.language as tl
from fastamp.kernels import _common as C

MASTER_NONE, MASTER_FP32, MASTER_REMAINDER, MASTER_ULP8 = 0, 1, 2, 3
STATE_FP32, STATE_BF16, STATE_Q8 = 0, 1, 2
Q8_BLOCK = 32  # fastamp.reference.q8.BLOCK
M_SCALE_MIN = 11  # fastamp.reference.q8.M_SCALE_MIN
W_SCALE_MIN = 75  # fastamp.reference.q8.W_SCALE_MIN

# the dtype kind of a master column (MASTER) and of a state's value column (STATE); q8 scales are KIND_U8
MASTER_KIND = {MASTER_FP32: C.KIND_F32, MASTER_REMAINDER: C.KIND_I16, MASTER_ULP8: C.KIND_I8}
STATE_KIND = {STATE_FP32: C.KIND_F32, STATE_BF16: C.KIND_BF16, STATE_Q8: C.KIND_U8}


@triton.jit
def q8_index(off, end, BLOCK: tl.constexpr):
    """A q8 launch's block ``off + [0, BLOCK)`` as ``[BLOCK // 32, 32]``: element indices, their q8
    block indices ``[BLOCK // 32]`` and the rows that hold an element (``off`` a multiple of BLOCK)."""
    ROWS: tl.constexpr = BLOCK // 32
    off = tl.multiple_of(off, BLOCK)
    rows = tl.arange(0, ROWS)
    idx = off + rows[:, None] * 32 + tl.arange(0, 32)[None, :]
    bidx = off // 32 + rows
    return idx, bidx, bidx * 32 < end


# ---- memory helpers of the byte streams ----


@triton.jit
def load_bytes(ptr, idx, mask, MASKED: tl.constexpr):
    """A 1-byte-per-element stream (q8 codes, ulp8 corrections) as stored; masked lanes read 0."""
    if MASKED:
        return tl.load(ptr + idx, mask=mask, other=0)
    else:
        return tl.load(ptr + idx)


@triton.jit
def store_bytes(ptr, idx, x, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + idx, x, mask=mask)
    else:
        tl.store(ptr + idx, x)


@triton.jit
def load_scales(ptr, bidx, bmask, MASKED: tl.constexpr):
    """The scale bytes of the block's rows (one per 32 elements); rows past the end read 0."""
    if MASKED:
        return tl.load(ptr + bidx, mask=bmask, other=0)
    else:
        return tl.load(ptr + bidx)


@triton.jit
def store_scales(ptr, bidx, x, bmask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + bidx, x, mask=bmask)
    else:
        tl.store(ptr + bidx, x)


# ---- the q8 codec (reference/q8.py; the scalar C++ twin is csrc/q8_math.h) ----


@triton.jit
def _pow2(k):
    """2^k as fp32 for int32 k in [-149, 127], subnormal powers included, from bits."""
    normal = tl.maximum(k + 127, 0) << 23
    sub = tl.full(k.shape, 1, tl.int32) << tl.minimum(tl.maximum(k + 149, 0), 31)
    return tl.where(k >= -126, normal, sub).to(tl.float32, bitcast=True)


@triton.jit
def _code_units(q, P: tl.constexpr):
    """K(q): a code magnitude's value (uint32) in units of 2^-(7+P) of the block scale."""
    low = q & ((1 << P) - 1)
    ex = tl.maximum((q >> P).to(tl.int32) - 1, 0).to(tl.uint32)
    return tl.where(q < (2 << P), q, ((1 << P) + low) << ex)


@triton.jit
def _decode_m(code, s):
    """m of uint8 codes over uint32 scale bytes ``s``: (-1)^sign * K * 2^(s - 137), exact; NaN where s == 0xFF."""
    c = code.to(tl.uint32)
    mag = _code_units(c & 0x7F, 4).to(tl.float32) * _pow2(s.to(tl.int32) - 137)
    bits = mag.to(tl.uint32, bitcast=True) | ((c & 0x80) << 24)
    return tl.where(s == 0xFF, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _decode_v(code, s):
    """v of uint8 codes over uint32 scale bytes: w = K * 2^(s - 138) (exact), v = fp32(w * w); NaN where s == 0xFF."""
    w = _code_units(code.to(tl.uint32), 5).to(tl.float32) * _pow2(s.to(tl.int32) - 138)
    bits = (w * w).to(tl.uint32, bitcast=True)
    return tl.where(s == 0xFF, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _encode_magnitude(a, s, rand16, P: tl.constexpr, SR: tl.constexpr):
    """The code magnitude q (uint32) of abs bits ``a`` (uint32) in a block of scale byte ``s``
    (uint32, >= the element's exponent; s == 0xFF is handled by the caller). SR: ``rand16``
    added just below the kept mantissa, then truncated; else nearest even."""
    e = a >> 23
    sig = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0).to(tl.uint32)
    ec = tl.maximum(e, 1).to(tl.int32) + 7 - s.to(tl.int32)
    shift = (23 - P) + tl.maximum(1 - ec, 0)  # >= 18
    if SR:
        # the reference clamps at 40: shift - 16 <= 24; sig >> shift is 0 from 24 on
        shift = tl.minimum(shift, 40).to(tl.uint32)
        hi = sig >> tl.minimum(shift, 31)
        up = (((sig >> (shift - 16)) & 0xFFFF) + rand16) >> 16
    else:
        # sig < 2^24 <= half from 25 on: no rounding up, as at the reference's 40
        shift = tl.minimum(shift, 25).to(tl.uint32)
        hi = sig >> shift
        half = tl.full(a.shape, 1, tl.uint32) << (shift - 1)
        rem = sig & ((half << 1) - 1)
        up = ((rem > half) | ((rem == half) & ((hi & 1) == 1))).to(tl.uint32)
    base = (tl.maximum(ec - 1, 0) << P).to(tl.uint32)
    return tl.minimum(base + hi + up, (1 << (P + 3)) - 1)


@triton.jit
def _scale_byte(a, mask, S_MIN: tl.constexpr, MASKED: tl.constexpr):
    """Each row's scale byte (uint32 ``[rows]``): max(E(absmax), S_MIN) of the abs bits ``a``
    (``[rows, 32]``); lanes past the tensor's end count as 0."""
    if MASKED:
        a = tl.where(mask, a, 0)
    return tl.maximum(tl.max(a, axis=1) >> 23, S_MIN)


# ---- the ulp8 master (reference/ulp8.py) ----


@triton.jit
def _rne_rshift15(t):
    """round(t / 2^15), ties to even, for int32 t (arithmetic shifts: floor)."""
    fl = t >> 15
    rem = t - (fl << 15)
    up = (rem > 0x4000) | ((rem == 0x4000) & ((fl & 1) == 1))
    return fl + up.to(tl.int32)


@triton.jit
def _ulp8_decode(pbits, corr, P_KIND: tl.constexpr):
    """fp32 master estimate of 16-bit param bits ``pbits`` (uint16) and int8 corrections (ulp8_decode)."""
    if P_KIND == 2:
        pf = (pbits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        pf = pbits.to(tl.float16, bitcast=True).to(tl.float32)
    pa = (pf.to(tl.uint32, bitcast=True) & 0x7FFFFFFF).to(tl.int32)
    neg = (pbits.to(tl.uint32) >> 15) == 1
    c = corr.to(tl.int32)
    c_mag = tl.where(neg, -c, c)
    # floor((c_mag * 2^16 + 127) / 254) for c_mag in [-128, 128]: offset to a positive numerator
    d_est = (c_mag * 65536 + (127 + 254 * 33100)) // 254 - 33100
    if P_KIND == 2:
        mag_bits = pa + d_est
        flip = mag_bits < 0
        mag = tl.where(flip, -mag_bits, mag_bits)
    else:
        normal = (pa > 0x38800000) | ((pa == 0x38800000) & (c_mag >= 0))
        n40 = ((pbits.to(tl.int32) & 0x7FFF) << 16) + d_est
        small = tl.where(n40 < 0, -n40, n40).to(tl.float32) * 9.094947017729282e-13  # 2^-40
        fl = d_est >> 3
        rem = d_est - (fl << 3)
        big = pa + fl + ((rem > 4) | ((rem == 4) & ((fl & 1) == 1))).to(tl.int32)
        mag = tl.where(normal, big, small.to(tl.int32, bitcast=True))
        flip = (normal == 0) & (n40 < 0)
    out = (mag.to(tl.uint32) | (neg != flip).to(tl.uint32) << 31).to(tl.float32, bitcast=True)
    finite = (pa & 0x7F800000) != 0x7F800000
    return tl.where(finite, out, pf)


@triton.jit
def _ulp8_encode(x, rand16, P_KIND: tl.constexpr, SR: tl.constexpr):
    """fp32 master ``x`` -> (param bits uint16 rounded to nearest even, int8 correction) (ulp8_encode)."""
    u = x.to(tl.uint32, bitcast=True)
    a = (u & 0x7FFFFFFF).to(tl.int32)
    if P_KIND == 2:
        pbits = C.f32_to_bf16_bits(x)
        pf = (pbits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        pbits = x.to(tl.float16).to(tl.uint16, bitcast=True)
        pf = pbits.to(tl.float16, bitcast=True).to(tl.float32)
    pa = (pf.to(tl.uint32, bitcast=True) & 0x7FFFFFFF).to(tl.int32)
    finite = (pa & 0x7F800000) != 0x7F800000
    diff = tl.where(finite, a - pa, 0)
    if P_KIND == 2:
        d = diff
    else:
        e = a >> 23
        sig = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
        sh = tl.maximum(e, 1) - 110
        # only masters below 2^-14 (sh <= 2) take fixed40; the clamps keep the other lanes defined
        fixed40 = tl.where(sh >= 0, sig << tl.minimum(tl.maximum(sh, 0), 7), sig >> tl.maximum(tl.minimum(-sh, 31), 0))
        d = tl.where(a >= 0x38800000, diff * 8, fixed40 - ((pbits.to(tl.int32) & 0x7FFF) << 16))
        d = tl.where(finite, d, 0)
    t = d * 127
    if SR:
        c_mag = (t + (rand16.to(tl.int32) >> 1)) >> 15
    else:
        c_mag = _rne_rshift15(t)
    c = tl.where((u >> 31) == 1, -c_mag, c_mag)
    return pbits, c.to(tl.int8)


# ---- the master formats ----


@triton.jit
def load_master(p_ptr, w_ptr, idx, mask, P_KIND: tl.constexpr, MASTER: tl.constexpr, MASKED: tl.constexpr):
    """The fp32 value optimised: the fp32 master, the exact join of param and remainder, the ulp8
    decode of param and correction, or the param itself (``w_ptr``: the master column)."""
    if MASTER == 1:
        p = C.load_f32(w_ptr, idx, mask, 0, MASKED)
    elif MASTER == 2:
        p = C.join_master(C.load_raw(p_ptr, idx, mask, MASKED), C.load_raw(w_ptr, idx, mask, MASKED))
    elif MASTER == 3:
        pbits = C.load_raw(p_ptr, idx, mask, MASKED).to(tl.uint16, bitcast=True)
        p = _ulp8_decode(pbits, load_bytes(w_ptr, idx, mask, MASKED), P_KIND)
    else:
        p = C.load_f32(p_ptr, idx, mask, P_KIND, MASKED)
    return p


@triton.jit
def store_master(
    p_ptr, w_ptr, idx, pv, mask, key, off, P_KIND: tl.constexpr, MASTER: tl.constexpr, SR: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    """Write the new fp32 value ``pv`` in the master format. ``SR`` (the launcher sets it only where
    the reference draws random bits: a bf16 param without a master, an ulp8 correction): rounded
    stochastically with the bits of ``key`` (:func:`_common.sr_stream_key`, stream 0) at ``idx``."""
    if SR:
        block_key = C.sr_block_key(key, off)
    else:
        block_key = key
    if MASTER == 1:
        C.store_raw(w_ptr, idx, pv, mask, MASKED)
        C.store_from_f32(p_ptr, idx, pv, mask, P_KIND, MASKED)
    elif MASTER == 2:
        new_bits, new_rem = C.split_master(pv)
        C.store_raw(p_ptr, idx, new_bits, mask, MASKED)
        C.store_raw(w_ptr, idx, new_rem, mask, MASKED)
    elif MASTER == 3:
        if SR:
            rand16 = C.sr_random16(block_key, idx)
        else:
            rand16 = tl.zeros(idx.shape, tl.uint32)
        new_bits, new_corr = _ulp8_encode(pv, rand16, P_KIND, SR)
        if P_KIND == 2:
            C.store_raw(p_ptr, idx, new_bits, mask, MASKED)
        else:
            C.store_raw(p_ptr, idx, new_bits.to(tl.float16, bitcast=True), mask, MASKED)
        store_bytes(w_ptr, idx, new_corr, mask, MASKED)
    elif P_KIND == 2:
        C.store_raw(p_ptr, idx, C.bf16_bits(pv, block_key, idx, SR), mask, MASKED)
    else:
        C.store_from_f32(p_ptr, idx, pv, mask, P_KIND, MASKED)


# ---- the state formats ----


@triton.jit
def load_state(
    c_ptr, s_ptr, idx, mask, bidx, bmask, STATE: tl.constexpr, CODE_V: tl.constexpr, MASKED: tl.constexpr
):  # fmt: skip
    """One state as fp32: its fp32 or bf16 values (``c_ptr``), or the decode of its q8 codes (``c_ptr``)
    over its scale bytes (``s_ptr``, rows ``bidx``): the ``v`` code where ``CODE_V``, else the ``m`` code."""
    if STATE == 2:
        s = load_scales(s_ptr, bidx, bmask, MASKED).to(tl.uint32)[:, None]
        codes = load_bytes(c_ptr, idx, mask, MASKED)
        if CODE_V:
            x = _decode_v(codes, s)
        else:
            x = _decode_m(codes, s)
    elif STATE == 1:
        x = C.load_f32(c_ptr, idx, mask, 2, MASKED)
    else:
        x = C.load_f32(c_ptr, idx, mask, 0, MASKED)
    return x


@triton.jit
def store_state(
    c_ptr, s_ptr, idx, mask, bidx, bmask, x, w, key, off, STATE: tl.constexpr, CODE_V: tl.constexpr,
    SR: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Write the new fp32 value ``x`` of one state in its format. A q8 ``v`` code encodes ``w`` (the
    caller's ``sqrt_rn(x)``: the update took that root too). ``SR`` (bf16 and q8 only): rounded
    stochastically with the bits of ``key`` (the state's stream) at ``idx``; else to nearest even."""
    if SR:
        block_key = C.sr_block_key(key, off)
    else:
        block_key = key
    if STATE == 2:
        if SR:
            rand16 = C.sr_random16(block_key, idx)
        else:
            rand16 = tl.zeros(idx.shape, tl.uint32)
        if CODE_V:
            a = w.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
            scale = _scale_byte(a, mask, 75, MASKED)  # W_SCALE_MIN
            s = scale[:, None]
            q = _encode_magnitude(a, s, rand16, 5, SR)
            q = tl.where((q == 0) & (a > 0), 1, q)  # a nonzero v never codes to 0
        else:
            u = x.to(tl.uint32, bitcast=True)
            a = u & 0x7FFFFFFF
            scale = _scale_byte(a, mask, 11, MASKED)  # M_SCALE_MIN
            s = scale[:, None]
            q = _encode_magnitude(a, s, rand16, 4, SR) | ((u >> 31) << 7)
        q = tl.where(s == 0xFF, 0, q)
        store_bytes(c_ptr, idx, q.to(tl.uint8), mask, MASKED)
        store_scales(s_ptr, bidx, scale.to(tl.uint8), bmask, MASKED)
    elif STATE == 1:
        C.store_state(c_ptr, idx, x, mask, 2, block_key, SR, MASKED)
    else:
        C.store_state(c_ptr, idx, x, mask, 0, block_key, SR, MASKED)
