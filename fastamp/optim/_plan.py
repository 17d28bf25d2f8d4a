"""The launch plan of fastamp's fused optimizers, cached across steps while it fits.

:class:`_Plan` holds per param group (:class:`_GroupPlan`) the launches per device and step
cohort (:class:`_Bucket`), each a kernel call (:class:`_Run`); :class:`StepCohorts` tells
which params may share step scalars without a host read, :class:`StateTable` drops the plan
when ``optimizer.state`` changes, and :class:`AmpInputs` carries a grad scaler's
``grad_scale``/``found_inf`` to each device without a host sync.
"""

from __future__ import annotations

import hashlib
import numbers
import operator
import weakref
from array import array
from collections import defaultdict
from collections.abc import Iterable
from copy import deepcopy
from typing import Any, Callable

import torch
from torch import Tensor

from fastamp._dtensor import is_dtensor, local_of


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    # Host-to-device copies are queued (the source is a host value anyway); a copy to the
    # CPU must be blocking because the CPU kernel reads it right away.
    if t.device == device:
        return t
    return t.to(device, non_blocking=device.type != "cpu")


class AmpInputs:
    """``grad_scale`` and ``found_inf`` as a grad scaler handed them over, per device.

    ``torch.amp.GradScaler`` (path B2 of its ``step``) and ``fastamp.Scaler`` set the
    attributes ``optimizer.grad_scale`` / ``optimizer.found_inf`` before calling
    ``optimizer.step()`` and delete them after. ``grad_scale`` may also fold a clipping
    coefficient in (``scale / clip_coef``). Everything here stays on the device.
    """

    def __init__(self, opt_name: str, grad_scale: Any, found_inf: Any) -> None:
        self.grad_scale = self._as_tensor(opt_name, "grad_scale", grad_scale)
        self.found_inf = self._as_tensor(opt_name, "found_inf", found_inf)
        self._grad_mul: Tensor | None = None
        self._per_device: dict[torch.device, tuple[Tensor | None, Tensor | None, Tensor | None]] = {}

    @staticmethod
    def _as_tensor(opt_name: str, name: str, value: Any) -> Tensor | None:
        if value is None:
            return None
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(f"{opt_name}: {name} must be a 1-element tensor, got shape {tuple(value.shape)}")
            if not value.is_floating_point():
                raise TypeError(f"{opt_name}: {name} must be a floating point tensor, got {value.dtype}")
            return value.detach().reshape(())
        # torch.amp.GradScaler hands over the Python int 0 when no param of this optimizer
        # has a grad (sum of an empty list); accept plain numbers.
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return torch.tensor(float(value), dtype=torch.float32)
        raise TypeError(f"{opt_name}: {name} must be a Tensor or None, got {type(value).__name__}")

    def on(self, device: torch.device) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """``(grad_mul, found_inf, step_increment)`` on ``device`` (each None when not given).

        ``grad_mul = 1/grad_scale`` is computed like ``GradScaler.unscale_``'s ``inv_scale``
        (fp64 reciprocal rounded to fp32), so a power-of-two scale unscales exactly.
        ``step_increment = (found_inf == 0)``: a skipped step (any non-zero flag, NaN
        included) does not count.
        """
        cached = self._per_device.get(device)
        if cached is not None:
            return cached
        grad_mul = None
        if self.grad_scale is not None:
            if self._grad_mul is None:
                gs = self.grad_scale
                wide = torch.float32 if gs.device.type == "mps" else torch.float64
                self._grad_mul = gs.to(wide).reciprocal().to(torch.float32)
            grad_mul = _to_device(self._grad_mul, device)
        found_inf = inc = None
        if self.found_inf is not None:
            found_inf = _to_device(self.found_inf.to(torch.float32), device)
            inc = (found_inf == 0).to(torch.float32)
        self._per_device[device] = (grad_mul, found_inf, inc)
        return self._per_device[device]


class StepCohorts:
    """Which params are guaranteed to hold the same ``step`` value, known on the host.

    A fused launch shares one set of step scalars (bias corrections), but torch keeps one
    step count per param, and a param whose grad is None is not stepped. Reading the
    counts would sync, so the host tracks a token per param instead: params that started
    from equal counts and took part in the same ``step()`` calls carry the same token
    (their counts were incremented by the same on-device ``found_inf`` flags), and only
    params with equal tokens share a launch. In the usual case (every param has a grad
    every step) there is one cohort.

    A count the host knows by value (just created, just loaded, or read because it was
    written from outside) gets the token of its value within its cohort: a read splits a
    cohort whose counts differ but never joins two cohorts, so the cohorts change only
    when a step's grad pattern or an outside write splits them (see :meth:`digest`).
    Joining by value is sound too, but a compiled step guards on the cohorts it was traced
    with: cohorts that join and split again would retrace it each time.
    """

    def __init__(self) -> None:
        self._token: dict[int, object] = {}
        self._remap: dict[object, object] = {}
        self._by_value: dict[tuple[object, float], object] = {}

    def begin_step(self) -> None:
        self._remap = {}
        self._by_value = {}

    def get(self, p: Tensor) -> object | None:
        return self._token.get(id(p))

    def of_value(self, value: float, prior: object | None = None) -> object:
        """The token of a count known to hold ``value``, in cohort ``prior`` (None: a new count)."""
        return self._by_value.setdefault((prior, value), object())

    def advance(self, p: Tensor, token: object) -> None:
        new = self._remap.get(token)
        if new is None:
            new = self._remap[token] = object()
        self._token[id(p)] = new

    def digest(self, params: Iterable[Tensor]) -> str:
        """A name of the partition of ``params`` into cohorts (equal names: the same partition).

        Cohorts are numbered by first appearance in ``params``, so the name does not depend
        on the token objects: a step whose grad pattern splits no cohort keeps the name.
        """
        index: dict[object, int] = {}
        token = self._token
        labels = array("q")
        for p in params:
            t = token.get(id(p))
            labels.append(-1 if t is None else index.setdefault(t, len(index)))
        return hashlib.blake2b(labels.tobytes(), digest_size=12).hexdigest()

    def rebuild(self, params_and_steps: Iterable[tuple[Tensor, float]]) -> None:
        """Tokens from known step values (after a load): equal counts share a token."""
        self._token = {}
        by_value: dict[float, object] = {}
        for p, value in params_and_steps:
            self._token[id(p)] = by_value.setdefault(value, object())


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
            owner._plan = None

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


_get_step = operator.itemgetter("step")


class _Run:
    """One kernel call of a launch plan: its params, where their grads sit, their states.

    Built once per plan. ``planned`` holds, per state key the launch reads, the tensors it
    was planned with; every step checks (by identity, a C-level pass) that the states still
    hold them, so a tensor replaced by assignment is validated by a new plan before any
    kernel runs. :meth:`refresh` fills the per-step lists (this step's grads, contiguous
    copies of strided params).
    """

    __slots__ = (
        "op",
        "kind",
        "keys",
        "params",
        "grads",
        "states",
        "planned",
        "launch",
        "ids",
        "gidx",
        "strided",
        "copy_back",
        "rng",
        "rng_base",
        "dtensor",
        "whole",
    )

    def __init__(self, op: str, kind: str, keys: tuple[str, ...] = ()) -> None:
        self.op, self.kind, self.keys = op, kind, keys
        self.params: list[Tensor] = []
        self.grads: list[Tensor] = []
        self.states: list[dict[str, Any]] = []
        self.planned: dict[str, list[Tensor]] = {}
        self.launch: dict[str, list[Tensor]] = {}  # what the kernels get: local shards of DTensor state
        self.ids: list[int] = []
        self.gidx: list[int] = []  # position of each param in its group (where its grad is gathered)
        self.strided: list[tuple[int, Tensor]] = []  # (position in this run, param) of non-contiguous params
        self.copy_back: list[tuple[Tensor, Tensor]] = []
        self.rng: Tensor | None = None
        self.rng_base = 0
        self.dtensor = False  # DTensor params (FSDP2): the kernels get the local shards
        self.whole = False  # holds every param of its group, in order: takes the group's grads as they are

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
            self.launch[key] = [local_of(t) for t in tensors] if self.dtensor else tensors
        if self.ids:
            self.rng = self.launch["rng"][0]
            self.rng_base = self.ids[0]

    def intact(self) -> bool:
        """Whether every state still holds the planned tensors (none replaced or removed)."""
        try:
            for key, tensors in self.planned.items():
                if not all(map(operator.is_, map(operator.itemgetter(key), self.states), tensors)):
                    return False
        except KeyError:
            return False
        return True

    @property
    def masters(self) -> list[Tensor]:
        if self.kind == "fp32":
            return self.launch["master_param"]
        if self.kind == "remainder":
            return self.launch["master_remainder"]
        return []

    def refresh(self, grads: list[Tensor]) -> None:
        """This step's lists; ``grads`` are the group's grads (contiguous, checked by the caller)."""
        self.grads = grads if self.whole else [grads[i] for i in self.gidx]
        if self.dtensor:
            self.grads = [local_of(g) for g in self.grads]
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
        """Runs whose stochastic-rounding tensor ids are consecutive (the kernel numbers them base + i)."""
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
                runs.append(r)
                start = i
        return runs


class _Bucket:
    """Params of one group on one device whose step counts are equal (one set of step scalars).

    Their ``step`` tensors are 0-dim views of one buffer, so a step increments them all in
    one op. Each step checks that the states still hold these views (identity) and that
    nobody wrote to them (the buffer's version counter, shared by its views, moved only by
    the optimizer's own increment): ``state[p]["step"].zero_()`` or a replaced ``step``
    leads to a new plan that reads the counts.
    """

    __slots__ = ("dev", "runs", "steps", "step_buf", "states", "rngs", "known")

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.runs: dict[Any, _Run] = {}
        self.steps: list[Tensor] = []
        self.step_buf: Tensor | None = None
        self.states: list[dict[str, Any]] = []
        self.rngs: list[Tensor] = []
        self.known: list[Any] = [None, 0]  # the optimizer's record of step_buf: [weakref, expected version]

    def share_steps(
        self, states: list[dict[str, Any]], remember: Callable[[Tensor], list[Any]], ours: Callable[[Tensor], bool]
    ) -> None:
        """Make the ``step`` tensors of ``states`` (equal values) views of one buffer.

        Counts that already are, in order, the views of a whole buffer this optimizer made
        (``ours``) stay the same tensors: a compiled step guards on their identity (see
        :mod:`fastamp.optim._traced`), so planning again the same cohort must not replace them.
        """
        if not states:
            return
        steps = [st["step"] for st in states]
        buf = steps[0]._base
        if not (
            buf is not None
            and ours(buf)
            and buf.dim() == 1
            and buf.numel() == len(steps)
            and all(
                s._base is buf and s.dim() == 0 and s.storage_offset() == buf.storage_offset() + i * buf.stride(0)
                for i, s in enumerate(steps)
            )
        ):
            buf = torch.stack([s.reshape(()) for s in steps])
            steps = list(buf.unbind(0))
            for st, view in zip(states, steps):
                st["step"] = view
        self.step_buf, self.states, self.steps = buf, states, steps
        self.known = remember(buf)

    def intact(self) -> bool:
        """Whether the step views are untouched and every run's state tensors are the planned ones."""
        if self.step_buf is not None:
            if self.step_buf._version != self.known[1]:
                return False
            try:
                if not all(map(operator.is_, map(_get_step, self.states), self.steps)):
                    return False
            except KeyError:
                return False
        return all(run.intact() for run in self.runs.values())


class _GroupPlan:
    """The launches of one param group, and what they assumed about it."""

    __slots__ = (
        "group",
        "params",
        "key",
        "param_dtypes",
        "grad_sig",
        "ptrs",
        "dtensor",
        "strided_grads",
        "buckets",
        "remainder",
        "versions",
    )

    def __init__(self, group: dict[str, Any], key: tuple) -> None:
        self.group = group
        self.params: list[Tensor] = list(group["params"])
        self.key = key
        self.param_dtypes = [p.dtype for p in self.params]
        grads = [p.grad for p in self.params]
        self.grad_sig = self.grad_signature(grads)
        self.dtensor = any(map(is_dtensor, self.params))
        self.ptrs = self.data_ptrs(self.params)
        self.strided_grads = [i for i, g in enumerate(grads) if g is not None and not g.is_contiguous()]
        self.buckets: list[_Bucket] = []
        self.remainder: list[Tensor] = []  # params with remainder masters, in plan order
        self.versions: list[int] | None = None  # their ``_version`` after the last step

    @staticmethod
    def grad_signature(grads: list[Tensor | None]) -> list[Any]:
        """Per grad: None, its dtype when dense and contiguous, ``(dtype,)`` when strided (one pass).

        Raises RuntimeError for a sparse grad (no ``is_contiguous``).
        """
        return [None if g is None else g.dtype if g.is_contiguous() else (g.dtype,) for g in grads]

    def data_ptrs(self, params: list[Tensor]) -> list[int]:
        # A param's storage changes with `.data = ...` (a resize, `model.to(memory_format=...)`,
        # a dtype or device move) without any version counter noticing; its address shows it.
        if self.dtensor:
            return [local_of(p).data_ptr() for p in params]
        return list(map(Tensor.data_ptr, params))


class _Plan:
    """How ``step()`` launches the kernels, cached across steps while it fits (see ``_gather``)."""

    __slots__ = ("groups", "state", "n_state", "needed")

    def __init__(self) -> None:
        self.groups: list[_GroupPlan] = []
        self.state: Any = None
        self.n_state = 0
        self.needed: set[tuple[str, torch.device]] = set()
