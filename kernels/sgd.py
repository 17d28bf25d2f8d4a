"""Triton kernel for the fused SGD step: ``sgd_``.

Semantics are :func:`fastamp.reference.sgd_` (``torch.optim.SGD``'s update: momentum,
dampening, nesterov, weight decay, maximize) with fp32 master weights, int16 master
remainders for bf16 params, or no master (bf16 params then rounded stochastically when
``rng`` is given). Registered as ``fastamp_triton::sgd_`` from the op
table in ``fastamp/_ops.py`` (schema and fake shared with the native op, ``opcheck`` clean).

One launch per (param dtype, grad dtype) group covers every chunk of every tensor (tensors
whose data is not 16-byte aligned go to a second launch, compiled without the alignment
hint). Each program reads ``found_inf`` and, when it is non-zero (NaN included), treats its
chunk as empty, so a skipped step writes nothing and leaves the first-step flag to the
caller's step count (``step_scalars = [lr, grad_mul, is_first]``, all read on the device).
``maximize``, ``nesterov``, weight decay on/off and whether ``found_inf`` is given are
runtime flags; the streams (master kind, momentum, stochastic rounding) are constexprs.

Agreement with the reference: bit-exact under ``TRITON_INTERPRET=1`` and, since the update
is only fp32 multiplies and adds compiled without FMA contraction plus integer bit
operations, on a GPU too.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from fastamp.kernels import _common as C
from fastamp.kernels import _guards as G
from torch import Tensor

from fastamp import _ops

__all__ = ["sgd_"]

# master kinds (constexpr MASTER)
_NO_MASTER = 0
_FP32_MASTER = 1
_REMAINDER = 2


@triton.jit
def _sgd_block(
    p_ptr,
    g_ptr,
    w_ptr,
    r_ptr,
    buf_ptr,
    off,
    end,
    key,
    lr,
    grad_mul,
    first,
    momentum,
    one_minus_dampening,
    weight_decay,
    maximize,
    nesterov,
    has_weight_decay,
    P_KIND: tl.constexpr,
    G_KIND: tl.constexpr,
    MASTER: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr,
    SR: tl.constexpr,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One block of elements ``off + [0, BLOCK)``; only a MASKED block may run past ``end``."""
    idx = C.block_index(off, BLOCK)
    mask = idx < end
    if MASTER == 1:
        p = C.load_f32(w_ptr, idx, mask, 0, MASKED)
    elif MASTER == 2:
        p = C.join_master(C.load_raw(p_ptr, idx, mask, MASKED), C.load_raw(r_ptr, idx, mask, MASKED))
    else:
        p = C.load_f32(p_ptr, idx, mask, P_KIND, MASKED)
    g = C.load_f32(g_ptr, idx, mask, G_KIND, MASKED) * grad_mul
    if maximize != 0:
        g = -g
    if has_weight_decay != 0:
        g = g + weight_decay * p
    if HAS_MOMENTUM:
        buf = C.load_f32(buf_ptr, idx, mask, 0, MASKED)
        # on the first step the old buffer is never used (it may hold anything)
        nb = tl.where(first, g, buf * momentum + one_minus_dampening * g)
        C.store_raw(buf_ptr, idx, nb, mask, MASKED)
        if nesterov != 0:
            g = g + momentum * nb
        else:
            g = nb
    pv = p - lr * g
    if MASTER == 1:
        C.store_raw(w_ptr, idx, pv, mask, MASKED)
        C.store_from_f32(p_ptr, idx, pv, mask, P_KIND, MASKED)
    elif MASTER == 2:
        new_bits, new_rem = C.split_master(pv)
        C.store_raw(p_ptr, idx, new_bits, mask, MASKED)
        C.store_raw(r_ptr, idx, new_rem, mask, MASKED)
    elif SR:
        C.store_raw(p_ptr, idx, C.bf16_bits(pv, C.sr_block_key(key, off), idx, True), mask, MASKED)
    else:
        C.store_from_f32(p_ptr, idx, pv, mask, P_KIND, MASKED)


@triton.jit
def _sgd_scalars(step_scalars_ptr):
    """``(lr, grad_mul, is_first)``. Read per block (cached; one address for every lane): live
    across the chunk loop, their pointer takes fewer registers than they do, and ptxas spilled
    8 bytes on sm_80 (P=f16, G=f32, fp32 masters, momentum) with them read once per program."""
    lr = tl.load(step_scalars_ptr)
    grad_mul = tl.load(step_scalars_ptr + 1)
    first = tl.load(step_scalars_ptr + 2) != 0
    return lr, grad_mul, first


@C.jit_launched
def _sgd_kernel(
    table_ptr,
    n_tensors,
    n_chunks,
    step_scalars_ptr,
    found_inf_ptr,
    rng_ptr,
    momentum,
    one_minus_dampening,
    weight_decay,
    check_found_inf,
    maximize,
    nesterov,
    has_weight_decay,
    P_KIND: tl.constexpr,
    G_KIND: tl.constexpr,
    N_PTR: tl.constexpr,
    MASTER: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr,
    SR: tl.constexpr,
    ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # table columns: param, grad, [master or remainder], [momentum buffer], [tensor id]
    pid = tl.program_id(0)
    t, start, numel = C.chunk_of(table_ptr, n_tensors, n_chunks, pid, N_PTR, CHUNK)
    p_ptr = C.load_ptr(table_ptr, t, P_KIND, ALIGNED)
    g_ptr = C.load_ptr(table_ptr, n_tensors + t, G_KIND, ALIGNED)
    HAS_MASTER: tl.constexpr = MASTER != 0
    if MASTER == 1:
        w_ptr = C.load_ptr(table_ptr, 2 * n_tensors + t, 0, ALIGNED)
    else:
        w_ptr = C.load_ptr(table_ptr, t, 0, ALIGNED)
    if MASTER == 2:
        r_ptr = C.load_ptr(table_ptr, 2 * n_tensors + t, 4, ALIGNED)
    else:
        r_ptr = C.load_ptr(table_ptr, t, 4, ALIGNED)
    if HAS_MOMENTUM:
        buf_ptr = C.load_ptr(table_ptr, (2 + HAS_MASTER) * n_tensors + t, 0, ALIGNED)
    else:
        buf_ptr = w_ptr
    if SR:
        tensor_id = tl.load(table_ptr + (2 + HAS_MASTER + HAS_MOMENTUM) * n_tensors + t)
        key = C.sr_stream_key(C.sr_base_key(rng_ptr), tensor_id, 0)
    else:
        key = tl.full([], 0, tl.uint32)
    # this tensor's row of an [n, k] step_scalars, or the shared [k]
    step_scalars_ptr = C.scalar_row(table_ptr, n_tensors, n_chunks, t, step_scalars_ptr, N_PTR)
    # A non-zero (or NaN) found_inf empties the chunk: no load, no store.
    end = C.chunk_end(start, numel, found_inf_ptr, check_found_inf, CHUNK)
    # full blocks unmasked (vector loads/stores), then the last partial block masked (see adamw)
    off = start
    while off + BLOCK <= end:
        lr, grad_mul, first = _sgd_scalars(step_scalars_ptr)
        _sgd_block(
            p_ptr, g_ptr, w_ptr, r_ptr, buf_ptr, off, end, key, lr, grad_mul, first, momentum,
            one_minus_dampening, weight_decay, maximize, nesterov, has_weight_decay,
            P_KIND, G_KIND, MASTER, HAS_MOMENTUM, SR, BLOCK, False,
        )  # fmt: skip
        off += BLOCK
    lr, grad_mul, first = _sgd_scalars(step_scalars_ptr)
    _sgd_block(
        p_ptr, g_ptr, w_ptr, r_ptr, buf_ptr, off, end, key, lr, grad_mul, first, momentum,
        one_minus_dampening, weight_decay, maximize, nesterov, has_weight_decay,
        P_KIND, G_KIND, MASTER, HAS_MOMENTUM, SR, BLOCK, True,
    )  # fmt: skip


def _sgd_impl(
    params: list[Tensor],
    grads: list[Tensor],
    masters: list[Tensor],
    momentum_buffers: list[Tensor],
    step_scalars: Tensor,
    found_inf: Optional[Tensor],
    rng: Optional[Tensor],
    rng_base: int,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
) -> None:
    if len(params) == 0:
        return
    dev = params[0].device
    remainder = len(masters) > 0 and masters[0].dtype == torch.int16
    # int16 remainders are the low half of a bf16 param's fp32 master
    lists = [("params", params, (torch.bfloat16,) if remainder else G.FLOAT_DTYPES, True)]
    lists += [("grads", grads, G.FLOAT_DTYPES, False)]
    lists += [("masters", masters, (torch.int16,) if remainder else G.F32, True)] if masters else []
    lists += [("momentum_buffers", momentum_buffers, G.F32, True)] if momentum != 0 else []
    scalars, found_inf, rng, stride = C.checked_scalars("sgd_", dev, params, lists, step_scalars, 3, found_inf, rng)
    if not masters:
        master_kind = _NO_MASTER
    else:
        master_kind = _REMAINDER if remainder else _FP32_MASTER
    has_momentum = momentum != 0
    grads = C.contiguous(grads)
    streams = [params, grads, *([masters] if master_kind != _NO_MASTER else [])]
    streams += [momentum_buffers] if has_momentum else []
    groups = C.launch_groups(streams, lambda i: (params[i].dtype, grads[i].dtype))
    chunk, block, opts = C.launch_config("sgd")
    with C.device_guard(dev):
        for (p_dtype, g_dtype, aligned), idxs in groups.items():
            # stochastic rounding only where the reference does it: bf16 params without a master
            sr = rng is not None and master_kind == _NO_MASTER and p_dtype == torch.bfloat16
            table, n_chunks, n_ptr = C.launch_table(idxs, streams, rng_base if sr else None, chunk, dev, stride)
            _sgd_kernel[(n_chunks,)](
                table,
                len(idxs),
                n_chunks,
                scalars,
                found_inf if found_inf is not None else scalars,
                rng if sr else table,
                C.to_f32(momentum),
                C.to_f32(1.0 - dampening),
                C.to_f32(weight_decay),
                int(found_inf is not None),
                int(maximize),
                int(nesterov and has_momentum),
                int(weight_decay != 0),
                P_KIND=C.DTYPE_KIND[p_dtype],
                G_KIND=C.DTYPE_KIND[g_dtype],
                N_PTR=n_ptr,
                MASTER=master_kind,
                HAS_MOMENTUM=has_momentum,
                SR=sr,
                ALIGNED=aligned,
                CHUNK=chunk,
                BLOCK=block,
                **opts,
            )


_sgd_op = _ops.register_triton("sgd_", _sgd_impl)


def sgd_(*args) -> None:
    """Triton :func:`fastamp.reference.sgd_` (its arguments, all positional): one launch per (param, grad) dtype group, no host sync."""
    _sgd_op(*_ops.coerce("sgd_", args))
