"""fastamp: fused mixed-precision training for PyTorch.

``fastamp.Scaler`` is a drop-in for ``torch.amp.GradScaler`` whose scale logic runs in
fused kernels with no host sync in the hot path; ``fastamp.optim`` holds fused optimizers
that keep fp32 master weights for fp16/bf16 params. ``python -m fastamp.env`` says which
backends are available.
"""

from fastamp import backends, functional, health, optim, reference, schedule  # noqa: F401  # noqa: E402
from fastamp._release import Release, release
from fastamp.cast import DEFAULT_KEEP_FP32, cast_model
from fastamp.health import AmpPitfallWarning, GradStats
from fastamp.ops import registry  # noqa: F401  (loads the op table and the native library)
from fastamp.optim import *  # noqa: F403  (the optimizers: fastamp.AdamW, fastamp.SGD, ... as fastamp.optim.__all__)
from fastamp.scaler import OptState, Scaler
from fastamp.schedule import DeviceLR, SkipAwareLR

__version__ = "0.1.0"

__all__ = [
    "Scaler",
    "release",
    "Release",
    "OptState",
    "backends",
    "functional",
    "reference",
    "__version__",
    "cast_model",
    "DEFAULT_KEEP_FP32",
    "health",
    "schedule",
    "AmpPitfallWarning",
    "GradStats",
    "DeviceLR",
    "SkipAwareLR",
]
# every optimizer of fastamp.optim, so that a new one is exported here without an edit (type checkers
# read `from ... import *` and `__all__ +=` of a module's literal __all__)
__all__ += optim.__all__
