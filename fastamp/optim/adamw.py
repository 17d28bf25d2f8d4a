"""``fastamp.optim.AdamW``: fused AdamW with fp32 / int16-remainder masters or stochastic rounding, amp skip on device."""

from __future__ import annotations

from typing import Any, Union

import torch
from torch import Tensor

from fastamp import functional, reference
from fastamp.optim import _common

__all__ = ["AdamW"]

_NAME = "AdamW"
_FP32_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")


def _validate_group(group: dict[str, Any], where: str, check_tensor_lr: bool = False) -> None:
    """torch.optim.Adam's checks and messages, applied to every group (torch checks only the defaults)."""
    _common.validate_lr(_NAME, group["lr"], check_tensor_lr)
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
    _common.check_lowbit_options(_NAME, group, where)
    sdt = group["state_dtype"]
    if sdt not in (torch.float32, torch.bfloat16):
        raise TypeError(f"{_NAME}: state_dtype must be torch.float32 or torch.bfloat16, got {sdt!r} in {where}")
    if sdt == torch.bfloat16 and not (
        group["master_weights"] is False
        or group["master_weights"] == "remainder"
        or (group["master_weights"] is None and group["stochastic_rounding"])
    ):
        raise ValueError(
            f"{_NAME}: state_dtype=torch.bfloat16 applies to bf16 params with master_weights='remainder' or without "
            f"a master (master_weights=False, or None with stochastic_rounding=True); got master_weights="
            f"{group['master_weights']!r}, stochastic_rounding={group['stochastic_rounding']} in {where}"
        )


def _as_float_betas(betas: Any) -> Any:
    # torch accepts 1-element tensor betas; the kernels take Python floats, so convert once
    # here (construction time) rather than syncing at every step.
    if isinstance(betas, (tuple, list)) and len(betas) == 2:
        return tuple(float(b) if isinstance(b, Tensor) and b.numel() == 1 else b for b in betas)
    return betas


class AdamW(_common.FusedOptimizer):
    r"""Fused AdamW with exact master weights for fp16/bf16 params, amp-aware and sync-free.

    The update is :class:`torch.optim.AdamW`'s (decoupled weight decay, bias corrections,
    ``amsgrad``, ``maximize``), done in one fused pass per group of tensors: each pass reads
    the grad (fp32, fp16 or bf16, still scaled when a grad scaler drives the step), the
    master, the moments, and writes the master, the moments and the param in its own dtype.
    All maths is fp32.

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

    Memory (bytes per param, besides the param and its grad): fp32 master + fp32 moments 12;
    ``master_weights="remainder"`` 10; remainder + ``state_dtype=torch.bfloat16`` 6;
    ``stochastic_rounding=True`` (no master) 8, with bf16 moments 4.

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
        master_weights (bool, None or "remainder", optional): ``None`` (default) or ``True``:
            fp16 and bf16 params keep an fp32 master copy in ``state[p]["master_param"]``, and
            the param is always that master rounded to nearest-even in the param's dtype
            (``None`` leaves bf16 params without a master when ``stochastic_rounding`` is on).
            ``"remainder"``: bf16 params keep only the low 16 bits of their fp32 master, as
            an int16 ``state[p]["master_remainder"]`` (2 bytes instead of 4); the master
            ``join_master(param, remainder)`` is exact, and its trajectory is bit-identical
            to ``True``'s. The param equals ``True``'s param except at an exact tie (the
            master's low 16 bits are ``0x8000``, about 1 element in 65,536), where it is the
            bf16 neighbour away from zero instead of the even one (see
            :func:`fastamp.reference.split_master`: no int16 remainder can be exact under
            ties-to-even). fp16 params get fp32 masters under ``"remainder"``. An fp32 param
            is its own master under every setting. ``False``: low-precision params are
            updated in place (fp32 maths, one rounding per step), as torch's fused AdamW
            does; small updates may then be lost.
        stochastic_rounding (bool, optional): bf16 values stored without an exact master are
            rounded stochastically (unbiased: up with probability equal to the discarded
            fraction) instead of to nearest-even: bf16 params without a master, and bf16
            moments (``state_dtype``). Default False. Not allowed with
            ``master_weights=True`` (nothing to round); fp16 params always round to nearest.
        seed (int, optional): seed of the counter-based random bits (default 0). The bits of
            an element depend only on (seed, the param's count of applied steps, the param's
            index among this optimizer's bf16 params, the element's index), so runs are
            reproducible and data-parallel ranks with the same seed round identically. The
            counter lives on the device in ``state[p]["rng"] = [seed, counter]`` (int64) and
            advances only on applied steps.
        state_dtype (torch.dtype, optional): ``torch.float32`` (default) or
            ``torch.bfloat16``: moments of bf16 params with remainder masters or without a
            master are stored in bf16 (rounded stochastically with ``stochastic_rounding``,
            else to nearest-even); other params keep fp32 moments. Trade-off: bf16 keeps 8
            mantissa bits, so ``exp_avg_sq`` with ``beta2=0.999`` cannot take increments below
            ~2^-9 of itself with round-to-nearest (it stalls; stochastic rounding keeps it
            unbiased but noisy): expect slightly worse loss than fp32 moments, most visible
            late in training and with small gradients. It buys 4 bytes per param.
        backend (str, optional): ``"native"``, ``"triton"`` or ``"torch"`` forces the
            kernel backend of this optimizer (an unavailable one raises); ``None`` uses
            :mod:`fastamp.backends` (``FASTAMP_BACKEND`` or the fastest available).

    State per param (created at its first step): ``step`` (fp32 0-dim tensor on the param's
    device, as with torch's ``fused=True``), ``exp_avg`` and ``exp_avg_sq`` (fp32, or bf16 per
    ``state_dtype``), ``max_exp_avg_sq`` (with ``amsgrad``), ``master_param`` (fp32) or
    ``master_remainder`` (int16), ``rng`` (int64 ``[seed, counter]``, with stochastic rounding).
    For a DTensor param (FSDP2 ``fully_shard``) the moments and the master are DTensors
    sharded like the param and the kernels update each rank's local shard;
    ``master_weights="remainder"`` is not supported for DTensor params yet.

    Amp: ``_step_supports_amp_scaling`` is True, so ``torch.amp.GradScaler`` and
    :class:`fastamp.Scaler` hand ``grad_scale`` and ``found_inf`` over as attributes instead
    of unscaling the grads and reading ``found_inf`` on the host. Grads are multiplied by
    ``1/grad_scale`` in registers and never written back. When ``found_inf`` is non-zero
    the whole step is skipped on the device: params, masters, moments, ``step`` and ``rng``
    stay bit-identical. Unlike torch's fused kernels, which skip only when ``found_inf == 1``,
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
        grad dtype, master kind, moment dtype), with the step scalars computed from the
        first param's count. A param skipped because its grad was None keeps its own count,
        as in torch.

    .. note::
        The master is the value being optimised. If you change a low-precision param in
        place outside the optimizer after its first step (re-initialisation, loading model
        weights that differ from the optimizer checkpoint), an fp32 master overwrites it at
        the next step: call :meth:`reset_master_weights` after such a change. A remainder
        master detects writes that bump the param's version counter (``param.copy_``,
        ``model.load_state_dict``) and re-syncs to the param with a warning; writes through
        ``param.data`` are invisible: call :meth:`reset_master_weights` after them. Load the
        model's and the optimizer's state from the same checkpoint before the next step.

    ``state_dict()`` holds the state as stored; ``state_dict(master_format="fp32")`` exports
    remainder masters as exact fp32 ``master_param``. ``load_state_dict`` accepts both forms
    for either master mode, keeps fp32 state fp32 (torch's would cast it to the param dtype),
    validates the whole dict before changing anything, and accepts a
    :class:`torch.optim.AdamW` state dict (for fp16/bf16 params the masters are then built
    from the params at the next step, and torch's low-precision moments are widened). A
    :class:`torch.optim.AdamW` loads the state dict of an fp32-param instance. float64 and
    complex params are rejected (use torch.optim for them).
    """

    _NAME = _NAME
    _COUNT_BEFORE = True
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
        master_weights: Union[bool, str, None] = None,
        stochastic_rounding: bool = False,
        seed: int = 0,
        state_dtype: torch.dtype = torch.float32,
        backend: str | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": _as_float_betas(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "master_weights": master_weights,
            "stochastic_rounding": stochastic_rounding,
            "seed": seed,
            "state_dtype": state_dtype,
        }
        self._setup(backend)
        _validate_group(defaults, "the defaults", check_tensor_lr=True)
        super().__init__(params, defaults)
        self._step_supports_amp_scaling = True

    # ---- hooks -------------------------------------------------------------------------
    def _validate_group(self, group: dict[str, Any], where: str, check_tensor_lr: bool = False) -> None:
        _validate_group(group, where, check_tensor_lr)

    def _prepare_group(self, group: dict[str, Any]) -> None:
        group["betas"] = _as_float_betas(group["betas"])

    def _group_setdefaults(self) -> dict[str, Any]:
        return {**super()._group_setdefaults(), "amsgrad": False, "state_dtype": torch.float32}

    @staticmethod
    def _moment_dtype(group: dict[str, Any], p: Tensor, kind: str) -> torch.dtype:
        if group["state_dtype"] == torch.bfloat16 and p.dtype == torch.bfloat16 and kind != "fp32":
            return torch.bfloat16
        return torch.float32

    def _kernel_op(self, group: dict[str, Any], p: Tensor, kind: str) -> str:
        if kind in ("remainder", "sr") or self._moment_dtype(group, p, kind) == torch.bfloat16:
            return "adamw_bf16_"
        return "adamw_"

    def _uses_rng(self, group: dict[str, Any], p: Tensor, st: dict[str, Any], kind: str) -> bool:
        return group["stochastic_rounding"] and (kind == "sr" or self._moment_dtype(group, p, kind) == torch.bfloat16)

    def _plan_key(self, group: dict[str, Any]) -> tuple:
        return super()._plan_key(group) + (group["amsgrad"], group["state_dtype"])

    def _extra_key(self, group: dict[str, Any], p: Tensor, st: dict[str, Any], kind: str) -> tuple:
        return (st["exp_avg"].dtype,)

    def _init_state(self, p: Tensor, st: dict[str, Any], group: dict[str, Any], kind: str) -> None:
        mdt = self._moment_dtype(group, p, kind)
        if len(st) == 0:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
        for key in keys:
            t = st.get(key)
            if t is None:
                st[key] = _common.state_zeros(p, mdt)
            elif t.dtype != mdt:
                # the group's state_dtype or master kind changed (or a state dict of the other
                # kind was loaded): convert once, rounding to nearest-even when narrowing
                st[key] = t.to(mdt).contiguous()

    def _scalars(self, group: dict[str, Any], lr: Any, steps: list[Tensor], grad_mul, dev) -> Tensor:
        beta1, beta2 = group["betas"]
        return reference.adamw_step_scalars(lr, steps[0], beta1, beta2, group["weight_decay"], grad_mul)

    def _launch(self, group: dict[str, Any], run: _common._Run, scalars: Tensor, found_inf: Tensor | None) -> None:
        beta1, beta2 = group["betas"]
        m = run.state_list("exp_avg")
        v = run.state_list("exp_avg_sq")
        vmax = run.state_list("max_exp_avg_sq") if group["amsgrad"] else []
        kw = dict(
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            amsgrad=group["amsgrad"],
            maximize=group["maximize"],
            backend=self.backend,
        )
        if run.op == "adamw_bf16_":
            rem = run.masters if run.kind == "remainder" else []
            functional.adamw_bf16_(
                run.params, run.grads, rem, m, v, vmax, scalars, found_inf, run.rng, run.rng_base, **kw
            )
        else:
            functional.adamw_(run.params, run.grads, run.masters, m, v, vmax, scalars, found_inf, **kw)

    # ---- state_dict ----------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class (either ``master_format``) or of :class:`torch.optim.AdamW`.

        Moments and masters are loaded in the dtype this optimizer keeps them in (fp32, or
        bf16 moments per ``state_dtype``) whatever the param dtype; ``step`` becomes an fp32
        0-dim tensor on the param's device. The whole dict is validated first: a state dict
        of another optimizer, with missing keys or wrongly shaped tensors raises
        ``ValueError`` and leaves this optimizer unchanged. Saved masters of params that
        keep none under the loading group's settings are dropped; a saved fp32 master of a
        remainder-mode param is split at the next step (the param becomes its top half),
        a saved remainder of an fp32-master param is joined with the param.
        """

        def required_state_keys(group: dict[str, Any]):
            return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())

        def drop_state_keys(p: Tensor, group: dict[str, Any]):
            kind = _common.master_kind(group.get("master_weights"), p.dtype, group.get("stochastic_rounding", False))
            return () if kind in ("fp32", "remainder") else ("master_param", "master_remainder")

        def state_dtype(p: Tensor, group: dict[str, Any], key: str) -> torch.dtype:
            if key == "master_param":
                return torch.float32
            g = {**group, "state_dtype": group.get("state_dtype", torch.float32)}
            kind = _common.master_kind(g.get("master_weights"), p.dtype, g.get("stochastic_rounding", False))
            return self._moment_dtype(g, p, kind)

        _common.load_state_dict(
            self,
            state_dict,
            opt_name=_NAME,
            required_group_keys=("lr", "betas", "eps", "weight_decay"),
            validate_group=_validate_group,
            required_state_keys=required_state_keys,
            fp32_state_keys=_FP32_STATE,
            group_defaults=lambda g: {
                "amsgrad": False,
                "maximize": False,
                "master_weights": g["master_weights"],
                "stochastic_rounding": g["stochastic_rounding"],
                "seed": g["seed"],
                "state_dtype": g["state_dtype"],
            },
            drop_state_keys=drop_state_keys,
            state_dtype=state_dtype,
        )
        self._after_load()
