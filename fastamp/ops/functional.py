"""Stateless fused ops that every backend implements (in-place ones end in ``_``).

Each function picks a backend with :func:`fastamp.backends.resolve` and calls it, with its
arguments checked by :mod:`fastamp.ops.validate` (the one place of the user-facing checks; its
docstring says which layer checks what): before the call for the Triton and torch backends,
and for the native one only when the kernel refuses the input (the C++ kernels check
everything themselves first), for the clearer message. Semantics are those of
:mod:`fastamp.reference`; no function here reads a device value on the host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from fastamp.ops import backends, registry
from fastamp.ops import validate as V
from fastamp.reference.optim import AMSGRAD, MAXIMIZE, to_optim

__all__ = [
    "optim_",
    "unscale_check_",
    "update_scale_",
    "adamw_",
    "adamw_bf16_",
    "adamw_q8_",
    "sgd_",
    "lion_",
    "sgd_q8_",
    "lion_q8_",
]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def unscale_check_(
    grads: Sequence[Tensor],
    found_inf: Tensor,
    inv_scale: Tensor,
    *,
    write_back: bool = True,
    compute_sumsq: bool = False,
    counts: Tensor | None = None,
    absmax: Tensor | None = None,
    backend: str | None = None,
) -> Tensor:
    """Unscale ``grads`` in place by ``inv_scale``, flag non-finite values in ``found_inf``.

    One read (and, with ``write_back``, one write) of every grad, all tensors of any of
    fp32/fp16/bf16 in one call. Also catches overflow created by unscaling itself, which
    ``torch._amp_foreach_non_finite_check_and_unscale_`` misses. See
    :func:`fastamp.reference.unscale_check_` for the exact semantics.

    Args:
        grads: dense or sparse (their values are used) gradients, all on ``found_inf``'s device.
        found_inf: 1-element fp32 tensor; set to 1.0 on any non-finite value, never reset.
        inv_scale: 1-element fp32 tensor on the same device.
        write_back: False leaves the grads untouched (check only, for fused optimizers).
        compute_sumsq: also return the sum of squares of the unscaled values.
        counts, absmax: when given (int64 ``[len(grads), 3]`` and fp32 ``[len(grads)]`` on the
            device), per-tensor health statistics are written in the same pass: see
            :func:`fastamp.reference.unscale_check_stats_`.
        backend: force a backend (see :mod:`fastamp.backends`).

    Returns:
        0-dim fp32 tensor on ``found_inf``'s device: the sum of squares, or 0.

    No host sync. fp64 grads always run on the torch reference (the kernels are fp32-maths).
    """
    op = "unscale_check_"
    V.unscale_check(op, grads, found_inf, inv_scale, counts, absmax)
    dev = found_inf.device
    want_stats = counts is not None
    chosen = backends.resolve("unscale_check_stats_" if want_stats else op, dev, backend)
    return _unscale_check(grads, found_inf, inv_scale, write_back, compute_sumsq, counts, absmax, chosen)


def _unscale_check(
    grads: Sequence[Tensor],
    found_inf: Tensor,
    inv_scale: Tensor,
    write_back: bool,
    compute_sumsq: bool,
    counts: Tensor | None,
    absmax: Tensor | None,
    backend: str,
) -> Tensor:
    """:func:`unscale_check_` past its argument checks, on the already resolved ``backend``.

    The Scaler's check pass calls it directly: it makes ``found_inf``, ``inv_scale`` and the
    statistics buffers itself, and resolves the backend once per device.
    """
    op = "unscale_check_"
    dev = found_inf.device
    want_stats = counts is not None
    fast = _native_fast_path(
        "unscale_check_stats_" if want_stats else op,
        backend,
        (list(grads), found_inf, inv_scale, write_back, compute_sumsq) + ((counts, absmax) if want_stats else ()),
    )
    if fast is not _NOT_RUN:
        return fast
    dense: list[Tensor] = []
    dense_idx: list[int] = []
    strided_copies = []
    other: list[Tensor] = []
    other_idx: list[int] = []
    for i, g in enumerate(grads):
        vals = V.unscale_grad(op, i, g, dev)
        if vals.dtype not in _KERNEL_DTYPES:
            other.append(vals)
            other_idx.append(i)
        elif vals.is_contiguous():
            dense.append(vals)
            dense_idx.append(i)
        else:
            tmp = vals.contiguous()
            dense.append(tmp)
            dense_idx.append(i)
            strided_copies.append((vals, tmp))
    if want_stats:
        stats_op = "unscale_check_stats_"
        impl = backends.get_impl(stats_op, backend)
        c_d = torch.empty((len(dense), 3), dtype=torch.int64, device=dev)
        a_d = torch.empty((len(dense),), dtype=torch.float32, device=dev)
        total = impl(dense, found_inf, inv_scale, write_back, compute_sumsq, c_d, a_d)
        _scatter_rows(counts, absmax, dense_idx, c_d, a_d)
    else:
        impl = backends.get_impl(op, backend)
        total = impl(dense, found_inf, inv_scale, write_back, compute_sumsq)
    if write_back:
        for orig, tmp in strided_copies:
            orig.copy_(tmp)
    if other:
        from fastamp import reference

        if want_stats:
            c_o = torch.empty((len(other), 3), dtype=torch.int64, device=dev)
            a_o = torch.empty((len(other),), dtype=torch.float32, device=dev)
            total = total + reference.unscale_check_stats_(
                other, found_inf, inv_scale, write_back, compute_sumsq, c_o, a_o
            )
            _scatter_rows(counts, absmax, other_idx, c_o, a_o)
        else:
            total = total + reference.unscale_check_(other, found_inf, inv_scale, write_back, compute_sumsq)
    return total


_NOT_RUN = object()


def _native_fast_path(op: str, backend: str, args: tuple | list):
    """Call the native kernel straight away when it is the chosen (resolved) ``backend``.

    The C++ op validates every grad (device, dtype, layout, contiguity) before it touches
    anything, so the common case (dense contiguous fp32/fp16/bf16 grads) skips the
    per-grad Python checks, which cost more than the kernel with thousands of small
    tensors. Anything it rejects (fp64, sparse or strided grads, bad input) goes through the
    caller's Python path, which handles the first three and raises a clear error for the
    rest. The one place that tries native first: the ops here and the Scaler's check pass.
    Returns the kernel's result, or ``_NOT_RUN`` when the caller must take its Python path.

    In eager mode the kernel is called through ``fastamp._C.<op>`` (csrc/direct_call.cpp):
    the same kernel without the dispatcher's per-tensor work (an IValue, a vector copy and
    an autograd-fallback visit per tensor, ~0.1 us each). It declines (``NotImplemented``,
    nothing done) whenever the dispatcher could do anything else (tensor subclasses, modes,
    non-dense keys, grad mode with tensors requiring grad) or the kernel refuses the input;
    ``torch.ops`` then runs as before. Under torch.compile the op is traced as it always was.
    """
    if backend != "native":
        return _NOT_RUN
    direct = _DIRECT.get(op)
    if direct is not None and not torch.compiler.is_compiling():
        out = direct(*args)
        if out is not NotImplemented:
            return out
    try:
        return backends.get_impl(op, "native")(*args)
    except (RuntimeError, TypeError):
        return _NOT_RUN


def _native_module():
    if not registry.NATIVE_LOADED:
        return None
    from fastamp import _C

    return _C


_NATIVE = _native_module()
_DIRECT = (
    {
        op: getattr(_NATIVE, op)
        for op in (*registry.OPS, *registry.Q8_OPS, *registry.GENERIC_OPS)
        if hasattr(_NATIVE, op)
    }
    if _NATIVE is not None
    else {}
)


# The direct call a table stands in for: a table runs only while _DIRECT holds it, so a test
# that routes _DIRECT through a spy (tests/helpers.spy_kernels) sees every kernel call.
_TABLE_DIRECT = _DIRECT.get("optim_")
_TABLE_RUN = getattr(_NATIVE, "optim_table_run", None)


def _optim_table(params: list[Tensor], masters: list[Tensor], states: list[Tensor], rule: str, flags: int):
    """A persistent table of these lists for :func:`optim_`'s ``_table`` (native CPU), or None.

    ``rule`` and ``flags`` as :func:`optim_` takes them (AMSGRAD decides AdamW's states; an SGD
    table keeps a momentum buffer where ``states`` is not empty). None where the extension has no
    tables or declines the tensors (not plain dense CPU tensors, or anything the op would refuse):
    the caller then passes the lists alone.
    """
    if _TABLE_RUN is None or torch.compiler.is_compiling():
        return None
    table = _NATIVE.optim_table(params, masters, states, rule, flags)
    return None if table is NotImplemented else table


def _run_table(table, backend: str, grads, step_scalars, found_inf, rng, rng_base, rule, hyper, flags) -> bool:
    """Whether ``table`` (:func:`_optim_table`) ran ``optim_`` on these arguments on the resolved ``backend``
    (False: not native, or the table declined; nothing written)."""
    return (
        backend == "native"
        and _DIRECT.get("optim_") is _TABLE_DIRECT
        and not torch.compiler.is_compiling()
        and _TABLE_RUN(table, grads, step_scalars, found_inf, rng, rng_base, rule, hyper, flags) is not NotImplemented
    )


def _optim_launch(args: tuple, backend: str, table=None) -> None:
    """``optim_(*args)`` on the already resolved ``backend``, for a launch the optimizer engine validated.

    What the engine's launch plans call: no argument checks and no backend resolution per call (the
    plan resolved it, see ``FusedOptimizer._backends_of``); ``table`` as :func:`optim_`'s ``_table``
    (:func:`_optim_table_for`). A native kernel that refuses the input (which the engine's checks should
    have made impossible) is answered by :mod:`fastamp.ops.validate`'s message where it has one, else by
    the kernel's error.
    """
    if table is not None and _run_table(table, backend, args[1], *args[4:]):
        return
    if _native_fast_path("optim_", backend, args) is not _NOT_RUN:
        return
    if backend == "native":
        V.optim("optim_", args[0][0].device, *args, strict=True)
    backends.get_impl("optim_", backend)(*args)


def _optim_table_for(args: tuple):
    """A persistent native table for ``optim_`` launches with these (positional) arguments, or None.

    Every rule and every master and state format (csrc/cpu/optim_table.h): :func:`_optim_table` of the
    launch's params, masters and states.
    """
    params, _, masters, states = args[:4]
    if len(params) == 0:
        return None
    return _optim_table(list(params), list(masters), list(states), args[8], args[10])


def _scatter_rows(counts: Tensor, absmax: Tensor, idx: list[int], c: Tensor, a: Tensor) -> None:
    if not idx:
        return
    if len(idx) == counts.shape[0]:
        counts.copy_(c)
        absmax.copy_(a)
        return
    where = torch.tensor(idx, dtype=torch.int64).to(counts.device, non_blocking=True)
    counts.index_copy_(0, where, c)
    absmax.index_copy_(0, where, a)


def update_scale_(
    scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int = 1,
    min_scale: float = 0.0,
    max_scale: float = math.inf,
    *,
    backend: str | None = None,
) -> None:
    """Backoff / hysteresis / growth / bounds of the loss scale, in place, on the device.

    Bit-exact with ``torch._amp_update_scale_`` when ``hysteresis=1`` and no bounds are set.
    See :func:`fastamp.reference.update_scale_`. No host sync.
    """
    op = "update_scale_"
    V.update_scale(op, scale, growth_tracker, hysteresis_tracker, found_inf)
    dev = scale.device
    impl = backends.get_impl(op, backends.resolve(op, dev, backend))
    tensors = (scale, growth_tracker, hysteresis_tracker, found_inf)
    impl(
        *registry.coerce(
            op, tensors + (growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale)
        )
    )


def _call_checked(op: str, dev: torch.device, backend: str | None, args: tuple, check) -> None:
    """Run an optimizer op: the native kernel first when it is the chosen backend (it checks every
    tensor itself before touching anything), ``check(strict)`` (:mod:`fastamp.ops.validate`) first
    otherwise, and after a refusal of the native kernel, for the clearer message."""
    backend = backends.resolve(op, dev, backend)
    if _native_fast_path(op, backend, args) is not _NOT_RUN:
        return
    check(backend != "torch")
    backends.get_impl(op, backend)(*args)


def _call_as_optim(op: str, dev: torch.device, backend: str | None, args: tuple, check) -> None:
    """Run the per-rule op ``op`` (its coerced positional ``args``) as the generic ``optim_`` computes it.

    ``check(strict)``: the per-rule op's own argument checks (their messages name its lists).
    """
    generic = registry.coerce("optim_", to_optim(op, args))
    _call_checked("optim_", dev, backend, generic, check)


def adamw_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor],
    step_scalars: Tensor,
    found_inf: Tensor | None,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    amsgrad: bool = False,
    maximize: bool = False,
    backend: str | None = None,
    _table=None,
) -> None:
    """One fused AdamW pass over a group of tensors (see :func:`fastamp.reference.adamw_`).

    All ``params`` share one dtype and device, all ``grads`` one dtype; ``masters``,
    moments are fp32 and contiguous. ``masters`` empty means the params are updated
    directly. ``step_scalars`` (``[step_size, bc2_sqrt, decay, grad_mul]``, see
    :func:`fastamp.reference.adamw_step_scalars`) is shape ``[4]``, shared by every tensor,
    or ``[n, 4]``, contiguous fp32, row ``i`` for ``params[i]`` (e.g. bias corrections from
    each param's own step count); any other shape is refused. Skips everything on device
    when ``found_inf`` is non-zero. No host sync.

    ``_table`` (private, for the optimizers' launch plans): what :func:`_optim_table` made of
    these ``params``, ``masters`` and moments (``states = exp_avgs + exp_avg_sqs (+
    max_exp_avg_sqs)``, rule ``"adamw"``). The native kernel then takes the table's tensors,
    checked in one pass (see csrc/cpu/optim_table.h), instead of the lists; the lists are used
    whenever the table declines.
    """
    op = "adamw_"
    if len(params) == 0:
        return
    dev = params[0].device
    V.adam_hyper(op, beta1, beta2, eps)
    flags = (MAXIMIZE if maximize else 0) | (AMSGRAD if amsgrad else 0)
    hyper = [float(beta1), float(beta2), float(eps)]
    if _table is not None and _run_table(_table, backends.resolve("optim_", dev, backend), grads, step_scalars, found_inf,
                                         None, 0, "adamw", hyper, flags):  # fmt: skip
        return
    tensors = (params, grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step_scalars, found_inf)
    args = registry.coerce(op, tensors + (beta1, beta2, eps, amsgrad, maximize))
    _call_as_optim(op, dev, backend, args, lambda strict: V.adamw(op, dev, *args[:8], args[-2], strict=strict))


def adamw_bf16_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    remainders: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor],
    step_scalars: Tensor,
    found_inf: Tensor | None,
    rng: Tensor | None = None,
    rng_base: int = 0,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    amsgrad: bool = False,
    maximize: bool = False,
    backend: str | None = None,
) -> None:
    """AdamW for bf16 params with int16 master remainders and/or stochastic rounding.

    See :func:`fastamp.reference.adamw_bf16_`. ``step_scalars`` as in :func:`adamw_`: ``[4]``
    shared, or ``[n, 4]`` (contiguous fp32) with row ``i`` for ``params[i]``. No host sync.
    """
    op = "adamw_bf16_"
    if len(params) == 0:
        return
    dev = params[0].device
    V.adam_hyper(op, beta1, beta2, eps)
    tensors = (params, grads, remainders, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step_scalars, found_inf, rng)
    args = registry.coerce(op, tensors + (rng_base, beta1, beta2, eps, amsgrad, maximize))
    _call_as_optim(op, dev, backend, args, lambda strict: V.adamw(op, dev, *args[:8], args[-2], args[8], strict=strict))


def adamw_q8_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor],
    exp_avg_codes: Sequence[Tensor],
    exp_avg_scales: Sequence[Tensor],
    exp_avg_sq_codes: Sequence[Tensor],
    exp_avg_sq_scales: Sequence[Tensor],
    step_scalars: Tensor,
    found_inf: Tensor | None,
    rng: Tensor | None = None,
    rng_base: int = 0,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    maximize: bool = False,
    sr_param: bool = False,
    sr_codes: bool = False,
    backend: str | None = None,
) -> None:
    """AdamW on 8-bit block-scaled moments (the q8 format; see :func:`fastamp.reference.adamw_q8_`).

    ``masters``: fp32 masters, int16 remainders (bf16 params), int8 ulp8 corrections (bf16 /
    fp16 params) or empty. Codes are uint8 shaped like the params (contiguous), scales uint8
    ``[ceil(n / 32)]``. ``rng`` (``[seed, counter]``, int64) drives the stochastic rounding of
    the codes (``sr_codes``) and of bf16 params without a master or of ulp8 corrections
    (``sr_param``). ``step_scalars`` as in :func:`adamw_`. No host sync.

    Backends: native (CPU; CUDA where built), Triton (CUDA; the CPU under ``TRITON_INTERPRET=1``),
    torch, all with every master kind.
    """
    op = "adamw_q8_"
    if len(params) == 0:
        return
    dev = params[0].device
    V.adam_hyper(op, beta1, beta2, eps)
    tensors = (params, grads, masters, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales,
               step_scalars, found_inf, rng)  # fmt: skip
    args = registry.coerce(op, tensors + (rng_base, beta1, beta2, eps, maximize, sr_param, sr_codes))
    _call_as_optim(op, dev, backend, args,
                  lambda strict: V.adamw_q8(op, dev, *args[:10], sr_param, sr_codes, strict=strict))  # fmt: skip


def sgd_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor],
    step_scalars: Tensor,
    found_inf: Tensor | None,
    rng: Tensor | None = None,
    rng_base: int = 0,
    *,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool = False,
    maximize: bool = False,
    backend: str | None = None,
) -> None:
    """Fused SGD (torch.optim.SGD's update) with fp32 / remainder / no masters.

    See :func:`fastamp.reference.sgd_`. ``step_scalars`` (``[lr, grad_mul, is_first]``, see
    :func:`fastamp.reference.sgd_step_scalars`) is ``[3]``, shared, or ``[n, 3]`` (contiguous
    fp32) with row ``i`` for ``params[i]``. No host sync.
    """
    op = "sgd_"
    if len(params) == 0:
        return
    dev = params[0].device
    tensors = (params, grads, masters, momentum_buffers, step_scalars, found_inf, rng)
    args = registry.coerce(op, tensors + (rng_base, momentum, dampening, weight_decay, nesterov, maximize))
    _call_as_optim(op, dev, backend, args, lambda strict: V.sgd(op, dev, *args[:7], args[8], strict=strict))


def lion_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    step_scalars: Tensor,
    found_inf: Tensor | None,
    rng: Tensor | None = None,
    rng_base: int = 0,
    *,
    beta1: float,
    beta2: float,
    maximize: bool = False,
    backend: str | None = None,
) -> None:
    """Fused Lion with fp32 / remainder / no masters.

    See :func:`fastamp.reference.lion_`. ``step_scalars`` (``[lr, decay, grad_mul]``, see
    :func:`fastamp.reference.lion_step_scalars`) is ``[3]``, shared, or ``[n, 3]`` (contiguous
    fp32) with row ``i`` for ``params[i]``. No host sync.
    """
    op = "lion_"
    if len(params) == 0:
        return
    dev = params[0].device
    V.lion_hyper(op, beta1, beta2)
    tensors = (params, grads, masters, exp_avgs, step_scalars, found_inf, rng)
    args = registry.coerce(op, tensors + (rng_base, beta1, beta2, maximize))
    _call_as_optim(op, dev, backend, args, lambda strict: V.lion(op, dev, *args[:7], strict=strict))


def sgd_q8_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor],
    momentum_buffer_codes: Sequence[Tensor],
    momentum_buffer_scales: Sequence[Tensor],
    step_scalars: Tensor,
    found_inf: Tensor | None,
    rng: Tensor | None = None,
    rng_base: int = 0,
    *,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool = False,
    maximize: bool = False,
    sr_param: bool = False,
    sr_codes: bool = False,
    backend: str | None = None,
) -> None:
    """:func:`sgd_` with the momentum buffers as q8 codes and scales (see :func:`fastamp.reference.sgd_q8_`).

    Codes are uint8 shaped like the params (contiguous), scales uint8 ``[ceil(n / 32)]``;
    ``momentum`` non-zero. ``rng`` (``[seed, counter]``, int64) drives the stochastic rounding of
    the codes (``sr_codes``) and of bf16 params without a master (``sr_param``). No host sync.

    Backends: native (a fused CPU kernel; on CUDA the dense kernel composed with the codec),
    Triton (composed), torch.
    """
    op = "sgd_q8_"
    if len(params) == 0:
        return
    if momentum == 0:
        raise ValueError(f"{op}: momentum must be non-zero (the q8 codes hold the momentum buffer)")
    dev = params[0].device
    tensors = (params, grads, masters, momentum_buffer_codes, momentum_buffer_scales, step_scalars, found_inf, rng)
    args = registry.coerce(
        op, tensors + (rng_base, momentum, dampening, weight_decay, nesterov, maximize, sr_param, sr_codes)
    )
    names = ("momentum_buffer_codes", "momentum_buffer_scales")
    _call_as_optim(op, dev, backend, args,
                  lambda strict: V.one_state_q8(op, dev, *args[:8], sr_param, sr_codes, names,
                                                "[lr, grad_mul, is_first]", strict=strict))  # fmt: skip


def lion_q8_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor],
    exp_avg_codes: Sequence[Tensor],
    exp_avg_scales: Sequence[Tensor],
    step_scalars: Tensor,
    found_inf: Tensor | None,
    rng: Tensor | None = None,
    rng_base: int = 0,
    *,
    beta1: float,
    beta2: float,
    maximize: bool = False,
    sr_param: bool = False,
    sr_codes: bool = False,
    backend: str | None = None,
) -> None:
    """:func:`lion_` with ``exp_avg`` as q8 codes and scales (see :func:`fastamp.reference.lion_q8_`).

    Arguments and backends as in :func:`sgd_q8_`. No host sync.
    """
    op = "lion_q8_"
    if len(params) == 0:
        return
    dev = params[0].device
    V.lion_hyper(op, beta1, beta2)
    tensors = (params, grads, masters, exp_avg_codes, exp_avg_scales, step_scalars, found_inf, rng)
    args = registry.coerce(op, tensors + (rng_base, beta1, beta2, maximize, sr_param, sr_codes))
    names = ("exp_avg_codes", "exp_avg_scales")
    _call_as_optim(op, dev, backend, args,
                  lambda strict: V.one_state_q8(op, dev, *args[:8], sr_param, sr_codes, names,
                                                "[lr, decay, grad_mul]", strict=strict))  # fmt: skip


def optim_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor],
    states: Sequence[Tensor],
    step_scalars: Tensor,
    found_inf: Tensor | None,
    rng: Tensor | None = None,
    rng_base: int = 0,
    *,
    rule: str,
    hyper: Sequence[float],
    flags: int = 0,
    backend: str | None = None,
    _table=None,
) -> None:
    """One fused optimizer step: the update ``rule`` on every param, its master and its states.

    The one optimizer op; see :func:`fastamp.reference.optim_` for every argument. ``rule``: a
    name of :data:`fastamp.reference.optim.RULES` (``"adamw"``, ``"sgd"``, ``"lion"``) with its
    ``hyper`` list and its step-scalar rows (``[k]`` shared, or ``[n, k]`` contiguous fp32, row
    ``i`` for ``params[i]``); ``masters``: empty, fp32, int16 remainders (bf16 params) or int8
    ulp8 corrections (bf16 / fp16 params); ``states``: the rule's state lists, all fp32, bf16,
    or q8 (codes, then block scales, per state); ``flags``: ``MAXIMIZE``, ``AMSGRAD``,
    ``NESTEROV``, ``SR_PARAM``, ``SR_STATE`` of :mod:`fastamp.reference.optim`. Skips
    everything on the device when ``found_inf`` is non-zero. No host sync.

    ``_table`` (private, for the optimizers' launch plans): what :func:`_optim_table` made of
    these ``params``, ``masters`` and ``states``; the native kernel then takes the table's tensors,
    checked in one pass (csrc/cpu/optim_table.h), whenever it does not decline.
    """
    op = "optim_"
    if len(params) == 0:
        return
    dev = params[0].device
    V.optim_rule(op, rule, hyper, flags)
    if _table is not None and _run_table(_table, backends.resolve(op, dev, backend), grads, step_scalars, found_inf,
                                         rng, rng_base, rule, hyper, flags):  # fmt: skip
        return
    args = registry.coerce(
        op, (params, grads, masters, states, step_scalars, found_inf, rng, rng_base, rule, hyper, flags)
    )
    _call_checked(op, dev, backend, args, lambda strict: V.optim(op, dev, *args, strict=strict))
