"""fastamp: fused mixed-precision training for PyTorch.

``fastamp.Scaler`` is a drop-in for ``torch.amp.GradScaler`` whose scale logic runs in
fused kernels with no host sync in the hot path; ``fastamp.optim`` holds fused optimizers
that keep fp32 master weights for fp16/bf16 params. ``python -m fastamp.env`` says which
backends are available.
"""

from fastamp import _ops, backends, functional, reference  # noqa: F401
from fastamp.optim import SGD, AdamW
from fastamp.scaler import OptState, Scaler

__version__ = "0.1.0"

__all__ = ["Scaler", "AdamW", "SGD", "OptState", "backends", "functional", "reference", "__version__"]
