"""Triton ``optim_`` (:func:`fastamp.reference.optim_`): the one optimizer op, a rule x a master format x a state format.

Until the Triton backend has a generic kernel of its own, ``optim_`` runs on its per-rule
launchers (``adamw_``, ``adamw_bf16_``, ``adamw_q8_``, ``sgd_``, ``lion_`` and the composed
``sgd_q8_`` / ``lion_q8_``): :mod:`fastamp.ops.legacy` maps the arguments, bit for bit.
"""

from __future__ import annotations

from fastamp.ops import registry


def _legacy_launcher(name: str):
    from fastamp import kernels

    return kernels.get_op(name)


_optim_op = registry.register_triton("optim_", registry.bridge(_legacy_launcher))
registry.BRIDGED.update({("triton", "cpu"), ("triton", "cuda")})


def optim_(*args) -> None:
    """Triton :func:`fastamp.reference.optim_` (its arguments, all positional), no host sync."""
    _optim_op(*registry.coerce("optim_", args))
