"""The public path of :mod:`fastamp.ops.functional`: ``fastamp.functional`` is that module itself (one object,
so ``fastamp.functional.X`` and ``fastamp.ops.functional.X`` are always the same thing)."""

import sys

from fastamp.ops import functional

sys.modules[__name__] = functional
