"""Triton kernel for AdamW on 8-bit block-scaled moments: ``adamw_q8_``.

Semantics are :func:`fastamp.reference.adamw_q8_` (the q8 codec: :mod:`fastamp.reference.q8`,
the ulp8 master: :mod:`fastamp.reference.ulp8`); registered as ``fastamp_triton::adamw_q8_``
from ``registry.Q8_OPS`` (schema and fake shared with the native op). Launch grouping (one launch
per (param dtype, grad dtype) group), the on-device skip on ``found_inf``, per-tensor step
scalars and the runtime flags are those of ``adamw.py``; the element maths is ``_common.py``'s.

Blocks: a program walks its chunk in blocks of ``BLOCK`` elements seen as ``[BLOCK // 32, 32]``,
one row per q8 block, so a row's absmax (the new scale byte) is a row reduction and the scale
bytes are one ``[BLOCK // 32]`` vector per moment. Chunks and blocks start at multiples of 32,
so no q8 block is split between programs. Per row: decode m and v from the codes and the two
scale bytes, run the AdamW update, write the param (and its master), then encode the new m and
``w = sqrt(v)`` (the root the update took) over the new scales. The last, partial block is
masked; its missing elements count as zeros in the row maxima, as in the reference.

Masters (constexpr ``MASTER``): none (the param itself; a bf16 one rounded stochastically with
``sr_param``), fp32, int16 remainders (bf16 params; the exact master), int8 ulp8 corrections
(bf16 / fp16 params; rounded stochastically with ``sr_param``). ``sr_codes`` rounds the codes
stochastically. Random bits: the reference's counter-based hash, streams ``4 * (rng_base + i)``
(param / correction), ``+ 1`` (m codes), ``+ 2`` (v codes), element index = flat index.

Agreement with the reference: the codecs are integer maths (uint32 / int32, shifts clamped
below 32 where the reference's int64 shifts further: the same results, see q8.py), the decode
products are exact, the AdamW maths is one rounding per operation with correctly rounded sqrt and
division (``RN``), the fp16 ulp8 decode's one int -> fp32 conversion rounds to nearest. So every
byte the op writes is bit-exact under ``TRITON_INTERPRET=1`` and, with IEEE ``sqrt.rn`` /
``div.rn`` (checked in the PTX by tests/tools/test_triton_aot.py), on a GPU.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from fastamp.kernels import _common as C
from fastamp.kernels import _guards as G
from torch import Tensor

from fastamp.ops import registry

__all__ = ["adamw_q8_"]

Q8_BLOCK = 32  # fastamp.reference.q8.BLOCK
MASTER_NONE, MASTER_FP32, MASTER_REMAINDER, MASTER_ULP8 = 0, 1, 2, 3
_MASTER_OF = {torch.float32: MASTER_FP32, torch.int16: MASTER_REMAINDER, torch.int8: MASTER_ULP8}
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _num_blocks(n: int) -> int:
    return -(-n // Q8_BLOCK)


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


# ---- memory helpers of the byte streams (each holds its tl.load / tl.store, as _common's: the PTX
# line info then names the calling line, which the AOT tier reads to tell the streams apart) ----


@triton.jit
def _load_bytes(ptr, idx, mask, MASKED: tl.constexpr):
    """A 1-byte-per-element stream (codes, ulp8 corrections) as stored; masked lanes read 0."""
    if MASKED:
        return tl.load(ptr + idx, mask=mask, other=0)
    else:
        return tl.load(ptr + idx)


@triton.jit
def _store_bytes(ptr, idx, x, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + idx, x, mask=mask)
    else:
        tl.store(ptr + idx, x)


@triton.jit
def _load_scales(ptr, bidx, bmask, MASKED: tl.constexpr):
    """The scale bytes of the block's rows (one per 32 elements); rows past the end read 0."""
    if MASKED:
        return tl.load(ptr + bidx, mask=bmask, other=0)
    else:
        return tl.load(ptr + bidx)


@triton.jit
def _store_scales(ptr, bidx, x, bmask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + bidx, x, mask=bmask)
    else:
        tl.store(ptr + bidx, x)


# ---- the kernel ----


@triton.jit
def _adamw_q8_block(
    p_ptr,
    g_ptr,
    w_ptr,
    cm_ptr,
    sm_ptr,
    cv_ptr,
    sv_ptr,
    off,
    end,
    key_p,
    key_m,
    key_v,
    step_size,
    bc2_sqrt,
    decay,
    grad_mul,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    maximize,
    lerp_small,
    P_KIND: tl.constexpr,
    G_KIND: tl.constexpr,
    MASTER: tl.constexpr,
    SR_P: tl.constexpr,
    SR_C: tl.constexpr,
    RN: tl.constexpr,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One block of elements ``off + [0, BLOCK)`` as ``[BLOCK // 32, 32]``; only a MASKED block may run past ``end``."""
    ROWS: tl.constexpr = BLOCK // 32
    off = tl.multiple_of(off, BLOCK)
    rows = tl.arange(0, ROWS)
    idx = off + rows[:, None] * 32 + tl.arange(0, 32)[None, :]
    mask = idx < end
    bidx = off // 32 + rows
    bmask = bidx * 32 < end
    s_m = _load_scales(sm_ptr, bidx, bmask, MASKED).to(tl.uint32)[:, None]
    s_v = _load_scales(sv_ptr, bidx, bmask, MASKED).to(tl.uint32)[:, None]
    m = _decode_m(_load_bytes(cm_ptr, idx, mask, MASKED), s_m)
    v = _decode_v(_load_bytes(cv_ptr, idx, mask, MASKED), s_v)
    if MASTER == 1:
        p = C.load_f32(w_ptr, idx, mask, 0, MASKED)
    elif MASTER == 2:
        p = C.join_master(C.load_raw(p_ptr, idx, mask, MASKED), C.load_raw(w_ptr, idx, mask, MASKED))
    elif MASTER == 3:
        p = _ulp8_decode(
            C.load_raw(p_ptr, idx, mask, MASKED).to(tl.uint16, bitcast=True),
            _load_bytes(w_ptr, idx, mask, MASKED),
            P_KIND,
        )
    else:
        p = C.load_f32(p_ptr, idx, mask, P_KIND, MASKED)
    g = C.load_f32(g_ptr, idx, mask, G_KIND, MASKED) * grad_mul
    if maximize != 0:
        g = C.neg(g)
    pv = p * decay
    mv, vv = C.adam_moments(g, m, v, beta1, one_minus_beta1, beta2, one_minus_beta2, lerp_small)
    w = C.sqrt_rn(vv, RN)
    denom = C.div_rn(w, bc2_sqrt, RN) + eps
    pv = pv - C.div_rn(step_size * mv, denom, RN)
    if SR_P:
        bkey_p = C.sr_block_key(key_p, off)
    else:
        bkey_p = key_p
    if MASTER == 1:
        C.store_raw(w_ptr, idx, pv, mask, MASKED)
        C.store_from_f32(p_ptr, idx, pv, mask, P_KIND, MASKED)
    elif MASTER == 2:
        new_bits, new_rem = C.split_master(pv)
        C.store_raw(p_ptr, idx, new_bits, mask, MASKED)
        C.store_raw(w_ptr, idx, new_rem, mask, MASKED)
    elif MASTER == 3:
        if SR_P:
            r_p = C.sr_random16(bkey_p, idx)
        else:
            r_p = tl.zeros(idx.shape, tl.uint32)
        new_bits, new_corr = _ulp8_encode(pv, r_p, P_KIND, SR_P)
        if P_KIND == 2:
            C.store_raw(p_ptr, idx, new_bits, mask, MASKED)
        else:
            C.store_raw(p_ptr, idx, new_bits.to(tl.float16, bitcast=True), mask, MASKED)
        _store_bytes(w_ptr, idx, new_corr, mask, MASKED)
    elif P_KIND == 2:
        C.store_raw(p_ptr, idx, C.bf16_bits(pv, bkey_p, idx, SR_P), mask, MASKED)
    else:
        C.store_from_f32(p_ptr, idx, pv, mask, P_KIND, MASKED)
    # the new moments, encoded over the new scale bytes of their rows
    ub = mv.to(tl.uint32, bitcast=True)
    am = ub & 0x7FFFFFFF
    aw = w.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    new_sm = _scale_byte(am, mask, 11, MASKED)  # q8.M_SCALE_MIN
    new_sv = _scale_byte(aw, mask, 75, MASKED)  # q8.W_SCALE_MIN
    if SR_C:
        r_m = C.sr_random16(C.sr_block_key(key_m, off), idx)
        r_v = C.sr_random16(C.sr_block_key(key_v, off), idx)
    else:
        r_m = tl.zeros(idx.shape, tl.uint32)
        r_v = r_m
    s_m2 = new_sm[:, None]
    s_v2 = new_sv[:, None]
    qm = _encode_magnitude(am, s_m2, r_m, 4, SR_C) | ((ub >> 31) << 7)
    qm = tl.where(s_m2 == 0xFF, 0, qm)
    qv = _encode_magnitude(aw, s_v2, r_v, 5, SR_C)
    qv = tl.where((qv == 0) & (aw > 0), 1, qv)
    qv = tl.where(s_v2 == 0xFF, 0, qv)
    _store_bytes(cm_ptr, idx, qm.to(tl.uint8), mask, MASKED)
    _store_bytes(cv_ptr, idx, qv.to(tl.uint8), mask, MASKED)
    _store_scales(sm_ptr, bidx, new_sm.to(tl.uint8), bmask, MASKED)
    _store_scales(sv_ptr, bidx, new_sv.to(tl.uint8), bmask, MASKED)


@C.jit_launched
def _adamw_q8_kernel(
    table_ptr,
    n_tensors,
    n_chunks,
    step_scalars_ptr,
    found_inf_ptr,
    rng_ptr,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    check_found_inf,
    maximize,
    lerp_small,
    P_KIND: tl.constexpr,
    G_KIND: tl.constexpr,
    N_PTR: tl.constexpr,
    MASTER: tl.constexpr,
    SR_P: tl.constexpr,
    SR_C: tl.constexpr,
    ALIGNED: tl.constexpr,
    RN: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # table columns: param, grad, [master], exp_avg codes, exp_avg scales, exp_avg_sq codes,
    # exp_avg_sq scales, [tensor id]
    pid = tl.program_id(0)
    t, start, numel = C.chunk_of(table_ptr, n_tensors, n_chunks, pid, N_PTR, CHUNK)
    HAS_M: tl.constexpr = MASTER != 0
    p_ptr = C.load_ptr(table_ptr, t, P_KIND, ALIGNED)
    g_ptr = C.load_ptr(table_ptr, n_tensors + t, G_KIND, ALIGNED)
    if MASTER == 1:
        w_ptr = C.load_ptr(table_ptr, 2 * n_tensors + t, 0, ALIGNED)
    elif MASTER == 2:
        w_ptr = C.load_ptr(table_ptr, 2 * n_tensors + t, 4, ALIGNED)
    elif MASTER == 3:
        w_ptr = C.load_ptr(table_ptr, 2 * n_tensors + t, 5, ALIGNED)
    else:
        w_ptr = p_ptr
    cm_ptr = C.load_ptr(table_ptr, (2 + HAS_M) * n_tensors + t, 6, ALIGNED)
    sm_ptr = C.load_ptr(table_ptr, (3 + HAS_M) * n_tensors + t, 6, ALIGNED)
    cv_ptr = C.load_ptr(table_ptr, (4 + HAS_M) * n_tensors + t, 6, ALIGNED)
    sv_ptr = C.load_ptr(table_ptr, (5 + HAS_M) * n_tensors + t, 6, ALIGNED)
    HAS_RNG: tl.constexpr = SR_P or SR_C
    if HAS_RNG:
        tensor_id = tl.load(table_ptr + (6 + HAS_M) * n_tensors + t)
        base = C.sr_base_key(rng_ptr)
        key_p = C.sr_stream_key(base, tensor_id, 0)
        key_m = C.sr_stream_key(base, tensor_id, 1)
        key_v = C.sr_stream_key(base, tensor_id, 2)
    else:
        key_p = tl.full([], 0, tl.uint32)
        key_m = key_p
        key_v = key_p
    step_scalars_ptr = C.scalar_row(table_ptr, n_tensors, n_chunks, t, step_scalars_ptr, N_PTR)
    step_size = tl.load(step_scalars_ptr)
    bc2_sqrt = tl.load(step_scalars_ptr + 1)
    decay = tl.load(step_scalars_ptr + 2)
    grad_mul = tl.load(step_scalars_ptr + 3)
    # A non-zero (or NaN) found_inf empties the chunk: no load, no store.
    end = C.chunk_end(start, numel, found_inf_ptr, check_found_inf, CHUNK)
    # full blocks unmasked, then the last partial block masked (see _adamw_kernel)
    off = start
    while off + BLOCK <= end:
        _adamw_q8_block(
            p_ptr, g_ptr, w_ptr, cm_ptr, sm_ptr, cv_ptr, sv_ptr, off, end, key_p, key_m, key_v,
            step_size, bc2_sqrt, decay, grad_mul, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
            maximize, lerp_small, P_KIND, G_KIND, MASTER, SR_P, SR_C, RN, BLOCK, False,
        )  # fmt: skip
        off += BLOCK
    _adamw_q8_block(
        p_ptr, g_ptr, w_ptr, cm_ptr, sm_ptr, cv_ptr, sv_ptr, off, end, key_p, key_m, key_v,
        step_size, bc2_sqrt, decay, grad_mul, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
        maximize, lerp_small, P_KIND, G_KIND, MASTER, SR_P, SR_C, RN, BLOCK, True,
    )  # fmt: skip


def _adamw_q8_impl(
    params: list[Tensor],
    grads: list[Tensor],
    masters: list[Tensor],
    exp_avg_codes: list[Tensor],
    exp_avg_scales: list[Tensor],
    exp_avg_sq_codes: list[Tensor],
    exp_avg_sq_scales: list[Tensor],
    step_scalars: Tensor,
    found_inf: Optional[Tensor],
    rng: Optional[Tensor],
    rng_base: int,
    beta1: float,
    beta2: float,
    eps: float,
    maximize: bool,
    sr_param: bool,
    sr_codes: bool,
    *,
    direct: bool = False,
) -> None:
    op = "adamw_q8_"
    if len(params) == 0:
        return
    dev = params[0].device
    G.guard(rng is not None or not (sr_param or sr_codes), op, "sr_param / sr_codes need rng")
    master = _MASTER_OF.get(masters[0].dtype, -1) if masters else MASTER_NONE
    G.guard(master >= 0, op, f"masters must be float32, int16 or int8, got {masters[0].dtype if masters else None}")
    if master == MASTER_REMAINDER:
        p_dtypes = (torch.bfloat16,)
    elif master == MASTER_ULP8:
        p_dtypes = (torch.bfloat16, torch.float16)
    else:
        p_dtypes = _DTYPES
    u8 = (torch.uint8,)
    lists = [("params", params, p_dtypes, True), ("grads", grads, _DTYPES, False)]
    lists += [("masters", masters, (masters[0].dtype,), True)] if masters else []
    lists += [
        ("exp_avg_codes", exp_avg_codes, u8, True),
        ("exp_avg_scales", exp_avg_scales, u8, True, _num_blocks),
        ("exp_avg_sq_codes", exp_avg_sq_codes, u8, True),
        ("exp_avg_sq_scales", exp_avg_sq_scales, u8, True, _num_blocks),
    ]
    scalars, found_inf, rng, stride = C.checked_scalars(op, dev, params, step_scalars, 4, found_inf, rng)

    def sr_p(p_dtype) -> bool:
        # the param's (or correction's) random bits only where the reference draws them
        return sr_param and (master == MASTER_ULP8 or (master == MASTER_NONE and p_dtype == torch.bfloat16))

    def use_rng(gkey) -> bool:
        return sr_codes or sr_p(gkey[0])

    chunk, block, opts = C.launch_config("adamw_q8")
    with C.device_guard(dev):
        launches = C.optimizer_launches(
            op, dev, lists, lambda i: (params[i].dtype, grads[i].dtype), chunk, stride,
            lambda k: rng_base if use_rng(k) else None, (master, sr_param, sr_codes, rng_base), direct,
        )  # fmt: skip
        for gkey, n_tensors, table, n_chunks, n_ptr in launches:
            p_dtype, g_dtype, aligned = gkey
            _adamw_q8_kernel[(n_chunks,)](
                table,
                n_tensors,
                n_chunks,
                scalars,
                found_inf if found_inf is not None else scalars,
                rng if use_rng(gkey) else table,
                *C.adam_hyper_args(beta1, beta2, eps, found_inf, maximize),
                P_KIND=C.DTYPE_KIND[p_dtype],
                G_KIND=C.DTYPE_KIND[g_dtype],
                N_PTR=n_ptr,
                MASTER=master,
                SR_P=sr_p(p_dtype),
                SR_C=sr_codes,
                ALIGNED=aligned,
                RN=C.RN,
                CHUNK=chunk,
                BLOCK=block,
                **opts,
            )


_adamw_q8_op = registry.register_triton("adamw_q8_", _adamw_q8_impl)


def adamw_q8_(*args) -> None:
    """Triton :func:`fastamp.reference.adamw_q8_` (its arguments, all positional): one launch per (param, grad) dtype group, no host sync."""
    C.call_launcher(_adamw_q8_op, _adamw_q8_impl, registry.coerce("adamw_q8_", args))
