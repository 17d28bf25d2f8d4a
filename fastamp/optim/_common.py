"""Helpers shared by fastamp's fused optimizers (AdamW, SGD).

What lives here is independent of the update rule: which dtypes an optimizer accepts,
which master a param gets (fp32, int16 remainder, none with stochastic rounding), how the
``grad_scale``/``found_inf`` handed over by a grad scaler reach each device without a host
sync, which params may share one kernel launch, the step loop that groups params into
launches (:class:`FusedOptimizer`), and a ``load_state_dict`` that keeps fp32 state fp32.
"""

from __future__ import annotations

import math
import numbers
import operator
import warnings
from collections import defaultdict
from collections.abc import Iterable, Sequence
from copy import deepcopy
from itertools import chain
from typing import Any, Callable

import torch
from torch import Tensor

PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOW_PRECISION_DTYPES = (torch.float16, torch.bfloat16)
GRAD_DTYPES = PARAM_DTYPES


def check_param_dtype(opt_name: str, p: Tensor, where: str) -> None:
    """Reject params the fused kernels cannot update, naming the param and the reason."""
    if p.dtype in PARAM_DTYPES:
        return
    if p.is_complex():
        raise TypeError(
            f"{opt_name}: {where} is complex ({p.dtype}); complex params are not supported. "
            "Keep the real and imaginary parts as separate real params."
        )
    if not p.is_floating_point():
        raise TypeError(f"{opt_name}: {where} must be a floating point tensor, got {p.dtype}")
    raise TypeError(
        f"{opt_name}: {where} has dtype {p.dtype}; supported param dtypes are float32, float16 and "
        "bfloat16 (the fused kernels compute in fp32). Use torch.optim for float64 params."
    )


def check_grad(opt_name: str, p: Tensor, g: Tensor, where: str) -> None:
    """Reject a gradient the fused kernels cannot read."""
    if g.layout is not torch.strided:
        raise RuntimeError(
            f"{opt_name} does not support sparse gradients ({where} has a {g.layout} grad); "
            "consider torch.optim.SparseAdam"
        )
    if g.dtype not in GRAD_DTYPES:
        raise TypeError(f"{opt_name}: the grad of {where} has dtype {g.dtype}; expected float32, float16 or bfloat16")
    if g.device != p.device:
        raise RuntimeError(f"{opt_name}: the grad of {where} is on {g.device} but the param is on {p.device}")
    if g.shape != p.shape:
        raise RuntimeError(
            f"{opt_name}: the grad of {where} has shape {tuple(g.shape)} but the param has shape {tuple(p.shape)}"
        )


def check_master_weights_flag(opt_name: str, value: Any) -> None:
    if value is not None and not isinstance(value, bool) and not (isinstance(value, str) and value == "remainder"):
        raise TypeError(f"{opt_name}: master_weights must be None, True, False or 'remainder', got {value!r}")


def master_kind(master_weights: Any, dtype: torch.dtype, stochastic_rounding: bool = False) -> str:
    """How a param of ``dtype`` is stored under a group's ``master_weights`` / ``stochastic_rounding``.

    ``"fp32"``: an fp32 master in ``state["master_param"]``; ``"remainder"``: a bf16 param
    whose exact fp32 master is ``join_master(param, state["master_remainder"])`` (int16);
    ``"sr"``: a bf16 param without master, rounded stochastically; ``"none"``: updated in
    place (fp32 maths, rounded to nearest-even once per step).

    ``True``: fp32 masters for fp16/bf16 params. ``None``: the same, except that bf16 params
    go without a master when ``stochastic_rounding`` is on. ``"remainder"``: int16
    remainders for bf16 params, fp32 masters for fp16 params (an fp16 value is not the top
    half of an fp32 one). ``False``: no masters. An fp32 param is its own master under
    every setting (not an error, so one group may mix dtypes).
    """
    if dtype not in LOW_PRECISION_DTYPES:
        return "none"
    sr = bool(stochastic_rounding) and dtype == torch.bfloat16
    if master_weights is True:
        return "fp32"
    if isinstance(master_weights, str):  # "remainder"
        return "remainder" if dtype == torch.bfloat16 else "fp32"
    if master_weights is None and not sr:
        return "fp32"
    return "sr" if sr else "none"


def uses_master(master_weights: Any, dtype: torch.dtype, stochastic_rounding: bool = False) -> bool:
    """Whether a param of ``dtype`` keeps an exact fp32 master (fp32 copy or int16 remainder)."""
    return master_kind(master_weights, dtype, stochastic_rounding) in ("fp32", "remainder")


def check_lowbit_options(opt_name: str, group: dict[str, Any], where: str) -> None:
    """Validate ``master_weights``, ``stochastic_rounding`` and ``seed`` of a group."""
    check_master_weights_flag(opt_name, group["master_weights"])
    sr = group["stochastic_rounding"]
    if not isinstance(sr, bool):
        raise TypeError(f"{opt_name}: stochastic_rounding must be a bool, got {sr!r} in {where}")
    seed = group["seed"]
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not -(2**63) <= seed < 2**63:
        raise TypeError(f"{opt_name}: seed must be an int in the int64 range, got {seed!r} in {where}")
    if sr and group["master_weights"] is True:
        raise ValueError(
            f"{opt_name}: stochastic_rounding=True has no effect with master_weights=True (the param is "
            f"rounded from an exact fp32 master); use master_weights=False or None for bf16 params without a "
            f"master, or 'remainder' ({where})"
        )


def validate_lr(opt_name: str, lr: Any, check_value: bool) -> None:
    """torch.optim's lr checks and messages; a tensor lr's value is checked only when asked (it syncs)."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not lr.is_floating_point():
            raise TypeError(f"{opt_name}: a Tensor lr must be floating point, got {lr.dtype}")
        if check_value and not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        return
    check_real_number(opt_name, "lr", lr)
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")


def check_backend_arg(opt_name: str, backend: Any) -> Any:
    from fastamp import backends

    if backend is not None and backend != "auto" and backend not in backends.BACKENDS:
        raise ValueError(
            f"{opt_name}: unknown backend {backend!r}; expected one of {backends.BACKENDS}, 'auto' or None"
        )
    return None if backend == "auto" else backend


def is_dtensor(t: Tensor) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 param or its state)."""
    return type(t) is not Tensor and isinstance(getattr(t, "_local_tensor", None), Tensor)


def local_of(t: Tensor) -> Tensor:
    """The local shard of a DTensor (what the kernels read and update in place), else ``t``."""
    return t._local_tensor if is_dtensor(t) else t


def state_zeros(p: Tensor, dtype: torch.dtype) -> Tensor:
    """Contiguous zeros shaped like ``p``; a DTensor with ``p``'s mesh and placements for a DTensor ``p``."""
    return torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)


def fp32_zeros_like(p: Tensor) -> Tensor:
    return state_zeros(p, torch.float32)


def state_copy(p: Tensor, value: Tensor, dtype: torch.dtype) -> Tensor:
    """A contiguous ``dtype`` copy of ``value`` laid out like ``p`` (a DTensor like ``p`` for a DTensor ``p``)."""
    return torch.empty_like(p, dtype=dtype, memory_format=torch.contiguous_format).copy_(value)


def fp32_copy_of(p: Tensor) -> Tensor:
    """A contiguous fp32 copy of ``p`` (exact: fp16/bf16 values are fp32 values)."""
    return state_copy(p, p.detach(), torch.float32)


def check_real_number(opt_name: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{opt_name}: {name} must be a real number, got {type(value).__name__}")


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
    """

    def __init__(self) -> None:
        self.fresh = object()
        self._token: dict[int, object] = {}
        self._remap: dict[object, object] = {}

    def begin_step(self) -> None:
        self._remap = {}

    def get(self, p: Tensor) -> object:
        return self._token.get(id(p), self.fresh)

    def advance(self, p: Tensor, token: object) -> None:
        new = self._remap.get(token)
        if new is None:
            new = self._remap[token] = object()
        self._token[id(p)] = new

    def rebuild(self, params_and_steps: Iterable[tuple[Tensor, float]]) -> None:
        """Tokens from known step values (after a load): equal counts share a token."""
        self._token = {}
        by_value: dict[float, object] = {}
        for p, value in params_and_steps:
            self._token[id(p)] = by_value.setdefault(value, object())


_INT_STATE: dict[str, tuple[torch.dtype, Callable[[Tensor], tuple[int, ...]]]] = {
    "master_remainder": (torch.int16, lambda p: tuple(p.shape)),
    "rng": (torch.int64, lambda p: (2,)),
}


def _fmt_shape(t: Any) -> str:
    return str(tuple(t.shape)) if isinstance(t, Tensor) else type(t).__name__


def load_state_dict(
    opt: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    *,
    opt_name: str,
    required_group_keys: Sequence[str],
    validate_group: Callable[[dict[str, Any], str], None],
    required_state_keys: Callable[[dict[str, Any]], Sequence[str]],
    fp32_state_keys: Sequence[str],
    group_defaults: Callable[[dict[str, Any]], dict[str, Any]],
    drop_state_keys: Callable[[Tensor, dict[str, Any]], Sequence[str]],
    state_dtype: Callable[[Tensor, dict[str, Any], str], torch.dtype] | None = None,
) -> dict[Tensor, float]:
    """``Optimizer.load_state_dict`` that keeps fp32 state fp32 and validates first.

    torch's version casts every floating state tensor to its param's dtype, which would
    round a bf16 param's fp32 master and moments to bf16. Here the tensors named in
    ``fp32_state_keys`` become fresh contiguous fp32 copies on the param's device, ``step``
    an fp32 0-dim tensor on the param's device; other state is copied to the param's
    device as is. ``state_dtype(p, group, key)``, when given, names the dtype a key of
    ``fp32_state_keys`` is stored in instead (bf16 moments). ``master_remainder`` must be an
    int16 tensor of the param's shape, ``rng`` an int64 ``[seed, counter]`` pair. The whole dict is checked before anything changes. Load pre/post hooks
    run as in torch. Returns the loaded step value of each param with state.
    """
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        keys = list(state_dict.keys()) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(f"{opt_name}.load_state_dict: expected a dict with 'state' and 'param_groups', got {keys}")
    state_dict = state_dict.copy()
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(opt, state_dict)
        if result is not None:
            state_dict = result

    groups = opt.param_groups
    saved_groups = deepcopy(state_dict["param_groups"])
    if len(groups) != len(saved_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
        raise ValueError(
            "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
        )
    for gi, sg in enumerate(saved_groups):
        missing = [k for k in required_group_keys if k not in sg]
        if missing:
            raise ValueError(
                f"{opt_name}.load_state_dict: param group {gi} of the loaded state dict has no {missing} "
                f"(its keys: {sorted(k for k in sg if k != 'params')}); was it saved by another optimizer?"
            )
        for k, v in group_defaults(groups[gi]).items():
            sg.setdefault(k, v)
        validate_group(sg, f"loaded param group {gi}")

    id_map = dict(
        zip(chain.from_iterable(s["params"] for s in saved_groups), chain.from_iterable(g["params"] for g in groups))
    )
    group_of = {pid: sg for sg in saved_groups for pid in sg["params"]}
    new_state: dict[Any, Any] = defaultdict(dict)
    steps: dict[Tensor, float] = {}
    for k, v in state_dict["state"].items():
        if k not in id_map:
            new_state[k] = v
            continue
        p = id_map[k]
        where = f"the state of param {k!r}"
        if not isinstance(v, dict):
            raise ValueError(f"{opt_name}.load_state_dict: {where} must be a dict, got {type(v).__name__}")
        if len(v) == 0:
            continue
        missing = [key for key in required_state_keys(group_of[k]) if key not in v]
        if missing:
            raise ValueError(
                f"{opt_name}.load_state_dict: {where} has no {missing} (its keys: {sorted(v)}); "
                "was it saved by another optimizer?"
            )
        entry: dict[str, Any] = {}
        dropped = set(drop_state_keys(p, group_of[k]))
        for key, value in v.items():
            if key in dropped:
                continue
            if key == "step":
                if isinstance(value, Tensor):
                    if value.numel() != 1:
                        raise ValueError(
                            f"{opt_name}.load_state_dict: {where}: 'step' must have one element, got {_fmt_shape(value)}"
                        )
                    step_value = float(value)
                elif isinstance(value, numbers.Real) and not isinstance(value, bool):
                    step_value = float(value)
                else:
                    raise ValueError(
                        f"{opt_name}.load_state_dict: {where}: 'step' must be a number or tensor, got {type(value).__name__}"
                    )
                if not math.isfinite(step_value) or step_value < 0:
                    raise ValueError(
                        f"{opt_name}.load_state_dict: {where}: 'step' must be finite and >= 0, got {step_value}"
                    )
                entry[key] = torch.full((), step_value, dtype=torch.float32, device=p.device)
                steps[p] = step_value
            elif key in fp32_state_keys:
                if not isinstance(value, Tensor) or not value.is_floating_point() or value.is_complex():
                    raise ValueError(
                        f"{opt_name}.load_state_dict: {where}: {key!r} must be a real floating point tensor, got {value!r:.80}"
                    )
                if value.shape != p.shape:
                    raise ValueError(
                        f"{opt_name}.load_state_dict: {where}: {key!r} has shape {tuple(value.shape)} "
                        f"but the param has shape {tuple(p.shape)}"
                    )
                dt = torch.float32 if state_dtype is None else state_dtype(p, group_of[k], key)
                if is_dtensor(p) != is_dtensor(value):
                    raise ValueError(
                        f"{opt_name}.load_state_dict: {where}: {key!r} is "
                        f"{'a DTensor' if is_dtensor(value) else 'a plain tensor'} but the param is "
                        f"{'a DTensor' if is_dtensor(p) else 'a plain tensor'}; load sharded state into the "
                        "same sharding (torch.distributed.checkpoint.state_dict.set_optimizer_state_dict hands "
                        "over DTensors)"
                    )
                entry[key] = state_copy(p, value, dt)
            elif key in _INT_STATE:
                dt, shape_of = _INT_STATE[key]
                if not isinstance(value, Tensor) or value.dtype != dt or tuple(value.shape) != shape_of(p):
                    raise ValueError(
                        f"{opt_name}.load_state_dict: {where}: {key!r} must be a {dt} tensor of shape "
                        f"{shape_of(p)}, got {value.dtype if isinstance(value, Tensor) else type(value).__name__} "
                        f"{_fmt_shape(value)}"
                    )
                entry[key] = value.to(device=p.device, copy=True).contiguous()
            elif isinstance(value, Tensor):
                entry[key] = value.to(device=p.device, copy=True)
            else:
                entry[key] = deepcopy(value)
        new_state[p] = entry

    for g, sg in zip(groups, saved_groups):
        sg["params"] = g["params"]
        if "param_names" in g and "param_names" not in sg:
            sg["param_names"] = g["param_names"]
    opt.__setstate__({"state": new_state, "param_groups": saved_groups})
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)
    return steps


def params_with_state(opt: torch.optim.Optimizer) -> list[Tensor]:
    return [p for g in opt.param_groups for p in g["params"] if len(opt.state.get(p, {})) > 0]


class _Run:
    """One kernel call of a launch plan: its params, where their grads sit, their states.

    Built once per plan; :meth:`refresh` fills the per-step lists (this step's grads, the
    masters read from the states, contiguous copies of strided params).
    """

    __slots__ = (
        "op",
        "kind",
        "params",
        "grads",
        "states",
        "masters",
        "ids",
        "gidx",
        "strided",
        "copy_back",
        "rng",
        "rng_base",
        "dtensor",
    )

    def __init__(self, op: str, kind: str) -> None:
        self.op, self.kind = op, kind
        self.params: list[Tensor] = []
        self.grads: list[Tensor] = []
        self.states: list[dict[str, Any]] = []
        self.masters: list[Tensor] = []
        self.ids: list[int] = []
        self.gidx: list[int] = []  # position of each param in its group (where its grad is gathered)
        self.strided: list[tuple[int, Tensor]] = []  # (position in this run, param) of non-contiguous params
        self.copy_back: list[tuple[Tensor, Tensor]] = []
        self.rng: Tensor | None = None
        self.rng_base = 0
        self.dtensor = False  # DTensor params (FSDP2): the kernels get the local shards

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

    def refresh(self, grads: list[Tensor]) -> None:
        """This step's lists; ``grads`` are the group's grads (contiguous, checked by the caller)."""
        self.grads = [grads[i] for i in self.gidx]
        if self.dtensor:
            self.grads = [local_of(g) for g in self.grads]
        if self.kind == "fp32":
            self.masters = self.state_list("master_param")
        elif self.kind == "remainder":
            self.masters = self.state_list("master_remainder")
        self.copy_back = []
        for pos, p in self.strided:
            tmp = p.detach().contiguous()
            self.copy_back.append((p, tmp))
            self.params[pos] = tmp

    def state_list(self, key: str) -> list[Tensor]:
        """``state[key]`` of every param, as the tensors the kernels update (local shards of DTensors)."""
        if self.dtensor:
            return [local_of(st[key]) for st in self.states]
        return [st[key] for st in self.states]

    def release(self) -> None:
        """Drop this step's lists after the launch, so that the plan keeps no grad alive."""
        self.grads, self.masters, self.copy_back = [], [], []
        for pos, p in self.strided:
            self.params[pos] = p

    def split(self) -> list[_Run]:
        """Runs whose stochastic-rounding tensor ids are consecutive (the kernel numbers them base + i)."""
        if not self.ids:
            return [self]
        runs, start = [], 0
        for i in range(1, len(self.ids) + 1):
            if i == len(self.ids) or self.ids[i] != self.ids[i - 1] + 1:
                r = _Run(self.op, self.kind)
                for name in ("params", "grads", "states", "masters"):
                    setattr(r, name, getattr(self, name)[start:i] if getattr(self, name) else [])
                r.rng = self.states[start]["rng"]
                r.rng_base = self.ids[start]
                r.dtensor = self.dtensor
                runs.append(r)
                start = i
        return runs


class _Bucket:
    """Params of one group on one device whose step counts are equal (one set of step scalars).

    Their ``step`` tensors are 0-dim views of one buffer, so a step increments them all in
    one op; the views are checked each step to still be the state's ``step`` tensors.
    """

    __slots__ = ("dev", "runs", "steps", "step_buf", "states", "rngs")

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.runs: dict[Any, _Run] = {}
        self.steps: list[Tensor] = []
        self.step_buf: Tensor | None = None
        self.states: list[dict[str, Any]] = []
        self.rngs: list[Tensor] = []

    def share_steps(self, states: list[dict[str, Any]]) -> None:
        """Make the ``step`` tensors of ``states`` (equal values) views of one buffer."""
        if not states:
            return
        buf = torch.stack([st["step"].reshape(()) for st in states])
        self.step_buf, self.states = buf, states
        self.steps = [buf[i] for i in range(len(states))]
        for st, view in zip(states, self.steps):
            st["step"] = view

    def steps_intact(self) -> bool:
        """Whether the states still hold the planned ``step`` views (not replaced by assignment)."""
        return all(map(operator.is_, [st.get("step") for st in self.states], self.steps))


class _GroupPlan:
    """The launches of one param group, and what they assumed about it."""

    __slots__ = ("group", "params", "key", "param_dtypes", "grad_dtypes", "buckets", "remainder", "versions")

    def __init__(self, group: dict[str, Any], key: tuple) -> None:
        self.group = group
        self.params: list[Tensor] = list(group["params"])
        self.key = key
        self.param_dtypes = [p.dtype for p in self.params]
        self.grad_dtypes = [None if p.grad is None else p.grad.dtype for p in self.params]
        self.buckets: list[_Bucket] = []
        self.remainder: list[Tensor] = []  # params with remainder masters, in plan order
        self.versions: list[int] | None = None  # their ``_version`` after the last step


class _Plan:
    """How ``step()`` launches the kernels, cached across steps while it fits (see ``_gather``)."""

    __slots__ = ("groups", "state", "n_state", "needed")

    def __init__(self) -> None:
        self.groups: list[_GroupPlan] = []
        self.state: Any = None
        self.n_state = 0
        self.needed: set[tuple[str, torch.device]] = set()


class FusedOptimizer(torch.optim.Optimizer):
    """The step loop, master-weight bookkeeping and state_dict shared by fastamp's optimizers.

    A subclass defines its update through a few hooks: ``_validate_group``, ``_kernel_op``,
    ``_init_state`` (its own state: moments, buffers, ``step``), ``_extra_key``,
    ``_uses_rng``, ``_scalars`` and ``_launch``; ``_COUNT_BEFORE`` says whether ``step`` is
    incremented before the step scalars are computed (AdamW: bias corrections use the new
    count) or after (SGD: ``is_first`` uses the count of applied steps before this one).

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

    Launch plan: a step groups the params with a grad into kernel launches and keeps that
    plan; later steps reuse it while it fits, checking per param only a few attribute reads
    (which params have a grad, param and grad dtypes, dense contiguous grads), so a step over
    tens of thousands of small params costs little host time. Which params have a grad, a
    dtype, a group's layout settings (``master_weights``, ``stochastic_rounding``, ``seed``,
    and the subclass's, see ``_plan_key``), ``add_param_group``, ``load_state_dict`` and
    :meth:`reset_master_weights` lead to a new plan; ``lr``, betas, ``eps``, ``weight_decay``
    and the like are read at every step, and state tensors replaced by assignment
    (``opt.state[p]["exp_avg"] = t``) are read from the state at every step. Replacing a
    param's whole state dict (``opt.state[p] = {...}``) is not seen: load state with
    ``load_state_dict``. The ``step`` tensors of the params of one launch are 0-dim views of
    one buffer (one add per step, not one per param); they are saved, exported and loaded
    as ordinary per-param counts.
    """

    _NAME = "FusedOptimizer"
    _COUNT_BEFORE = True
    _step_supports_amp_scaling = True

    # ---- hooks -------------------------------------------------------------------------
    def _validate_group(self, group: dict[str, Any], where: str, check_tensor_lr: bool = False) -> None:
        raise NotImplementedError

    def _kernel_op(self, group: dict[str, Any], p: Tensor, kind: str) -> str:
        raise NotImplementedError

    def _init_state(self, p: Tensor, st: dict[str, Any], group: dict[str, Any], kind: str) -> None:
        raise NotImplementedError

    def _extra_key(self, group: dict[str, Any], p: Tensor, st: dict[str, Any], kind: str) -> tuple:
        return ()

    def _uses_rng(self, group: dict[str, Any], p: Tensor, st: dict[str, Any], kind: str) -> bool:
        return kind == "sr"

    def _scalars(self, group: dict[str, Any], lr: Any, steps: list[Tensor], grad_mul, dev) -> Tensor:
        raise NotImplementedError

    def _launch(self, group: dict[str, Any], run: _Run, scalars: Tensor, found_inf: Tensor | None) -> None:
        raise NotImplementedError

    # ---- construction / pickling ---------------------------------------------------------
    def _setup(self, backend: Any) -> None:
        self.backend = check_backend_arg(self._NAME, backend)
        self._cohorts = StepCohorts()
        self._param_versions: dict[int, int] = {}
        self._plan: _Plan | None = None

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
        except Exception:
            self.param_groups.pop()
            raise

    def _prepare_group(self, group: dict[str, Any]) -> None:
        """Normalise a new group in place (e.g. tensor betas to floats) before validation."""

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["backend"] = self.backend
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("backend", None)
        self._param_versions = {}
        self._plan = None
        for group in self.param_groups:
            for k, v in self._group_setdefaults().items():
                group.setdefault(k, v)
        self._rebuild_cohorts()

    def _group_setdefaults(self) -> dict[str, Any]:
        return {"maximize": False, "master_weights": None, "stochastic_rounding": False, "seed": 0}

    def _rebuild_cohorts(self) -> None:
        """Cohort tokens from the stored step counts (one read per device, off the hot path)."""
        self._cohorts = StepCohorts()
        by_device: dict[torch.device, list[Tensor]] = {}
        for p in params_with_state(self):
            step = self.state[p].get("step")
            if isinstance(step, Tensor):
                by_device.setdefault(step.device, []).append(p)
        pairs = []
        for plist in by_device.values():
            values = torch.stack([self.state[p]["step"].reshape(()).float() for p in plist]).cpu().tolist()
            pairs.extend(zip(plist, values))
        self._cohorts.rebuild(pairs)

    # ---- masters -----------------------------------------------------------------------
    def _kind(self, group: dict[str, Any], p: Tensor) -> str:
        return master_kind(group["master_weights"], p.dtype, group["stochastic_rounding"])

    @torch.no_grad()
    def reset_master_weights(self) -> None:
        """Re-sync every master to its param (call after changing params outside the optimizer).

        fp32 masters become copies of the params; remainders become 0 (master == param).
        Needed after writes that bypass autograd version counters (``param.data.copy_``);
        other in-place writes are detected for remainder masters at the next step.
        """
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if not st:
                    continue
                if "master_param" in st:
                    st["master_param"].copy_(p.detach())
                if "master_remainder" in st:
                    st["master_remainder"].zero_()
                    self._param_versions[id(p)] = p._version
        self._plan = None

    def _init_master(self, p: Tensor, st: dict[str, Any], kind: str) -> None:
        from fastamp import reference

        if kind == "fp32":
            if "master_param" not in st:
                rem = st.pop("master_remainder", None)
                if rem is not None and p.dtype == torch.bfloat16:
                    st["master_param"] = reference.join_master(p.detach(), rem).contiguous()
                else:
                    st["master_param"] = fp32_copy_of(p)
            st.pop("master_remainder", None)
        elif kind == "remainder":
            if "master_remainder" not in st:
                master = st.pop("master_param", None)
                if master is not None:
                    hi, rem = reference.split_master(master)
                    p.copy_(hi)
                    st["master_remainder"] = rem.contiguous()
                else:
                    st["master_remainder"] = state_zeros(p, torch.int16)
            st.pop("master_param", None)
        else:
            st.pop("master_param", None)
            st.pop("master_remainder", None)

    def _resync_if_written(self, p: Tensor, st: dict[str, Any], where: str) -> None:
        seen = self._param_versions.get(id(p))
        if seen is not None and p._version != seen:
            warnings.warn(
                f"{self._NAME}: {where} (bf16, master_weights='remainder') was written outside the optimizer "
                "since its last step; its master is re-synced to the param (remainder := 0). Call "
                "reset_master_weights() after such writes to silence this.",
                stacklevel=3,
            )
            st["master_remainder"].zero_()

    def _bf16_ids(self) -> dict[int, int]:
        """Stochastic-rounding tensor id of each bf16 param: its index among the optimizer's bf16 params.

        Stable across runs and data-parallel ranks (param order), and fp32/fp16 params in
        between do not split a launch.
        """
        ids: dict[int, int] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype == torch.bfloat16 and id(p) not in ids:
                    ids[id(p)] = len(ids)
        return ids

    # ---- the step ------------------------------------------------------------------------
    def _plan_key(self, group: dict[str, Any]) -> tuple:
        """The group settings that decide how its params are laid out in launches.

        A change of any of them rebuilds the launch plan at the next step; the other
        hyperparameters are read at every step.
        """
        return (group["master_weights"], group["stochastic_rounding"], group["seed"])

    def _collect(self) -> list[tuple[dict[str, Any], list[tuple[int, Tensor, Tensor]]]]:
        """Every (group, [(index, param, grad)]) to update, fully validated; changes nothing."""
        from fastamp import backends

        work = []
        needed: set[tuple[str, torch.device]] = set()
        for gi, group in enumerate(self.param_groups):
            self._validate_group(group, f"param group {gi}")
            items = []
            for i, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                if p.dtype not in PARAM_DTYPES:
                    check_param_dtype(self._NAME, p, f"param {i} of param group {gi}")
                check_grad(self._NAME, p, g, f"param {i} of param group {gi}")
                if is_dtensor(p) and self._kind(group, p) == "remainder":
                    raise NotImplementedError(
                        f"{self._NAME}: param {i} of param group {gi} is a DTensor (FSDP2) with "
                        "master_weights='remainder', which is not supported yet; use master_weights=True "
                        "(fp32 masters, sharded like the param) or stochastic_rounding=True"
                    )
                items.append((i, p, g))
                needed.add((self._kernel_op(group, p, self._kind(group, p)), p.device))
            work.append((group, items))
        for op, dev in sorted(needed, key=str):
            backends.resolve(op, dev, self.backend)
        return work

    def _build_plan(self, work: list[tuple[dict[str, Any], list[tuple[int, Tensor, Tensor]]]]) -> _Plan:
        """Create missing state and masters and group the params with a grad into launches.

        Called when there is no plan or it no longer fits (first step, a param gained or
        lost its grad, a grad or param dtype changed, a layout setting of a group changed,
        state was loaded). Advances the step cohorts of the params it plans: the plan is
        executed right after.
        """
        plan = _Plan()
        cohorts = self._cohorts
        cohorts.begin_step()
        sr_ids: dict[int, int] | None = None
        for group, items in work:
            gp = _GroupPlan(group, self._plan_key(group))
            # (device, cohort) -> bucket
            buckets: dict[Any, _Bucket] = {}
            step_states: dict[Any, list[dict[str, Any]]] = {}
            for pos, p, g in items:
                st = self.state.get(p)
                if st is None:
                    st = {}
                token = cohorts.get(p) if len(st) else cohorts.fresh
                kind = self._kind(group, p)
                self._init_state(p, st, group, kind)
                self._init_master(p, st, kind)
                if kind == "remainder":
                    self._resync_if_written(p, st, "a param")
                    gp.remainder.append(p)
                use_rng = self._uses_rng(group, p, st, kind)
                if use_rng and "rng" not in st:
                    rng = torch.zeros(2, dtype=torch.int64, device=p.device)
                    rng[0] = int(group["seed"])
                    st["rng"] = rng
                if st:
                    self.state[p] = st
                cohorts.advance(p, token)
                bucket = buckets.get((p.device, token))
                if bucket is None:
                    bucket = buckets[(p.device, token)] = _Bucket(p.device)
                    step_states[(p.device, token)] = []
                if "step" in st:
                    step_states[(p.device, token)].append(st)
                sr_id = None
                if use_rng:
                    bucket.rngs.append(st["rng"])
                    if sr_ids is None:
                        sr_ids = self._bf16_ids()
                    sr_id = sr_ids[id(p)]
                op = self._kernel_op(group, p, kind)
                key = (op, p.dtype, g.dtype, kind, use_rng) + self._extra_key(group, p, st, kind)
                run = bucket.runs.get(key)
                if run is None:
                    run = bucket.runs[key] = _Run(op, kind)
                run.add(p, pos, st, sr_id)
                plan.needed.add((op, p.device))
            for key, bucket in buckets.items():
                # Every step in a bucket holds the same value (see StepCohorts).
                bucket.share_steps(step_states[key])
            gp.buckets = list(buckets.values())
            plan.groups.append(gp)
        plan.state = self.state
        plan.n_state = len(self.state)
        return plan

    def _gather(self, plan: _Plan | None) -> list[list[Tensor | None]] | None:
        """This step's grads of every group, or None when ``plan`` does not fit this step.

        Per param this costs a few attribute reads (no Python call per param), which is what
        makes a step with tens of thousands of small params cheap. It checks what can change
        between steps without the optimizer noticing: which params have a grad, param and
        grad dtypes, that grads are dense and contiguous, the params of each group, the
        groups' layout settings, and that the ``step`` tensors are still the planned ones.
        """
        if (
            plan is None
            or self.state is not plan.state
            or len(self.state) != plan.n_state
            or len(self.param_groups) != len(plan.groups)
        ):
            return None
        out = []
        for group, gp in zip(self.param_groups, plan.groups):
            params = group["params"]
            if group is not gp.group or len(params) != len(gp.params) or not all(map(operator.is_, params, gp.params)):
                return None
            if self._plan_key(group) != gp.key:
                return None
            grads = [p.grad for p in params]
            if [None if g is None else g.dtype for g in grads] != gp.grad_dtypes:
                return None
            if [p.dtype for p in params] != gp.param_dtypes:
                return None
            try:
                if not all([g.is_contiguous() for g in grads if g is not None]):
                    return None
            except RuntimeError:  # sparse grads have no is_contiguous: the full checks name them
                return None
            if not all(b.steps_intact() for b in gp.buckets):
                return None
            out.append(grads)
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """Perform a single optimization step.

        Args:
            closure (Callable, optional): a closure that reevaluates the model and returns
                the loss (not allowed when a grad scaler drives the step, as in torch).
        """
        from fastamp import backends

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for gi, group in enumerate(self.param_groups):
            self._validate_group(group, f"param group {gi}")
        amp = AmpInputs(self._NAME, getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
        plan = self._plan
        grads = self._gather(plan)
        if grads is None:
            self._plan = None
            work = self._collect()
            if not any(items for _, items in work):
                return loss
            plan = self._build_plan(work)
            grads = self._gather(plan)
            if grads is None:  # only non-contiguous grads (copied below) get here
                grads = [[p.grad for p in group["params"]] for group, _ in work]
                grads = [[g if g is None or g.is_contiguous() else g.contiguous() for g in gl] for gl in grads]
            else:
                self._plan = plan
        else:
            for op, dev in plan.needed:
                backends.resolve(op, dev, self.backend)
        try:
            self._execute(plan, grads, amp)
        except BaseException:
            self._plan = None
            raise
        return loss

    def _execute(self, plan: _Plan, grads_per_group: list[list[Tensor | None]], amp: AmpInputs) -> None:
        rng_inc: dict[torch.device, Tensor] = {}
        for gp, grads in zip(plan.groups, grads_per_group):
            if not gp.buckets:
                continue
            group = gp.group
            if gp.remainder and gp.versions is not None:
                versions = [p._version for p in gp.remainder]
                if versions != gp.versions:
                    self._resync_written(gp, versions)
            lr_per_device: dict[torch.device, Any] = {}
            lr = group["lr"]
            for b in gp.buckets:
                dev = b.dev
                grad_mul, found_inf, inc = amp.on(dev)
                if dev not in lr_per_device:
                    lr_per_device[dev] = _to_device(lr, dev) if isinstance(lr, Tensor) else lr
                steps = []
                if b.steps:
                    # every view of the bucket's buffer holds the same count
                    first = b.steps[0]
                    if self._COUNT_BEFORE:
                        first = first + (1.0 if inc is None else inc)
                    steps = [first]
                scalars = self._scalars(group, lr_per_device[dev], steps, grad_mul, dev)
                for run in b.runs.values():
                    run.refresh(grads)
                    try:
                        for part in run.split():
                            self._launch(group, part, scalars, found_inf)
                        for p, tmp in run.copy_back:
                            p.copy_(tmp)
                    finally:
                        run.release()
                if b.step_buf is not None:
                    b.step_buf.add_(1.0 if inc is None else inc)
                if b.rngs:
                    delta = rng_inc.get(dev)
                    if delta is None:
                        delta = rng_inc[dev] = torch.zeros(2, dtype=torch.int64, device=dev)
                        if inc is None:
                            delta[1] = 1
                        else:
                            delta[1].copy_(inc)
                    torch._foreach_add_(b.rngs, [delta] * len(b.rngs))
            if gp.remainder:
                gp.versions = [p._version for p in gp.remainder]
                self._param_versions.update(zip(map(id, gp.remainder), gp.versions))

    def _resync_written(self, gp: _GroupPlan, versions: list[int]) -> None:
        """Re-sync the remainder masters of params written since the last step (see the class doc)."""
        for p, now, seen in zip(gp.remainder, versions, gp.versions):
            if now != seen:
                self._resync_if_written(p, self.state[p], "a param")

    # ---- state_dict ----------------------------------------------------------------------
    def state_dict(self, master_format: str = "native") -> dict[str, Any]:
        """The optimizer state, as torch's ``state_dict()``.

        Args:
            master_format (str): ``"native"`` (default) keeps remainder masters as the int16
                ``master_remainder`` they are stored as (exact only together with the bf16
                params of the model's own state dict, saved at the same time). ``"fp32"``
                exports them as an fp32 ``master_param`` (the exact master: for other tools,
                or to load into an optimizer with ``master_weights=True``); both forms load.
        """
        if master_format not in ("native", "fp32"):
            raise ValueError(
                f"{self._NAME}.state_dict: master_format must be 'native' or 'fp32', got {master_format!r}"
            )
        sd = super().state_dict()
        if master_format == "fp32":
            from fastamp import reference

            params = [p for g in self.param_groups for p in g["params"]]
            for idx, st in list(sd["state"].items()):
                if not (isinstance(idx, int) and isinstance(st, dict) and "master_remainder" in st):
                    continue
                p = params[idx].detach()
                st = dict(st)
                rem = st.pop("master_remainder")
                seen = self._param_versions.get(id(params[idx]))
                if seen is not None and params[idx]._version != seen:
                    master = fp32_copy_of(p)  # what the next step would re-sync to
                else:
                    master = reference.join_master(p, rem)
                st["master_param"] = master
                sd["state"][idx] = st
        return sd

    def _after_load(self) -> None:
        self._param_versions = {}
        self._plan = None
        self._rebuild_cohorts()


def _count(steps: list[Tensor], inc: Tensor | None) -> None:
    if not steps:
        return
    if inc is None:
        torch._foreach_add_(steps, 1.0)
    else:
        torch._foreach_add_(steps, [inc] * len(steps))
