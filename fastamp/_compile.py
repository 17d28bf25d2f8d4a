"""torch.compile and the Scaler's entry points: they run eagerly, never traced.

:func:`_eager_under_compile` wraps every :class:`fastamp.Scaler` method that decides on the
host what to run (unscale_, clip_grad_norm_, step, update, the checkpoint methods and the
torch hooks other libraries call). Met inside a compiled function the call becomes a graph
break into a dynamo-disabled twin of the method; ``fullgraph=True`` then fails at trace
time, before anything ran, with :data:`_COMPILE_HELP` as the reason.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

_COMPILE_HELP = (
    "fastamp.Scaler.{name}() cannot be captured by torch.compile: it decides on the host what to run "
    "(skip or step, unscale or not) and hands grad_scale/found_inf to the optimizer as attributes. "
    "Outside fullgraph=True it runs eagerly at a graph break, with exactly the eager result. With "
    "fullgraph=True, compile the model and loss (or the forward and backward) and call "
    "scaler.unscale_ / clip_grad_norm_ / step / update outside the compiled function."
)

# (slot, method, name) of every entry point that runs eagerly under torch.compile; slot[0]
# holds the dynamo-disabled twin of the method once torch._dynamo is imported.
_EAGER_ENTRIES: list[tuple[list, Any, str]] = []
_eager_ready = [False]


def _prepare_eager_entries() -> None:
    """Build the dynamo-disabled twin of every entry point (torch._dynamo must be imported).

    Done outside any trace: dynamo refuses to trace ``torch.compiler.disable`` itself, and
    importing torch._dynamo only for this would double ``import fastamp``'s time (any
    ``torch.optim`` optimizer imports it anyway).
    """
    for slot, method, name in _EAGER_ENTRIES:
        if slot[0] is None:
            reason = _COMPILE_HELP.format(name=name)
            try:
                slot[0] = torch.compiler.disable(method, recursive=True, reason=reason)
            except TypeError:  # torch < 2.7: no reason argument
                slot[0] = torch.compiler.disable(method, recursive=True)
    _eager_ready[0] = True


def _maybe_prepare_eager_entries() -> None:
    if not _eager_ready[0] and "torch._dynamo" in sys.modules:
        _prepare_eager_entries()


def _eager_under_compile(method):
    """Make a Scaler method run eagerly, never traced, when torch.compile meets it.

    Under dynamo the call becomes a graph break into the dynamo-disabled twin (so the whole
    method, the optimizer's step included, runs as in eager mode; fullgraph=True then fails
    at trace time, before anything ran, with :data:`_COMPILE_HELP` as the reason). In eager
    mode, once torch._dynamo is imported, the twin is called too: a frame that dynamo chose
    to run eagerly still has its callback installed, and would otherwise compile the
    method's own frame piecewise (the bug this prevents: attributes set for the optimizer
    lost across a graph break, an overflowed step applied). Costs ~1 us per call.
    """
    slot: list = [None]
    name = method.__name__

    def entry(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            eager = slot[0]
            if eager is None:
                # No twin yet (torch._dynamo was imported after the last eager call): refuse
                # before anything ran; outside fullgraph dynamo then runs this frame eagerly.
                raise RuntimeError(_COMPILE_HELP.format(name=name))
            return eager(self, *args, **kwargs)
        if slot[0] is None:
            if "torch._dynamo" not in sys.modules:
                return method(self, *args, **kwargs)
            _prepare_eager_entries()
        return slot[0](self, *args, **kwargs)

    functools.update_wrapper(entry, method)
    entry._fastamp_eager_body = method
    _EAGER_ENTRIES.append((slot, method, name))
    return entry


def _without_entry(bound):
    """``bound`` (``self.<method>``) to call from inside an entry point, which already runs eagerly.

    One of fastamp's own entry points comes back as its method, without the entry (whose only
    work, running the method eagerly, is done: two Python frames and, once torch._dynamo is
    imported, torch's disable wrapper saved per nested call). Anything else (a subclass's
    override, an attribute patched on the instance) comes back as it is, and is called as
    before.
    """
    body = getattr(getattr(bound, "__func__", None), "_fastamp_eager_body", None)
    return bound if body is None else body.__get__(bound.__self__)
