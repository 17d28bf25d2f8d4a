"""Which backend runs an op on a device: the one place that decides.

Backends:
  ``native``  C++ kernels in ``fastamp._C`` (CPU always built; CUDA where built)
  ``triton``  Triton kernels in ``fastamp.kernels`` (CUDA; on CPU only under TRITON_INTERPRET=1)
  ``torch``   the plain-torch reference in ``fastamp.reference`` (always available)

AUTO (the default) picks the fastest available for the op and device: native, then
triton, then torch. ``FASTAMP_BACKEND=native|triton|torch`` or :func:`set_backend` forces
one; forcing a backend that cannot run the op on that device raises
:class:`BackendUnavailableError` naming the reason; nothing silently falls back when the
user asked for something specific. An explicit ``backend=`` argument on an op or an
optimizer wins over both.
"""

from __future__ import annotations

import os
from typing import Callable, Union

import torch

from fastamp.ops import registry

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "set_backend",
    "get_backend",
    "available",
    "resolve",
    "get_impl",
    "kernel",
]

BACKENDS = ("native", "triton", "torch")
_AUTO_ORDER = {"cpu": ("native", "torch"), "cuda": ("native", "triton", "torch")}
_forced: str | None = None


class BackendUnavailableError(RuntimeError):
    """A backend was requested explicitly but cannot run the op on that device."""


def _check_name(name: str | None) -> str | None:
    if name is None or name == "auto":
        return None
    if name not in BACKENDS:
        raise ValueError(f"fastamp: unknown backend {name!r}; expected one of {BACKENDS} or 'auto'")
    return name


def set_backend(name: str | None) -> None:
    """Force a backend for every op (``None`` or ``'auto'`` restores AUTO)."""
    global _forced
    _forced = _check_name(name)


def get_backend() -> str | None:
    """The forced backend (from :func:`set_backend` or ``FASTAMP_BACKEND``), or None for AUTO."""
    if _forced is not None:
        return _forced
    return _check_name(os.environ.get("FASTAMP_BACKEND") or None)


def _device_type(device: Union[str, torch.device]) -> str:
    return torch.device(device).type


def available(backend: str, op: str, device: Union[str, torch.device]) -> tuple[bool, str]:
    """Whether ``backend`` can run ``op`` on ``device``, and why not if it cannot."""
    dt = _device_type(device)
    if backend == "torch":
        return True, "plain torch reference"
    if backend == "native":
        if not registry.NATIVE_LOADED:
            return False, f"fastamp._C is not built or failed to load ({registry.NATIVE_ERROR})"
        if registry.native_has_kernel(op, dt):
            return True, "fastamp._C"
        return False, f"fastamp._C has no {dt} kernel for {op} (built: {registry.build_info()})"
    if backend == "triton":
        from fastamp import kernels

        ok, why = kernels.available(dt)
        if not ok:
            return False, why
        if kernels.get_op(op) is None:
            return False, f"no Triton kernel for {op}"
        return True, why
    raise ValueError(f"fastamp: unknown backend {backend!r}; expected one of {BACKENDS}")


def resolve(op: str, device: Union[str, torch.device], backend: str | None = None) -> str:
    """The backend that runs ``op`` on ``device``: explicit argument, then forced, then AUTO."""
    requested = _check_name(backend) or get_backend()
    if requested is not None:
        ok, why = available(requested, op, device)
        if not ok:
            raise BackendUnavailableError(
                f"fastamp: backend {requested!r} was requested for {op} on {torch.device(device)} "
                f"but is not available: {why}"
            )
        return requested
    for cand in _AUTO_ORDER.get(_device_type(device), ("torch",)):
        if available(cand, op, device)[0]:
            return cand
    return "torch"


def get_impl(op: str, backend: str) -> Callable:
    """The callable implementing ``op`` in ``backend``; all share the reference's signature.

    The op itself (:func:`kernel`), except for Triton: its Python launcher, which imports the
    kernel module (registering ``torch.ops.fastamp_triton.<op>``) and checks what the op's
    launch tables rely on.
    """
    if backend == "torch" and (op in registry.Q8_OPS or op in registry.GENERIC_OPS):
        registry.reference_op(op)  # registers fastamp_ref::op, which kernel() returns
    if backend in ("torch", "native"):
        return kernel(op, backend)
    if backend == "triton":
        from fastamp import kernels

        fn = kernels.get_op(op)
        if fn is None:
            raise BackendUnavailableError(f"fastamp: no Triton kernel for {op}")
        return fn
    raise ValueError(f"fastamp: unknown backend {backend!r}")


def kernel(op: str, backend: str) -> Callable:
    """The op of ``op`` in a resolved ``backend`` as a graph holds it: reached by attribute lookups dynamo traces.

    ``torch.ops.fastamp.<op>`` (native), ``torch.ops.fastamp_triton.<op>`` (Triton: the op its
    launcher registered) or the reference function (torch). The compiled paths of the scaler
    and of the optimizers call this; :func:`get_impl` must have run first for Triton, at trace
    time: a Triton op is registered when its module is imported, which dynamo does not trace.
    Not a table filled at trace time: dynamo reads a module's dict once per trace, so an entry
    that a later ``_init_group`` of the same trace adds would be missing from it.
    """
    if backend == "torch":
        if (
            op in registry.Q8_OPS or op in registry.GENERIC_OPS
        ):  # opaque under torch.compile (see registry.reference_op)
            return getattr(torch.ops.fastamp_ref, op)
        from fastamp import reference

        return getattr(reference, op)
    return getattr(getattr(torch.ops, registry.NATIVE_NS if backend == "native" else registry.TRITON_NS), op)
