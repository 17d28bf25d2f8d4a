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
