"""Triton kernels for the fused AdamW step: ``adamw_`` (optional fp32 master weights) and
``adamw_bf16_`` (bf16 params with int16 master remainders and/or stochastic rounding).

Semantics are :func:`fastamp.reference.adamw_` and :func:`fastamp.reference.adamw_bf16_`;
registered as ``fastamp_triton::adamw_`` and ``fastamp_triton::adamw_bf16_`` from the op table
in ``fastamp/_ops.py`` (schema and fake shared with the native ops, ``opcheck`` clean).

One launch per (param dtype, grad dtype) group covers every chunk of every tensor (tensors
whose data is not 16-byte aligned go to a second launch, compiled without the alignment
hint). Each program reads ``found_inf`` and, when it is non-zero (NaN included), treats its
chunk as empty: nothing is loaded or stored, so a skipped step leaves every tensor
bit-identical without a host sync. The step scalars ``[step_size, bc2_sqrt, decay,
grad_mul]`` are read from the device tensor. ``maximize``, torch.lerp's branch and whether
``found_inf`` is given are runtime flags, not constexprs, so they compile no new variant.

Agreement with the reference: bit-exact under ``TRITON_INTERPRET=1`` (numpy fp32
arithmetic, one rounding per operation, the same operation order; bf16 stores rounded by
integer ops). On an NVIDIA GPU the kernel is compiled without FMA contraction and divides
and takes square roots with the IEEE ``div.rn.f32`` / ``sqrt.rn.f32`` (inline PTX: Triton
3.2 and 3.3 lower ``tl.div_rn`` / ``tl.sqrt_rn`` to the flush-to-zero forms), so it is
expected to be bit-exact there too; tests/tools/test_triton_aot.py checks the PTX of every
specialisation for it. With Triton older than 3.2 (approximate sqrt/division) it stays
within ``tolerances.ADAMW_GPU_RTOL`` per step.

``adamw_bf16_`` shares the element maths; the master is rebuilt from (param, remainder) and
split again with integer operations, and the stochastic-rounding bits come from the same
counter-based hash as the reference (uint32 wrap-around), so params, remainders and bf16
moments are bit-exact under the interpreter and, given exact sqrt/division, on a GPU: the
integer parts are exact on every target.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from fastamp.kernels import _common as C
from torch import Tensor

from fastamp import _ops

__all__ = ["adamw_", "adamw_bf16_"]

_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@triton.jit
def _adamw_block(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    w_ptr,
    vmax_ptr,
    off,
    end,
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
    HAS_MASTER: tl.constexpr,
    AMSGRAD: tl.constexpr,
    RN: tl.constexpr,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One block of elements ``off + [0, BLOCK)``; only a MASKED block may run past ``end``."""
    idx = C.block_index(off, BLOCK)
    mask = idx < end
    if HAS_MASTER:
        p = C.load_f32(w_ptr, idx, mask, 0, MASKED)
    else:
        p = C.load_f32(p_ptr, idx, mask, P_KIND, MASKED)
    g = C.load_f32(g_ptr, idx, mask, G_KIND, MASKED) * grad_mul
    if maximize != 0:
        g = -g
    m = C.load_f32(m_ptr, idx, mask, 0, MASKED)
    v = C.load_f32(v_ptr, idx, mask, 0, MASKED)
    pv = p * decay
    diff = g - m
    # torch.lerp(m, g, 1 - beta1), with the branch chosen on the host in fp64
    if lerp_small != 0:
        mv = m + one_minus_beta1 * diff
    else:
        mv = g - diff * beta1
    vv = v * beta2 + (one_minus_beta2 * g) * g
    if AMSGRAD:
        a = C.load_f32(vmax_ptr, idx, mask, 0, MASKED)
        # torch.maximum propagates NaN
        vmax = tl.where((a != a) | (vv != vv), a + vv, tl.maximum(a, vv))
        C.store_raw(vmax_ptr, idx, vmax, mask, MASKED)
        d = vmax
    else:
        d = vv
    denom = C.div_rn(C.sqrt_rn(d, RN), bc2_sqrt, RN) + eps
    pv = pv - C.div_rn(step_size * mv, denom, RN)
    C.store_raw(m_ptr, idx, mv, mask, MASKED)
    C.store_raw(v_ptr, idx, vv, mask, MASKED)
    if HAS_MASTER:
        C.store_raw(w_ptr, idx, pv, mask, MASKED)
    C.store_from_f32(p_ptr, idx, pv, mask, P_KIND, MASKED)


@C.jit_launched
def _adamw_kernel(
    table_ptr,
    n_tensors,
    n_chunks,
    step_scalars_ptr,
    found_inf_ptr,
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
    HAS_MASTER: tl.constexpr,
    AMSGRAD: tl.constexpr,
    ALIGNED: tl.constexpr,
    RN: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t, start, numel = C.chunk_of(table_ptr, n_tensors, n_chunks, pid, N_PTR, CHUNK)
    p_ptr = C.load_ptr(table_ptr, t, P_KIND, ALIGNED)
    g_ptr = C.load_ptr(table_ptr, n_tensors + t, G_KIND, ALIGNED)
    m_ptr = C.load_ptr(table_ptr, 2 * n_tensors + t, 0, ALIGNED)
    v_ptr = C.load_ptr(table_ptr, 3 * n_tensors + t, 0, ALIGNED)
    # master and max_exp_avg_sq columns exist only when used; m_ptr stands in otherwise
    if HAS_MASTER:
        w_ptr = C.load_ptr(table_ptr, 4 * n_tensors + t, 0, ALIGNED)
    else:
        w_ptr = m_ptr
    if AMSGRAD:
        vmax_ptr = C.load_ptr(table_ptr, (4 + HAS_MASTER) * n_tensors + t, 0, ALIGNED)
    else:
        vmax_ptr = m_ptr
    step_size = tl.load(step_scalars_ptr)
    bc2_sqrt = tl.load(step_scalars_ptr + 1)
    decay = tl.load(step_scalars_ptr + 2)
    grad_mul = tl.load(step_scalars_ptr + 3)
    # A non-zero (or NaN) found_inf empties the chunk: no load, no store.
    end = C.chunk_end(start, numel, found_inf_ptr, check_found_inf, CHUNK)
    # Full blocks unmasked (vector loads/stores), then the tensor's last partial block masked
    # (all lanes off when there is none). A while loop: a range() over bounds read from memory
    # breaks Triton 3.6's interpreter, and Triton 3.2 compiles no helper call under a runtime
    # `if` inside a loop.
    off = start
    while off + BLOCK <= end:
        _adamw_block(
            p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, vmax_ptr, off, end, step_size, bc2_sqrt, decay, grad_mul,
            beta1, one_minus_beta1, beta2, one_minus_beta2, eps, maximize, lerp_small,
            P_KIND, G_KIND, HAS_MASTER, AMSGRAD, RN, BLOCK, False,
        )  # fmt: skip
        off += BLOCK
    _adamw_block(
        p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, vmax_ptr, off, end, step_size, bc2_sqrt, decay, grad_mul,
        beta1, one_minus_beta1, beta2, one_minus_beta2, eps, maximize, lerp_small,
        P_KIND, G_KIND, HAS_MASTER, AMSGRAD, RN, BLOCK, True,
    )  # fmt: skip


def _check_call(
    op, params, grads, masters_name, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step_scalars, found_inf, amsgrad
):
    """Checks shared by adamw_ and adamw_bf16_: list lengths, step_scalars, found_inf.

    Returns the params' device, or None when there is nothing to update."""
    n = len(params)
    for name, lst in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        if len(lst) != n:
            raise ValueError(f"{op}: {name} has {len(lst)} tensors but params has {n}")
    if len(masters) not in (0, n):
        raise ValueError(f"{op}: {masters_name} must be empty or have one tensor per param ({n}), got {len(masters)}")
    if amsgrad and len(max_exp_avg_sqs) != n:
        raise ValueError(f"{op}: amsgrad needs one max_exp_avg_sq per param ({n}), got {len(max_exp_avg_sqs)}")
    if n == 0:
        return None
    dev = params[0].device
    if step_scalars.numel() != 4 or not step_scalars.is_floating_point():
        raise ValueError(
            f"{op}: step_scalars must be 4 floats [step_size, bc2_sqrt, decay, grad_mul], "
            f"got shape {tuple(step_scalars.shape)} {step_scalars.dtype}"
        )
    if step_scalars.device != dev:
        raise ValueError(f"{op}: step_scalars is on {step_scalars.device} but params are on {dev}")
    _check_found_inf(op, found_inf, dev)
    return dev


def _validate(params, grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step_scalars, found_inf, amsgrad):
    op = "fastamp_triton::adamw_"
    dev = _check_call(
        op, params, grads, "masters", masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step_scalars, found_inf, amsgrad
    )
    if dev is None:
        return
    fp32_lists = [("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs), ("masters", masters)]
    if amsgrad:
        fp32_lists.append(("max_exp_avg_sqs", max_exp_avg_sqs))
    for i, p in enumerate(params):
        g = grads[i]
        if p.device != dev or g.device != dev:
            raise ValueError(f"{op}: params[{i}] ({p.device}) and grads[{i}] ({g.device}) must be on {dev}")
        if p.dtype not in _PARAM_DTYPES:
            raise TypeError(f"{op}: params[{i}] must be a floating point tensor, got {p.dtype}")
        if g.dtype not in _PARAM_DTYPES:
            raise TypeError(f"{op}: grads[{i}] must be a floating point tensor, got {g.dtype}")
        if g.layout != torch.strided or p.layout != torch.strided:
            raise TypeError(f"{op}: params[{i}] and grads[{i}] must be dense, got {p.layout} and {g.layout}")
        if g.numel() != p.numel():
            raise ValueError(f"{op}: grads[{i}] has {g.numel()} elements but params[{i}] has {p.numel()}")
        if not p.is_contiguous():
            raise ValueError(f"{op}: params[{i}] must be contiguous")
        for name, lst in fp32_lists:
            s = lst[i] if lst else None
            if s is None:
                continue
            if s.device != dev:
                raise ValueError(f"{op}: {name}[{i}] is on {s.device} but params are on {dev}")
            if s.dtype != torch.float32:
                raise TypeError(f"{op}: {name}[{i}] must be float32, got {s.dtype}")
            if s.numel() != p.numel():
                raise ValueError(f"{op}: {name}[{i}] has {s.numel()} elements but params[{i}] has {p.numel()}")
            if not s.is_contiguous():
                raise ValueError(f"{op}: {name}[{i}] must be contiguous")


def _adamw_impl(
    params: list[Tensor],
    grads: list[Tensor],
    masters: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    step_scalars: Tensor,
    found_inf: Optional[Tensor],  # noqa: UP045 (runtime annotation, Python 3.9)
    beta1: float,
    beta2: float,
    eps: float,
    amsgrad: bool,
    maximize: bool,
) -> None:
    _validate(params, grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step_scalars, found_inf, amsgrad)
    if len(params) == 0:
        return
    dev = params[0].device
    C.check_runnable("adamw_", dev)
    scalars = step_scalars.reshape(-1)
    if scalars.dtype != torch.float32 or not scalars.is_contiguous():
        scalars = scalars.to(torch.float32).contiguous()
    if found_inf is not None and found_inf.dtype != torch.float32:
        # any non-zero value (NaN included) must stay non-zero: a tiny fp64 could round to 0
        found_inf = found_inf.ne(0).to(torch.float32)
    has_master = len(masters) > 0
    groups = {}
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        g = grads[i] if grads[i].is_contiguous() else grads[i].contiguous()
        streams = [p, g, exp_avgs[i], exp_avg_sqs[i]]
        streams += [masters[i]] if has_master else []
        streams += [max_exp_avg_sqs[i]] if amsgrad else []
        # views at odd offsets go to the kernel compiled without the 16-byte alignment hint
        groups.setdefault((p.dtype, g.dtype, C.is_aligned(*streams)), []).append((i, g))
    chunk, block, opts = C.launch_config("adamw")
    n_ptr = 4 + int(has_master) + int(amsgrad)
    with C.device_guard(dev):
        for (p_dtype, g_dtype, aligned), members in groups.items():
            idxs = [i for i, _ in members]
            columns = [
                [params[i].data_ptr() for i in idxs],
                [g.data_ptr() for _, g in members],
                [exp_avgs[i].data_ptr() for i in idxs],
                [exp_avg_sqs[i].data_ptr() for i in idxs],
            ]
            if has_master:
                columns.append([masters[i].data_ptr() for i in idxs])
            if amsgrad:
                columns.append([max_exp_avg_sqs[i].data_ptr() for i in idxs])
            table, n_chunks = C.build_table(columns, [params[i].numel() for i in idxs], chunk, dev)
            _adamw_kernel[(n_chunks,)](
                table,
                len(idxs),
                n_chunks,
                scalars,
                found_inf if found_inf is not None else scalars,
                C.to_f32(beta1),
                C.to_f32(1.0 - beta1),
                C.to_f32(beta2),
                C.to_f32(1.0 - beta2),
                C.to_f32(eps),
                int(found_inf is not None),
                int(maximize),
                int(C.lerp_small(beta1)),
                P_KIND=C.DTYPE_KIND[p_dtype],
                G_KIND=C.DTYPE_KIND[g_dtype],
                N_PTR=n_ptr,
                HAS_MASTER=has_master,
                AMSGRAD=amsgrad,
                ALIGNED=aligned,
                RN=C.RN,
                CHUNK=chunk,
                BLOCK=block,
                **opts,
            )


_adamw_op = _ops.register_triton("adamw_", _adamw_impl)


def adamw_(
    params,
    grads,
    masters,
    exp_avgs,
    exp_avg_sqs,
    max_exp_avg_sqs,
    step_scalars: Tensor,
    found_inf: Optional[Tensor],  # noqa: UP045 (runtime annotation, Python 3.9)
    beta1: float,
    beta2: float,
    eps: float,
    amsgrad: bool,
    maximize: bool,
) -> None:
    """Triton :func:`fastamp.reference.adamw_`: one launch per (param, grad) dtype group, no host sync."""
    args = (
        params,
        grads,
        masters,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        step_scalars,
        found_inf,
        beta1,
        beta2,
        eps,
        amsgrad,
        maximize,
    )
    _adamw_op(*_ops.coerce("adamw_", args))


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
        g = -g
    m = C.load_f32(m_ptr, idx, mask, M_KIND, MASKED)
    v = C.load_f32(v_ptr, idx, mask, V_KIND, MASKED)
    pv = p * decay
    diff = g - m
    if lerp_small != 0:
        mv = m + one_minus_beta1 * diff
    else:
        mv = g - diff * beta1
    vv = v * beta2 + (one_minus_beta2 * g) * g
    if AMSGRAD:
        a = C.load_f32(vmax_ptr, idx, mask, VMAX_KIND, MASKED)
        vmax = tl.where((a != a) | (vv != vv), a + vv, tl.maximum(a, vv))
        C.store_state(vmax_ptr, idx, vmax, mask, VMAX_KIND, C.sr_block_key(key_vmax, off), SR_VMAX, MASKED)
        d = vmax
    else:
        d = vv
    denom = C.div_rn(C.sqrt_rn(d, RN), bc2_sqrt, RN) + eps
    pv = pv - C.div_rn(step_size * mv, denom, RN)
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


def _check_list_entry(op, name, s, i, dev, dtypes, numel):
    if s.device != dev:
        raise ValueError(f"{op}: {name}[{i}] is on {s.device} but params are on {dev}")
    if s.dtype not in dtypes:
        allowed = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{op}: {name}[{i}] must be {allowed}, got {s.dtype}")
    if s.numel() != numel:
        raise ValueError(f"{op}: {name}[{i}] has {s.numel()} elements but params[{i}] has {numel}")
    if not s.is_contiguous():
        raise ValueError(f"{op}: {name}[{i}] must be contiguous")


def _check_rng(op, rng, dev):
    if rng is None:
        return
    if rng.dtype != torch.int64 or rng.numel() < 2:
        raise ValueError(f"{op}: rng must be an int64 tensor [seed, counter], got {rng.dtype} {tuple(rng.shape)}")
    if rng.device != dev:
        raise ValueError(f"{op}: rng is on {rng.device} but params are on {dev}")


def _check_found_inf(op, found_inf, dev):
    if found_inf is None:
        return
    if found_inf.numel() != 1:
        raise ValueError(f"{op}: found_inf must be a 1-element tensor, got shape {tuple(found_inf.shape)}")
    if found_inf.device != dev:
        raise ValueError(f"{op}: found_inf is on {found_inf.device} but params are on {dev}")


def _validate_bf16(
    params, grads, remainders, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step_scalars, found_inf, rng, amsgrad
):
    op = "fastamp_triton::adamw_bf16_"
    dev = _check_call(
        op,
        params,
        grads,
        "remainders",
        remainders,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        step_scalars,
        found_inf,
        amsgrad,
    )
    if dev is None:
        return
    _check_rng(op, rng, dev)
    lists = [("exp_avgs", exp_avgs, _STATE_DTYPES), ("exp_avg_sqs", exp_avg_sqs, _STATE_DTYPES)]
    if remainders:
        lists.append(("remainders", remainders, (torch.int16,)))
    if amsgrad:
        lists.append(("max_exp_avg_sqs", max_exp_avg_sqs, _STATE_DTYPES))
    for i, p in enumerate(params):
        g = grads[i]
        if p.device != dev or g.device != dev:
            raise ValueError(f"{op}: params[{i}] ({p.device}) and grads[{i}] ({g.device}) must be on {dev}")
        if p.dtype != torch.bfloat16:
            raise TypeError(f"{op}: params[{i}] must be bfloat16, got {p.dtype}")
        if g.dtype not in _PARAM_DTYPES:
            raise TypeError(f"{op}: grads[{i}] must be a floating point tensor, got {g.dtype}")
        if g.layout != torch.strided or p.layout != torch.strided:
            raise TypeError(f"{op}: params[{i}] and grads[{i}] must be dense, got {p.layout} and {g.layout}")
        if g.numel() != p.numel():
            raise ValueError(f"{op}: grads[{i}] has {g.numel()} elements but params[{i}] has {p.numel()}")
        if not p.is_contiguous():
            raise ValueError(f"{op}: params[{i}] must be contiguous")
        for name, lst, dtypes in lists:
            _check_list_entry(op, name, lst[i], i, dev, dtypes, p.numel())


def _adamw_bf16_impl(
    params: list[Tensor],
    grads: list[Tensor],
    remainders: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    step_scalars: Tensor,
    found_inf: Optional[Tensor],  # noqa: UP045 (runtime annotation, Python 3.9)
    rng: Optional[Tensor],  # noqa: UP045
    rng_base: int,
    beta1: float,
    beta2: float,
    eps: float,
    amsgrad: bool,
    maximize: bool,
) -> None:
    _validate_bf16(
        params, grads, remainders, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step_scalars, found_inf, rng, amsgrad
    )
    if len(params) == 0:
        return
    dev = params[0].device
    C.check_runnable("adamw_bf16_", dev)
    scalars = step_scalars.reshape(-1)
    if scalars.dtype != torch.float32 or not scalars.is_contiguous():
        scalars = scalars.to(torch.float32).contiguous()
    if found_inf is not None and found_inf.dtype != torch.float32:
        found_inf = found_inf.ne(0).to(torch.float32)
    if rng is not None and not rng.is_contiguous():
        rng = rng.contiguous()
    has_rem = len(remainders) > 0
    groups = {}
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        g = grads[i] if grads[i].is_contiguous() else grads[i].contiguous()
        vmax_dtype = max_exp_avg_sqs[i].dtype if amsgrad else torch.float32
        streams = [p, g, exp_avgs[i], exp_avg_sqs[i]]
        streams += [remainders[i]] if has_rem else []
        streams += [max_exp_avg_sqs[i]] if amsgrad else []
        key = (g.dtype, exp_avgs[i].dtype, exp_avg_sqs[i].dtype, vmax_dtype, C.is_aligned(*streams))
        groups.setdefault(key, []).append((i, g))
    chunk, block, opts = C.launch_config("adamw_bf16")
    with C.device_guard(dev):
        for (g_dtype, m_dtype, v_dtype, vmax_dtype, aligned), members in groups.items():
            # the random streams are read only where something is rounded stochastically
            use_rng = rng is not None and (
                not has_rem or torch.bfloat16 in (m_dtype, v_dtype) or (amsgrad and vmax_dtype == torch.bfloat16)
            )
            idxs = [i for i, _ in members]
            columns = [
                [params[i].data_ptr() for i in idxs],
                [g.data_ptr() for _, g in members],
                [exp_avgs[i].data_ptr() for i in idxs],
                [exp_avg_sqs[i].data_ptr() for i in idxs],
            ]
            if has_rem:
                columns.append([remainders[i].data_ptr() for i in idxs])
            if amsgrad:
                columns.append([max_exp_avg_sqs[i].data_ptr() for i in idxs])
            if use_rng:
                # the tensor id of the random stream is the index in the call, not in the group
                columns.append([rng_base + i for i in idxs])
            table, n_chunks = C.build_table(columns, [params[i].numel() for i in idxs], chunk, dev)
            _adamw_bf16_kernel[(n_chunks,)](
                table,
                len(idxs),
                n_chunks,
                scalars,
                found_inf if found_inf is not None else scalars,
                rng if use_rng else table,
                C.to_f32(beta1),
                C.to_f32(1.0 - beta1),
                C.to_f32(beta2),
                C.to_f32(1.0 - beta2),
                C.to_f32(eps),
                int(found_inf is not None),
                int(maximize),
                int(C.lerp_small(beta1)),
                G_KIND=C.DTYPE_KIND[g_dtype],
                M_KIND=C.DTYPE_KIND[m_dtype],
                V_KIND=C.DTYPE_KIND[v_dtype],
                VMAX_KIND=C.DTYPE_KIND[vmax_dtype],
                N_PTR=len(columns),
                HAS_REM=has_rem,
                HAS_RNG=use_rng,
                AMSGRAD=amsgrad,
                ALIGNED=aligned,
                RN=C.RN,
                CHUNK=chunk,
                BLOCK=block,
                **opts,
            )


_adamw_bf16_op = _ops.register_triton("adamw_bf16_", _adamw_bf16_impl)


def adamw_bf16_(
    params,
    grads,
    remainders,
    exp_avgs,
    exp_avg_sqs,
    max_exp_avg_sqs,
    step_scalars: Tensor,
    found_inf: Optional[Tensor],  # noqa: UP045 (runtime annotation, Python 3.9)
    rng: Optional[Tensor],  # noqa: UP045
    rng_base: int,
    beta1: float,
    beta2: float,
    eps: float,
    amsgrad: bool,
    maximize: bool,
) -> None:
    """Triton :func:`fastamp.reference.adamw_bf16_`: one launch per (grad, moment dtypes) group, no host sync."""
    args = (
        params,
        grads,
        remainders,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        step_scalars,
        found_inf,
        rng,
        rng_base,
        beta1,
        beta2,
        eps,
        amsgrad,
        maximize,
    )
    _adamw_bf16_op(*_ops.coerce("adamw_bf16_", args))
