"""The step loop shared by fastamp's fused optimizers (AdamW, SGD): :class:`FusedOptimizer`.

It validates a whole step before changing anything, groups the params with a grad into
kernel launches (:mod:`fastamp.optim.engine.plan`), keeps that plan while it fits, and keeps the
step counts of one launch as views of one buffer. Validation, masters, state dicts and the
records of the step counts live in :mod:`._checks`, :mod:`._masters`, :mod:`._state_dict`
and :mod:`._steps`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import Tensor

from fastamp import _compile_errors
from fastamp._dtensor import is_dtensor
from fastamp.ops import functional
from fastamp.optim.engine import rng as _rng
from fastamp.optim.engine import traced as _traced
from fastamp.optim.engine.checks import (
    GRAD_DTYPES,
    PARAM_DTYPES,
    TensorLRChecks,
    _StateValidation,
    check_backend_arg,
    check_grad,
    check_no_shared_memory,
    check_param_dtype,
    cycles_momentum,
    where_of,
)
from fastamp.optim.engine.context import StepContext
from fastamp.optim.engine.plan import (
    StateTable,
    _Bucket,
    _GroupPlan,
    _Plan,
    _Run,
    _version_of,
)
from fastamp.optim.engine.state_dict import _StateDictExport
from fastamp.optim.engine.steps import _StepRecords
from fastamp.optim.formats import moments as _formats
from fastamp.optim.formats.masters import _MASTER_KEY_OF, _MasterWeights
from fastamp.reference import optim as _R


def _select(params: list[Tensor], positions: list[int]) -> list[Tensor]:
    return list(map(params.__getitem__, positions))


class FusedOptimizer(_MasterWeights, _StateValidation, _StateDictExport, _StepRecords, torch.optim.Optimizer):
    """The step loop, master-weight bookkeeping and state_dict shared by fastamp's optimizers.

    A subclass is an update rule of the one optimizer op ``optim_`` (``_RULE``: a name of
    :data:`fastamp.reference.optim.RULES`) and defines it through a few hooks: ``_validate_group``,
    ``_init_state`` (its own state: moments, buffers, ``step``), ``_moment_keys``,
    ``_extra_key``, ``_uses_rng``, ``_hyper``, ``_step_scalars``, ``_rule_hyper`` and
    ``_rule_flags`` (the op's ``hyper`` list and rule flags); the engine builds every launch's
    arguments itself (:meth:`_kernel_args`, shared by the eager and the compiled step: no
    optimizer writes its kernel call);
    ``_COUNT_BEFORE`` says whether ``step`` is incremented before the step scalars are
    computed (AdamW: bias corrections use the new count) or after (SGD: ``is_first`` uses
    the count of applied steps before this one).

    Master bookkeeping (see :func:`master_kind`): an fp32 master is created from the param;
    a remainder starts at 0 (master == param). A loaded ``master_param`` for a param in
    remainder mode is split at the next step (the param is set to the master's top half);
    a loaded ``master_remainder`` for a param in fp32 mode is joined with the param.

    Remainder masters and foreign writes: after each step the param's autograd version
    counter (``p._version``) is recorded. If the param was written since (``param.copy_``,
    ``model.load_state_dict``, an in-place op), the next step warns and re-syncs the master
    to the param (remainder := 0), instead of joining the new top half with a stale
    remainder. ``param.data.copy_(...)`` and other writes through ``.data`` bypass version
    counters and cannot be detected: call :meth:`reset_master_weights` after them.

    Atomic steps: a step validates everything it is about to use, in every group (params,
    grads, every state tensor, step counts, hyperparameters, params sharing memory, the
    backend) before it changes anything; an error names the param by group, index and shape.

    Launch plan: a step groups the params with a grad into kernel launches and keeps that
    plan; later steps reuse it while it fits, checking per param only a few attribute reads
    and identity tests (which params have a grad, param and grad dtypes, grad layouts, the
    params' storage addresses, that each state still holds the planned tensors), so a step
    over tens of thousands of small params costs little host time. Anything else leads to a
    new plan, validated in full: a param replaced or resized through ``.data``, a layout
    change (``model.to(memory_format=torch.channels_last)``), a state tensor replaced by
    assignment (``opt.state[p]["exp_avg"] = t``), a state dict assigned or removed
    (``opt.state[p] = {}``, ``del opt.state[p]``), a layout setting of a group
    (``master_weights``, ``stochastic_rounding``, ``seed``, and the subclass's, see
    ``_plan_key``), ``add_param_group``, ``load_state_dict`` and :meth:`reset_master_weights`.
    ``lr``, betas, ``eps``, ``weight_decay`` and the like are read (and validated) at every
    step.

    Step counts: the ``step`` tensors of the params of one launch are 0-dim views of one
    buffer (one add per step, not one per param); they are saved, exported and loaded as
    ordinary per-param counts. Each param's bias correction uses its own count, as in
    torch: the kernels take one row of step scalars per param, computed on the device from
    the buffer, so the counts of one launch may differ and no count is read on the host to
    step. A ``step`` written in place (``.zero_()``, ``.fill_()``, ``+=``; these move the
    version counter the views share) is used by the next step as it is; one replaced
    (``state[p]["step"] = torch.tensor(0.)``) leads to a new plan that stacks the counts
    into a new buffer on the device. Either write is validated (finite, >= 0) at the next
    step by one host read of the counts it can no longer vouch for. Writes through
    ``.data`` (of a step, a state tensor or a grad) bypass version counters and identity:
    a step count written so is used but not validated, and a same-address rebind of a
    param (``p.data = p.data.t()``) is not seen.

    Random bits (stochastic rounding): one ``rng`` counter per param group and device, the
    same tensor in each param's state, advanced once per applied step that stepped a param of
    the group there, after the step's launches, so every launch of a step reads the same
    count whichever params have a grad (:mod:`fastamp.optim.engine.rng`; :meth:`bucket_step` for
    steps made of :meth:`step_bucket` calls).

    torch.compile: under ``torch.compiler.is_compiling()`` the step takes the path of
    :mod:`fastamp.optim.engine.traced` (``fullgraph=True``, one compile, eager's bits): the checks
    and the plan run once at trace time (``_init_group``), the graph holds the kernel ops. A
    check that fails there raises eager's error (class and message, see
    :mod:`fastamp._compile_errors`). torch's LR schedulers leave ``step`` as it is (see
    ``_wrapped_by_lr_sched`` below the class); one that cycles the momentum is refused at
    trace time (``_check_traceable``).
    """

    _NAME = "FusedOptimizer"
    _RULE = ""  # the update rule of optim_ (fastamp.reference.optim.RULES)
    _COUNT_BEFORE = True
    _STEP_REQUIRED = False  # a non-empty state must hold a ``step`` (AdamW: bias corrections)
    _step_supports_amp_scaling = True

    @property
    def _plan(self) -> _Plan | None:
        return self.__dict__.get("_whole_plan")

    @_plan.setter
    def _plan(self, plan: _Plan | None) -> None:
        # Whatever drops the step's plan (a state dict assigned or removed, a load, a new
        # group, reset_master_weights) drops the buckets' plans too: their checks at each
        # call, like the step's, cover only what can change without the optimizer noticing.
        self.__dict__["_whole_plan"] = plan
        if plan is None:
            self.__dict__["_bucket_plans"] = {}

    # ---- hooks -------------------------------------------------------------------------
    def _validate_group(self, group: dict[str, Any], where: str, check_tensor_lr: bool = False) -> None:
        raise NotImplementedError

    def _init_state(self, p: Tensor, st: dict[str, Any], group: dict[str, Any], kind: str) -> float | None:
        """Create missing state; returns the value of a ``step`` it created (None if it created none)."""
        raise NotImplementedError

    def _moment_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The state keys of the update's own buffers (shaped like the param, floating point)."""
        return ()

    def _extra_key(self, group: dict[str, Any], p: Tensor, st: dict[str, Any], kind: str) -> tuple:
        return (self._q8(group, p),)

    def _uses_rng(self, group: dict[str, Any], p: Tensor, st: dict[str, Any], kind: str) -> bool:
        if (
            self._q8(group, p)
            and group["state_rounding"] == "stochastic"
            and (self._moment_keys(group) or kind == "ulp8")
        ):
            return True  # q8 states or an ulp8 correction (SGD without momentum keeps only the latter)
        return kind == "sr"

    @staticmethod
    def _q8(group: dict[str, Any], p: Tensor) -> bool:
        """Whether ``p`` keeps its moments as q8 codes (the group's ``state_format``, for params of
        ``lowbit_min_numel`` or more; a DTensor param only where its shards start on q8 blocks,
        :func:`fastamp.optim.formats.moments.scale_shape`)."""
        return (
            group["state_format"] == "q8"
            and p.numel() >= group["lowbit_min_numel"]
            and (not is_dtensor(p) or _formats.scale_shape(p) is not None)
        )

    def _warn_dtensor_q8(self, gi: int, i: int, p: Tensor, group: dict[str, Any]) -> None:
        """Warn once where q8 falls back to fp32 moments for a DTensor param (FSDP2)."""
        if (
            group["state_format"] == "q8"
            and p.numel() >= group["lowbit_min_numel"]
            and _formats.scale_shape(p) is None
            and not getattr(self, "_warned_dtensor_q8", False)
        ):
            self._warned_dtensor_q8 = True
            warnings.warn(
                f"{self._NAME}: {where_of(gi, i, p)} is a DTensor with placements {tuple(p.placements)} and shape "
                f"{tuple(p.shape)}: its shards do not start on q8's blocks of 32 elements (q8 shards params sharded "
                "on dim 0 whose rows hold a multiple of 32 elements, and replicated ones), so it keeps fp32 moments; "
                "so may other params of this optimizer (warned once)",
                stacklevel=4,
            )

    def _moment_format(self, group: dict[str, Any], p: Tensor, kind: str) -> Any:
        """The :class:`~fastamp.optim.formats.moments.MomentFormat` ``p``'s moments are kept in (q8 or fp32 here)."""
        return _formats.Q8 if self._q8(group, p) else _formats.FP32

    def _hyper(self, group: dict[str, Any]) -> dict[str, Any]:
        """The group as the kernels read it this step (e.g. tensor betas read as floats)."""
        return group

    def _step_scalars(
        self, group: dict[str, Any], counts: Tensor | None, found_inf: Tensor | None, grad_scale: Tensor | None, dev
    ) -> Tensor:
        """A launch's step scalars: one row per entry of the 1-D ``counts`` (``[n, k]``), or ``[k]`` for None.

        ``counts``: each param's count *before* this step (None for params without a
        ``step``: SGD without momentum does not use it); ``found_inf`` / ``grad_scale``: the
        grad scaler's, as handed over (None without one). Eager and compiled steps both call
        this, and it calls one op of :data:`fastamp.ops.registry.OPTIM_OPS` (its kernel is eager code
        that inductor cannot re-derive), so the two paths compute the same bits.
        """
        raise NotImplementedError

    def _rule_hyper(self, group: dict[str, Any]) -> tuple[float, ...]:
        """The ``hyper`` list of ``optim_`` for the rule (e.g. AdamW's ``(beta1, beta2, eps)``), from the group as read this step."""
        raise NotImplementedError

    def _rule_flags(self, group: dict[str, Any]) -> int:
        """The rule's flags of ``optim_`` (MAXIMIZE, AMSGRAD, NESTEROV of :mod:`fastamp.reference.optim`)."""
        return _R.MAXIMIZE if group["maximize"] else 0

    def _kernel_args(self, group: dict[str, Any], launch: _traced.Launch, scalars: Tensor) -> tuple:
        """The positional arguments of ``optim_`` for one launch (eager and compiled alike).

        The master list is the launch's master key of its kind; the states are its other keys but
        ``rng``, in the launch's order (the rule's states; q8: codes, then scales, per state).
        Random bits: SR_PARAM rounds a bf16 param without a master (kind "sr") or, where the
        launch draws bits, an ulp8 correction; SR_STATE rounds bf16 states or, under
        ``state_rounding="stochastic"``, q8 codes, where the launch draws bits.
        """
        st = launch.state
        master_key = _MASTER_KEY_OF.get(launch.kind)
        masters = st[master_key] if master_key is not None else []
        states: list[Tensor] = []
        for key, tensors in st.items():  # list += list: ~6x faster than a nested comprehension at 20,000 params
            if key != "rng" and key != master_key:
                states += tensors
        rng = launch.rng
        flags = self._rule_flags(group)
        if launch.kind == "sr" or (launch.kind == "ulp8" and rng is not None):
            flags |= _R.SR_PARAM
        if rng is not None and states:
            lowp = states[0].dtype
            if lowp == torch.bfloat16 or (lowp == torch.uint8 and group["state_rounding"] == "stochastic"):
                flags |= _R.SR_STATE
        return (launch.params, launch.grads, masters, states, scalars, launch.found_inf, rng, launch.rng_base,
                self._RULE, self._rule_hyper(group), flags)  # fmt: skip

    # ---- construction / pickling ---------------------------------------------------------
    def _init_fused(self, params: Any, defaults: dict[str, Any], backend: Any) -> None:
        """A subclass's ``__init__`` after it built ``defaults``: validated, torch's ``__init__``, the deferred checks."""
        self._setup(backend)
        self._validate_group(defaults, "the defaults", check_tensor_lr=True)
        super().__init__(params, defaults)
        self._step_supports_amp_scaling = True
        self._finish_init()

    def _lr_checks(self) -> TensorLRChecks:
        """Which tensor lrs were checked (made on first use: also after unpickling, which does not keep it)."""
        checks = self.__dict__.get("_tensor_lr_checks")
        if checks is None:
            checks = self._tensor_lr_checks = TensorLRChecks()
        return checks

    def _setup(self, backend: Any) -> None:
        self.backend = check_backend_arg(self._NAME, backend)
        self._param_versions: dict[int, int] = {}
        self._plan: _Plan | None = None
        self._known_steps: dict[int, list[Any]] = {}
        self._step_of: dict[int, Tensor] = {}  # id(param) -> the step tensor it was given
        self._compiled = {"ran": False}  # see _forget_compiled_steps
        # torch's __init__ adds the groups one by one: check shared memory once at the end
        # (once per group would cost groups x params, e.g. one group per param)
        self._constructing = True

    def _finish_init(self) -> None:
        """The checks deferred during ``__init__``, and the tracked state table."""
        self._constructing = False
        check_no_shared_memory(self._NAME, self.param_groups)
        self._track_state()

    def _track_state(self) -> None:
        """Make ``self.state`` a :class:`StateTable` owned by this optimizer."""
        self.state = StateTable(dict, self.state, owner=self)
        self._state_changed()

    def _state_changed(self) -> None:
        """``self.state`` was replaced, or a param's entry assigned or removed: plan again, eager and compiled."""
        self._plan = None
        self.__dict__["_traced_states"] = None  # a compiled step's guard on it fails: it traces again

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._plan = None
        group = self.param_groups[-1]
        gi = len(self.param_groups) - 1
        try:
            self._prepare_group(group)
            self._validate_group(group, f"param group {gi}", check_tensor_lr=True)
            seen: dict[int, int] = {}
            for i, p in enumerate(group["params"]):
                check_param_dtype(self._NAME, p, f"param {i} of param group {gi}")
                if id(p) in seen:
                    # torch only warns; a fused launch would update the param twice per step
                    raise ValueError(
                        f"{self._NAME}: param {i} of param group {gi} is the same tensor as param {seen[id(p)]}; "
                        "duplicate params are not allowed"
                    )
                seen[id(p)] = i
            if not getattr(self, "_constructing", False):
                check_no_shared_memory(self._NAME, self.param_groups)
        except Exception:
            self.param_groups.pop()
            raise

    def _prepare_group(self, group: dict[str, Any]) -> None:
        """Normalise a new group in place before validation."""

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["backend"] = self.backend
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("backend", None)
        self._param_versions = {}
        self._known_steps = {}
        self._step_of = {}
        self._compiled = {"ran": False}
        for group in self.param_groups:
            for k, v in self._group_setdefaults().items():
                group.setdefault(k, v)
        self._track_state()
        self._adopt_steps()

    def _group_setdefaults(self) -> dict[str, Any]:
        return {
            "maximize": False,
            "master_weights": None,
            "stochastic_rounding": False,
            "seed": 0,
            "state_format": None,
            "lowbit_min_numel": 4096,
            "state_rounding": "stochastic",
        }

    # ---- the step ------------------------------------------------------------------------
    def _plan_key(self, group: dict[str, Any]) -> tuple:
        """The group settings that decide how its params are laid out in launches.

        A change of any of them rebuilds the launch plan at the next step; the other
        hyperparameters are read at every step.
        """
        return (
            group["master_weights"],
            group["stochastic_rounding"],
            group["seed"],
            group["state_format"],
            group["lowbit_min_numel"],
            group["state_rounding"],
        )

    def _launch_keys(self, group: dict[str, Any], kind: str, use_rng: bool, q8: bool = False) -> tuple[str, ...]:
        keys = self._moment_keys(group)
        if q8:  # codes and block scales of each moment (see fastamp.optim.formats.moments)
            keys = tuple(k for key in keys for k in (key + "_q", key + "_scale"))
        if kind == "fp32":
            keys += ("master_param",)
        elif kind == "remainder":
            keys += ("master_remainder",)
        elif kind == "ulp8":
            keys += ("master_ulp8",)
        if use_rng:
            keys += ("rng",)
        return keys

    def _collect(
        self, subsets: list[list[int]] | None = None
    ) -> tuple[list[tuple[dict[str, Any], list[tuple[int, Tensor, Tensor]]]], dict[int, float]]:
        """Every (group, [(position, param, grad)]) to update and the step counts to read, fully validated.

        Checks everything the launches will use, in every group, and changes nothing: a
        failing step leaves params, grads and state as they were. Returns the work and the
        values of step counts written from outside since the optimizer last vouched for them.
        ``subsets``: per group, the indices of the params to consider (a bucket, see
        :meth:`step_bucket`); a position is then one in that list; None: every param.
        """
        from fastamp.ops import backends

        work = []
        needed: set[tuple[str, torch.device]] = set()
        untrusted: list[tuple[int, int, Tensor, Any]] = []
        state = self.state
        for gi, group in enumerate(self.param_groups):
            items = []
            moment_keys = self._moment_keys(group)
            params = group["params"]
            for pos, i in enumerate(range(len(params)) if subsets is None else subsets[gi]):
                p = params[i]
                g = p.grad
                if g is None:
                    continue
                if p.dtype not in PARAM_DTYPES:
                    check_param_dtype(self._NAME, p, where_of(gi, i, p))
                if (
                    g.layout is not torch.strided
                    or g.dtype not in GRAD_DTYPES
                    or g.device != p.device
                    or g.shape != p.shape
                ):
                    check_grad(self._NAME, p, g, where_of(gi, i, p))
                kind = self._kind(group, p)
                if is_dtensor(p):
                    self._warn_dtensor_q8(gi, i, p, group)
                st = state.get(p)
                if st and self._check_state(gi, i, p, st, group, kind, moment_keys):
                    untrusted.append((gi, i, p, st["step"]))
                items.append((pos, p, g))
                needed.add(("optim_", p.device))
            work.append((group, items))
        check_no_shared_memory(self._NAME, self.param_groups)
        for op, dev in sorted(needed, key=str):
            backends.resolve(op, dev, self.backend)
        return work, self._read_steps(untrusted)

    def _build_plan(
        self,
        work: list[tuple[dict[str, Any], list[tuple[int, Tensor, Tensor]]]],
        step_values: dict[int, float],
        subsets: list[list[int]] | None = None,
    ) -> _Plan:
        """Create missing state and masters and group the params with a grad into launches.

        Called when there is no plan or it no longer fits (see ``_gather``), after
        ``_collect`` validated everything. ``step_values``: the counts ``_collect`` read to
        validate them (written from outside); a count that is not an fp32 0-dim tensor on its
        param's device is replaced by one holding the value. The launches of a group on one
        device are one bucket whatever their counts: each param's step scalars come from its
        own count (see ``_execute``). ``subsets``: as ``_collect``'s (a bucket's plan covers
        only its params: their counts make its buffers).
        """
        plan = _Plan()
        sr_ids: dict[int, int] | None = None
        for gi, (group, items) in enumerate(work):
            params = None if subsets is None else _select(group["params"], subsets[gi])
            gp = _GroupPlan(group, self._plan_key(group), params)
            buckets: dict[torch.device, _Bucket] = {}
            counters: dict[torch.device, Tensor] = {}  # the group's rng counter per device (see _rng)
            for pos, p, g in items:
                st = self.state.get(p)
                if st is None:
                    st = {}
                if st:
                    value = step_values.get(id(p))
                    if value is not None:
                        step = st["step"]
                        if not (
                            type(step) is Tensor
                            and step.dtype == torch.float32
                            and step.dim() == 0
                            and step.device == p.device
                        ):
                            st["step"] = torch.full((), value, dtype=torch.float32, device=p.device)
                kind = self._kind(group, p)
                self._init_state(p, st, group, kind)
                self._init_master(p, st, kind)
                if kind == "remainder" or kind == "ulp8":
                    self._resync_if_written(p, st, "a param")
                    gp.remainder.append(p)
                use_rng = self._uses_rng(group, p, st, kind)
                if use_rng:
                    rng = counters.get(p.device)
                    if rng is None:
                        rng = counters[p.device] = _rng.group_counter(self, group, p.device)
                    if st.get("rng") is not rng:
                        st["rng"] = rng
                if st and self.state.get(p) is not st:
                    self.state[p] = st
                bucket = buckets.get(p.device)
                if bucket is None:
                    bucket = buckets[p.device] = _Bucket(p.device)
                sr_id = None
                if use_rng:
                    if not bucket.rngs:
                        bucket.rngs.append(rng)
                    if sr_ids is None:
                        sr_ids = self._rng_ids()
                    sr_id = sr_ids[id(p)]
                op = "optim_"
                counted = "step" in st
                key = (op, p.dtype, g.dtype, kind, use_rng, counted) + self._extra_key(group, p, st, kind)
                run = bucket.runs.get(key)
                if run is None:
                    run = bucket.runs[key] = _Run(op, kind, self._launch_keys(group, kind, use_rng, self._q8(group, p)))
                run.add(p, pos, st, sr_id)
                plan.needed.add((op, p.device))
            stepped = {pos for pos, _, _ in items}
            for dev, bucket in buckets.items():
                # the count vector, run by run: each run's rows are consecutive
                step_states: list[dict[str, Any]] = []
                step_params: list[int] = []
                for run in bucket.runs.values():
                    if "step" in run.states[0]:
                        run.row0 = len(step_states)
                        step_states.extend(run.states)
                        step_params.extend(id(gp.params[i]) for i in run.gidx)
                    run.seal(len(gp.params))
                spare = []
                for i, q in enumerate(gp.params):
                    st = self.state.get(q) if i not in stepped and q.device == dev else None
                    step = st.get("step") if st else None
                    if type(step) is Tensor and step.dtype == torch.float32 and step.dim() == 0 and step.device == dev:
                        spare.append((id(q), st))
                for pid in bucket.share_steps(step_states, spare, self._remember_steps, self._recorded_steps):
                    self._step_of.pop(pid, None)
                self._step_of.update(zip(step_params, bucket.steps))
            gp.buckets = list(buckets.values())
            plan.groups.append(gp)
        plan.state = self.state
        plan.n_state = len(self.state)
        return plan

    def _gather(self, plan: _Plan | None, subsets: list[list[int]] | None = None) -> list[list[Tensor | None]] | None:
        """This step's grads of every group, or None when ``plan`` does not fit this step.

        Per param this costs a few attribute reads and identity tests (no Python call per
        param), which is what makes a step with tens of thousands of small params cheap. It
        checks what can change between steps without the optimizer noticing: the params of
        each group and their storage addresses, which params have a grad, param and grad
        dtypes, grad layouts (dense; strided ones as planned, copied here), the groups'
        layout settings, that the ``step`` tensors are the planned ones and unwritten, and
        that every state still holds the planned tensors. Assignments to ``self.state``
        itself drop the plan (:class:`StateTable`).
        """
        if (
            plan is None
            or self.state is not plan.state
            or len(self.state) != plan.n_state
            or len(self.param_groups) != len(plan.groups)
        ):
            return None
        out = []
        for gi, (group, gp) in enumerate(zip(self.param_groups, plan.groups)):
            if group is not gp.group or self._plan_key(group) != gp.key:
                return None
            grads = gp.gather(group["params"] if subsets is None else _select(group["params"], subsets[gi]))
            if grads is None:
                return None
            if not all(b.intact() for b in gp.buckets):
                return None
            for i in gp.strided_grads:
                # a grad laid out unlike the param (channels_last vs contiguous): the kernels
                # read grads in the param's logical order
                grads[i] = grads[i].contiguous()
            out.append(grads)
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """Perform a single optimization step.

        Args:
            closure (Callable, optional): a closure that reevaluates the model and returns
                the loss (not allowed when a grad scaler drives the step, as in torch).
        """

        if torch.compiler.is_compiling():
            return _traced.traced_step(self, closure)
        self._opt_called = True  # what torch's LR schedulers record (see _wrapped_by_lr_sched below the class)
        if self.__dict__.get("_rng_pending") is not None:
            raise RuntimeError(
                f"{self._NAME}: step() inside bucket_step() (a step made of step_bucket calls, such as "
                "fastamp.release's): its params would draw the random bits of that step again; step the buckets "
                "with step_bucket, or call step() after the block"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        if type(self.state) is not StateTable:
            self._track_state()
        if self._compiled["ran"]:
            self._forget_compiled_steps()
        for gi, group in enumerate(self.param_groups):
            self._validate_group(group, f"param group {gi}")
        ctx = StepContext.of(self)
        plan = self._plan
        grads = self._gather(plan)
        if grads is None:
            self._plan = None
            work, step_values = self._collect()
            if not any(items for _, items in work):
                return loss
            plan = self._build_plan(work, step_values)
            grads = self._gather(plan)
            if grads is None:
                raise RuntimeError(f"{self._NAME}: internal error: a new launch plan does not fit its own step")
            self._plan = plan
        try:
            self._execute(plan, grads, ctx)
        except BaseException:
            self._plan = None
            raise
        return loss

    @contextlib.contextmanager
    def bucket_step(self) -> Iterator[None]:
        """One optimizer step made of :meth:`step_bucket` calls (what :func:`fastamp.release` runs each step).

        Stochastic rounding draws each launch's random bits from the ``rng`` counter of its
        param group (one per group and device, see :mod:`fastamp.optim.engine.rng`), which a step
        advances once, after its launches. Inside this block every ``step_bucket`` call reads
        the counters as they were when the block began, and they advance once when it ends
        (by 1 where any launch of the group was applied: ``found_inf == 0``, or no scaler), also
        when it ends with an error (the launches that ran used their bits). So the buckets of one
        step, stepped inside it in any order, give :meth:`step`'s bits. Without stochastic
        rounding the block changes nothing. ``step()`` inside it, or a nested block, is refused.

        Example::

            with opt.bucket_step():
                for bucket in buckets:  # disjoint; each once
                    opt.step_bucket(bucket)
        """
        if self.__dict__.get("_rng_pending") is not None:
            raise RuntimeError(f"{self._NAME}: bucket_step() inside bucket_step(): one step is one block")
        pending = self._rng_pending = _rng.PendingAdvances()
        try:
            yield
        finally:
            self._rng_pending = None
            with torch.no_grad():
                pending.apply()

    @torch.no_grad()
    def step_bucket(self, params: list[Tensor] | tuple[Tensor, ...]) -> None:
        """Perform the optimization step of ``params`` only (a *bucket* of this optimizer's params).

        What :meth:`step` does to these params, bit for bit, and nothing to the others: the
        same validation before any write (of the bucket's params, grads and state; shared
        memory among all params), each param's own step count, masters, ``rng`` counters, a
        grad scaler's ``grad_scale`` / ``found_inf`` if set on the optimizer, the same kernels.
        A param of the bucket without a grad is not stepped, as in :meth:`step`. Used by
        gradient release (:func:`fastamp.release`), which steps each bucket as soon as its
        grads are accumulated.

        Each bucket keeps its own launch plan, keyed by the params (same objects, same
        order): a bucket stepped again with the same layout costs what a step of a plan that
        fits costs (a few attribute reads and identity tests per param, no host sync). A
        bucket's params get their own ``step`` buffer; the step's plan and the buckets' plans
        notice each other's buffers by identity and plan again when the other path is used.

        Bit-identity with :meth:`step`: the kernels are elementwise, each param's step
        scalars come from its own count (computed lane-wise, see
        :func:`fastamp.reference.adamw_step_scalars`, so their bits do not depend on where a
        count sits in the vector), and each param keeps its stochastic-rounding tensor id.
        Stochastic rounding draws a launch's bits from its group's ``rng`` counter (one per
        group and device, :mod:`fastamp.optim.engine.rng`), which a step advances once: the calls of
        one step go inside :meth:`bucket_step`, which advances the counters when it ends, and
        then give :meth:`step`'s bits, buckets in any order. A call outside it is a step of its
        own for the counters (they advance when it returns): two calls on disjoint buckets then
        draw other random bits than one ``step()`` of both (everything else is the same).

        Args:
            params: params of this optimizer, each at most once (any groups).
        """

        if torch.compiler.is_compiling():
            raise NotImplementedError(
                f"{self._NAME}: step_bucket cannot be compiled; call it eagerly (torch.compile of opt.step() is "
                "supported)"
            )
        self._opt_called = True
        if type(self.state) is not StateTable:
            self._track_state()
        if self._compiled["ran"]:
            self._forget_compiled_steps()
        plans = self.__dict__.setdefault("_bucket_plans", {})
        key = tuple(map(id, params))
        entry = plans.get(key)
        fresh = entry is None
        if fresh:
            entry = [tuple(params), self._bucket_positions(params), None]
        subsets = entry[1]
        for gi, group in enumerate(self.param_groups):
            if subsets[gi]:
                self._validate_group(group, f"param group {gi}")
        ctx = StepContext.of(self)
        plan = entry[2]
        grads = self._gather(plan, subsets) if plan is not None else None
        if grads is None:
            entry[2] = None
            if not fresh:
                # the params may have moved in their groups since the bucket was planned
                entry[1] = subsets = self._bucket_positions(params)
            work, step_values = self._collect(subsets)
            plans[key] = entry
            if not any(items for _, items in work):
                return
            plan = self._build_plan(work, step_values, subsets)
            grads = self._gather(plan, subsets)
            if grads is None:
                raise RuntimeError(f"{self._NAME}: internal error: a new launch plan does not fit its own bucket")
            entry[2] = plan
            # planning may have replaced state dicts of the table (dropping every plan)
            self.__dict__.setdefault("_bucket_plans", {})[key] = entry
        try:
            self._execute(plan, grads, ctx)
        except BaseException:
            entry[2] = None
            raise

    def _bucket_positions(self, params: list[Tensor] | tuple[Tensor, ...]) -> list[list[int]]:
        """Per group, the indices of ``params`` in it (in group order); an error names a param not held or repeated."""
        where: dict[int, tuple[int, int]] = {}
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                where[id(p)] = (gi, i)
        subsets: list[list[int]] = [[] for _ in self.param_groups]
        seen: set[int] = set()
        for k, p in enumerate(params):
            if not isinstance(p, Tensor):
                raise TypeError(
                    f"{self._NAME}: step_bucket: entry {k} of the bucket is a {type(p).__name__}, not a param"
                )
            loc = where.get(id(p))
            if loc is None:
                raise ValueError(
                    f"{self._NAME}: step_bucket: entry {k} of the bucket (shape {tuple(p.shape)}) is not a param of "
                    "this optimizer"
                )
            if id(p) in seen:
                raise ValueError(f"{self._NAME}: step_bucket: entry {k} of the bucket appears twice")
            seen.add(id(p))
            subsets[loc[0]].append(loc[1])
        for positions in subsets:
            positions.sort()
        return subsets

    def _init_group(self) -> tuple:
        """:meth:`_trace_time_plan`, run by dynamo eagerly at trace time; its errors reach the user as eager's.

        A check that fails raises the error eager raises, as :func:`fastamp._compile_errors.as_eager`
        delivers it through dynamo (which would wrap it in ``InternalTorchDynamoError``).
        """
        # torch's LR schedulers read it once, after their first step; dynamo drops attribute writes
        # to an optimizer in traced code (torch 2.13: OptimizerVariable is not tracked for side
        # effects), so the compiled step records it here, as the schedulers' wrapper would
        self._opt_called = True
        try:
            plan = self._trace_time_plan()
        except Exception as e:
            raise _compile_errors.as_eager(e) from None
        self.__dict__["_traced_states"] = _traced.traced_states(self)
        return plan

    def _trace_time_plan(self) -> tuple:
        """Validate and plan the compiled step; run by dynamo eagerly at trace time, never traced.

        dynamo calls an optimizer's ``_init_group`` with the real objects and guards on what
        it finds afterwards (the hook torch's optimizers create their state in). This is the
        eager step's validation and planning (``_collect``, ``_build_plan``: missing state
        and masters created, launches grouped as eager groups them), returned as constants for
        :func:`fastamp.optim.engine.traced.traced_step`:
        ``((group index, ((count positions, (launch, ...)), ...)), ...)`` per group with work,
        per device: the group positions of the params whose counts make the bucket's count
        vector, in the order of eager's buffer, and each launch ``(op, backend, kind, state
        keys, param positions, rng_base, positions of strided params, row0)``, its step
        scalars being rows ``row0 ..`` of the vector's (``row0 < 0``: one shared set). See
        :mod:`fastamp.optim.engine.traced` for what a compiled step does not re-check.
        """
        from fastamp.ops import backends

        if type(self.state) is not StateTable:
            self._track_state()
        for gi, group in enumerate(self.param_groups):
            self._validate_group(group, f"param group {gi}")
            self._check_traceable(group, f"param group {gi}")
        if self._compiled["ran"]:
            self._forget_compiled_steps()
        self._plan = None
        work, step_values = self._collect()
        if not any(items for _, items in work):
            return ()
        plan = self._build_plan(work, step_values)
        chosen = {(op, dev): backends.resolve(op, dev, self.backend) for op, dev in plan.needed}
        for op, backend in chosen.items():
            backends.get_impl(op[0], backend)  # imports a Triton kernel module (see fastamp.backends.kernel)
        out = []
        for gi, gp in enumerate(plan.groups):
            if not gp.buckets:
                continue
            if gp.dtensor:
                raise NotImplementedError(
                    f"{self._NAME}: param group {gi} holds DTensor params (FSDP2); their step cannot be compiled "
                    "yet: call opt.step() outside the compiled function"
                )
            buckets = []
            for b in gp.buckets:
                counted = []
                launches = []
                for run in b.runs.values():
                    if run.row0 >= 0:
                        if run.row0 != len(counted):
                            raise RuntimeError(f"{self._NAME}: internal error: a run's rows are not where planned")
                        counted.extend(run.gidx)
                    strided = {pos for pos, _ in run.strided}
                    for start, stop, rng_base in _traced.rng_parts(run.ids, len(run.gidx)):
                        launches.append(
                            (
                                run.op,
                                chosen[(run.op, b.dev)],
                                run.kind,
                                run.keys,
                                tuple(run.gidx[start:stop]),
                                rng_base,
                                tuple(i - start for i in range(start, stop) if i in strided),
                                run.row0 + start if run.row0 >= 0 else -1,
                            )
                        )
                buckets.append((tuple(counted), tuple(launches)))
            out.append((gi, tuple(buckets)))
        return tuple(out)

    def _check_traceable(self, group: dict[str, Any], where: str) -> None:
        """Refuse, at trace time, a group setting a compiled step cannot honour."""
        if cycles_momentum(group):
            key = "betas" if "betas" in group else "momentum"
            raise NotImplementedError(
                f"{self._NAME}: {where} has its {key} cycled by an LR scheduler (OneCycleLR or CyclicLR with "
                f"cycle_momentum=True, which keep 'base_momentum' and 'max_momentum' in the group and write "
                f"group[{key!r}] at every step); a compiled step takes {key} as constants of the graph (the kernels "
                "take them as numbers), so every new value would compile a new graph until dynamo's recompile limit: "
                "pass cycle_momentum=False to the scheduler, or call opt.step() outside the compiled function"
            )

    def _backends_of(self, plan: _Plan) -> dict[torch.device, str]:
        """The backend of each device's launches: resolved when the plan is made, again only when the forced
        backend (``FASTAMP_BACKEND``, :func:`fastamp.backends.set_backend`) changed since (one read a step)."""
        from fastamp.ops import backends

        forced = backends.get_backend()
        if plan.chosen is None or plan.forced != forced:
            plan.chosen = {dev: backends.resolve(op, dev, self.backend) for op, dev in plan.needed}
            plan.forced = forced
        return plan.chosen

    def _execute(self, plan: _Plan, grads_per_group: list[list[Tensor | None]], ctx: StepContext) -> None:
        chosen = self._backends_of(plan)
        pending = self.__dict__.get("_rng_pending")  # inside bucket_step(): the counters advance when it ends
        for gi, (gp, grads) in enumerate(zip(plan.groups, grads_per_group)):
            if not gp.buckets:
                continue
            group = self._hyper(gp.group)
            if gp.remainder and gp.versions is not None:
                versions = list(map(_version_of, gp.remainder))
                if versions != gp.versions:
                    self._resync_written(gp, versions)
            for b in gp.buckets:
                dev = b.dev
                found_inf, inc = ctx.found_inf_on(dev), ctx.increment_on(dev)
                rows = shared = None
                if b.step_buf is not None:
                    # One row per param from its own count. The count vector is the bucket's
                    # buffer as it is (its length and order), and each launch takes its rows
                    # by slicing: a compiled step stacks the same counts in the same order and
                    # slices the same rows (see _traced), so both compute the fp64 ``pow`` of
                    # reference.adamw_step_scalars over the same vector. torch's CPU loops give
                    # a vector's lanes and its tail other last bits than a 0-dim call: equal
                    # vectors are what makes eager and compiled steps bit-identical.
                    rows = self._step_scalars(group, b.counts(), ctx.found_inf, ctx.grad_scale, dev)
                for run in b.runs.values():
                    run.refresh(grads)
                    try:
                        for part in run.split():
                            if part.row0 >= 0:
                                scalars = rows[part.row0 : part.row0 + len(part.params)]
                            else:
                                if shared is None:
                                    shared = self._step_scalars(group, None, ctx.found_inf, ctx.grad_scale, dev)
                                scalars = shared
                            launch = _traced.Launch(
                                part.op, self.backend, part.kind, part.params, part.grads, part.launch,
                                found_inf, part.rng, part.rng_base,
                            )  # fmt: skip
                            args = self._kernel_args(group, launch, scalars)
                            backend = chosen[dev]
                            table = self._table_of(run, args, backend) if part is run else None
                            functional._optim_launch(args, backend, table)
                        for p, tmp in run.copy_back:
                            p.copy_(tmp)
                    finally:
                        run.release()
                if b.step_buf is not None:
                    b.advance(inc)
                if b.rngs and pending is not None:
                    pending.note(gi, b.rngs[0], inc)
                elif b.rngs:
                    # the group's one counter on this device (see _rng), once per step
                    torch._foreach_add_(b.rngs, [ctx.rng_delta_on(dev)] * len(b.rngs))
            if gp.remainder:
                gp.versions = list(map(_version_of, gp.remainder))
                self._param_versions.update(zip(map(id, gp.remainder), gp.versions))

    def _table_of(self, run: _Run, args: tuple, backend: str) -> Any:
        """The run's persistent kernel table (made at its first native launch), or None.

        Runs whose params are copied contiguous each step (strided params) or are DTensor
        shards take the lists each time; so does every run the native backend has no table
        for (fastamp.functional._optim_table_for says which).
        """
        table = run.table
        if table is None:
            table = False
            if not run.strided and not run.dtensor and backend == "native":
                table = functional._optim_table_for(args) or False
            run.table = table
        return table or None

    def _resync_written(self, gp: _GroupPlan, versions: list[int]) -> None:
        """Re-sync the remainder masters of params written since the last step (see the class doc)."""
        for p, now, seen in zip(gp.remainder, versions, gp.versions):
            if now != seen:
                self._resync_if_written(p, self.state[p], "a param")


# torch's LR schedulers (torch.optim.lr_scheduler.LRScheduler.__init__) replace ``opt.step`` on
# the instance with a wrapper that records ``opt._opt_called`` (for their warning "lr_scheduler.step()
# before optimizer.step()"), unless the step has this attribute. That wrapper lives in a file
# dynamo refuses to trace, so a compiled step (``torch.compile(opt.step)``, or the scaler's traced
# step calling ``opt.step``) would fail on it, and compiling ``opt.step`` first would make the
# scheduler fail on the compiled function instead. ``step`` records the call itself.
FusedOptimizer.step._wrapped_by_lr_sched = True
