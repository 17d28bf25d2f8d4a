"""Errors that fastamp raises while torch.compile traces its steps, delivered as eager delivers them.

dynamo rewraps what it meets while tracing a frame: an exception raised in traced code
becomes ``torch._dynamo.exc.Unsupported`` ("Observed exception"), one raised from code dynamo
runs eagerly at trace time (an optimizer's ``_init_group``, a function marked
``torch.compiler.assume_constant_result``) becomes ``InternalTorchDynamoError``, in both
cases with dynamo's message. It lets through unchanged only its own exceptions and a few
builtins it treats as internal (torch 2.13: ``torch._dynamo.convert_frame._compile``). So a
check that fails at trace time raises, from such eagerly run code, :func:`as_eager` of the
error: an instance of a subclass of the error's class that is also dynamo's
``TorchRuntimeError``, whose ``str()`` is the eager message. ``except ValueError`` and
``pytest.raises(ValueError, match=...)`` see what eager raises, with or without
``fullgraph``; ``type(e) is ValueError`` does not hold (the class is a subclass of the same
name), and the error is also a ``RuntimeError`` (every dynamo exception is one).

Nothing here imports torch._dynamo at ``import fastamp``: the classes are made when the
first error is raised, and :func:`raise_traced` is marked ``assume_constant_result`` by
:func:`fastamp.scaler.compiled._prepare_eager_entries` (with the scaler's other trace-time hooks).
"""

from __future__ import annotations

from typing import Any

import torch

_CLASSES: dict[type, type | None] = {}


def _str(self) -> str:
    # dynamo appends its "from user code" trace to args[0] (torch._dynamo.exc.augment_exc_message)
    return self._eager_message


def _reduce(self) -> tuple:
    # pickled (e.g. to another process) as the eager exception it stands for
    return (self._eager_type, (self._eager_message,))


def _passing_class(cls: type) -> type | None:
    """A subclass of ``cls`` and of dynamo's ``TorchRuntimeError``, named as ``cls`` (None if Python cannot make one)."""
    if cls in _CLASSES:
        return _CLASSES[cls]
    from torch._dynamo.exc import TorchRuntimeError

    made = None
    namespace = {"__module__": __name__, "__qualname__": cls.__qualname__, "__str__": _str, "__reduce__": _reduce}
    # (RuntimeError, TorchRuntimeError) has no consistent MRO: TorchRuntimeError derives from it
    for bases in ((cls, TorchRuntimeError), (TorchRuntimeError, cls)):
        try:
            made = type(cls.__name__, bases, dict(namespace))
            break
        except TypeError:  # an MRO or instance layout conflict (OSError and the like)
            continue
    _CLASSES[cls] = made
    return made


def as_eager(error: BaseException) -> BaseException:
    """``error`` (raised at trace time) as an exception dynamo lets reach the user with eager's class and message.

    dynamo's own exceptions (which steer tracing: restarts, graph breaks) and anything that is
    not an ``Exception`` are returned as they are.
    """
    from torch._dynamo.exc import TorchDynamoException, TorchRuntimeError

    if not isinstance(error, Exception) or isinstance(error, TorchDynamoException):
        return error
    cls = _passing_class(type(error))
    if cls is None:
        return error
    message = str(error)
    out = cls.__new__(cls)
    out.__dict__.update(error.__dict__)
    TorchRuntimeError.__init__(out, message)
    out._eager_type = type(error)
    out._eager_message = message
    return out.with_traceback(error.__traceback__)


def raise_traced(exc_type: type, *args: Any) -> None:
    """Raise ``exc_type(*args)`` from traced code as eager raises it; its arguments must be constants of the trace.

    Marked ``torch.compiler.assume_constant_result``, so dynamo calls it at trace time instead
    of tracing it, and the exception of :func:`as_eager` leaves the trace unchanged.
    """
    raise as_eager(exc_type(*args))


def fail(exc_type: type, *args: Any) -> None:
    """``raise exc_type(*args)``, written once for eager and traced code (see :func:`raise_traced`)."""
    if torch.compiler.is_compiling():
        raise_traced(exc_type, *args)
    raise exc_type(*args)
