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
import weakref
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


FP32_MAX = 3.4028234663852886e38


def at(message: str, where: str) -> str:
    """``message`` with the place of the bad value; bare for the defaults, as torch words it."""
    return message if where in ("the defaults", "") else f"{message} (in {where})"


def check_hyper(opt_name: str, name: str, value: Any, where: str, invalid: str, *, upper: float | None = None) -> float:
    """Refuse a hyperparameter that is not a real number in ``[0, upper)`` (``[0, inf)`` without one).

    torch's own checks (``not 0.0 <= value``) let inf through, and SGD's let NaN through
    (``value < 0`` is False for NaN); either would silently wreck the params. Values beyond
    fp32's range are refused too: the kernels compute in fp32, where they become inf.
    ``invalid`` is torch's message prefix (``"Invalid epsilon value"``); returns the value
    as a float.
    """
    check_real_number(opt_name, name, value)
    try:
        v = float(value)
    except OverflowError:
        v = math.inf
    if not (0.0 <= v <= FP32_MAX) or (upper is not None and not v < upper):
        raise ValueError(at(f"{invalid}: {value}", where))
    return v


def validate_lr(opt_name: str, lr: Any, check_value: bool, where: str = "the defaults") -> None:
    """torch.optim's lr checks and messages, plus finiteness; a tensor lr's value is checked only when asked (it syncs)."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not lr.is_floating_point():
            raise TypeError(f"{opt_name}: a Tensor lr must be floating point, got {lr.dtype}")
        if check_value:
            v = float(lr)
            if not 0.0 <= v <= FP32_MAX:
                raise ValueError(at(f"Invalid learning rate: {lr}", where))
        return
    check_hyper(opt_name, "lr", lr, where, "Invalid learning rate")


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
    every step) there is one cohort. A count the host knows by value (just created, just
    loaded, or read after a write from outside) gets the token of that value.
    """

    def __init__(self) -> None:
        self._token: dict[int, object] = {}
        self._remap: dict[object, object] = {}
        self._by_value: dict[float, object] = {}

    def begin_step(self) -> None:
        self._remap = {}
        self._by_value = {}

    def get(self, p: Tensor) -> object | None:
        return self._token.get(id(p))

    def of_value(self, value: float) -> object:
        return self._by_value.setdefault(value, object())

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


def where_of(gi: int, i: int, p: Tensor) -> str:
    """How errors name a param: its place in ``param_groups`` and its shape."""
    return f"param {i} of param group {gi} (shape {tuple(p.shape)})"


def _span(t: Tensor) -> tuple[int, int] | None:
    """The bytes ``[start, end)`` that ``t``'s elements lie within, or None when it has none."""
    n = t.numel()
    if n == 0:
        return None
    start = t.data_ptr()
    if start == 0:  # no storage (meta)
        return None
    if t.is_contiguous():
        return start, start + n * t.element_size()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def _elements_overlap(a: Tensor, span_a: tuple[int, int], b: Tensor, span_b: tuple[int, int]) -> bool:
    """Whether two tensors whose spans intersect share a byte (exact for strided views)."""
    if a.is_contiguous() and b.is_contiguous():
        return True
    lo, hi = min(span_a[0], span_b[0]), max(span_a[1], span_b[1])
    if hi - lo > 1 << 28:
        return True  # too large to mark; the spans intersect, so refuse rather than guess
    # Only sizes and strides matter: mark a's bytes in a host buffer covering both spans.
    mark = torch.zeros(hi - lo, dtype=torch.uint8)

    def cover(t: Tensor, start: int) -> Tensor:
        isz = t.element_size()
        return torch.as_strided(mark, (*t.shape, isz), (*(s * isz for s in t.stride()), 1), start - lo)

    try:
        cover(a, span_a[0]).fill_(1)
    except RuntimeError:  # a overlaps itself (a zero stride): no element-wise update can be right
        return True
    return bool(cover(b, span_b[0]).any())


def check_no_shared_memory(opt_name: str, param_groups: Sequence[dict[str, Any]]) -> None:
    """Refuse params of one optimizer whose memory overlaps (two Parameters over one storage).

    torch updates such params one after the other, so both updates land (how they combine
    depends on torch's code path). A fused launch cannot: threads update both at once from
    stale reads, a strided param is updated through a contiguous copy written back over
    the other's update, and each param keeps its own master and moments, which can never
    agree with one shared storage. Params that are disjoint views of one buffer (a flat
    parameter buffer, interleaved columns) are fine. The same param object twice is torch's
    duplicate check. Costs a few attribute reads per param and a sort of their addresses.
    """
    places = [(gi, i) for gi, group in enumerate(param_groups) for i in range(len(group["params"]))]
    params = [p for group in param_groups for p in group["params"]]
    ts = [local_of(p) for p in params] if any(map(is_dtensor, params)) else params
    starts = list(map(Tensor.data_ptr, ts))
    sizes = list(map(_NBYTES, ts))
    dense = list(map(Tensor.is_contiguous, ts))
    devices = list(map(Tensor.get_device, ts))
    spans = []
    for k, (start, size) in enumerate(zip(starts, sizes)):
        if size == 0 or start == 0:  # no elements, or no storage (meta)
            continue
        end = start + size if dense[k] else _span(ts[k])[1]
        spans.append((devices[k], start, end, k))
    spans.sort()
    device, reach = None, 0
    for dev, start, end, _ in spans:
        if dev == device and start < reach:
            break
        if dev != device:
            device, reach = dev, end
        else:
            reach = max(reach, end)
    else:
        return  # no two address ranges intersect
    active: list[tuple[int, int, int, int]] = []
    for dev, start, end, k in spans:
        active = [a for a in active if a[0] == dev and a[2] > start]
        for _, a_start, a_end, ak in active:
            if _elements_overlap(ts[ak], (a_start, a_end), ts[k], (start, end)):
                first, second = sorted((ak, k), key=places.__getitem__)
                (gi, i), (gj, j) = places[first], places[second]
                raise ValueError(
                    f"{opt_name}: {where_of(gi, i, params[first])} and {where_of(gj, j, params[second])} share "
                    "memory (two Parameters over one storage, such as a weight and its transposed view, or "
                    "overlapping views). A fused step would lose one of their updates, and each would keep its "
                    "own master and moments. Tie them as one Parameter (e.g. `head.weight = emb.weight`, which "
                    "torch.optim also updates once), or give each its own storage (`.clone()`)."
                )
        active.append((dev, start, end, k))


_NBYTES = operator.attrgetter("nbytes")
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

    def share_steps(self, states: list[dict[str, Any]], remember: Callable[[Tensor], list[Any]]) -> None:
        """Make the ``step`` tensors of ``states`` (equal values) views of one buffer."""
        if not states:
            return
        buf = torch.stack([st["step"].reshape(()) for st in states])
        self.step_buf, self.states = buf, states
        self.steps = list(buf.unbind(0))
        for st, view in zip(states, self.steps):
            st["step"] = view
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


class FusedOptimizer(torch.optim.Optimizer):
    """The step loop, master-weight bookkeeping and state_dict shared by fastamp's optimizers.

    A subclass defines its update through a few hooks: ``_validate_group``, ``_kernel_op``,
    ``_init_state`` (its own state: moments, buffers, ``step``), ``_moment_keys``,
    ``_extra_key``, ``_uses_rng``, ``_hyper``, ``_scalars`` and ``_launch``;
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
    torch: a ``step`` replaced (``state[p]["step"] = torch.tensor(0.)``) or written in place
    (``.zero_()``, ``.fill_()``, ``+=``; these move the version counter the views share)
    is seen at the next step, which then reads the counts it can no longer vouch for (one
    host read) and regroups the launches. Writes through ``.data`` (of a step, a state
    tensor or a grad) bypass version counters and identity and are not seen; a same-address
    rebind of a param (``p.data = p.data.t()``) is not either.
    """

    _NAME = "FusedOptimizer"
    _COUNT_BEFORE = True
    _STEP_REQUIRED = False  # a non-empty state must hold a ``step`` (AdamW: bias corrections)
    _step_supports_amp_scaling = True

    # ---- hooks -------------------------------------------------------------------------
    def _validate_group(self, group: dict[str, Any], where: str, check_tensor_lr: bool = False) -> None:
        raise NotImplementedError

    def _kernel_op(self, group: dict[str, Any], p: Tensor, kind: str) -> str:
        raise NotImplementedError

    def _init_state(self, p: Tensor, st: dict[str, Any], group: dict[str, Any], kind: str) -> float | None:
        """Create missing state; returns the value of a ``step`` it created (None if it created none)."""
        raise NotImplementedError

    def _moment_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The state keys of the update's own buffers (shaped like the param, floating point)."""
        return ()

    def _extra_key(self, group: dict[str, Any], p: Tensor, st: dict[str, Any], kind: str) -> tuple:
        return ()

    def _uses_rng(self, group: dict[str, Any], p: Tensor, st: dict[str, Any], kind: str) -> bool:
        return kind == "sr"

    def _hyper(self, group: dict[str, Any]) -> dict[str, Any]:
        """The group as the kernels read it this step (e.g. tensor betas read as floats)."""
        return group

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
        self._known_steps: dict[int, list[Any]] = {}
        self._step_of: dict[int, Tensor] = {}  # id(param) -> the step tensor it was given
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
        self._plan = None

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
        for group in self.param_groups:
            for k, v in self._group_setdefaults().items():
                group.setdefault(k, v)
        self._track_state()
        self._rebuild_cohorts()

    def _group_setdefaults(self) -> dict[str, Any]:
        return {"maximize": False, "master_weights": None, "stochastic_rounding": False, "seed": 0}

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

    # ---- validation ----------------------------------------------------------------------
    def _check_state_tensor(
        self,
        gi: int,
        i: int,
        p: Tensor,
        key: str,
        t: Any,
        dtype: torch.dtype | None,
        shape: tuple | None = None,
        contiguous: bool = False,
    ) -> None:
        """Refuse a state tensor the kernels cannot use for ``p``, naming the param and the key."""
        if (
            type(t) is Tensor
            and type(p) is Tensor
            and (t.is_floating_point() if dtype is None else t.dtype == dtype)
            and t.shape == (p.shape if shape is None else shape)
            and t.device == p.device
            and (not contiguous or t.is_contiguous())
        ):
            return
        if not isinstance(t, Tensor):
            raise ValueError(
                f"{self._NAME}: {where_of(gi, i, p)}: its state {key!r} must be a tensor, got {type(t).__name__}"
            )
        if dtype is None:
            if not t.is_floating_point():
                raise ValueError(
                    f"{self._NAME}: {where_of(gi, i, p)}: its state {key!r} must be a real floating point "
                    f"tensor, got {t.dtype}"
                )
        elif t.dtype != dtype:
            raise ValueError(f"{self._NAME}: {where_of(gi, i, p)}: its state {key!r} must be {dtype}, got {t.dtype}")
        want = tuple(p.shape) if shape is None else shape
        if tuple(t.shape) != want:
            raise ValueError(
                f"{self._NAME}: {where_of(gi, i, p)}: its state {key!r} has shape {tuple(t.shape)}, expected "
                f"{want}. Was the param resized or replaced (`.data = ...`) after its state was created? Reset "
                "its state (`del opt.state[p]`) or restore the param."
            )
        if t.device != p.device:
            raise ValueError(
                f"{self._NAME}: {where_of(gi, i, p)}: its state {key!r} is on {t.device} but the param is on "
                f"{p.device}; move the model before building the optimizer, or load the state again"
            )
        if shape is None and is_dtensor(t) != is_dtensor(p):  # a fixed-shape state (rng) is never sharded
            raise ValueError(
                f"{self._NAME}: {where_of(gi, i, p)}: its state {key!r} is "
                f"{'a DTensor' if is_dtensor(t) else 'a plain tensor'} but the param is "
                f"{'a DTensor' if is_dtensor(p) else 'a plain tensor'}"
            )
        if contiguous and not local_of(t).is_contiguous():
            raise ValueError(f"{self._NAME}: {where_of(gi, i, p)}: its state {key!r} must be contiguous")

    def _check_state(
        self,
        gi: int,
        i: int,
        p: Tensor,
        st: dict[str, Any],
        group: dict[str, Any],
        kind: str,
        moment_keys: tuple[str, ...],
    ) -> bool:
        """Validate the state the next launch of ``p`` reads (changes nothing).

        Returns whether its ``step`` is a count the optimizer cannot vouch for (written from
        outside, or not its own tensor), whose value must be read.
        """
        step = st.get("step")
        if step is None:
            if self._STEP_REQUIRED:
                raise ValueError(
                    f"{self._NAME}: {where_of(gi, i, p)}: its state has no 'step' (keys {sorted(st)}); reset the "
                    "whole state (`opt.state[p].clear()`) or set its step count"
                )
            untrusted = False
        else:
            untrusted = not self._step_trusted(p, step)
            if untrusted and not (
                (isinstance(step, numbers.Real) and not isinstance(step, bool))
                or (
                    isinstance(step, Tensor)
                    and step.numel() == 1
                    and not step.is_complex()
                    and step.dtype != torch.bool
                    and not is_dtensor(step)
                )
            ):
                raise ValueError(
                    f"{self._NAME}: {where_of(gi, i, p)}: its state 'step' must be a number or a 1-element real "
                    f"tensor, got {_fmt_shape(step) if isinstance(step, Tensor) else type(step).__name__}"
                    + (f" {step.dtype}" if isinstance(step, Tensor) else "")
                )
        shape, device = p.shape, p.device
        for key in moment_keys:
            t = st.get(key)
            # the common case inline: a rebuild at tens of thousands of params checks every state
            if t is not None and not (
                type(t) is Tensor and t.shape == shape and t.device == device and t.is_floating_point()
            ):
                self._check_state_tensor(gi, i, p, key, t, None)
        if kind == "fp32" or kind == "remainder":
            t = st.get("master_param")
            if t is not None and not (
                type(t) is Tensor
                and t.dtype == torch.float32
                and t.shape == shape
                and t.device == device
                and t.is_contiguous()
            ):
                self._check_state_tensor(gi, i, p, "master_param", t, torch.float32, contiguous=True)
            t = st.get("master_remainder")
            if t is not None:
                self._check_state_tensor(gi, i, p, "master_remainder", t, torch.int16, contiguous=True)
        if "rng" in st and self._uses_rng(group, p, st, kind):
            self._check_state_tensor(gi, i, p, "rng", st["rng"], torch.int64, (2,), contiguous=True)
        return untrusted

    def _read_steps(self, untrusted: list[tuple[int, int, Tensor, Any]]) -> dict[int, float]:
        """The values of step counts written from outside (one host read per device), validated."""
        values: dict[int, float] = {}
        by_device: dict[torch.device, list[tuple[int, int, Tensor, Tensor]]] = {}
        for gi, i, p, step in untrusted:
            if isinstance(step, Tensor):
                by_device.setdefault(step.device, []).append((gi, i, p, step))
            else:
                try:
                    value = float(step)
                except OverflowError:
                    value = math.inf
                values[id(p)] = self._step_value(gi, i, p, value)
        for entries in by_device.values():
            read = torch.stack([s.detach().reshape(()).to(torch.float64) for *_, s in entries]).cpu().tolist()
            for (gi, i, p, _), v in zip(entries, read):
                values[id(p)] = self._step_value(gi, i, p, v)
        return values

    def _step_value(self, gi: int, i: int, p: Tensor, value: float) -> float:
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(
                f"{self._NAME}: {where_of(gi, i, p)}: its state 'step' must be finite and >= 0, got {value}"
            )
        return value

    # ---- the step ------------------------------------------------------------------------
    def _plan_key(self, group: dict[str, Any]) -> tuple:
        """The group settings that decide how its params are laid out in launches.

        A change of any of them rebuilds the launch plan at the next step; the other
        hyperparameters are read at every step.
        """
        return (group["master_weights"], group["stochastic_rounding"], group["seed"])

    def _launch_keys(self, group: dict[str, Any], kind: str, use_rng: bool) -> tuple[str, ...]:
        keys = self._moment_keys(group)
        if kind == "fp32":
            keys += ("master_param",)
        elif kind == "remainder":
            keys += ("master_remainder",)
        if use_rng:
            keys += ("rng",)
        return keys

    def _collect(self) -> tuple[list[tuple[dict[str, Any], list[tuple[int, Tensor, Tensor]]]], dict[int, float]]:
        """Every (group, [(index, param, grad)]) to update and the step counts to read, fully validated.

        Checks everything the launches will use, in every group, and changes nothing: a
        failing step leaves params, grads and state as they were. Returns the work and the
        values of step counts written from outside since the optimizer last vouched for them.
        """
        from fastamp import backends

        work = []
        needed: set[tuple[str, torch.device]] = set()
        untrusted: list[tuple[int, int, Tensor, Any]] = []
        state = self.state
        for gi, group in enumerate(self.param_groups):
            items = []
            moment_keys = self._moment_keys(group)
            for i, p in enumerate(group["params"]):
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
                if is_dtensor(p) and kind == "remainder":
                    raise NotImplementedError(
                        f"{self._NAME}: {where_of(gi, i, p)} is a DTensor (FSDP2) with "
                        "master_weights='remainder', which is not supported yet; use master_weights=True "
                        "(fp32 masters, sharded like the param) or stochastic_rounding=True"
                    )
                st = state.get(p)
                if st and self._check_state(gi, i, p, st, group, kind, moment_keys):
                    untrusted.append((gi, i, p, st["step"]))
                items.append((i, p, g))
                needed.add((self._kernel_op(group, p, kind), p.device))
            work.append((group, items))
        check_no_shared_memory(self._NAME, self.param_groups)
        for op, dev in sorted(needed, key=str):
            backends.resolve(op, dev, self.backend)
        return work, self._read_steps(untrusted)

    def _build_plan(
        self, work: list[tuple[dict[str, Any], list[tuple[int, Tensor, Tensor]]]], step_values: dict[int, float]
    ) -> _Plan:
        """Create missing state and masters and group the params with a grad into launches.

        Called when there is no plan or it no longer fits (see ``_gather``), after
        ``_collect`` validated everything. Advances the step cohorts of the params it plans:
        the plan is executed right after. ``step_values``: counts read from the host (written
        from outside), which replace those params' step tensors and decide their cohorts.
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
            step_params: dict[Any, list[int]] = {}
            for pos, p, g in items:
                st = self.state.get(p)
                if st is None:
                    st = {}
                token = None
                if st:
                    value = step_values.get(id(p))
                    if value is not None:
                        st["step"] = torch.full((), value, dtype=torch.float32, device=p.device)
                        token = cohorts.of_value(value)
                    else:
                        token = cohorts.get(p)
                kind = self._kind(group, p)
                created = self._init_state(p, st, group, kind)
                if created is not None:
                    token = cohorts.of_value(created)
                self._init_master(p, st, kind)
                if kind == "remainder":
                    self._resync_if_written(p, st, "a param")
                    gp.remainder.append(p)
                use_rng = self._uses_rng(group, p, st, kind)
                if use_rng and "rng" not in st:
                    rng = torch.zeros(2, dtype=torch.int64, device=p.device)
                    rng[0] = int(group["seed"])
                    st["rng"] = rng
                if st and self.state.get(p) is not st:
                    self.state[p] = st
                cohorts.advance(p, token)
                bucket = buckets.get((p.device, token))
                if bucket is None:
                    bucket = buckets[(p.device, token)] = _Bucket(p.device)
                    step_states[(p.device, token)] = []
                    step_params[(p.device, token)] = []
                if "step" in st:
                    step_states[(p.device, token)].append(st)
                    step_params[(p.device, token)].append(id(p))
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
                    run = bucket.runs[key] = _Run(op, kind, self._launch_keys(group, kind, use_rng))
                run.add(p, pos, st, sr_id)
                plan.needed.add((op, p.device))
            for key, bucket in buckets.items():
                # Every step in a bucket holds the same value (see StepCohorts).
                bucket.share_steps(step_states[key], self._remember_steps)
                self._step_of.update(zip(step_params[key], bucket.steps))
                for run in bucket.runs.values():
                    run.seal(len(gp.params))
            gp.buckets = list(buckets.values())
            plan.groups.append(gp)
        plan.state = self.state
        plan.n_state = len(self.state)
        return plan

    def _gather(self, plan: _Plan | None) -> list[list[Tensor | None]] | None:
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
        for group, gp in zip(self.param_groups, plan.groups):
            params = group["params"]
            if group is not gp.group or len(params) != len(gp.params) or not all(map(operator.is_, params, gp.params)):
                return None
            if self._plan_key(group) != gp.key:
                return None
            grads = [p.grad for p in params]
            try:
                if gp.grad_signature(grads) != gp.grad_sig:
                    return None
            except RuntimeError:  # sparse grads have no is_contiguous: the full checks name them
                return None
            if [p.dtype for p in params] != gp.param_dtypes:
                return None
            if gp.data_ptrs(params) != gp.ptrs:
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
        from fastamp import backends

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        if type(self.state) is not StateTable:
            self._track_state()
        for gi, group in enumerate(self.param_groups):
            self._validate_group(group, f"param group {gi}")
        amp = AmpInputs(self._NAME, getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
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
            group = self._hyper(gp.group)
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
                    b.known[1] = b.step_buf._version
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
