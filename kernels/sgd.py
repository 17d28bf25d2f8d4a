"""Triton kernel for the one-state optimizer steps: ``sgd_`` and ``lion_``.

One kernel, two update rules (the constexpr ``RULE``), sharing everything but the update: the
param's storage (fp32 master weights, int16 master remainders for bf16 params, or no master,
bf16 params then rounded stochastically when ``rng`` is given), one fp32 state stream, the
launch table, the step scalars (``[3]`` or ``[n, 3]``), the guards and the found_inf skip.

* ``sgd_``: :func:`fastamp.reference.sgd_` (``torch.optim.SGD``'s update: momentum,
  dampening, nesterov, weight decay, maximize); the state is the momentum buffer (absent
  without momentum); ``step_scalars = [lr, grad_mul, is_first]``.
* ``lion_``: :func:`fastamp.reference.lion_` (Lion: decoupled decay, the sign of an
  interpolated momentum); the state is ``exp_avg``; ``step_scalars = [lr, decay, grad_mul]``.

Registered as ``fastamp_triton::sgd_`` and ``fastamp_triton::lion_`` from the op table in
``fastamp/ops/registry.py`` (schemas and fakes shared with the native ops, ``opcheck`` clean).

One launch per (param dtype, grad dtype) group covers every chunk of every tensor (tensors
whose data is not 16-byte aligned go to a second launch, compiled without the alignment
hint). Each program reads ``found_inf`` and, when it is non-zero (NaN included), treats its
chunk as empty, so a skipped step writes nothing (and leaves SGD's first-step flag to the
caller's step count; the step scalars are all read on the device). ``maximize``, SGD's
``nesterov`` and weight decay on/off, and whether ``found_inf`` is given are runtime flags;
the rule and the streams (master kind, state, stochastic rounding) are constexprs.

Agreement with the reference: bit-exact under ``TRITON_INTERPRET=1`` and, since both updates
are only fp32 multiplies, adds and comparisons compiled without FMA contraction plus integer
bit operations, on a GPU too.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from fastamp.kernels import _common as C
from fastamp.kernels import _guards as G
from torch import Tensor

from fastamp.ops import registry

__all__ = ["sgd_", "lion_", "sgd_q8_", "lion_q8_"]

# update rules (constexpr RULE)
_SGD = 0
_LION = 1

# master kinds (constexpr MASTER)
_NO_MASTER = 0
_FP32_MASTER = 1
_REMAINDER = 2


@triton.jit
def _lion_sign(c):
    """reference.lion_sign: +-1, or ``c`` itself for +-0 and NaN (its two comparisons, in its order)."""
    return tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, c))


@triton.jit
def _one_state_block(
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
    aux,
    momentum,
    one_minus_dampening,
    weight_decay,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    maximize,
    nesterov,
    has_weight_decay,
    RULE: tl.constexpr,
    P_KIND: tl.constexpr,
    G_KIND: tl.constexpr,
    MASTER: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr,
    SR: tl.constexpr,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One block of elements ``off + [0, BLOCK)``; only a MASKED block may run past ``end``.

    ``aux``: SGD's first-step flag, or Lion's ``decay`` (:func:`_step_scalars`). ``buf_ptr``: the
    state stream (SGD's momentum buffer, Lion's exp_avg)."""
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
        g = C.neg(g)
    if RULE == 1:
        m = C.load_f32(buf_ptr, idx, mask, 0, MASKED)
        c = m * beta1 + g * one_minus_beta1
        pv = p * aux - lr * _lion_sign(c)
        C.store_raw(buf_ptr, idx, m * beta2 + g * one_minus_beta2, mask, MASKED)
    else:
        if has_weight_decay != 0:
            g = g + weight_decay * p
        if HAS_MOMENTUM:
            buf = C.load_f32(buf_ptr, idx, mask, 0, MASKED)
            # on the first step the old buffer is never used (it may hold anything)
            nb = tl.where(aux, g, buf * momentum + one_minus_dampening * g)
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
def _step_scalars(step_scalars_ptr, RULE: tl.constexpr):
    """``(lr, grad_mul, aux)``: SGD's ``[lr, grad_mul, is_first]`` (aux the flag), Lion's
    ``[lr, decay, grad_mul]`` (aux ``decay``). Read per block (cached; one address for every
    lane): live across the chunk loop, their pointer takes fewer registers than they do, and
    ptxas spilled 8 bytes on sm_80 (SGD, P=f16, G=f32, fp32 masters, momentum) with them read
    once per program."""
    lr = tl.load(step_scalars_ptr)
    if RULE == 1:
        aux = tl.load(step_scalars_ptr + 1)
        grad_mul = tl.load(step_scalars_ptr + 2)
    else:
        grad_mul = tl.load(step_scalars_ptr + 1)
        aux = tl.load(step_scalars_ptr + 2) != 0
    return lr, grad_mul, aux


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
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    check_found_inf,
    maximize,
    nesterov,
    has_weight_decay,
    RULE: tl.constexpr,
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
    # table columns: param, grad, [master or remainder], [state: momentum buffer or exp_avg], [tensor id]
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
        lr, grad_mul, aux = _step_scalars(step_scalars_ptr, RULE)
        _one_state_block(
            p_ptr, g_ptr, w_ptr, r_ptr, buf_ptr, off, end, key, lr, grad_mul, aux, momentum,
            one_minus_dampening, weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2,
            maximize, nesterov, has_weight_decay, RULE, P_KIND, G_KIND, MASTER, HAS_MOMENTUM, SR,
            BLOCK, False,
        )  # fmt: skip
        off += BLOCK
    lr, grad_mul, aux = _step_scalars(step_scalars_ptr, RULE)
    _one_state_block(
        p_ptr, g_ptr, w_ptr, r_ptr, buf_ptr, off, end, key, lr, grad_mul, aux, momentum,
        one_minus_dampening, weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2,
        maximize, nesterov, has_weight_decay, RULE, P_KIND, G_KIND, MASTER, HAS_MOMENTUM, SR,
        BLOCK, True,
    )  # fmt: skip


def _launch(
    op: str,
    rule: int,
    params: list[Tensor],
    grads: list[Tensor],
    masters: list[Tensor],
    states: Optional[tuple],
    step_scalars: Tensor,
    found_inf: Optional[Tensor],
    rng: Optional[Tensor],
    rng_base: int,
    hyper: tuple,
    flags: tuple,
    direct: bool,
) -> None:
    """Both rules' launches. ``states``: ``(name, tensors)`` of the state stream, or None (SGD
    without momentum); ``hyper``: the seven fp32 hyperparameters of :func:`_sgd_kernel`,
    the other rule's zero; ``flags``: ``(maximize, nesterov, has_weight_decay)``."""
    if len(params) == 0:
        return
    dev = params[0].device
    remainder = len(masters) > 0 and masters[0].dtype == torch.int16
    # int16 remainders are the low half of a bf16 param's fp32 master
    lists = [("params", params, (torch.bfloat16,) if remainder else G.FLOAT_DTYPES, True)]
    lists += [("grads", grads, G.FLOAT_DTYPES, False)]
    lists += [("masters", masters, (torch.int16,) if remainder else G.F32, True)] if masters else []
    lists += [(states[0], states[1], G.F32, True)] if states is not None else []
    scalars, found_inf, rng, stride = C.checked_scalars(op, dev, params, step_scalars, 3, found_inf, rng)
    if not masters:
        master_kind = _NO_MASTER
    else:
        master_kind = _REMAINDER if remainder else _FP32_MASTER

    def sr(gkey):
        # stochastic rounding only where the reference does it: bf16 params without a master
        return rng is not None and master_kind == _NO_MASTER and gkey[0] == torch.bfloat16

    chunk, block, opts = C.launch_config("sgd")
    with C.device_guard(dev):
        launches = C.optimizer_launches(
            op, dev, lists, lambda i: (params[i].dtype, grads[i].dtype), chunk, stride,
            lambda k: rng_base if sr(k) else None, (rule, master_kind, states is not None, rng is not None, rng_base),
            direct,
        )  # fmt: skip
        for gkey, n_tensors, table, n_chunks, n_ptr in launches:
            p_dtype, g_dtype, aligned = gkey
            _sgd_kernel[(n_chunks,)](
                table,
                n_tensors,
                n_chunks,
                scalars,
                found_inf if found_inf is not None else scalars,
                rng if sr(gkey) else table,
                *hyper,
                int(found_inf is not None),
                *flags,
                RULE=rule,
                P_KIND=C.DTYPE_KIND[p_dtype],
                G_KIND=C.DTYPE_KIND[g_dtype],
                N_PTR=n_ptr,
                MASTER=master_kind,
                HAS_MOMENTUM=states is not None,
                SR=sr(gkey),
                ALIGNED=aligned,
                CHUNK=chunk,
                BLOCK=block,
                **opts,
            )


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
    *,
    direct: bool = False,
) -> None:
    has_momentum = momentum != 0
    hyper = (C.to_f32(momentum), C.to_f32(1.0 - dampening), C.to_f32(weight_decay), 0.0, 0.0, 0.0, 0.0)
    _launch(
        "sgd_", _SGD, params, grads, masters, ("momentum_buffers", momentum_buffers) if has_momentum else None,
        step_scalars, found_inf, rng, rng_base, hyper,
        (int(maximize), int(nesterov and has_momentum), int(weight_decay != 0)), direct,
    )  # fmt: skip


def _lion_impl(
    params: list[Tensor],
    grads: list[Tensor],
    masters: list[Tensor],
    exp_avgs: list[Tensor],
    step_scalars: Tensor,
    found_inf: Optional[Tensor],
    rng: Optional[Tensor],
    rng_base: int,
    beta1: float,
    beta2: float,
    maximize: bool,
    *,
    direct: bool = False,
) -> None:
    # the betas and their complements rounded to fp32 on the host, as the reference's _f32
    hyper = (0.0, 0.0, 0.0, C.to_f32(beta1), C.to_f32(1.0 - beta1), C.to_f32(beta2), C.to_f32(1.0 - beta2))
    _launch(
        "lion_", _LION, params, grads, masters, ("exp_avgs", exp_avgs), step_scalars, found_inf, rng, rng_base,
        hyper, (int(maximize), 0, 0), direct,
    )  # fmt: skip


_sgd_op = registry.register_triton("sgd_", _sgd_impl)
_lion_op = registry.register_triton("lion_", _lion_impl)


def sgd_(*args) -> None:
    """Triton :func:`fastamp.reference.sgd_` (its arguments, all positional): one launch per (param, grad) dtype group, no host sync."""
    C.call_launcher(_sgd_op, _sgd_impl, registry.coerce("sgd_", args))


def lion_(*args) -> None:
    """Triton :func:`fastamp.reference.lion_` (its arguments, all positional): one launch per (param, grad) dtype group, no host sync."""
    C.call_launcher(_lion_op, _lion_impl, registry.coerce("lion_", args))


# sgd_q8_ / lion_q8_: the launchers above composed with the q8 codec (no fused Triton kernel yet)
_sgd_q8_op = registry.register_triton("sgd_q8_", registry.composed_q8(sgd_))
_lion_q8_op = registry.register_triton("lion_q8_", registry.composed_q8(lion_))


def sgd_q8_(*args) -> None:
    """Triton :func:`fastamp.reference.sgd_q8_` (its arguments, all positional): :func:`sgd_` on the decoded momentum buffers, encoded again."""
    _sgd_q8_op(*registry.coerce("sgd_q8_", args))


def lion_q8_(*args) -> None:
    """Triton :func:`fastamp.reference.lion_q8_` (its arguments, all positional): :func:`lion_` on the decoded ``exp_avg``, encoded again."""
    _lion_q8_op(*registry.coerce("lion_q8_", args))
