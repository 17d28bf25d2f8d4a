"""The check pass (pass 1): one fused read of an optimizer's grads, per device.

In the same read: the non-finite check into ``found_inf``, the unscale in place
(``write_back``), the sum of squares for clipping (``compute_sumsq``) and, with the
scaler's ``track_stats``, per-tensor health statistics into buffers kept per optimizer and
device. The common case (dense ``torch.Tensor`` grads on one device, native backend) is one
kernel call with no Python work per grad; anything else (several devices, sparse, strided,
fp64 or DTensor grads) goes through the per-grad path, which groups the grads by device and
lets :mod:`fastamp.functional` split off what the kernels cannot take. The backend is
resolved once per device and check.

These functions take the :class:`fastamp.Scaler` whose pass they run: they read its
``_backend``, ``_track_stats`` and ``_health`` and keep its ``_stats``.
"""

from __future__ import annotations

import operator
import weakref
from collections import defaultdict
from itertools import chain, compress, repeat

import torch
from torch import Tensor

from fastamp import health
from fastamp._dtensor import local_of
from fastamp.ops import backends, functional
from fastamp.scaler.device_scalars import _PerDevice

_DTYPE_OF = operator.attrgetter("dtype")
_GRAD_OF = operator.attrgetter("grad")


def _native_param_grads():
    """``fastamp._C.param_grads`` (csrc/plan_check.cpp), None where the extension lacks it."""
    try:
        from fastamp import _C
    except (ImportError, OSError):
        return None
    return getattr(_C, "param_grads", None)


_PARAM_GRADS = _native_param_grads()
_PARAMS_OF = operator.itemgetter("params")


def _check_grads(
    scaler,
    optimizer,
    inv_scale: Tensor,
    found_inf: Tensor,
    *,
    allow_fp16: bool,
    write_back: bool,
    compute_sumsq: bool,
    stats: bool = False,
) -> tuple[dict[torch.device, Tensor], dict[torch.device, Tensor]]:
    """One fused pass per device: non-finite check, optional unscale, optional sum of squares.

    ``stats`` (with ``track_stats``): the same pass also writes the per-tensor health
    statistics into this optimizer's buffers for that device. Returns ``found_inf`` and the
    sum of squares, per device.

    The common case is handled here: one native kernel call and no Python work per grad
    beyond reading it. Dense ``torch.Tensor`` grads on one device with the native backend.
    The kernel checks every grad (device, layout, dtype, contiguity) before it touches
    anything, so grads on several devices, sparse, strided or fp64 grads make it refuse and
    the per-grad path runs instead (which handles them or raises its error). With many small
    tensors that per-grad Python would cost more than the kernel.
    """
    inv_rep, found_rep = _PerDevice(inv_scale), _PerDevice(found_inf)
    stats = stats and scaler._track_stats
    op = "unscale_check_stats_" if stats else "unscale_check_"
    resolved: dict[torch.device, str] = {}
    with torch.no_grad():
        plain = _plain_grads(optimizer, allow_fp16)
        if plain is not None:
            params, positions, grads = plain
            if not grads:
                return found_rep.copies, {}
            device = grads[0].device
            resolved[device] = backends.resolve(op, device, scaler._backend)
            if resolved[device] == "native":
                if scaler._health.wants_dtypes():
                    scaler._health.note_grads(grads)
                args = [grads, found_rep.get(device), inv_rep.get(device), write_back, compute_sumsq]
                if stats:
                    # A dense grad has its param's shape (torch enforces it), but not always its dtype
                    # (fp32 grads on fp16 params: p.grad_dtype): each row is labelled, and judged by the
                    # pitfall guards, by its grad's own dtype. One attribute read per grad, in C.
                    dtypes = list(map(_DTYPE_OF, grads))
                    args += _stats_buffers(
                        scaler, optimizer, device, params, positions, dtypes, None, inv_rep.get(device)
                    )
                sumsq = functional._native_fast_path(op, "native", args)
                if sumsq is not functional._NOT_RUN:
                    return found_rep.copies, {device: sumsq}
        per_grad = _check_per_grad(
            scaler,
            optimizer,
            inv_rep,
            found_rep,
            op,
            resolved,
            allow_fp16=allow_fp16,
            write_back=write_back,
            compute_sumsq=compute_sumsq,
            stats=stats,
        )
    return found_rep.copies, per_grad


def _check_per_grad(
    scaler,
    optimizer,
    inv_rep: _PerDevice,
    found_rep: _PerDevice,
    op: str,
    resolved: dict[torch.device, str],
    *,
    allow_fp16: bool,
    write_back: bool,
    compute_sumsq: bool,
    stats: bool,
) -> dict[torch.device, Tensor]:
    """The per-grad path of :func:`_check_grads`: one :mod:`fastamp.functional` call per device.

    Grads are gathered through the scaler's ``_grads_by_device`` (a subclass, or a test, can
    see or replace it). ``resolved``: the backends already chosen for ``op``, by device.
    """
    sumsq: dict[torch.device, Tensor] = {}
    owners: dict[torch.device, list] | None = defaultdict(list) if stats else None
    for device, grads in scaler._grads_by_device(optimizer, allow_fp16, owners).items():
        if scaler._health.wants_dtypes():
            scaler._health.note_grads(grads)
        counts = absmax = None
        if stats:
            own = owners[device]
            counts, absmax = _stats_buffers(
                scaler,
                optimizer,
                device,
                [p for p, _ in own],
                [i for _, i in own],
                [g.dtype for g in grads],
                [tuple((g._values() if g.is_sparse else g).shape) for g in grads],
                inv_rep.get(device),
            )
        backend = resolved.get(device) or backends.resolve(op, device, scaler._backend)
        sumsq[device] = functional._unscale_check(
            grads, found_rep.get(device), inv_rep.get(device), write_back, compute_sumsq, counts, absmax, backend
        )
    return sumsq


def _stats_buffers(
    scaler, optimizer, device, params, positions, dtypes, shapes, inv_scale: Tensor
) -> tuple[Tensor, Tensor]:
    """This optimizer's statistics buffers on ``device`` (reused while the row count is unchanged).

    ``params``: the param of each row; ``positions``, ``dtypes``, ``shapes``: see
    :class:`fastamp.health._StatsRows` (None: derived from the params).
    """
    key = (id(optimizer), device)
    old = scaler._stats.get(key)
    n = len(params)
    if old is not None and old.counts.shape[0] == n and old.optimizer() is optimizer:
        counts, absmax = old.counts, old.absmax
    else:
        counts = torch.zeros((n, 3), dtype=torch.int64, device=device)
        absmax = torch.zeros((n,), dtype=torch.float32, device=device)
    scaler._stats[key] = health._StatsRows(
        weakref.ref(optimizer), params, positions, dtypes, shapes, counts, absmax, inv_scale
    )
    scaler._last_stats_update = scaler._health.updates
    return counts, absmax


def _grads_by_device(optimizer, allow_fp16: bool, owners=None) -> dict[torch.device, list[Tensor]]:
    per_device: dict[torch.device, list[Tensor]] = defaultdict(list)
    position = -1
    for group in optimizer.param_groups:
        for param in group["params"]:
            position += 1
            if not isinstance(param, Tensor):
                raise AssertionError(f"expected param to be torch.Tensor, got {type(param).__name__}")
            grad = param.grad
            if grad is None:
                continue
            if not allow_fp16 and grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            if grad.is_sparse and grad.dtype is torch.float16:
                # duplicate indices are summed by coalescing, which can itself overflow:
                # check what the optimizer will really see (as torch does).
                grad = param.grad = grad.coalesce()
            # FSDP2 grads are DTensors: each rank checks (and unscales in place) its own shard;
            # process_group then makes the flag and, with sharded=True, the norm global.
            if type(grad) is not Tensor:
                grad = local_of(grad)
            device = grad.device
            per_device[device].append(grad)
            if owners is not None:
                owners[device].append((param, position))
    return per_device


def _plain_grads(optimizer, allow_fp16: bool) -> tuple[list[Tensor], list[int] | None, list[Tensor]] | None:
    """``(params with a grad, their positions, their grads)`` without a Python call per param.

    ``positions`` (in the optimizer's flattened param order) is None when every param has a
    grad. None when the per-param loop of ``Scaler._grads_by_device`` is needed: a
    non-tensor param, a grad that is not a plain ``torch.Tensor`` (DTensor), or fp16 grads
    where they are refused (that loop raises the error).
    """
    groups = optimizer.param_groups
    params = list(groups[0]["params"]) if len(groups) == 1 else list(chain.from_iterable(map(_PARAMS_OF, groups)))
    got = NotImplemented if _PARAM_GRADS is None else _PARAM_GRADS(params)
    if got is NotImplemented:
        if not all(map(isinstance, params, repeat(Tensor))):
            return None
        # C-level passes only (no Python code per param): thousands of small params are common
        grads = list(map(_GRAD_OF, params))
        plain = fp16 = None
    else:
        # the same answers from one prefetched C loop (csrc/plan_check.cpp)
        grads, plain, fp16 = got
    positions = None
    if any(map(operator.is_, grads, repeat(None))):
        positions = list(compress(range(len(grads)), map(operator.is_not, grads, repeat(None))))
        params = list(map(params.__getitem__, positions))
        grads = list(map(grads.__getitem__, positions))
    if plain is None:
        plain = set(map(type, grads)) <= {Tensor}
        fp16 = not allow_fp16 and torch.float16 in set(map(_DTYPE_OF, grads))
    if not plain or (fp16 and not allow_fp16):
        return None
    return params, positions, grads


def _params_with_grads(optimizer) -> list[Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if isinstance(p, Tensor) and p.grad is not None]
