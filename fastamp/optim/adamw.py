"""``fastamp.optim.AdamW``: fused AdamW with fp32 master weights, amp skip on device."""

from __future__ import annotations

from typing import Any, Callable, Union

import torch
from torch import Tensor

from fastamp import backends, functional, reference
from fastamp.optim import _common

__all__ = ["AdamW"]

_NAME = "AdamW"
_FP32_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")


def _validate_lr(lr: Any, check_value: bool) -> None:
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not lr.is_floating_point():
            raise TypeError(f"{_NAME}: a Tensor lr must be floating point, got {lr.dtype}")
        # Reading a device lr would sync: its value is checked at construction only.
        if check_value and not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        return
    _common.check_real_number(_NAME, "lr", lr)
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")


def _validate_group(group: dict[str, Any], where: str, check_tensor_lr: bool = False) -> None:
    """torch.optim.Adam's checks and messages, applied to every group (torch checks only the defaults)."""
    _validate_lr(group["lr"], check_tensor_lr)
    eps, betas, wd = group["eps"], group["betas"], group["weight_decay"]
    _common.check_real_number(_NAME, "eps", eps)
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{_NAME}: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        _common.check_real_number(_NAME, f"betas[{i}]", b)
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    _common.check_real_number(_NAME, "weight_decay", wd)
    if not 0.0 <= wd:
        raise ValueError(f"Invalid weight_decay value: {wd}")
    for flag in ("amsgrad", "maximize"):
        if not isinstance(group[flag], bool):
            raise TypeError(f"{_NAME}: {flag} must be a bool, got {group[flag]!r} in {where}")
    _common.check_master_weights_flag(_NAME, group["master_weights"])


def _as_float_betas(betas: Any) -> Any:
    # torch accepts 1-element tensor betas; the kernels take Python floats, so convert once
    # here (construction time) rather than syncing at every step.
    if isinstance(betas, (tuple, list)) and len(betas) == 2:
        return tuple(float(b) if isinstance(b, Tensor) and b.numel() == 1 else b for b in betas)
    return betas


class AdamW(torch.optim.Optimizer):
    r"""Fused AdamW with fp32 master weights for fp16/bf16 params, amp-aware and sync-free.

    The update is :class:`torch.optim.AdamW`'s (decoupled weight decay, bias corrections,
    ``amsgrad``, ``maximize``), done in one fused pass per group of tensors: each pass reads
    the grad (fp32, fp16 or bf16, still scaled when a grad scaler drives the step), the
    fp32 master, the fp32 moments, and writes the master, the moments and the param
    rounded to nearest-even in its own dtype. All maths is fp32.

    Example::

        >>> model = model.to(torch.bfloat16)
        >>> opt = fastamp.optim.AdamW(model.parameters(), lr=1e-4)
        >>> scaler = fastamp.Scaler()            # or torch.amp.GradScaler(); or no scaler for bf16
        >>> for x, y in loader:
        ...     opt.zero_grad()
        ...     loss = loss_fn(model(x), y)
        ...     scaler.scale(loss).backward()
        ...     scaler.step(opt)                 # unscaling and the overflow skip happen on device
        ...     scaler.update()

    Args:
        params (iterable): params or dicts defining param groups (as in torch.optim).
        lr (float or Tensor, optional): learning rate (default: 1e-3). A 1-element tensor
            lr may live on any device; it is copied to each param device without blocking.
        betas (Tuple[float, float], optional): coefficients of the running averages of the
            gradient and its square (default: (0.9, 0.999)).
        eps (float, optional): added to the denominator (default: 1e-8).
        weight_decay (float, optional): decoupled weight decay coefficient (default: 1e-2).
        amsgrad (bool, optional): use the AMSGrad variant (default: False).
        maximize (bool, optional): maximize the objective (default: False).
        master_weights (bool or None, optional): ``None`` (default) or ``True``: fp16 and bf16
            params keep an fp32 master copy in ``state[p]["master_param"]``, and the param is
            always that master rounded to nearest-even in the param's dtype. An fp32 param is
            its own master, so ``True`` adds nothing for it (not an error: one group may mix
            dtypes). ``False``: low-precision params are updated in place (fp32 maths, one
            rounding per step), as torch's fused AdamW does; small updates may then be lost.
        backend (str, optional): ``"native"``, ``"triton"`` or ``"torch"`` forces the
            kernel backend of this optimizer (an unavailable one raises); ``None`` uses
            :mod:`fastamp.backends` (``FASTAMP_BACKEND`` or the fastest available).

    State per param (created at its first step): ``step`` (fp32 0-dim tensor on the param's
    device, as with torch's ``fused=True``), ``exp_avg`` and ``exp_avg_sq`` (always fp32),
    ``max_exp_avg_sq`` (fp32, with ``amsgrad``), ``master_param`` (fp32, when masters are on).

    Amp: ``_step_supports_amp_scaling`` is True, so ``torch.amp.GradScaler`` and
    :class:`fastamp.Scaler` hand ``grad_scale`` and ``found_inf`` over as attributes instead
    of unscaling the grads and reading ``found_inf`` on the host. Grads are multiplied by
    ``1/grad_scale`` in registers and never written back. When ``found_inf`` is non-zero
    the whole step is skipped on the device: params, masters, moments and ``step`` stay
    bit-identical. Unlike torch's fused kernels, which skip only when ``found_inf == 1``,
    any non-zero value skips (NaN, and 2.0, which ``GradScaler`` produces when two devices
    of one optimizer overflow). ``step`` grows by ``(found_inf == 0)`` on the device.

    .. note::
        ``step()`` does not synchronise with the device. Exceptions: a CPU param whose
        ``lr``/``grad_scale``/``found_inf`` lives on a GPU (the copy to the CPU blocks), and
        the first ``step()`` after unpickling or ``copy.deepcopy`` (the step counts are read
        once to know which params can share a launch).

    .. note::
        Params whose ``step`` counts are equal (known on the host: same starting count, same
        ``step()`` calls with a grad) are updated in one launch per (device, param dtype,
        grad dtype, master on/off), with the step scalars computed from the first param's
        count. A param skipped because its grad was None keeps its own count, as in torch.

    .. note::
        The master is the value being optimised. If you change a low-precision param in
        place outside the optimizer after its first step (re-initialisation, loading model
        weights that differ from the optimizer checkpoint), the next step overwrites it with
        the rounded master; call :meth:`reset_master_weights` after such a change.

    ``state_dict()`` holds fp32 tensors; ``load_state_dict`` keeps them fp32 (torch's would
    cast them to the param dtype), validates the whole dict before changing anything, and
    accepts a :class:`torch.optim.AdamW` state dict (for fp16/bf16 params the masters are
    then built from the params at the next step, and torch's low-precision moments are
    widened). A :class:`torch.optim.AdamW` loads the state dict of an fp32-param instance.
    float64 and complex params are rejected (use torch.optim for them).
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params,
        lr: Union[float, Tensor] = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        master_weights: bool | None = None,
        backend: str | None = None,
    ) -> None:
        if backend is not None and backend != "auto" and backend not in backends.BACKENDS:
            raise ValueError(
                f"{_NAME}: unknown backend {backend!r}; expected one of {backends.BACKENDS}, 'auto' or None"
            )
        defaults = {
            "lr": lr,
            "betas": _as_float_betas(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "master_weights": master_weights,
        }
        _validate_group(defaults, "the defaults", check_tensor_lr=True)
        self.backend = None if backend == "auto" else backend
        self._cohorts = _common.StepCohorts()
        super().__init__(params, defaults)
        self._step_supports_amp_scaling = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        gi = len(self.param_groups) - 1
        try:
            group["betas"] = _as_float_betas(group["betas"])
            _validate_group(group, f"param group {gi}", check_tensor_lr=True)
            for i, p in enumerate(group["params"]):
                _common.check_param_dtype(_NAME, p, f"param {i} of param group {gi}")
        except Exception:
            self.param_groups.pop()
            raise

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["backend"] = self.backend
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("backend", None)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("master_weights", None)
        self._rebuild_cohorts()

    def _rebuild_cohorts(self) -> None:
        """Cohort tokens from the stored step counts (one read per device, off the hot path)."""
        self._cohorts = _common.StepCohorts()
        with_state = _common.params_with_state(self)
        by_device: dict[torch.device, list[Tensor]] = {}
        for p in with_state:
            step = self.state[p].get("step")
            if isinstance(step, Tensor):
                by_device.setdefault(step.device, []).append(p)
        pairs = []
        for plist in by_device.values():
            values = torch.stack([self.state[p]["step"].reshape(()).float() for p in plist]).cpu().tolist()
            pairs.extend(zip(plist, values))
        self._cohorts.rebuild(pairs)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of :class:`torch.optim.AdamW`.

        fp32 state (moments, masters) stays fp32 whatever the param dtype; ``step`` becomes
        an fp32 0-dim tensor on the param's device. The whole dict is validated first: a
        state dict of another optimizer, with missing keys or wrongly shaped tensors raises
        ``ValueError`` and leaves this optimizer unchanged. Saved masters of fp32 params,
        or of groups loaded with ``master_weights=False``, are dropped.
        """

        def required_state_keys(group: dict[str, Any]):
            return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())

        def drop_state_keys(p: Tensor, group: dict[str, Any]):
            return () if _common.uses_master(group.get("master_weights"), p.dtype) else ("master_param",)

        _common.load_state_dict(
            self,
            state_dict,
            opt_name=_NAME,
            required_group_keys=("lr", "betas", "eps", "weight_decay"),
            validate_group=_validate_group,
            required_state_keys=required_state_keys,
            fp32_state_keys=_FP32_STATE,
            group_defaults=lambda g: {"amsgrad": False, "maximize": False, "master_weights": g["master_weights"]},
            drop_state_keys=drop_state_keys,
        )

    @torch.no_grad()
    def reset_master_weights(self) -> None:
        """Copy every param into its fp32 master (after changing params outside the optimizer)."""
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if st and "master_param" in st:
                    st["master_param"].copy_(p.detach())

    def _collect(self) -> list[tuple[dict[str, Any], list[tuple[Tensor, Tensor]]]]:
        """Every (group, [(param, grad)]) to update, fully validated; changes nothing."""
        work = []
        devices = set()
        for gi, group in enumerate(self.param_groups):
            _validate_group(group, f"param group {gi}")
            items = []
            for i, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                if p.dtype not in _common.PARAM_DTYPES:
                    _common.check_param_dtype(_NAME, p, f"param {i} of param group {gi}")
                _common.check_grad(_NAME, p, g, f"param {i} of param group {gi}")
                items.append((p, g))
                devices.add(p.device)
            if items:
                work.append((group, items))
        for dev in devices:
            backends.resolve("adamw_", dev, self.backend)
        return work

    def _init_state(self, p: Tensor, st: dict[str, Any], group: dict[str, Any], use_master: bool) -> None:
        if len(st) == 0:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            st["exp_avg"] = _common.fp32_zeros_like(p)
            st["exp_avg_sq"] = _common.fp32_zeros_like(p)
        if group["amsgrad"] and "max_exp_avg_sq" not in st:
            st["max_exp_avg_sq"] = _common.fp32_zeros_like(p)
        if use_master:
            if "master_param" not in st:
                st["master_param"] = _common.fp32_copy_of(p)
        elif "master_param" in st:
            del st["master_param"]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """Perform a single optimization step.

        Args:
            closure (Callable, optional): a closure that reevaluates the model and returns
                the loss (not allowed when a grad scaler drives the step, as in torch).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        work = self._collect()
        if not work:
            return loss
        amp = _common.AmpInputs(_NAME, getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
        cohorts = self._cohorts
        cohorts.begin_step()
        for group, items in work:
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            # (device, cohort) -> (steps, {(param dtype, grad dtype, master): lists})
            buckets: dict[Any, tuple[list[Tensor], dict[Any, dict[str, list[Tensor]]]]] = {}
            for p, g in items:
                st = self.state[p]
                use_master = _common.uses_master(group["master_weights"], p.dtype)
                token = cohorts.get(p) if len(st) else cohorts.fresh
                self._init_state(p, st, group, use_master)
                cohorts.advance(p, token)
                key = (p.device, token)
                bucket = buckets.get(key)
                if bucket is None:
                    bucket = buckets[key] = ([], {})
                bucket[0].append(st["step"])
                sub_key = (p.dtype, g.dtype, use_master)
                lists = bucket[1].get(sub_key)
                if lists is None:
                    lists = bucket[1][sub_key] = {k: [] for k in ("p", "g", "master", "m", "v", "vmax", "copy_back")}
                if not p.is_contiguous():
                    tmp = p.detach().contiguous()
                    lists["copy_back"].append((p, tmp))
                    lists["p"].append(tmp)
                else:
                    lists["p"].append(p)
                lists["g"].append(g if g.is_contiguous() else g.contiguous())
                if use_master:
                    lists["master"].append(st["master_param"])
                lists["m"].append(st["exp_avg"])
                lists["v"].append(st["exp_avg_sq"])
                if group["amsgrad"]:
                    lists["vmax"].append(st["max_exp_avg_sq"])

            lr_per_device: dict[torch.device, Any] = {}
            for (dev, _), (steps, subgroups) in buckets.items():
                grad_mul, found_inf, inc = amp.on(dev)
                if inc is None:
                    torch._foreach_add_(steps, 1.0)
                else:
                    torch._foreach_add_(steps, [inc] * len(steps))
                if dev not in lr_per_device:
                    lr_per_device[dev] = _common._to_device(lr, dev) if isinstance(lr, Tensor) else lr
                # Every step in this bucket holds the same value (see StepCohorts).
                scalars = reference.adamw_step_scalars(
                    lr_per_device[dev], steps[0], beta1, beta2, group["weight_decay"], grad_mul
                )
                for lists in subgroups.values():
                    functional.adamw_(
                        lists["p"],
                        lists["g"],
                        lists["master"],
                        lists["m"],
                        lists["v"],
                        lists["vmax"],
                        scalars,
                        found_inf,
                        beta1=beta1,
                        beta2=beta2,
                        eps=group["eps"],
                        amsgrad=group["amsgrad"],
                        maximize=group["maximize"],
                        backend=self.backend,
                    )
                    for p, tmp in lists["copy_back"]:
                        p.copy_(tmp)
        return loss
