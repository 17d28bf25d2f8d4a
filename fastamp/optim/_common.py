"""Helpers shared by fastamp's fused optimizers (AdamW now, SGD later).

What lives here is independent of the update rule: which dtypes an optimizer accepts,
when a param gets an fp32 master, how the ``grad_scale``/``found_inf`` handed over by a
grad scaler reach each device without a host sync, which params may share one kernel
launch, and a ``load_state_dict`` that keeps fp32 state fp32.
"""

from __future__ import annotations

import math
import numbers
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
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{opt_name}: master_weights must be None, True or False, got {value!r}")


def uses_master(master_weights: bool | None, dtype: torch.dtype) -> bool:
    """Whether a param of ``dtype`` keeps an fp32 master under the group's ``master_weights``.

    ``None`` and ``True`` both mean: masters for fp16/bf16 params. An fp32 param is its own
    master, so ``True`` adds nothing for it (it is not an error, so one group may mix
    dtypes). ``False`` updates every param in place with fp32 maths, rounding once.
    """
    return master_weights is not False and dtype in LOW_PRECISION_DTYPES


def fp32_zeros_like(p: Tensor) -> Tensor:
    return torch.zeros(p.shape, dtype=torch.float32, device=p.device)


def fp32_copy_of(p: Tensor) -> Tensor:
    """A contiguous fp32 copy of ``p`` (exact: fp16/bf16 values are fp32 values)."""
    return torch.empty(p.shape, dtype=torch.float32, device=p.device).copy_(p.detach())


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
) -> dict[Tensor, float]:
    """``Optimizer.load_state_dict`` that keeps fp32 state fp32 and validates first.

    torch's version casts every floating state tensor to its param's dtype, which would
    round a bf16 param's fp32 master and moments to bf16. Here the tensors named in
    ``fp32_state_keys`` become fresh contiguous fp32 copies on the param's device, ``step``
    an fp32 0-dim tensor on the param's device; other state is copied to the param's
    device as is. The whole dict is checked before anything changes. Load pre/post hooks
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
                entry[key] = torch.empty(p.shape, dtype=torch.float32, device=p.device).copy_(value)
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
