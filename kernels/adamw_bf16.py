"""Triton kernel for AdamW on bf16 params with int16 master remainders and/or stochastic
rounding: ``adamw_bf16_``.

Semantics are :func:`fastamp.reference.adamw_bf16_`; registered as
``fastamp_triton::adamw_bf16_`` from the op table in ``fastamp/ops/registry.py`` (schema and fake
shared with the native op, ``opcheck`` clean). Launch grouping, skipping on ``found_inf`` and
the runtime flags are those of ``adamw.py`` (``adamw_``), and so is the element maths
(``_common.py``).

Agreement with the reference: the element maths is ``adamw_``'s; the master is rebuilt from
(param, remainder) and split again with integer operations, and the stochastic-rounding bits come from the same
counter-based hash as the reference (uint32 wrap-around), so params, remainders and bf16
moments are bit-exact under the interpreter and, given exact sqrt/division, on a GPU: the
integer parts are exact on every target.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from fastamp.kernels import _common as C
from fastamp.kernels import _guards as G
from torch import Tensor

from fastamp.ops import registry

__all__ = ["adamw_bf16_"]

_STATE_DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def _adamw_bf16_block(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    r_ptr,
    vmax_ptr,
    off,
    end,
    key_p,
    key_m,
    key_v,
    key_vmax,
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
    G_KIND: tl.constexpr,
    M_KIND: tl.constexpr,
    V_KIND: tl.constexpr,
    VMAX_KIND: tl.constexpr,
    HAS_REM: tl.constexpr,
    AMSGRAD: tl.constexpr,
    SR_P: tl.constexpr,
    SR_M: tl.constexpr,
    SR_V: tl.constexpr,
    SR_VMAX: tl.constexpr,
    RN: tl.constexpr,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One block of elements ``off + [0, BLOCK)``; only a MASKED block may run past ``end``."""
    idx = C.block_index(off, BLOCK)
    mask = idx < end
    pbits = C.load_raw(p_ptr, idx, mask, MASKED)
    if HAS_REM:
        p = C.join_master(pbits, C.load_raw(r_ptr, idx, mask, MASKED))
    else:
        p = (pbits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    g = C.load_f32(g_ptr, idx, mask, G_KIND, MASKED) * grad_mul
    if maximize != 0:
        g = C.neg(g)
    m = C.load_f32(m_ptr, idx, mask, M_KIND, MASKED)
    v = C.load_f32(v_ptr, idx, mask, V_KIND, MASKED)
    pv = p * decay
    mv, vv = C.adam_moments(g, m, v, beta1, one_minus_beta1, beta2, one_minus_beta2, lerp_small)
    if AMSGRAD:
        vmax = C.nan_maximum(C.load_f32(vmax_ptr, idx, mask, VMAX_KIND, MASKED), vv)
        C.store_state(vmax_ptr, idx, vmax, mask, VMAX_KIND, C.sr_block_key(key_vmax, off), SR_VMAX, MASKED)
        d = vmax
    else:
        d = vv
    pv = C.adam_param(pv, d, mv, step_size, bc2_sqrt, eps, RN)
    C.store_state(m_ptr, idx, mv, mask, M_KIND, C.sr_block_key(key_m, off), SR_M, MASKED)
    C.store_state(v_ptr, idx, vv, mask, V_KIND, C.sr_block_key(key_v, off), SR_V, MASKED)
    if HAS_REM:
        new_bits, new_rem = C.split_master(pv)
        C.store_raw(p_ptr, idx, new_bits, mask, MASKED)
        C.store_raw(r_ptr, idx, new_rem, mask, MASKED)
    else:
        C.store_raw(p_ptr, idx, C.bf16_bits(pv, C.sr_block_key(key_p, off), idx, SR_P), mask, MASKED)


@C.jit_launched
def _adamw_bf16_kernel(
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
    G_KIND: tl.constexpr,
    M_KIND: tl.constexpr,
    V_KIND: tl.constexpr,
    VMAX_KIND: tl.constexpr,
    N_PTR: tl.constexpr,
    HAS_REM: tl.constexpr,
    HAS_RNG: tl.constexpr,
    AMSGRAD: tl.constexpr,
    ALIGNED: tl.constexpr,
    RN: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # table columns: param (bf16 bits), grad, exp_avg, exp_avg_sq, [remainder], [max_exp_avg_sq], [tensor id]
    pid = tl.program_id(0)
    t, start, numel = C.chunk_of(table_ptr, n_tensors, n_chunks, pid, N_PTR, CHUNK)
    p_ptr = C.load_ptr(table_ptr, t, 2, ALIGNED)
    g_ptr = C.load_ptr(table_ptr, n_tensors + t, G_KIND, ALIGNED)
    m_ptr = C.load_ptr(table_ptr, 2 * n_tensors + t, M_KIND, ALIGNED)
    v_ptr = C.load_ptr(table_ptr, 3 * n_tensors + t, V_KIND, ALIGNED)
    if HAS_REM:
        r_ptr = C.load_ptr(table_ptr, 4 * n_tensors + t, 4, ALIGNED)
    else:
        r_ptr = C.load_ptr(table_ptr, t, 4, ALIGNED)
    if AMSGRAD:
        vmax_ptr = C.load_ptr(table_ptr, (4 + HAS_REM) * n_tensors + t, VMAX_KIND, ALIGNED)
    else:
        vmax_ptr = C.load_ptr(table_ptr, t, VMAX_KIND, ALIGNED)
    # stochastic rounding: param (no remainder), and each bf16 moment, one stream each
    SR_P: tl.constexpr = HAS_RNG and not HAS_REM
    SR_M: tl.constexpr = HAS_RNG and M_KIND == 2
    SR_V: tl.constexpr = HAS_RNG and V_KIND == 2
    # (Triton 3.2 refuses chained `and`s)
    SR_VMAX: tl.constexpr = (HAS_RNG and AMSGRAD) and VMAX_KIND == 2
    if HAS_RNG:
        tensor_id = tl.load(table_ptr + (4 + HAS_REM + AMSGRAD) * n_tensors + t)
        base = C.sr_base_key(rng_ptr)
        key_p = C.sr_stream_key(base, tensor_id, 0)
        key_m = C.sr_stream_key(base, tensor_id, 1)
        key_v = C.sr_stream_key(base, tensor_id, 2)
        key_vmax = C.sr_stream_key(base, tensor_id, 3)
    else:
        key_p = tl.full([], 0, tl.uint32)
        key_m = key_p
        key_v = key_p
        key_vmax = key_p
    # this tensor's row of an [n, k] step_scalars, or the shared [k]
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
        _adamw_bf16_block(
            p_ptr, g_ptr, m_ptr, v_ptr, r_ptr, vmax_ptr, off, end, key_p, key_m, key_v, key_vmax,
            step_size, bc2_sqrt, decay, grad_mul, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
            maximize, lerp_small, G_KIND, M_KIND, V_KIND, VMAX_KIND, HAS_REM, AMSGRAD,
            SR_P, SR_M, SR_V, SR_VMAX, RN, BLOCK, False,
        )  # fmt: skip
        off += BLOCK
    _adamw_bf16_block(
        p_ptr, g_ptr, m_ptr, v_ptr, r_ptr, vmax_ptr, off, end, key_p, key_m, key_v, key_vmax,
        step_size, bc2_sqrt, decay, grad_mul, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
        maximize, lerp_small, G_KIND, M_KIND, V_KIND, VMAX_KIND, HAS_REM, AMSGRAD,
        SR_P, SR_M, SR_V, SR_VMAX, RN, BLOCK, True,
    )  # fmt: skip


def _adamw_bf16_impl(
    params: list[Tensor],
    grads: list[Tensor],
    remainders: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    step_scalars: Tensor,
    found_inf: Optional[Tensor],
    rng: Optional[Tensor],
    rng_base: int,
    beta1: float,
    beta2: float,
    eps: float,
    amsgrad: bool,
    maximize: bool,
    *,
    direct: bool = False,
) -> None:
    if len(params) == 0:
        return
    dev = params[0].device
    lists = [("params", params, (torch.bfloat16,), True), ("grads", grads, G.FLOAT_DTYPES, False)]
    lists += [("exp_avgs", exp_avgs, _STATE_DTYPES, True), ("exp_avg_sqs", exp_avg_sqs, _STATE_DTYPES, True)]
    lists += [("remainders", remainders, (torch.int16,), True)] if remainders else []
    lists += [("max_exp_avg_sqs", max_exp_avg_sqs, _STATE_DTYPES, True)] if amsgrad else []
    scalars, found_inf, rng, stride = C.checked_scalars("adamw_bf16_", dev, params, step_scalars, 4, found_inf, rng)
    has_rem = len(remainders) > 0

    def key(i):
        vmax_dtype = max_exp_avg_sqs[i].dtype if amsgrad else torch.float32
        return grads[i].dtype, exp_avgs[i].dtype, exp_avg_sqs[i].dtype, vmax_dtype

    def use_rng(gkey):
        # the random streams are read only where something is rounded stochastically
        _, m_dtype, v_dtype, vmax_dtype, _ = gkey
        return rng is not None and (
            not has_rem or torch.bfloat16 in (m_dtype, v_dtype) or (amsgrad and vmax_dtype == torch.bfloat16)
        )

    chunk, block, opts = C.launch_config("adamw_bf16")
    with C.device_guard(dev):
        launches = C.optimizer_launches(
            "adamw_bf16_", dev, lists, key, chunk, stride, lambda k: rng_base if use_rng(k) else None,
            (has_rem, amsgrad, rng is not None, rng_base), direct,
        )  # fmt: skip
        for gkey, n_tensors, table, n_chunks, n_ptr in launches:
            g_dtype, m_dtype, v_dtype, vmax_dtype, aligned = gkey
            _adamw_bf16_kernel[(n_chunks,)](
                table,
                n_tensors,
                n_chunks,
                scalars,
                found_inf if found_inf is not None else scalars,
                rng if use_rng(gkey) else table,
                *C.adam_hyper_args(beta1, beta2, eps, found_inf, maximize),
                G_KIND=C.DTYPE_KIND[g_dtype],
                M_KIND=C.DTYPE_KIND[m_dtype],
                V_KIND=C.DTYPE_KIND[v_dtype],
                VMAX_KIND=C.DTYPE_KIND[vmax_dtype],
                N_PTR=n_ptr,
                HAS_REM=has_rem,
                HAS_RNG=use_rng(gkey),
                AMSGRAD=amsgrad,
                ALIGNED=aligned,
                RN=C.RN,
                CHUNK=chunk,
                BLOCK=block,
                **opts,
            )


_adamw_bf16_op = registry.register_triton("adamw_bf16_", _adamw_bf16_impl)


def adamw_bf16_(*args) -> None:
    """Triton :func:`fastamp.reference.adamw_bf16_` (its arguments, all positional): one launch per (grad, moment dtypes) group, no host sync."""
    C.call_launcher(_adamw_bf16_op, _adamw_bf16_impl, registry.coerce("adamw_bf16_", args))
