"""The per-rule optimizer ops as ``optim_`` runs them on a backend without a generic kernel of its own.

``optim_`` (:func:`fastamp.reference.optim_`) is the one optimizer op: an update rule x a master
format x a state format. Until a backend has its own kernel of it, that backend runs ``optim_``
on its older per-rule ops (``adamw_``, ``adamw_bf16_``, ``adamw_q8_``, ``sgd_``, ``sgd_q8_``,
``lion_``, ``lion_q8_``), which compute the same bits for the combinations they cover:
:func:`to_legacy` maps the generic arguments to one of them. A combination none of them covers
(e.g. an ulp8 master under SGD, or bf16 states without a bf16 param) raises
``NotImplementedError`` naming it. :func:`bridged` says whether a backend runs this bridge.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from fastamp.reference.optim import (
    AMSGRAD,
    MAXIMIZE,
    NESTEROV,
    RULES,
    SR_PARAM,
    SR_STATE,
    state_format,
    streams_per_state,
)


def _split(states: list, n: int, lists: int) -> list[list]:
    # RuntimeError, as a kernel refuses an input: fastamp.functional then names the problem
    if len(states) != n * lists:
        raise RuntimeError(f"fastamp::optim_: got {len(states)} state tensors for {n} params, expected {n * lists}")
    return [list(states[k * n : (k + 1) * n]) for k in range(lists)]


def to_legacy(args: tuple) -> tuple[str, tuple]:
    """``(op, its positional arguments)``: the per-rule op that computes ``optim_(*args)``, bit for bit."""
    params, grads, masters, states, scalars, found_inf, rng, rng_base, rule, hyper, flags = args
    r = RULES.get(rule)
    if r is None:
        raise RuntimeError(f"fastamp::optim_: unknown rule {rule!r}; expected one of {tuple(RULES)}")
    n = len(params)
    fmt = state_format(states)
    defs = r.states(hyper, flags)
    lists = _split(list(states), n, len(defs) * streams_per_state(fmt))
    maximize = bool(flags & MAXIMIZE)
    sr_param, sr_state = bool(flags & SR_PARAM), bool(flags & SR_STATE)
    mdt = masters[0].dtype if len(masters) else None
    head = (list(params), list(grads), list(masters))

    def refuse(why: str):
        raise NotImplementedError(f"fastamp::optim_: no per-rule op runs rule {rule!r} with {why}")

    if fmt == "q8":
        if flags & AMSGRAD:
            refuse("amsgrad on q8 states")
        tail = (scalars, found_inf, rng, rng_base)
        if rule == "adamw":
            return "adamw_q8_", (*head, *lists, *tail, *hyper, maximize, sr_param, sr_state)
        if mdt == torch.int8:
            refuse("an ulp8 master")
        if rule == "sgd":
            return "sgd_q8_", (*head, *lists, *tail, *hyper, bool(flags & NESTEROV), maximize, sr_param, sr_state)
        return "lion_q8_", (*head, *lists, *tail, *hyper, maximize, sr_param, sr_state)
    if mdt == torch.int8:
        refuse(f"an ulp8 master and {fmt} states")
    if rule == "adamw":
        amsgrad = bool(flags & AMSGRAD)
        m, v = lists[0], lists[1]
        vmax = lists[2] if amsgrad else []
        bf16_param = n > 0 and params[0].dtype == torch.bfloat16
        low = mdt == torch.int16 or (mdt is None and bf16_param and (sr_param or fmt == "bf16"))
        if not low:
            if fmt == "bf16":
                refuse(f"bf16 states and {'fp32 masters' if mdt is not None else params[0].dtype} params")
            return "adamw_", (*head, m, v, vmax, scalars, found_inf, *hyper, amsgrad, maximize)
        # adamw_bf16_ rounds with rng both what SR_PARAM and SR_STATE name (where they apply)
        uses_param = mdt is None
        uses_state = fmt == "bf16"
        if (uses_param and sr_param != (sr_param or sr_state)) or (uses_state and sr_state != (sr_param or sr_state)):
            refuse("only one of SR_PARAM and SR_STATE")
        use_rng = sr_param or sr_state
        return "adamw_bf16_", (*head, m, v, vmax, scalars, found_inf, rng if use_rng else None, rng_base, *hyper,
                               amsgrad, maximize)  # fmt: skip
    if fmt == "bf16":
        refuse("bf16 states")
    rng_arg = rng if sr_param else None
    state = lists[0] if lists else []
    if rule == "sgd":
        return "sgd_", (*head, state, scalars, found_inf, rng_arg, rng_base, *hyper, bool(flags & NESTEROV), maximize)
    return "lion_", (*head, state, scalars, found_inf, rng_arg, rng_base, *hyper, maximize)


def run(args: tuple, op_of: Callable[[str], Any]) -> Any:
    """``optim_(*args)`` through the per-rule op ``op_of(name)`` (a backend's kernel of it)."""
    name, legacy_args = to_legacy(args)
    return op_of(name)(*legacy_args)
