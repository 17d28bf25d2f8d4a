"""The counters of the counter-based random bits (stochastic rounding): one per param group and device.

The kernels draw the random bits of a launch from one ``rng`` tensor, ``[seed, counter]``
(int64, on the device), with stream ``4 * (rng_base + i) + k`` for its tensor ``i`` (the
param's stochastic-rounding id, :meth:`_MasterWeights._rng_ids
<fastamp.optim.formats.masters._MasterWeights._rng_ids>`). So that every launch of a step reads the
same counter, whichever params got a grad and however the step is cut into launches (one
``step()``, or :meth:`step_bucket <fastamp.optim.engine.base.FusedOptimizer.step_bucket>` calls inside
one :meth:`bucket_step <fastamp.optim.engine.base.FusedOptimizer.bucket_step>`, buckets in any order),
the params of a group on one device share one counter: their states hold the same tensor as
``state[p]["rng"]`` (a write in place writes the group's). It advances by one per applied step
(``found_inf == 0``) that stepped at least one of those params, once, after the step's launches.

Against the earlier rule (a counter per param, a launch reading its first param's) the bits
differ only where those counters would have differed: a launch whose first param had missed a
step read a lagging count (and its other params could draw bits they had drawn before).

Created with the group's ``seed`` at the first step that needs it; a param whose state is
created later (its first grad at step k) joins the counter as it is. The states are the
record: a plan (of a step or of a bucket) looks at the whole group and, where its params'
states hold different counter tensors (a state dict loaded from per-param counters, an
``rng`` assigned by hand), makes them one: the first one's seed (in group order) and the
largest counter, so that no param draws bits it has drawn before. ``state_dict()`` gives each
param its own copy; ``state_dict(format="fp32")`` (torch's per-param layout) gives it to the group
instead, ``group["rng"] = [seed, counter]``, and a load hands it back to the params that use it. The group's ``seed`` is read when its counter is created (a later change
does not reseed it; a cleared state or a new group starts a new counter with its seed).
A compiled step reads each group's counter through the first param of its launches: a
counter replaced by hand in another param's state is merged by the next eager step or load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fastamp._dtensor import is_dtensor


def _is_counter(t: Any, dev: torch.device) -> bool:
    """A tensor the kernels can take as ``rng`` on ``dev`` (others are left to the state checks)."""
    return (
        isinstance(t, Tensor)
        and not is_dtensor(t)
        and t.dtype == torch.int64
        and t.shape == (2,)
        and t.device == dev
        and t.is_contiguous()
    )


def group_counter(opt: Any, group: dict[str, Any], dev: torch.device) -> Tensor:
    """The counter of ``group``'s params on ``dev``: the one tensor their states hold (made one here), or a new one.

    Looks at every param of the group (not only those of the plan being built), so that a
    step's plan and the plans of its buckets find the same tensor: a pass over the group's
    states per plan (a bucket's plan already checks every param's memory), none per step.
    Device ops only (no host read of a counter).
    """
    found: dict[int, Tensor] = {}
    holders: list[dict[str, Any]] = []
    state = opt.state
    for q in group["params"]:
        st = state.get(q)
        if not st:
            continue
        t = st.get("rng")
        if t is None or q.device != dev or not _is_counter(t, dev):
            continue
        found.setdefault(id(t), t)
        holders.append(st)
    if not found:
        rng = torch.zeros(2, dtype=torch.int64, device=dev)
        rng[0] = int(group["seed"])
        return rng
    if len(found) == 1:
        return next(iter(found.values()))
    counters = torch.stack(list(found.values()))
    rng = counters[0].clone()
    rng[1] = counters[:, 1].amax()
    for st in holders:
        st["rng"] = rng
    return rng


def share_counters(opt: Any) -> None:
    """Make the counters of each group and device one tensor (see :func:`group_counter`): after a load."""
    for group in opt.param_groups:
        devices = []
        for q in group["params"]:
            st = opt.state.get(q)
            if st and "rng" in st and q.device not in devices and _is_counter(st["rng"], q.device):
                devices.append(q.device)
        for dev in devices:
            group_counter(opt, group, dev)


def advance(counters: list[Tensor], incs: list[Tensor | None]) -> None:
    """Add ``inc`` (None: 1; else a 0-dim ``found_inf == 0``) to each counter's count, on the device, exactly."""
    deltas: dict[tuple[torch.device, int], Tensor] = {}
    out = []
    for counter, inc in zip(counters, incs):
        key = (counter.device, id(inc))
        delta = deltas.get(key)
        if delta is None:
            delta = deltas[key] = torch.zeros(2, dtype=torch.int64, device=counter.device)
            if inc is None:
                delta[1] = 1
            else:
                delta[1].copy_(inc)
        out.append(delta)
    if counters:
        torch._foreach_add_(counters, out)


class PendingAdvances:
    """The counter advances of a step made of :meth:`step_bucket` calls, applied once when it ends.

    Keyed by (group index, device), as :meth:`step` advances each group's counter on each
    device once: a counter advances if any launch of it was applied (the largest of the
    increments its launches had; they differ only when a bucket's own ``found_inf`` skipped it).
    """

    def __init__(self) -> None:
        self.entries: dict[tuple[int, torch.device], list[Any]] = {}

    def note(self, gi: int, counter: Tensor, inc: Tensor | None) -> None:
        key = (gi, counter.device)
        entry = self.entries.get(key)
        if entry is None:
            self.entries[key] = [counter, [inc]]
            return
        incs = entry[1]
        if incs[0] is None or any(x is inc for x in incs):
            return
        if inc is None:
            entry[1] = [None]
        else:
            incs.append(inc)

    def apply(self) -> None:
        counters, incs = [], []
        for counter, got in self.entries.values():
            counters.append(counter)
            incs.append(got[0] if len(got) == 1 else torch.stack(got).amax())
        self.entries = {}
        advance(counters, incs)
