"""The host's records of the step counts of fastamp's fused optimizers: :class:`_StepRecords`.

The kernels read every count on the device (one row of step scalars per param), so the
host never needs a count's value to step. It reads a count only to validate it (finite,
>= 0) after a write it cannot vouch for: the optimizer vouches for the ``step`` tensors it
gave out (views of buffers whose version counters it remembers), so a later step reads
only the counts written from outside; after a load (which validated them) the counts become
such views again. A compiled step advances the counts without these records: it makes them
stale (``_forget_compiled_steps``), and the next eager step reads the counts once.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

from fastamp.optim.engine.state_dict import params_with_state


class _StepRecords:
    """The step-count bookkeeping of :class:`~fastamp.optim.engine.base.FusedOptimizer` (see its doc: Step counts)."""

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

    def _adopt_steps(self) -> None:
        """Vouch for the stored step counts (after a load, which validated them, or unpickling): no host read.

        The counts become 0-dim views of one fp32 buffer per group and device (the buffer a
        step's plan keeps, see ``_Bucket.share_steps``), which this optimizer then
        vouches for as a whole (one version counter to check, one record rather than one per
        param). Counts that are not fp32 0-dim tensors on their param's device are not vouched
        for: the next step reads and validates them.
        """
        self._step_of = {}
        by_device: dict[tuple[int, torch.device], list[tuple[Tensor, dict[str, Any]]]] = {}
        group_of = {id(p): gi for gi, group in enumerate(self.param_groups) for p in group["params"]}
        for p in params_with_state(self):
            st = self.state[p]
            step = st.get("step")
            if type(step) is Tensor and step.dtype == torch.float32 and step.numel() == 1 and step.device == p.device:
                by_device.setdefault((group_of.get(id(p), -1), step.device), []).append((p, st))
        for entries in by_device.values():
            buf = torch.stack([st["step"].detach().reshape(()) for _, st in entries])
            for (p, st), view in zip(entries, buf.unbind(0)):
                st["step"] = view
                self._step_of[id(p)] = view
            self._remember_steps(buf)

    def _recorded_steps(self, buf: Tensor) -> list[Any] | None:
        """This optimizer's record ``[weakref, version]`` of ``buf`` if it is a buffer of step counts it made, else None."""
        entry = self._known_steps.get(id(buf))
        return entry if entry is not None and entry[0]() is buf else None

    def _forget_compiled_steps(self) -> None:
        """What the host recorded before compiled steps ran (they set ``_compiled["ran"]``): forget it.

        A compiled step advances the counts and writes the params without the host
        bookkeeping (and moves their version counters): the next plan reads (validates) the
        counts once, and a remainder-mode param written between a compiled step and the next
        eager one is not re-synced (nothing recorded its version). The mark is a dict
        entry, not an attribute of the optimizer: torch 2.13's dynamo drops attribute
        stores on an optimizer object (it does not track it for side effects), and
        replays item stores on a dict it holds.
        """
        self._compiled["ran"] = False
        self._plan = None
        self._step_of = {}
        self._param_versions = {}
