"""The host's records of the step counts of fastamp's fused optimizers: :class:`_StepRecords`.

The optimizer vouches for the ``step`` tensors it gave out (views of buffers whose version
counters it remembers), so a later step reads only the counts written from outside;
after a load the counts become such views again, grouped in cohorts. A compiled step
advances the counts without these records: it makes them stale (``_forget_compiled_steps``);
the cohorts stay exact through compiled steps, and a plan that splits one renames the
partition that every compiled step guards on (``_name_cohorts``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

from fastamp.optim._plan import StepCohorts
from fastamp.optim._state_dict import params_with_state


class _StepRecords:
    """The step-count bookkeeping of :class:`~fastamp.optim._base.FusedOptimizer` (see its doc: Step counts)."""

    def _remember_steps(self, t: Tensor) -> list[Any]:
        """Vouch for the step count(s) in ``t`` as they are now: ``[weakref, version]``, updated by each increment."""
        known = self._known_steps
        key = id(t)

        def forget(ref: weakref.ref, key: int = key) -> None:
            entry = known.get(key)
            if entry is not None and entry[0] is ref:
                del known[key]

        entry = [weakref.ref(t, forget), t._version]
        known[key] = entry
        return entry

    def _step_trusted(self, p: Tensor, step: Any) -> bool:
        """Whether ``step`` is the count this optimizer gave ``p`` and nobody wrote since.

        The counts it gives out are views of buffers it remembers (``_remember_steps``), so
        an in-place write to any of them moves the buffer's version counter.
        """
        if self._step_of.get(id(p)) is not step:
            return False
        base = step._base
        entry = self._known_steps.get(id(base))
        return entry is not None and entry[0]() is base and base._version == entry[1]

    def _rebuild_cohorts(self) -> None:
        """Cohort tokens from the stored step counts (one read per device, off the hot path).

        The counts become 0-dim views of one fp32 buffer per device, which this optimizer
        then vouches for as a whole (one version counter to check, one record rather than one
        per param). Counts that are not fp32 0-dim tensors on their param's device get no
        token and are read at the next step.
        """
        self._cohorts = StepCohorts()
        self._step_of = {}
        by_device: dict[torch.device, list[tuple[Tensor, dict[str, Any]]]] = {}
        for p in params_with_state(self):
            st = self.state[p]
            step = st.get("step")
            if type(step) is Tensor and step.dtype == torch.float32 and step.numel() == 1 and step.device == p.device:
                by_device.setdefault(step.device, []).append((p, st))
        pairs = []
        for entries in by_device.values():
            buf = torch.stack([st["step"].detach().reshape(()) for _, st in entries])
            for (p, st), view in zip(entries, buf.unbind(0)):
                st["step"] = view
                self._step_of[id(p)] = view
            self._remember_steps(buf)
            pairs.extend(zip((p for p, _ in entries), buf.cpu().tolist()))
        self._cohorts.rebuild(pairs)
        self._retire_compiled_steps()

    def _owns_steps(self, buf: Tensor) -> bool:
        """Whether ``buf`` is a buffer of step counts this optimizer made (and still records)."""
        entry = self._known_steps.get(id(buf))
        return entry is not None and entry[0]() is buf

    def _retire_compiled_steps(self) -> None:
        """Make every compiled step of this optimizer retrace (after a load: new state, cohorts from values)."""
        self._epochs = getattr(self, "_epochs", 0) + 1
        self.__dict__.pop("_held_steps", None)
        self._name_cohorts()

    def _hold_guarded_steps(self, steps: list[Tensor]) -> None:
        """Keep the counts a compiled step is traced with alive for as long as it may run.

        The step guards their identity by ``id`` (see :mod:`fastamp.optim._traced`): a count
        freed while a graph guarding it lives could leave its address to a new tensor, which
        would then pass the guard. They are held until every compiled step retraces (a load;
        or here, past a bound, for a run that keeps replacing its counts).
        """
        held = self.__dict__.setdefault("_held_steps", {})
        if len(held) + len(steps) > 2 * sum(len(g["params"]) for g in self.param_groups) + 64:
            self._retire_compiled_steps()
            held = self.__dict__.setdefault("_held_steps", {})
        for s in steps:
            held[id(s)] = s

    def _name_cohorts(self) -> None:
        """Name the current step cohorts in ``_trace_epoch``, the value every compiled step guards on.

        A compiled step is traced with the launches of the cohorts *after* its own plan
        (``_init_group``) and reads ``_trace_epoch`` then: it runs again only while the
        cohorts are exactly those, and then, every class of the partition being either
        wholly stepped or wholly skipped by its grad pattern, it leaves them as they are.
        Any plan (eager or traced) that splits a cohort renames it, and every compiled step
        that may now group counts that differ retraces. A string: dynamo guards its value
        and never makes it dynamic, as it would an int.
        """
        params = [p for group in self.param_groups for p in group["params"]]
        self._trace_epoch = f"plan {getattr(self, '_epochs', 0)}: cohorts {self._cohorts.digest(params)}"

    def _forget_compiled_steps(self) -> None:
        """What the host recorded before compiled steps ran (they set ``_compiled["ran"]``): forget it.

        A compiled step advances the counts and writes the params without the host
        bookkeeping (and moves their version counters): the next plan reads the counts
        once, and a remainder-mode param written between a compiled step and the next
        eager one is not re-synced (nothing recorded its version). The mark is a dict
        entry, not an attribute of the optimizer: torch 2.13's dynamo drops attribute
        stores on an optimizer object (it does not track it for side effects), and
        replays item stores on a dict it holds.
        """
        self._compiled["ran"] = False
        self._plan = None
        self._step_of = {}
        self._param_versions = {}
