"""DTensor (FSDP2) helpers shared by the grad scaler and the optimizers.

Kernels read and update the local shard of a DTensor in place; these tell the two apart
without importing ``torch.distributed``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def is_dtensor(t: Tensor) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 param or its state)."""
    return type(t) is not Tensor and isinstance(getattr(t, "_local_tensor", None), Tensor)


def local_of(t: Tensor) -> Tensor:
    """The local shard of a DTensor (what the kernels read and update in place), else ``t``."""
    return t._local_tensor if is_dtensor(t) else t


def sharded_like(like: Tensor, local: Tensor, shape: tuple[int, ...] | None = None) -> Tensor:
    """A DTensor on ``like``'s mesh and placements whose shard here is ``local``: of global ``shape``
    (contiguous), or of ``like``'s shape and strides. No communication (``run_check=False``)."""
    if shape is None:
        size, stride = like.shape, like.stride()
    else:
        size, acc, rev = torch.Size(shape), 1, []
        for n in reversed(shape):
            rev.append(acc)
            acc *= max(n, 1)
        stride = tuple(reversed(rev))
    return type(like).from_local(local, like.device_mesh, like.placements, run_check=False, shape=size, stride=stride)


def on_shards(fn, *tensors: Tensor):
    """``fn(*tensors)`` for plain tensors; for DTensors, ``fn`` on each rank's local shards, its tensor
    results wrapped as DTensors sharded like the first argument (same global shape and placements).

    For the elementwise conversions of master formats (``fastamp.reference.split_master`` and the
    like), whose bit views DTensor does not shard: each result is shaped like the first argument.
    """
    if not is_dtensor(tensors[0]):
        return fn(*tensors)
    like = tensors[0]
    out = fn(*(local_of(t) for t in tensors))
    return tuple(sharded_like(like, t) for t in out) if isinstance(out, tuple) else sharded_like(like, out)
