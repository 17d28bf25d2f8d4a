"""Triton kernels for the loss-scaler ops: ``unscale_check_``, ``unscale_check_stats_`` and
``update_scale_``.

Semantics are :func:`fastamp.reference.unscale_check_`,
:func:`fastamp.reference.unscale_check_stats_` and :func:`fastamp.reference.update_scale_`;
all are registered as the ``fastamp_triton`` ops of the op table in ``fastamp/ops/registry.py``
(schema and fake shared with the native ops, ``opcheck`` clean).

Agreement with the reference:

* ``unscale_check_``: ``found_inf`` and the written grads are bit-exact, under the
  interpreter and on a GPU (one fp32 multiply per element, one RNE rounding on store; bf16
  rounding by integer ops). The sum of squares adds fp32 squares per ``BLOCK`` (a tree in
  fp32), blocks and chunks in fp64, in a fixed order (no atomics): deterministic, within
  ``tolerances.SUMSQ_RTOL`` of the reference's fp64 sum. Squares below fp32's normal range
  (|y| < ~1e-19) flush towards 0 there; they cannot move a norm that has any ordinary
  element.
* ``unscale_check_stats_``: as ``unscale_check_``, plus per-tensor counts and absmax that
  are exact (integer counts; the max of fp32 values) and so bit-exact everywhere.
* ``update_scale_``: bit-exact everywhere (the scale times the factor is an fp64 multiply
  rounded to fp32, as torch does; the factors travel as their fp64 bits).
"""

import torch
import triton
import triton.language as tl
from fastamp.kernels import _common as C
from fastamp.kernels import _guards as G
from torch import Tensor

from fastamp.ops import registry

__all__ = ["unscale_check_", "unscale_check_partials_", "unscale_check_stats_", "update_scale_"]

_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# chunks combined per iteration of the per-tensor statistics reduction
_STATS_RBLOCK = 128


@triton.jit
def _unscale_block(
    ptr,
    off,
    end,
    inv_scale,
    KIND: tl.constexpr,
    WRITE_BACK: tl.constexpr,
    SUMSQ: tl.constexpr,
    STATS: tl.constexpr,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One block: (non-finite count, zero count, fp16-underflow count, absmax, fp32 sum of squares)."""
    idx = C.block_index(off, BLOCK)
    mask = idx < end
    x = C.load_f32(ptr, idx, mask, KIND, MASKED)
    y = x * inv_scale
    # x non-finite (torch's rule) or overflow created by the unscale itself
    x_fin = C.is_finite_f32(x)
    y_fin = C.is_finite_f32(y)
    bad = ~(x_fin & y_fin)
    if WRITE_BACK:
        bad = bad | ~C.store_from_f32(ptr, idx, y, mask, KIND, MASKED)
    n_bad = tl.sum((bad & mask).to(tl.int32), axis=0)
    n_zero = tl.full([], 0, tl.int32)
    n_under = tl.full([], 0, tl.int32)
    amax = tl.full([], 0.0, tl.float32)
    sumsq = tl.full([], 0.0, tl.float32)
    if STATS:
        ay = tl.abs(y)
        n_zero = tl.sum((mask & x_fin & (y == 0)).to(tl.int32), axis=0)
        n_under = tl.sum((mask & (ay > 0) & (ay < 6.103515625e-05)).to(tl.int32), axis=0)
        amax = tl.max(tl.where(mask & y_fin, ay, 0.0), axis=0)
    if SUMSQ:
        sumsq = tl.sum(tl.where(mask, y * y, 0.0), axis=0)
    return n_bad, n_zero, n_under, amax, sumsq


@C.jit_launched
def _unscale_check_kernel(
    table_ptr,
    n_tensors,
    n_chunks,
    found_inf_ptr,
    inv_scale_ptr,
    partial_ptr,
    chunk_counts_ptr,
    chunk_absmax_ptr,
    KIND: tl.constexpr,
    N_COL: tl.constexpr,
    WRITE_BACK: tl.constexpr,
    SUMSQ: tl.constexpr,
    STATS: tl.constexpr,
    ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t, start, numel = C.chunk_of(table_ptr, n_tensors, n_chunks, pid, N_COL, CHUNK)
    ptr = C.load_ptr(table_ptr, t, KIND, ALIGNED)
    inv_scale = tl.load(inv_scale_ptr)
    end = tl.minimum(start + CHUNK, numel)
    n_bad = tl.full([], 0, tl.int32)
    n_zero = tl.full([], 0, tl.int32)
    n_under = tl.full([], 0, tl.int32)
    amax = tl.full([], 0.0, tl.float32)
    acc = tl.full([], 0.0, tl.float64)
    # Full blocks unmasked (vector loads/stores), then the last partial block masked (all lanes
    # off when there is none, adding exact zeros); blocks are summed in order, as before.
    off = start
    while off + BLOCK <= end:
        b, z, u, a, s = _unscale_block(ptr, off, end, inv_scale, KIND, WRITE_BACK, SUMSQ, STATS, BLOCK, False)
        n_bad += b
        n_zero += z
        n_under += u
        amax = tl.maximum(amax, a)
        acc += s.to(tl.float64)
        off += BLOCK
    b, z, u, a, s = _unscale_block(ptr, off, end, inv_scale, KIND, WRITE_BACK, SUMSQ, STATS, BLOCK, True)
    n_bad += b
    n_zero += z
    n_under += u
    amax = tl.maximum(amax, a)
    acc += s.to(tl.float64)
    # Every flagging program stores the same 1.0: a benign race, no atomics, never a reset.
    tl.store(found_inf_ptr, 1.0, mask=n_bad > 0)
    if SUMSQ:
        tl.store(partial_ptr + pid, acc)
    if STATS:
        # per-chunk statistics; _stats_reduce_kernel combines each tensor's chunks (no atomics)
        tl.store(chunk_counts_ptr + 3 * pid, n_bad.to(tl.int64))
        tl.store(chunk_counts_ptr + 3 * pid + 1, n_zero.to(tl.int64))
        tl.store(chunk_counts_ptr + 3 * pid + 2, n_under.to(tl.int64))
        tl.store(chunk_absmax_ptr + pid, amax)


@C.jit_launched
def _stats_reduce_kernel(
    table_ptr,
    n_tensors,
    chunk_counts_ptr,
    chunk_absmax_ptr,
    counts_ptr,
    absmax_ptr,
    CHUNK: tl.constexpr,
    RBLOCK: tl.constexpr,
):
    # table columns: grad ptr, index in the call, first chunk in the launch; then numel
    t = tl.program_id(0)
    gid = tl.load(table_ptr + n_tensors + t)
    first = tl.load(table_ptr + 2 * n_tensors + t)
    numel = tl.load(table_ptr + 3 * n_tensors + t)
    last = first + (numel + CHUNK - 1) // CHUNK
    c_bad = tl.full([], 0, tl.int64)
    c_zero = tl.full([], 0, tl.int64)
    c_under = tl.full([], 0, tl.int64)
    amax = tl.full([], 0.0, tl.float32)
    # integer sums and a max of non-negative values: the result does not depend on the order.
    # A while loop: a range() over bounds read from memory breaks Triton 3.6's interpreter.
    c0 = first
    while c0 < last:
        c = c0 + tl.arange(0, RBLOCK)
        m = c < last
        c_bad += tl.sum(tl.load(chunk_counts_ptr + 3 * c, mask=m, other=0), axis=0)
        c_zero += tl.sum(tl.load(chunk_counts_ptr + 3 * c + 1, mask=m, other=0), axis=0)
        c_under += tl.sum(tl.load(chunk_counts_ptr + 3 * c + 2, mask=m, other=0), axis=0)
        amax = tl.maximum(amax, tl.max(tl.load(chunk_absmax_ptr + c, mask=m, other=0.0), axis=0))
        c0 += RBLOCK
    tl.store(counts_ptr + 3 * gid, c_bad)
    tl.store(counts_ptr + 3 * gid + 1, c_zero)
    tl.store(counts_ptr + 3 * gid + 2, c_under)
    tl.store(absmax_ptr + gid, amax)


def _launch_unscale_check(op, grads, found_inf, inv_scale, write_back, compute_sumsq, counts, absmax):
    dev = found_inf.device
    G.guard_lists(op, dev, [1, 1], [("found_inf, inv_scale", [found_inf, inv_scale], G.F32, False)])
    G.guard_lists(op, dev, [g.numel() for g in grads], [("grads", grads, _GRAD_DTYPES, False)])
    stats = counts is not None
    if stats:
        n = len(grads)
        G.guard(counts.device == dev and counts.dtype == torch.int64 and tuple(counts.shape) == (n, 3), op, "counts")
        G.guard(absmax.device == dev and absmax.dtype == torch.float32 and tuple(absmax.shape) == (n,), op, "absmax")
        G.guard(counts.is_contiguous() and absmax.is_contiguous(), op, "counts and absmax must be contiguous")
    C.check_runnable(op, dev)
    groups, copies = _group_grads(grads)
    with C.device_guard(dev):
        sumsq = _launch_groups(groups, dev, found_inf, inv_scale, write_back, compute_sumsq, counts, absmax)
    if write_back:
        for orig, tmp in copies:
            orig.copy_(tmp)
    return sumsq


def _launch_groups(groups, dev, found_inf, inv_scale, write_back, compute_sumsq, counts, absmax):
    """One unscale_check launch per (dtype, aligned) group (+ a statistics reduction each); the sum of squares."""
    partials = _launch_partials(groups, dev, found_inf, inv_scale, write_back, compute_sumsq, counts, absmax)
    if compute_sumsq and partials.numel() > 0:
        return _fold(partials)
    return torch.zeros((), dtype=torch.float32, device=dev)


def _fold(partials: Tensor) -> Tensor:
    # a fixed-order fp64 reduction of the per-chunk partials: deterministic
    return partials.sum().to(torch.float32)


def _launch_partials(groups, dev, found_inf, inv_scale, write_back, compute_sumsq, counts, absmax):
    """The launches of :func:`_launch_groups`; the fp64 partial of every chunk, group after group (empty without sumsq)."""
    chunk, block, opts = C.launch_config("unscale_check")
    stats = counts is not None
    launches = []
    total_chunks = 0
    for (dtype, aligned), members in groups.items():
        ts = [g for _, g in members]
        columns = [[t.data_ptr() for t in ts]]
        if stats:
            # where each tensor's row is, and where its chunks start among this launch's chunks
            columns.append([i for i, _ in members])
            firsts, c = [], 0
            for t in ts:
                firsts.append(c)
                c += -(-t.numel() // chunk)
            columns.append(firsts)
        table, n_chunks = C.build_table(columns, [t.numel() for t in ts], chunk, dev)
        launches.append((C.DTYPE_KIND[dtype], aligned, len(ts), table, n_chunks, total_chunks))
        total_chunks += n_chunks
    partials = torch.empty(total_chunks if compute_sumsq else 1, dtype=torch.float64, device=dev)
    if stats:
        # rows of empty tensors are never launched: they keep these zeros
        counts.zero_()
        absmax.zero_()
        chunk_counts = torch.empty((max(total_chunks, 1), 3), dtype=torch.int64, device=dev)
        chunk_absmax = torch.empty(max(total_chunks, 1), dtype=torch.float32, device=dev)
    else:
        chunk_counts = chunk_absmax = partials
    for kind, aligned, n_tensors, table, n_chunks, first in launches:
        _unscale_check_kernel[(n_chunks,)](
            table,
            n_tensors,
            n_chunks,
            found_inf,
            inv_scale,
            partials[first:] if compute_sumsq else partials,
            chunk_counts[first:] if stats else chunk_counts,
            chunk_absmax[first:] if stats else chunk_absmax,
            KIND=kind,
            N_COL=3 if stats else 1,
            WRITE_BACK=write_back,
            SUMSQ=compute_sumsq,
            STATS=stats,
            ALIGNED=aligned,
            CHUNK=chunk,
            BLOCK=block,
            **opts,
        )
        if stats:
            _stats_reduce_kernel[(n_tensors,)](
                table,
                n_tensors,
                chunk_counts[first:],
                chunk_absmax[first:],
                counts,
                absmax,
                CHUNK=chunk,
                RBLOCK=_STATS_RBLOCK,
                **C.LAUNCH_OPTS,
            )
    return partials if compute_sumsq else partials[:0]


def _group_grads(grads):
    """The grads by (dtype, aligned) in first-seen order, each as (index in the call, contiguous grad); strided copies."""
    groups = {}
    copies = []
    for i, g in enumerate(grads):
        if g.numel() == 0:
            continue
        if not g.is_contiguous():
            tmp = g.contiguous()
            copies.append((g, tmp))
            g = tmp
        # views at odd offsets go to the kernel compiled without the 16-byte alignment hint
        groups.setdefault((g.dtype, C.is_aligned(g)), []).append((i, g))
    return groups, copies


def sumsq_key(grad: Tensor):
    """The launch group of ``grad`` in :func:`unscale_check_` (whose partials come group after group)."""
    # a strided grad is launched as its contiguous copy: a fresh allocation, aligned
    return grad.dtype, C.is_aligned(grad) if grad.is_contiguous() else True


def sumsq_partial_count(numel: int) -> int:
    """The chunk partials of a grad of ``numel`` elements (0 for an empty one: it is not launched)."""
    return -(-numel // C.launch_config("unscale_check")[0])


def sumsq_fold(partials: Tensor, index: Tensor) -> Tensor:
    """:func:`unscale_check_`'s fold of ``partials[index]`` (its partials in its launch order): bit for bit."""
    if index.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=partials.device)
    return _fold(partials[index])


def unscale_check_partials_(grads, found_inf: Tensor, inv_scale: Tensor, partials: Tensor, offsets) -> None:
    """Triton :func:`fastamp.reference.unscale_check_partials_`: grad i's chunk partials into ``partials[offsets[i]:]``.

    The launches of :func:`unscale_check_` (check only, with the sum of squares); each grad's
    chunk partials (:func:`sumsq_partial_count` of them, the values ``unscale_check_`` folds)
    are then copied into its slots. No host sync.
    """
    op = "unscale_check_partials_"
    dev = found_inf.device
    G.guard_lists(op, dev, [1, 1], [("found_inf, inv_scale", [found_inf, inv_scale], G.F32, False)])
    G.guard_lists(op, dev, [g.numel() for g in grads], [("grads", grads, _GRAD_DTYPES, False)])
    G.guard(partials.device == dev and partials.dtype == torch.float64 and partials.dim() == 1, op, "partials")
    C.check_runnable(op, dev)
    groups, _ = _group_grads(grads)
    with C.device_guard(dev):
        chunk_partials = _launch_partials(groups, dev, found_inf, inv_scale, False, True, None, None)
    if chunk_partials.numel() == 0:
        return
    slots = []
    for members in groups.values():
        for i, g in members:
            slots.extend(range(offsets[i], offsets[i] + sumsq_partial_count(g.numel())))
    partials.index_copy_(0, torch.tensor(slots, dtype=torch.int64, device=dev), chunk_partials)


def _unscale_check_impl(grads, found_inf, inv_scale, write_back, compute_sumsq):
    return _launch_unscale_check("unscale_check_", grads, found_inf, inv_scale, write_back, compute_sumsq, None, None)


def _unscale_check_stats_impl(grads, found_inf, inv_scale, write_back, compute_sumsq, counts, absmax):
    return _launch_unscale_check(
        "unscale_check_stats_", grads, found_inf, inv_scale, write_back, compute_sumsq, counts, absmax
    )


_unscale_check_op = registry.register_triton("unscale_check_", _unscale_check_impl)
_unscale_check_stats_op = registry.register_triton("unscale_check_stats_", _unscale_check_stats_impl)


def unscale_check_(grads, found_inf: Tensor, inv_scale: Tensor, write_back: bool = True, compute_sumsq: bool = False):
    """Triton :func:`fastamp.reference.unscale_check_`: one launch per grad dtype, no host sync.

    Sparse grads are handled through their values. Returns the fp32 0-dim sum of squares
    of the unscaled values (0 when ``compute_sumsq`` is False) on ``found_inf``'s device.
    """
    dense = [g._values() if g.is_sparse else g for g in grads]
    return _unscale_check_op(
        *registry.coerce("unscale_check_", (dense, found_inf, inv_scale, write_back, compute_sumsq))
    )


def unscale_check_stats_(
    grads, found_inf: Tensor, inv_scale: Tensor, write_back: bool, compute_sumsq: bool, counts: Tensor, absmax: Tensor
):
    """Triton :func:`fastamp.reference.unscale_check_stats_`: the unscale_check_ pass plus per-tensor statistics.

    ``counts`` (int64 ``[len(grads), 3]``: non-finite, zeros, fp16 underflow) and ``absmax``
    (fp32 ``[len(grads)]``) are overwritten. Each program counts its chunk; a second small
    launch per dtype group combines each tensor's chunks (integer sums and a max, so the
    result is exact and deterministic, without atomics). No host sync.
    """
    dense = [g._values() if g.is_sparse else g for g in grads]
    args = (dense, found_inf, inv_scale, write_back, compute_sumsq, counts, absmax)
    return _unscale_check_stats_op(*registry.coerce("unscale_check_stats_", args))


@C.jit_launched
def _update_scale_kernel(
    scale_ptr,
    growth_tracker_ptr,
    hysteresis_tracker_ptr,
    found_inf_ptr,
    growth_factor_bits,
    backoff_factor_bits,
    growth_interval,
    hysteresis,
    min_scale,
    max_scale,
):
    scale = tl.load(scale_ptr)
    tracker = tl.load(growth_tracker_ptr)
    h_dec = tl.load(hysteresis_tracker_ptr) - 1
    found = tl.load(found_inf_ptr)
    overflow = found != 0  # NaN too
    clean = found == 0
    growth_factor = tl.cast(growth_factor_bits, tl.int64).to(tl.float64, bitcast=True)
    backoff_factor = tl.cast(backoff_factor_bits, tl.int64).to(tl.float64, bitcast=True)

    do_backoff = overflow & (h_dec <= 0)
    backed = (scale.to(tl.float64) * backoff_factor).to(tl.float32)
    backed = tl.where(backed < min_scale, min_scale, backed)
    successful = tracker + 1
    grow_step = clean & (successful.to(tl.int64) == tl.cast(growth_interval, tl.int64))
    grown = (scale.to(tl.float64) * growth_factor).to(tl.float32)
    grown = tl.where(grown > max_scale, max_scale, grown)
    grow_ok = grow_step & C.is_finite_f32(grown)
    new_scale = tl.where(do_backoff, backed, tl.where(grow_ok, grown, scale))
    new_tracker = tl.where(overflow | grow_step, 0, successful)
    new_h = tl.where(overflow, tl.where(h_dec <= 0, 0, h_dec), tl.cast(hysteresis, tl.int32))
    tl.store(scale_ptr, new_scale)
    tl.store(growth_tracker_ptr, new_tracker)
    tl.store(hysteresis_tracker_ptr, new_h)


def _update_scale_impl(
    scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float,
) -> None:
    op = "update_scale_"
    dev = scale.device
    int32 = (torch.int32,)
    lists = [("scale", [scale], G.F32, True), ("found_inf", [found_inf], G.F32, False)]
    lists += [
        ("growth_tracker", [growth_tracker], int32, True),
        ("hysteresis_tracker", [hysteresis_tracker], int32, True),
    ]
    G.guard_lists(op, dev, [1], lists)
    C.check_runnable(op, dev)
    with C.device_guard(dev):
        _update_scale_kernel[(1,)](
            scale,
            growth_tracker,
            hysteresis_tracker,
            found_inf,
            C.f64_bits(growth_factor),
            C.f64_bits(backoff_factor),
            growth_interval,
            hysteresis,
            C.to_f32(min_scale),
            C.to_f32(max_scale),
            **C.LAUNCH_OPTS,
        )


_update_scale_op = registry.register_triton("update_scale_", _update_scale_impl)


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
    max_scale: float = float("inf"),
) -> None:
    """Triton :func:`fastamp.reference.update_scale_`: one single-program launch, no host sync."""
    args = (
        scale,
        growth_tracker,
        hysteresis_tracker,
        found_inf,
        growth_factor,
        backoff_factor,
        growth_interval,
        hysteresis,
        min_scale,
        max_scale,
    )
    _update_scale_op(*registry.coerce("update_scale_", args))
