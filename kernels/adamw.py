"""Triton kernel for the fused AdamW step with optional fp32 master weights: ``adamw_``.

Semantics are :func:`fastamp.reference.adamw_`; registered as ``fastamp_triton::adamw_`` from
the op table in ``fastamp/ops/registry.py`` (schema and fake shared with the native op, ``opcheck``
clean). ``adamw_bf16_`` (bf16 params with int16 remainders and/or stochastic rounding) is in
``adamw_bf16.py``; the element maths both share is in ``_common.py``.

One launch per (param dtype, grad dtype) group covers every chunk of every tensor (tensors
whose data is not 16-byte aligned go to a second launch, compiled without the alignment
hint). Each program reads ``found_inf`` and, when it is non-zero (NaN included), treats its
chunk as empty: nothing is loaded or stored, so a skipped step leaves every tensor
bit-identical without a host sync. The step scalars ``[step_size, bc2_sqrt, decay,
grad_mul]`` are read from the device tensor, at the offset the table's last column gives the
program's tensor: its row of an ``[n, 4]`` (index in the call times 4), or 0 for a shared
``[4]``; both forms run the same compiled kernel. ``maximize``, torch.lerp's branch and whether
``found_inf`` is given are runtime flags, not constexprs, so they compile no new variant.

Agreement with the reference: bit-exact under ``TRITON_INTERPRET=1`` (numpy fp32
arithmetic, one rounding per operation, the same operation order; bf16 stores rounded by
integer ops). On an NVIDIA GPU the kernel is compiled without FMA contraction and divides
and takes square roots with the IEEE ``div.rn.f32`` / ``sqrt.rn.f32`` (inline PTX: Triton
3.2 and 3.3 lower ``tl.div_rn`` / ``tl.sqrt_rn`` to the flush-to-zero forms), so it is
expected to be bit-exact there too; tests/tools/test_triton_aot.py checks the PTX of every
specialisation for it. With Triton older than 3.2 (approximate sqrt/division) it stays
within ``tolerances.ADAMW_GPU_RTOL`` per step.
"""

from typing import Optional

import triton
import triton.language as tl
from fastamp.kernels import _common as C
from fastamp.kernels import _guards as G
from torch import Tensor

from fastamp.ops import registry

__all__ = ["adamw_"]


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
        g = C.neg(g)
    m = C.load_f32(m_ptr, idx, mask, 0, MASKED)
    v = C.load_f32(v_ptr, idx, mask, 0, MASKED)
    pv = p * decay
    mv, vv = C.adam_moments(g, m, v, beta1, one_minus_beta1, beta2, one_minus_beta2, lerp_small)
    if AMSGRAD:
        vmax = C.nan_maximum(C.load_f32(vmax_ptr, idx, mask, 0, MASKED), vv)
        C.store_raw(vmax_ptr, idx, vmax, mask, MASKED)
        d = vmax
    else:
        d = vv
    pv = C.adam_param(pv, d, mv, step_size, bc2_sqrt, eps, RN)
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
    # this tensor's row of an [n, k] step_scalars, or the shared [k]
    step_scalars_ptr = C.scalar_row(table_ptr, n_tensors, n_chunks, t, step_scalars_ptr, N_PTR)
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


def _adamw_impl(
    params: list[Tensor],
    grads: list[Tensor],
    masters: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    step_scalars: Tensor,
    found_inf: Optional[Tensor],
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
    lists = [("params", params, G.FLOAT_DTYPES, True), ("grads", grads, G.FLOAT_DTYPES, False)]
    lists += [("exp_avgs", exp_avgs, G.F32, True), ("exp_avg_sqs", exp_avg_sqs, G.F32, True)]
    lists += [("masters", masters, G.F32, True)] if masters else []
    lists += [("max_exp_avg_sqs", max_exp_avg_sqs, G.F32, True)] if amsgrad else []
    scalars, found_inf, _, stride = C.checked_scalars("adamw_", dev, params, step_scalars, 4, found_inf, None)
    has_master = len(masters) > 0
    chunk, block, opts = C.launch_config("adamw")
    with C.device_guard(dev):
        launches = C.optimizer_launches(
            "adamw_", dev, lists, lambda i: (params[i].dtype, grads[i].dtype), chunk, stride, lambda k: None,
            (has_master, amsgrad), direct,
        )  # fmt: skip
        for (p_dtype, g_dtype, aligned), n_tensors, table, n_chunks, n_ptr in launches:
            _adamw_kernel[(n_chunks,)](
                table,
                n_tensors,
                n_chunks,
                scalars,
                found_inf if found_inf is not None else scalars,
                *C.adam_hyper_args(beta1, beta2, eps, found_inf, maximize),
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


_adamw_op = registry.register_triton("adamw_", _adamw_impl)


def adamw_(*args) -> None:
    """Triton :func:`fastamp.reference.adamw_` (its arguments, all positional): one launch per (param, grad) dtype group, no host sync."""
    C.call_launcher(_adamw_op, _adamw_impl, registry.coerce("adamw_", args))
