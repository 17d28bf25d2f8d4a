"""DTensor (FSDP2) helpers shared by the grad scaler and the optimizers.

Kernels read and update the local shard of a DTensor in place; these tell the two apart
without importing ``torch.distributed``.
"""

from __future__ import annotations

from torch import Tensor


def is_dtensor(t: Tensor) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 param or its state)."""
    return type(t) is not Tensor and isinstance(getattr(t, "_local_tensor", None), Tensor)


def local_of(t: Tensor) -> Tensor:
    """The local shard of a DTensor (what the kernels read and update in place), else ``t``."""
    return t._local_tensor if is_dtensor(t) else t


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

    def wrap(t: Tensor) -> Tensor:
        return type(like).from_local(
            t, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
        )

    return tuple(map(wrap, out)) if isinstance(out, tuple) else wrap(out)
