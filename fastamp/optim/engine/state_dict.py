"""``state_dict`` and ``load_state_dict`` of fastamp's fused optimizers.

A load keeps fp32 state fp32 (torch's casts it to the param's dtype) and validates the whole
dict before anything changes; an export can give remainder masters as fp32 masters.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections import defaultdict
from collections.abc import Sequence
from copy import deepcopy
from itertools import chain
from typing import Any, Callable

import torch
from torch import Tensor

from fastamp._dtensor import is_dtensor, on_shards
from fastamp.optim.engine import rng as _rng
from fastamp.optim.engine.checks import _fmt_shape
from fastamp.optim.formats.masters import fp32_copy_of, state_copy

_INT_STATE: dict[str, tuple[torch.dtype, Callable[[Tensor], tuple[int, ...]]]] = {
    "master_remainder": (torch.int16, lambda p: tuple(p.shape)),
    "master_ulp8": (torch.int8, lambda p: tuple(p.shape)),
    "rng": (torch.int64, lambda p: (2,)),
}


_CODES, _SCALE = "_q", "_scale"
# The key of a param group's random-bit counter in ``state_dict(format="fp32")`` (per param otherwise)
GROUP_RNG = "rng"
# The key of a param group's step counts at which ``state_dict(format="fp32")`` exported its fp32
# masters (one int per param of the group, None without a master): torch's optimizers keep such group
# keys but never update a master, so a count that moved since says the master is stale.
GROUP_MASTER_STEPS = "master_steps"


def _q8_entry(opt_name: str, where: str, p: Tensor, key: str, value: Any, saved: dict[str, Any]) -> Tensor:
    """A moment saved as q8 (``fastamp.optim.formats.moments``): ``<moment>_q`` uint8 shaped like the param, ``<moment>_scale``
    uint8 of ``moments.scale_shape(param)``, both present; a plain tensor copied to the param's device, or for
    a DTensor param a DTensor of the same shape, copied into the param's sharding."""
    from fastamp.optim.formats import moments

    codes = key.endswith(_CODES)
    base = key[: -len(_CODES)] if codes else key[: -len(_SCALE)]
    other = base + (_SCALE if codes else _CODES)
    if other not in saved:
        raise ValueError(
            f"{opt_name}.load_state_dict: {where}: {key!r} is given but {other!r} is missing (q8 codes and scales "
            "go together)"
        )
    if base in saved:
        raise ValueError(
            f"{opt_name}.load_state_dict: {where}: holds moment {base!r} twice, as {base!r} and as {key!r}"
        )
    shape = tuple(p.shape) if codes else moments.scale_shape(p)
    kind = "torch.uint8 DTensor" if is_dtensor(p) else "plain torch.uint8 tensor"
    if shape is None:
        raise ValueError(
            f"{opt_name}.load_state_dict: {where}: {key!r} is q8 state, but the param's shards do not start on q8's "
            "blocks of 32 elements (fastamp.optim.formats.moments.scale_shape): it keeps fp32 moments; load those "
            "(state_dict(format='fp32') exports them)"
        )
    if (
        not isinstance(value, Tensor)
        or value.dtype != torch.uint8
        or tuple(value.shape) != shape
        or is_dtensor(value) != is_dtensor(p)
    ):
        raise ValueError(
            f"{opt_name}.load_state_dict: {where}: {key!r} must be a {kind} of shape {shape}, got "
            f"{value.dtype if isinstance(value, Tensor) else type(value).__name__} "
            f"{'DTensor ' if is_dtensor(value) else ''}{_fmt_shape(value)}"
        )
    if is_dtensor(p):  # into the param's sharding (torch.distributed.checkpoint may hand over another)
        return moments.Q8.create(p, base)[key].copy_(value)
    return value.to(device=p.device, copy=True).contiguous()


def _q8_key(key: str, fp32_state_keys: Sequence[str]) -> bool:
    return (key.endswith(_CODES) and key[: -len(_CODES)] in fp32_state_keys) or (
        key.endswith(_SCALE) and key[: -len(_SCALE)] in fp32_state_keys
    )


# The options every rule takes from the engine (FusedOptimizer._group_setdefaults): a loaded
# group that lacks one keeps the live group's value.
CARRIED_OPTIONS = (
    "master_weights",
    "stochastic_rounding",
    "seed",
    "state_format",
    "lowbit_min_numel",
    "state_rounding",
)


def load_state_dict(
    opt: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    *,
    opt_name: str,
    required_group_keys: Sequence[str],
    validate_group: Callable[[dict[str, Any], str], None],
    required_state_keys: Callable[[dict[str, Any]], Sequence[str]],
    fp32_state_keys: Sequence[str],
    drop_state_keys: Callable[[Tensor, dict[str, Any]], Sequence[str]],
    state_dtype: Callable[[Tensor, dict[str, Any], str], torch.dtype] | None = None,
    group_defaults: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[Tensor, float]:
    """``Optimizer.load_state_dict`` that keeps fp32 state fp32 and validates first.

    torch's version casts every floating state tensor to its param's dtype, which would
    round a bf16 param's fp32 master and moments to bf16. Here the tensors named in
    ``fp32_state_keys`` become fresh contiguous fp32 copies on the param's device, ``step``
    an fp32 0-dim tensor on the param's device; other state is copied to the param's
    device as is. ``state_dtype(p, group, key)``, when given, names the dtype a key of
    ``fp32_state_keys`` is stored in instead (bf16 moments). ``master_remainder`` must be an
    int16 tensor of the param's shape, ``rng`` an int64 ``[seed, counter]`` pair; a group's ``rng``
    (``state_dict(format="fp32")``: two ints) goes to each of its params that draws random bits
    and has no counter of its own, and leaves the group. A saved group
    without one of the engine's options (:data:`CARRIED_OPTIONS`; a torch state dict has none)
    takes the live group's value, ``maximize`` False, and the rule's own from
    ``group_defaults(live_group)``. The whole dict is checked before anything changes. Load pre/post hooks
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
        sg.setdefault("maximize", False)
        for k in CARRIED_OPTIONS:
            sg.setdefault(k, groups[gi][k])
        for k, v in (group_defaults(groups[gi]) if group_defaults else {}).items():
            sg.setdefault(k, v)
        validate_group(sg, f"loaded param group {gi}")
        if GROUP_RNG in sg:
            sg[GROUP_RNG] = _group_counter(opt_name, sg[GROUP_RNG], f"loaded param group {gi}")
        _master_steps(opt_name, sg, f"loaded param group {gi}")

    id_map = dict(
        zip(chain.from_iterable(s["params"] for s in saved_groups), chain.from_iterable(g["params"] for g in groups))
    )
    group_of = {pid: sg for sg in saved_groups for pid in sg["params"]}
    exported_at = {
        pid: at for sg in saved_groups for pid, at in zip(sg["params"], sg.pop(GROUP_MASTER_STEPS, None) or ())
    }
    stale = 0
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
        # a moment may be saved as q8 codes (<key>_q, with <key>_scale) instead
        missing = [key for key in required_state_keys(group_of[k]) if key not in v and key + _CODES not in v]
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
            elif _q8_key(key, fp32_state_keys):
                entry[key] = _q8_entry(opt_name, where, p, key, value, v)
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
        at = exported_at.get(k)
        if at is not None and "master_param" in entry and steps.get(p) != at:
            del entry["master_param"]  # stepped since the export by an optimizer that keeps no master
            stale += 1
        new_state[p] = entry
    if stale:
        warnings.warn(
            f"{opt_name}.load_state_dict: {stale} fp32 master(s) were exported (state_dict(format='fp32')) at "
            "another step count than the state now holds: the state was stepped elsewhere (e.g. by "
            "torch.optim.AdamW, which keeps but never updates them). They are dropped: the next step re-makes "
            "each from its param (load the params trained there into the model).",
            stacklevel=3,
        )

    for g, sg in zip(groups, saved_groups):
        sg["params"] = g["params"]
        if "param_names" in g and "param_names" not in sg:
            sg["param_names"] = g["param_names"]
    opt.__setstate__({"state": new_state, "param_groups": saved_groups})
    _counters_from_groups(opt)
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)
    return steps


def _master_steps(opt_name: str, sg: dict[str, Any], where: str) -> None:
    """Check a saved group's ``master_steps`` (``state_dict(format="fp32")``): one int or None per param."""
    value = sg.get(GROUP_MASTER_STEPS)
    if value is None:
        return
    ok = isinstance(value, (list, tuple)) and len(value) == len(sg["params"])
    ok = ok and all(x is None or (isinstance(x, numbers.Real) and not isinstance(x, bool)) for x in value)
    if not ok:
        raise ValueError(
            f"{opt_name}.load_state_dict: {where}: {GROUP_MASTER_STEPS!r} must hold one step count (or None) per "
            f"param of the group, got {value!r:.80}"
        )


def _master_steps_to_groups(sd: dict[str, Any]) -> None:
    """Record in each group the step count of each param whose fp32 master the export holds (one host read a group)."""
    for group in sd["param_groups"]:
        sts = [sd["state"].get(i) for i in group["params"]]
        with_master = [i for i, st in enumerate(sts) if isinstance(st, dict) and "master_param" in st and "step" in st]
        if not with_master:
            continue
        counts = torch.stack(
            [torch.as_tensor(sts[i]["step"], dtype=torch.float64).reshape(()).cpu() for i in with_master]
        )
        recorded: list[float | None] = [None] * len(sts)
        for i, c in zip(with_master, counts.tolist()):
            recorded[i] = c
        group[GROUP_MASTER_STEPS] = recorded


def _counters_to_groups(sd: dict[str, Any]) -> None:
    """torch's per-param layout: each group's random-bit counter, ``[seed, counter]``, moved into the group as ints.

    Left per param in a group whose params hold counters of different values (params on several
    devices, one of which missed steps): one group value could not give each its own back.
    """
    for group in sd["param_groups"]:
        idxs = [i for i in group["params"] if isinstance(sd["state"].get(i), dict) and "rng" in sd["state"][i]]
        counters = {id(t): t for t in (sd["state"][i]["rng"] for i in idxs)}
        if not counters or not all(isinstance(t, Tensor) for t in counters.values()):
            continue
        values = {tuple(int(x) for x in t.tolist()) for t in counters.values()}
        if len(values) != 1:
            continue
        group[GROUP_RNG] = list(values.pop())
        for i in idxs:
            sd["state"][i] = {k: v for k, v in sd["state"][i].items() if k != "rng"}


def _group_counter(opt_name: str, value: Any, where: str) -> list[int]:
    """A saved group's ``rng`` (``state_dict(format="fp32")``): two ints ``[seed, counter]``, the counter >= 0."""
    ok = (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in value)
        and -(2**63) <= value[0] < 2**63
        and 0 <= value[1] < 2**63
    )
    if not ok:
        raise ValueError(
            f"{opt_name}.load_state_dict: {where}: 'rng' must be [seed, counter], two ints (int64, the counter >= 0), "
            f"got {value!r:.80}"
        )
    return [int(x) for x in value]


def _counters_from_groups(opt: torch.optim.Optimizer) -> None:
    """Give a loaded group's ``rng`` (``[seed, counter]``) to each of its params that draws random bits and has none."""
    for group in opt.param_groups:
        value = group.pop(GROUP_RNG, None)
        if value is None:
            continue
        for p in group["params"]:
            st = opt.state.get(p)
            if st and "rng" not in st and opt._uses_rng(group, p, st, opt._kind(group, p)):
                st["rng"] = torch.tensor(value, dtype=torch.int64, device=p.device)


def params_with_state(opt: torch.optim.Optimizer) -> list[Tensor]:
    return [p for g in opt.param_groups for p in g["params"] if len(opt.state.get(p, {})) > 0]


class _StateDictExport:
    """``state_dict`` of :class:`~fastamp.optim.engine.base.FusedOptimizer` (remainder masters exported as is or as fp32)."""

    def state_dict(
        self, master_format: str = "native", moment_format: str = "native", format: str | None = None
    ) -> dict[str, Any]:
        """The optimizer state, as torch's ``state_dict()``.

        Args:
            master_format (str): ``"native"`` (default) keeps remainder masters as the int16
                ``master_remainder`` they are stored as (exact only together with the bf16
                params of the model's own state dict, saved at the same time). ``"fp32"``
                exports them as an fp32 ``master_param`` (the exact master: for other tools,
                or to load into an optimizer with ``master_weights=True``); both forms load.
            moment_format (str): ``"native"`` (default) keeps the moments as stored (q8 codes
                ``*_q`` with their ``*_scale``, bf16); ``"fp32"`` decodes them to fp32 tensors shaped
                like the params (exact), torch.optim's layout; both forms load.
            format (str, optional): ``"fp32"`` is both of the above: torch.optim's layout (fp32
                moments) plus exact fp32 masters. Each param's state then holds torch's keys
                (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` for AdamW) and
                ``master_param`` for a param with a master, nothing else: the random-bit counter
                of stochastic rounding and q8 codes (``rng``, one per group and device, see
                :mod:`fastamp.optim.engine.rng`) moves to its param group, as
                ``group["rng"] = [seed, counter]`` (Python ints; reading it is a host sync for a
                device counter). There :class:`torch.optim.AdamW` keeps it untouched (an unknown
                group key), and saves it again, while an unknown per-param tensor would be cast
                to the param's dtype (a float ``[seed, counter]``, rounded in bf16). Loading the
                export back gives the counter to every param that draws random bits, so
                native -> fp32 -> native resumes bit-exactly. A group whose params on several
                devices have different counters keeps them per param (as ``"native"`` does).
                Each group also records the step count of each param whose master it exports
                (``group["master_steps"]``, one number or None per param): torch keeps those masters
                but never updates them, so a state dict that comes back from torch after steps
                there loads without them (a warning says how many): the next step re-makes each
                master from its param, which should then hold the weights trained there.

        Without ``format="fp32"`` (both formats ``"fp32"``), each param's state holds its own copy of
        the group's counter as ``rng`` (int64 ``[seed, counter]``), which loads into any optimizer.
        """
        if format is not None:
            if format not in ("native", "fp32"):
                raise ValueError(f"{self._NAME}.state_dict: format must be 'native' or 'fp32', got {format!r}")
            master_format = moment_format = format
        if master_format not in ("native", "fp32"):
            raise ValueError(
                f"{self._NAME}.state_dict: master_format must be 'native' or 'fp32', got {master_format!r}"
            )
        if moment_format not in ("native", "fp32"):
            raise ValueError(
                f"{self._NAME}.state_dict: moment_format must be 'native' or 'fp32', got {moment_format!r}"
            )
        sd = super().state_dict()
        if master_format == moment_format == "fp32":
            _counters_to_groups(sd)
        for idx, st in list(sd["state"].items()):
            if isinstance(st, dict) and isinstance(st.get("rng"), Tensor):
                # the group's counter, one tensor shared by its params (see fastamp.optim.engine.rng): each
                # param gets its own [seed, counter], as one loads into any optimizer
                sd["state"][idx] = {**st, "rng": st["rng"].clone()}
        if moment_format == "fp32":
            from fastamp.optim.formats import moments as _formats

            for idx, st in list(sd["state"].items()):
                if isinstance(st, dict):
                    keys = tuple(
                        k
                        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")
                        if k + _CODES in st or (isinstance(st.get(k), Tensor) and st[k].dtype == torch.bfloat16)
                    )
                    if keys:
                        sd["state"][idx] = _formats.export_fp32(st, keys)
        if master_format == "fp32":
            from fastamp import reference

            params = [p for g in self.param_groups for p in g["params"]]
            # compiled steps write the params without recording their versions, and the next
            # step does not re-sync after them (see _forget_compiled_steps): the records are void
            versions = {} if self._compiled["ran"] else self._param_versions
            for idx, st in list(sd["state"].items()):
                if not (
                    isinstance(idx, int) and isinstance(st, dict) and ("master_remainder" in st or "master_ulp8" in st)
                ):
                    continue
                p = params[idx].detach()
                st = dict(st)
                rem, corr = st.pop("master_remainder", None), st.pop("master_ulp8", None)
                seen = versions.get(id(params[idx]))
                if seen is not None and params[idx]._version != seen:
                    master = fp32_copy_of(p)  # what the next step would re-sync to
                elif rem is not None:
                    master = on_shards(reference.join_master, p, rem)
                else:
                    master = on_shards(reference.ulp8_decode, p, corr)  # the master the next step would use
                st["master_param"] = master
                sd["state"][idx] = st
        if master_format == moment_format == "fp32":
            _master_steps_to_groups(sd)
        return sd

    def _after_load(self) -> None:
        self._param_versions = {}
        self._plan = None
        self._adopt_steps()
        _rng.share_counters(self)
