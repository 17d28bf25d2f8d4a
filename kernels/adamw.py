"""Triton kernel for the fused AdamW step with optional fp32 master weights: ``adamw_``.

Semantics are :func:`fastamp.reference.adamw_`; registered as the ``torch.library``
custom op ``fastamp_triton::adamw_`` (fake impl included, ``opcheck`` clean).

One launch per (param dtype, grad dtype) group covers every chunk of every tensor. Each
program reads ``found_inf`` and, when it is non-zero (NaN included), runs zero iterations:
nothing is loaded or stored, so a skipped step leaves every tensor bit-identical without a
host sync. The step scalars ``[step_size, bc2_sqrt, decay, grad_mul]`` are read from the
device tensor.

Agreement with the reference: bit-exact under ``TRITON_INTERPRET=1`` (numpy fp32
arithmetic, one rounding per operation, the same operation order; bf16 stores rounded by
integer ops). On a GPU the kernel is compiled without FMA contraction and with correctly
rounded ``tl.sqrt_rn`` / ``tl.div_rn`` (Triton >= 3.2), so it is expected to be bit-exact
there too; with older Triton (approximate sqrt/division) it stays within
``tolerances.ADAMW_GPU_RTOL`` per step.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from fastamp.kernels import _common as C
from torch import Tensor

__all__ = ["adamw_"]

_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@triton.jit
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
    P_KIND: tl.constexpr,
    G_KIND: tl.constexpr,
    N_PTR: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    LERP_SMALL: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    HAS_RN: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(table_ptr + (N_PTR + 1) * n_tensors + pid)
    start = tl.load(table_ptr + (N_PTR + 1) * n_tensors + n_chunks + pid)
    numel = tl.load(table_ptr + N_PTR * n_tensors + t)
    p_ptr = C.load_ptr(table_ptr, t, P_KIND)
    g_ptr = C.load_ptr(table_ptr, n_tensors + t, G_KIND)
    m_ptr = C.load_ptr(table_ptr, 2 * n_tensors + t, 0)
    v_ptr = C.load_ptr(table_ptr, 3 * n_tensors + t, 0)
    # master and max_exp_avg_sq columns exist only when used; m_ptr stands in otherwise
    if HAS_MASTER:
        w_ptr = C.load_ptr(table_ptr, 4 * n_tensors + t, 0)
    else:
        w_ptr = m_ptr
    if AMSGRAD:
        vmax_ptr = C.load_ptr(table_ptr, (4 + HAS_MASTER) * n_tensors + t, 0)
    else:
        vmax_ptr = m_ptr
    step_size = tl.load(step_scalars_ptr)
    bc2_sqrt = tl.load(step_scalars_ptr + 1)
    decay = tl.load(step_scalars_ptr + 2)
    grad_mul = tl.load(step_scalars_ptr + 3)
    end = tl.minimum(start + CHUNK, numel)
    if HAS_FOUND_INF:
        # A non-zero (or NaN) found_inf makes the loop empty: no load, no store.
        end = tl.where(tl.load(found_inf_ptr) == 0, end, start)
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        mask = idx < end
        if HAS_MASTER:
            p = tl.load(w_ptr + idx, mask=mask, other=0.0)
        else:
            p = C.load_f32(p_ptr, idx, mask, P_KIND)
        g = C.load_f32(g_ptr, idx, mask, G_KIND) * grad_mul
        if MAXIMIZE:
            g = -g
        m = tl.load(m_ptr + idx, mask=mask, other=0.0)
        v = tl.load(v_ptr + idx, mask=mask, other=0.0)
        pv = p * decay
        diff = g - m
        # torch.lerp(m, g, 1 - beta1), with the branch chosen on the host in fp64
        if LERP_SMALL:
            mv = m + one_minus_beta1 * diff
        else:
            mv = g - diff * beta1
        vv = v * beta2 + (one_minus_beta2 * g) * g
        if AMSGRAD:
            a = tl.load(vmax_ptr + idx, mask=mask, other=0.0)
            # torch.maximum propagates NaN
            vmax = tl.where((a != a) | (vv != vv), a + vv, tl.maximum(a, vv))
            tl.store(vmax_ptr + idx, vmax, mask=mask)
            d = vmax
        else:
            d = vv
        denom = C.div_rn(C.sqrt_rn(d, HAS_RN), bc2_sqrt, HAS_RN) + eps
        pv = pv - C.div_rn(step_size * mv, denom, HAS_RN)
        tl.store(m_ptr + idx, mv, mask=mask)
        tl.store(v_ptr + idx, vv, mask=mask)
        if HAS_MASTER:
            tl.store(w_ptr + idx, pv, mask=mask)
        C.store_from_f32(p_ptr, idx, pv, mask, P_KIND)


def _validate(params, grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step_scalars, found_inf, amsgrad):
    op = "fastamp_triton::adamw_"
    n = len(params)
    for name, lst in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        if len(lst) != n:
            raise ValueError(f"{op}: {name} has {len(lst)} tensors but params has {n}")
    if len(masters) not in (0, n):
        raise ValueError(f"{op}: masters must be empty or have one tensor per param ({n}), got {len(masters)}")
    if amsgrad and len(max_exp_avg_sqs) != n:
        raise ValueError(f"{op}: amsgrad needs one max_exp_avg_sq per param ({n}), got {len(max_exp_avg_sqs)}")
    if n == 0:
        return
    dev = params[0].device
    if step_scalars.numel() != 4 or not step_scalars.is_floating_point():
        raise ValueError(
            f"{op}: step_scalars must be 4 floats [step_size, bc2_sqrt, decay, grad_mul], "
            f"got shape {tuple(step_scalars.shape)} {step_scalars.dtype}"
        )
    if step_scalars.device != dev:
        raise ValueError(f"{op}: step_scalars is on {step_scalars.device} but params are on {dev}")
    if found_inf is not None:
        if found_inf.numel() != 1:
            raise ValueError(f"{op}: found_inf must be a 1-element tensor, got shape {tuple(found_inf.shape)}")
        if found_inf.device != dev:
            raise ValueError(f"{op}: found_inf is on {found_inf.device} but params are on {dev}")
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


@torch.library.custom_op(
    "fastamp_triton::adamw_",
    mutates_args=("params", "masters", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"),
    schema="(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] masters, Tensor(c!)[] exp_avgs, "
    "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor step_scalars, Tensor? found_inf, "
    "float beta1, float beta2, float eps, bool amsgrad, bool maximize) -> ()",
)
def _adamw_op(
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
        groups.setdefault((p.dtype, g.dtype), []).append((i, g))
    chunk, block = C.chunk_config()
    n_ptr = 4 + int(has_master) + int(amsgrad)
    for (p_dtype, g_dtype), members in groups.items():
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
            P_KIND=C.DTYPE_KIND[p_dtype],
            G_KIND=C.DTYPE_KIND[g_dtype],
            N_PTR=n_ptr,
            HAS_MASTER=has_master,
            AMSGRAD=amsgrad,
            MAXIMIZE=maximize,
            LERP_SMALL=(1.0 - beta1) < 0.5,
            HAS_FOUND_INF=found_inf is not None,
            HAS_RN=C.HAS_RN,
            CHUNK=chunk,
            BLOCK=block,
            **C.LAUNCH_OPTS,
        )


@_adamw_op.register_fake
def _(
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
):
    return None


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
    _adamw_op(
        list(params),
        list(grads),
        list(masters),
        list(exp_avgs),
        list(exp_avg_sqs),
        list(max_exp_avg_sqs),
        step_scalars,
        found_inf,
        float(beta1),
        float(beta2),
        float(eps),
        bool(amsgrad),
        bool(maximize),
    )
