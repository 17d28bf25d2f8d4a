"""The Scaler's communication: one small all-reduce of the overflow flags (and the squared norm).

With a ``process_group`` every rank must skip the same steps and keep the same scale, so every
recorded ``found_inf`` is summed over the group on the scale's device before any skip decision
or scale update; with ``sharded=True`` the clip's squared norm rides in the same collective.
No host sync. Without a process group nothing here communicates.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _check_process_group(process_group: Any, sharded: Any) -> Any:
    if not isinstance(sharded, bool):
        raise TypeError(f"fastamp.Scaler: sharded must be a bool, got {sharded!r}")
    if process_group is None:
        if sharded:
            raise ValueError("fastamp.Scaler: sharded=True needs a process_group to sum the squared norm over")
        return None
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("fastamp.Scaler: a process_group was given but torch.distributed is not available")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"fastamp.Scaler: process_group must be a torch.distributed ProcessGroup (e.g. dist.group.WORLD after "
            f"init_process_group), got {type(process_group).__name__}"
        )
    return process_group


def _all_reduce_flags(
    process_group: Any, scale: Tensor, found: dict[torch.device, Tensor], sumsq: Tensor | None = None
) -> tuple[dict[torch.device, Tensor], Tensor | None]:
    """All-reduce this rank's overflow flags (and a partial squared norm) over the process group.

    One collective on the scale's device, no host sync: the per-device flags are combined
    into one, summed over the ranks with ``sumsq`` in the same fp64 buffer, and clamped to
    0/1 (so a fused kernel that skips only on exactly 1 still skips). Returns the global
    flag on every device ``found`` had (on the scale's device when it had none) and the
    global ``sumsq`` (fp32). Without a process group, returns its inputs unchanged.
    """
    if process_group is None:
        return found, sumsq
    import torch.distributed as dist

    dev = scale.device
    wide = torch.float32 if dev.type == "mps" else torch.float64
    flags = [f.to(dev, non_blocking=True).reshape(()) for f in found.values()]
    flag = torch.stack(flags).ne(0).any().to(wide) if flags else torch.zeros((), dtype=wide, device=dev)
    buf = flag.reshape(1) if sumsq is None else torch.stack([flag, sumsq.to(dev).reshape(()).to(wide)])
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=process_group)
    global_flag = buf[0].clamp(max=1.0).to(torch.float32)
    out = {d: global_flag.to(d, non_blocking=True) for d in found} if found else {dev: global_flag}
    return out, (None if sumsq is None else buf[1].to(torch.float32))


def _all_reduce_clip_check(
    process_group: Any,
    sharded: bool,
    scale: Tensor,
    found: dict[torch.device, Tensor],
    sumsq: dict[torch.device, Tensor],
) -> tuple[dict[torch.device, Tensor], dict[torch.device, Tensor]]:
    """The clip's check results made global: the flag always, the squared norm when ``sharded``.

    Every rank joins the collective, even one without grads. Sharded: the global squared
    norm is the sum of the ranks' partial sums (same collective as the flag). Returns the
    flags and the squared norm on the scale's device; without a process group, its inputs.
    """
    if process_group is None:
        return found, sumsq
    local_sq = torch.zeros((), dtype=torch.float32, device=scale.device)
    for part in sumsq.values():
        local_sq = local_sq + part.to(local_sq.device, non_blocking=True)
    found, global_sq = _all_reduce_flags(process_group, scale, found, local_sq if sharded else None)
    return found, {local_sq.device: global_sq if sharded else local_sq}
