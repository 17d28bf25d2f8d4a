"""The launch plan of fastamp's fused optimizers, cached across steps while it fits.

:class:`_Plan` holds per param group (:class:`_GroupPlan`) the launches per device
(:class:`_Bucket`, whose ``step`` counts are views of one buffer), each a kernel call
(:class:`_Run`) that takes one row of step scalars per tensor, computed from that tensor's
own count; :class:`StateTable` drops the plan when ``optimizer.state`` changes. What a
grad scaler hands a step is :mod:`fastamp.optim.engine.context`'s.
"""

from __future__ import annotations

import operator
import weakref
from collections import defaultdict
from copy import deepcopy
from itertools import repeat
from typing import Any, Callable

import torch
from torch import Tensor

from fastamp._dtensor import is_dtensor, local_of
from fastamp.optim.engine.context import to_device


class StateTable(defaultdict):
    """``optimizer.state`` that tells its optimizer when an entry is assigned or removed.

    The launch plan holds each param's state dict; ``opt.state[p] = {}`` (a layer's state
    reset by a new dict) or ``del opt.state[p]`` must not leave it updating the old dict,
    and must not keep the old tensors alive. Any change of the table drops the plan; the
    next step plans again. Pickles and copies as a plain ``defaultdict(dict)``.
    """

    def __init__(self, *args: Any, owner: Any = None) -> None:
        super().__init__(*args)
        self._owner = None if owner is None else weakref.ref(owner)

    def _changed(self) -> None:
        owner = None if self._owner is None else self._owner()
        if owner is not None:
            owner._state_changed()

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self._changed()

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        self._changed()

    def pop(self, *args: Any) -> Any:
        self._changed()
        return super().pop(*args)

    def popitem(self) -> Any:
        self._changed()
        return super().popitem()

    def clear(self) -> None:
        super().clear()
        self._changed()

    def update(self, *args: Any, **kwargs: Any) -> None:
        super().update(*args, **kwargs)
        self._changed()

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self._changed()
        return super().setdefault(key, default)

    def __ior__(self, other: Any) -> StateTable:
        self.update(other)
        return self

    def __reduce__(self) -> Any:
        return (defaultdict, (self.default_factory,), None, None, iter(self.items()))

    def __copy__(self) -> defaultdict:
        return defaultdict(self.default_factory, self)

    def __deepcopy__(self, memo: dict) -> defaultdict:
        return defaultdict(self.default_factory, deepcopy(dict(self), memo))


def _native_plan_checks() -> tuple[Callable | None, Callable | None]:
    """``fastamp._C.plan_grads`` and ``same_items`` (csrc/plan_check.cpp), None where the extension lacks them."""
    try:
        from fastamp import _C
    except (ImportError, OSError):
        return None, None
    return getattr(_C, "plan_grads", None), getattr(_C, "same_items", None)


_plan_grads, _same_items = _native_plan_checks()


def _all_hold(states: list[dict[str, Any]], keys: tuple[str, ...], tensors: tuple[list[Tensor], ...]) -> bool:
    """Whether ``states[i][keys[k]] is tensors[k][i]`` for all i, k (a missing key: False); one C loop where built."""
    if _same_items is not None:
        got = _same_items(states, keys, tensors)
        if got is not NotImplemented:
            return got
    try:
        return all(
            all(map(operator.is_, map(operator.itemgetter(key), states), planned))
            for key, planned in zip(keys, tensors)
        )
    except KeyError:
        return False


_grad_of = operator.attrgetter("grad")
_dtype_of = operator.attrgetter("dtype")
_version_of = operator.attrgetter("_version")
_is_contiguous = Tensor.is_contiguous


class _Run:
    """One kernel call of a launch plan: its params, where their grads sit, their states.

    Built once per plan. ``planned`` holds, per state key the launch reads, the tensors it
    was planned with; every step checks (by identity, a C-level pass) that the states still
    hold them, so a tensor replaced by assignment is validated by a new plan before any
    kernel runs. :meth:`refresh` fills the per-step lists (this step's grads, contiguous
    copies of strided params).

    ``row0``: where the run's counts start in its bucket's count vector (the run's params hold
    consecutive entries, in order), so its step scalars are rows ``row0 .. row0 + n`` of the
    bucket's; -1 for a run of params without a ``step`` (SGD without momentum), which takes one
    shared set.
    """

    __slots__ = (
        "op",
        "kind",
        "keys",
        "params",
        "grads",
        "states",
        "planned",
        "planned_keys",
        "planned_tensors",
        "launch",
        "ids",
        "gidx",
        "strided",
        "copy_back",
        "rng",
        "rng_base",
        "dtensor",
        "whole",
        "row0",
        "table",
    )

    def __init__(self, op: str, kind: str, keys: tuple[str, ...] = ()) -> None:
        self.op, self.kind, self.keys = op, kind, keys
        self.params: list[Tensor] = []
        self.grads: list[Tensor] = []
        self.states: list[dict[str, Any]] = []
        self.planned: dict[str, list[Tensor]] = {}
        self.planned_keys: tuple[str, ...] = ()  # the same, as the plan check takes them
        self.planned_tensors: tuple[list[Tensor], ...] = ()
        self.launch: dict[str, list[Tensor]] = {}  # what the kernels get: local shards of DTensor state
        self.ids: list[int] = []
        self.gidx: list[int] = []  # position of each param in its group (where its grad is gathered)
        self.strided: list[tuple[int, Tensor]] = []  # (position in this run, param) of non-contiguous params
        self.copy_back: list[tuple[Tensor, Tensor]] = []
        self.rng: Tensor | None = None
        self.rng_base = 0
        self.dtensor = False  # DTensor params (FSDP2): the kernels get the local shards
        self.whole = False  # holds every param of its group, in order: takes the group's grads as they are
        self.row0 = -1
        # the kernel's persistent table of this run's tensors (fastamp.functional._adamw_table):
        # None until the first native launch tries to make one, False where none can be made
        self.table: Any = None

    def add(self, p: Tensor, pos: int, st: dict[str, Any], sr_id: int | None) -> None:
        if is_dtensor(p):
            self.dtensor = True
            p = p._local_tensor
        if not p.is_contiguous():
            self.strided.append((len(self.params), p))
        self.params.append(p)
        self.gidx.append(pos)
        self.states.append(st)
        if sr_id is not None:
            self.ids.append(sr_id)

    def seal(self, group_size: int) -> None:
        """Record the state tensors the launch reads, once the states are complete."""
        self.whole = self.gidx == list(range(group_size))
        for key in self.keys:
            tensors = [st[key] for st in self.states]
            self.planned[key] = tensors
            if not self.dtensor:
                self.launch[key] = tensors
            elif key.endswith("_scale"):  # q8 block scales: the shard's, flat (moments.scale_shape)
                self.launch[key] = [local_of(t).view(-1) for t in tensors]
            else:
                self.launch[key] = [local_of(t) for t in tensors]
        self.planned_keys = tuple(self.planned)
        self.planned_tensors = tuple(self.planned.values())
        if self.ids:
            self.rng = self.launch["rng"][0]
            self.rng_base = self.ids[0]

    def intact(self) -> bool:
        """Whether every state still holds the planned tensors (none replaced or removed)."""
        return _all_hold(self.states, self.planned_keys, self.planned_tensors)

    @property
    def masters(self) -> list[Tensor]:
        if self.kind == "fp32":
            return self.launch["master_param"]
        if self.kind == "remainder":
            return self.launch["master_remainder"]
        if self.kind == "ulp8":
            return self.launch["master_ulp8"]
        return []

    def refresh(self, grads: list[Tensor]) -> None:
        """This step's lists; ``grads`` are the group's grads (contiguous, checked by the caller)."""
        self.grads = grads if self.whole else list(map(grads.__getitem__, self.gidx))
        if self.dtensor:
            self.grads = list(map(local_of, self.grads))
        self.copy_back = []
        for pos, p in self.strided:
            tmp = p.detach().contiguous()
            self.copy_back.append((p, tmp))
            self.params[pos] = tmp

    def state_list(self, key: str) -> list[Tensor]:
        """``state[key]`` of every param, as the tensors the kernels update (local shards of DTensors)."""
        return self.launch[key]

    def release(self) -> None:
        """Drop this step's lists after the launch, so that the plan keeps no grad alive."""
        self.grads, self.copy_back = [], []
        for pos, p in self.strided:
            self.params[pos] = p

    def split(self) -> list[_Run]:
        """Runs whose stochastic-rounding tensor ids are consecutive (the kernel numbers them base + i).

        Each keeps the rows of its own params (``row0``).
        """
        ids = self.ids
        if not ids or ids[-1] - ids[0] == len(ids) - 1:
            return [self]
        runs, start = [], 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or ids[i] != ids[i - 1] + 1:
                r = _Run(self.op, self.kind)
                r.params, r.grads, r.states = self.params[start:i], self.grads[start:i], self.states[start:i]
                r.launch = {key: tensors[start:i] for key, tensors in self.launch.items()}
                r.rng = r.launch["rng"][0]
                r.rng_base = ids[start]
                r.dtensor = self.dtensor
                r.row0 = self.row0 + start if self.row0 >= 0 else -1
                runs.append(r)
                start = i
        return runs


class _Bucket:
    """The params of one group on one device that a step updates, and their ``step`` counts.

    The counts of the group's params on the device are 0-dim views of one buffer, kept
    across grad patterns (a param skipped by a step keeps its view). The count vector the
    step scalars are computed from (one row per param, from its own count) lists the
    bucket's counts run by run (each run's entries consecutive, from its ``row0``): the
    buffer itself when it holds exactly those in that order, else the buffer gathered at
    ``step_idx``; a step increments the same entries in one op. The counts may differ
    (params skipped by some steps, counts reset). Each step checks that the states still
    hold these views (identity) and that nobody wrote to the buffer (its version counter,
    shared by its views, moved only by the optimizer's own increment): after
    ``state[p]["step"].zero_()`` or a replaced ``step`` a new plan validates the counts,
    stacking replaced ones into a new buffer on the device.
    """

    __slots__ = ("dev", "runs", "steps", "step_buf", "step_idx", "ones", "states", "rngs", "known")

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.runs: dict[Any, _Run] = {}
        self.steps: list[Tensor] = []
        self.step_buf: Tensor | None = None
        self.step_idx: Tensor | None = None  # where the bucket's counts sit in step_buf (None: all of it, in order)
        self.ones: Tensor | None = None
        self.states: list[dict[str, Any]] = []
        self.rngs: list[
            Tensor
        ] = []  # the group's rng counter on this device, if used (one: see fastamp.optim.engine.rng)
        self.known: list[Any] = [None, 0]  # the optimizer's record of step_buf: [weakref, expected version]

    def share_steps(
        self,
        states: list[dict[str, Any]],
        spare: list[tuple[int, dict[str, Any]]],
        remember: Callable[[Tensor], list[Any]],
        recorded: Callable[[Tensor], list[Any] | None],
    ) -> list[int]:
        """Make the ``step`` tensors of ``states`` views of one buffer (device ops, no host read).

        ``spare``: ``(id(param), state)`` of the group's other params on the device whose
        count is an fp32 0-dim tensor there (no grad this step): a new buffer holds their
        counts too, so that the next grad pattern finds its counts in it. Counts that already
        are views of a buffer this optimizer made and records (``recorded``), whose every
        entry is a count of this group on this device, stay the same tensors: planning again
        (a new grad pattern, a plan dropped after compiled steps, a load) neither copies nor
        replaces them, and a compiled step that guards on the views' base finds it unchanged.
        Returns the ids of spare params whose counts sit in a kept buffer written from
        outside since the optimizer recorded it (not validated: no longer vouched for).
        """
        if not states:
            return []
        steps = [st["step"] for st in states]
        buf = steps[0]._base
        offsets = None
        stale: list[int] = []
        entry = None if buf is None else recorded(buf)
        if entry is not None and buf.dim() == 1 and all(s._base is buf and s.dim() == 0 for s in steps):
            mine = [(pid, st["step"]) for pid, st in spare if st["step"]._base is buf]
            views = steps + [v for _, v in mine]
            offsets = [(v.storage_offset() - buf.storage_offset()) // buf.stride(0) for v in views]
            if sorted(offsets) != list(range(buf.numel())):
                offsets = None
            elif buf._version != entry[1]:
                stale = [pid for pid, _ in mine]
        if offsets is None:
            every = states + [st for _, st in spare]
            buf = torch.stack([st["step"].detach().reshape(()) for st in every])
            for st, view in zip(every, buf.unbind(0)):
                st["step"] = view
            steps = [st["step"] for st in states]
            offsets = list(range(len(every)))
        idx = offsets[: len(steps)]
        if idx == list(range(buf.numel())):
            self.step_idx = self.ones = None
        else:
            self.step_idx = to_device(torch.tensor(idx, dtype=torch.int64), self.dev)
            self.ones = torch.ones(len(idx), dtype=buf.dtype, device=self.dev)
        self.step_buf, self.states, self.steps = buf, states, steps
        self.known = remember(buf)
        return stale

    def counts(self) -> Tensor:
        """The bucket's counts, run by run (a new tensor when gathered, the buffer itself otherwise)."""
        if self.step_idx is None:
            return self.step_buf
        return self.step_buf.index_select(0, self.step_idx)

    def advance(self, inc: Tensor | None) -> None:
        """Add ``inc`` (1 without a grad scaler, else ``found_inf == 0``) to the bucket's counts, exactly."""
        buf = self.step_buf
        if self.step_idx is None:
            buf.add_(1.0 if inc is None else inc)
        else:
            buf.index_add_(0, self.step_idx, self.ones if inc is None else inc.expand(self.ones.shape))
        self.known[1] = buf._version

    def intact(self) -> bool:
        """Whether the step views are untouched and every run's state tensors are the planned ones."""
        if self.step_buf is not None:
            if self.step_buf._version != self.known[1]:
                return False
            if not _all_hold(self.states, ("step",), (self.steps,)):
                return False
        return all(run.intact() for run in self.runs.values())


class _GroupPlan:
    """The launches of one param group, and what they assumed about it."""

    __slots__ = (
        "group",
        "params",
        "key",
        "param_dtypes",
        "absent",
        "present",
        "grad_dtypes",
        "dense",
        "grad_kinds",
        "strided_flags",
        "ptrs",
        "dtensor",
        "strided_grads",
        "buckets",
        "remainder",
        "versions",
    )

    def __init__(self, group: dict[str, Any], key: tuple, params: list[Tensor] | None = None) -> None:
        self.group = group
        # the params the plan covers: the group's, or a bucket's among them (see FusedOptimizer.step_bucket)
        self.params: list[Tensor] = list(group["params"]) if params is None else params
        self.key = key
        self.param_dtypes = list(map(_dtype_of, self.params))
        grads = list(map(_grad_of, self.params))
        self.absent = [i for i, g in enumerate(grads) if g is None]
        self.present = [i for i, g in enumerate(grads) if g is not None]
        self.grad_dtypes = [grads[i].dtype for i in self.present]
        self.strided_grads = [i for i in self.present if not grads[i].is_contiguous()]
        # the grads that must stay contiguous, as positions in the group (None: every grad)
        self.dense = (
            None if not self.absent and not self.strided_grads else sorted(set(self.present) - set(self.strided_grads))
        )
        # the same facts per position, as fastamp._C.plan_grads reads them
        self.grad_kinds = [None if g is None else g.dtype for g in grads]
        self.strided_flags = bytes(i in self.strided_grads for i in range(len(grads)))
        self.dtensor = any(map(is_dtensor, self.params))
        self.ptrs = self.data_ptrs(self.params)
        self.buckets: list[_Bucket] = []
        self.remainder: list[Tensor] = []  # params with remainder masters, in plan order
        self.versions: list[int] | None = None  # their ``_version`` after the last step

    def gather(self, params: list[Tensor]) -> list[Tensor | None] | None:
        """The grads of ``params`` (the group's list) if the group still fits this plan, else None.

        It fits when the group holds the planned param objects, at their planned storage
        addresses and dtypes (``.data`` rebinds), and :meth:`grads_fit` holds. One call of
        ``fastamp._C.plan_grads`` where the extension has it (one C loop, no Python per
        param), else a few C-level passes here; both answer the same.
        """
        if _plan_grads is not None and not self.dtensor:
            got = _plan_grads(params, self.params, self.ptrs, self.param_dtypes, self.grad_kinds, self.strided_flags)
            if got is not NotImplemented:
                return None if got is False else got
        if len(params) != len(self.params) or not all(map(operator.is_, params, self.params)):
            return None
        if list(map(_dtype_of, params)) != self.param_dtypes or self.data_ptrs(params) != self.ptrs:
            return None
        grads = list(map(_grad_of, params))
        return grads if self.grads_fit(grads) else None

    def grads_fit(self, grads: list[Tensor | None]) -> bool:
        """Whether this step's grads of the group fit the plan: the same params have one, same dtypes, dense.

        A few C-level passes over the list (no Python code per grad): which params have a
        grad, their dtypes, and that every grad planned contiguous still is (a strided one
        is copied contiguous by the caller, whatever its strides now). A sparse grad fails
        (no ``is_contiguous``): the full checks of a new plan name it.
        """
        if self.absent:
            if not all(map(operator.is_, map(grads.__getitem__, self.absent), repeat(None))):
                return False
            present = list(map(grads.__getitem__, self.present))
        else:
            present = grads
        try:
            if list(map(_dtype_of, present)) != self.grad_dtypes:
                return False
            dense = present if self.dense is None else map(grads.__getitem__, self.dense)
            return all(map(_is_contiguous, dense))
        except (AttributeError, RuntimeError):  # a None where a grad was planned; a sparse grad
            return False

    def data_ptrs(self, params: list[Tensor]) -> list[int]:
        # A param's storage changes with `.data = ...` (a resize, `model.to(memory_format=...)`,
        # a dtype or device move) without any version counter noticing; its address shows it.
        if self.dtensor:
            return [local_of(p).data_ptr() for p in params]
        return list(map(Tensor.data_ptr, params))


class _Plan:
    """How ``step()`` launches the kernels, cached across steps while it fits (see ``_gather``)."""

    __slots__ = ("groups", "state", "n_state", "needed", "chosen", "forced")

    def __init__(self) -> None:
        self.groups: list[_GroupPlan] = []
        self.state: Any = None
        self.n_state = 0
        self.needed: set[tuple[str, torch.device]] = set()
        # the backend of each device's launches, resolved once per plan (see FusedOptimizer._backends_of),
        # and the forced backend (fastamp.backends.get_backend) it was resolved under
        self.chosen: dict[torch.device, str] | None = None
        self.forced: str | None = None
