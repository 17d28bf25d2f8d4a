"""The public path of :mod:`fastamp.ops.backends`: ``fastamp.backends`` is that module itself (one object,
so ``fastamp.backends.X`` and ``fastamp.ops.backends.X`` are always the same thing)."""

import sys

from fastamp.ops import backends

sys.modules[__name__] = backends
