"""``fastamp.optim.SGD``: fused SGD (momentum, Nesterov) with fp32 / int16-remainder masters or stochastic rounding."""

from __future__ import annotations

import functools
from typing import Any, Union

import torch
from torch import Tensor

from fastamp.optim.engine import checks as _checks
from fastamp.optim.engine import state_dict as _state_dict
from fastamp.optim.engine import traced as _traced
from fastamp.optim.engine.base import FusedOptimizer
from fastamp.optim.engine.context import grad_mul
from fastamp.optim.formats import masters as _masters
from fastamp.optim.formats import moments as _formats
from fastamp.reference import optim as _R

__all__ = ["SGD"]

_NAME = "SGD"


def _validate_group(
    group: dict[str, Any], where: str, check_tensor_lr: bool = False, lr_checks: _checks.TensorLRChecks | None = None
) -> None:
    """torch.optim.SGD's checks and messages, applied to every group (torch checks only the defaults).

    Stricter than torch where torch lets a value through that would silently wreck the
    run: NaN ``momentum``/``weight_decay`` (torch tests ``value < 0``, which NaN passes),
    inf anywhere (and values beyond fp32's range), and a NaN, inf or negative
    ``dampening`` (torch does not check it). Every value accepted here keeps the step
    finite in its scalars: ``sgd_step_scalars`` rounds the lr (at most FP32_MAX) to fp32, and
    momentum, ``1 - dampening`` and weight_decay are fp32-finite too (AdamW's bias-corrected
    step size is what can overflow, see ``check_adamw_step_scalars``).
    """
    read = check_tensor_lr or (lr_checks is not None and lr_checks.needs_read(group, ()))
    if _checks.validate_lr(_NAME, group["lr"], read, where) is not None and lr_checks is not None:
        lr_checks.checked(group, ())  # a tensor lr: see TensorLRChecks
    _checks.check_hyper(_NAME, "momentum", group["momentum"], where, "Invalid momentum value")
    _checks.check_hyper(_NAME, "dampening", group["dampening"], where, "Invalid dampening value")
    _checks.check_hyper(_NAME, "weight_decay", group["weight_decay"], where, "Invalid weight_decay value")
    for flag in ("nesterov", "maximize"):
        if not isinstance(group[flag], bool):
            raise TypeError(f"{_NAME}: {flag} must be a bool, got {group[flag]!r} in {where}")
    if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
        raise ValueError(_checks.at("Nesterov momentum requires a momentum and zero dampening", where))
    _checks.check_lowbit_options(_NAME, group, where)
    _checks.check_state_format(_NAME, group, where)


@_traced.rule_step_scalars("sgd")
def _step_scalars_op(
    counts: Tensor, found_inf: Tensor | None, grad_scale: Tensor | None, lr: Tensor, args: list[float]
) -> Tensor:
    """``[lr, grad_mul, is_first]`` from applied-step counts (1-D: one row each; 0-dim: one set).

    The kernel of ``fastamp_optim::step_scalars`` for SGD: :func:`fastamp.reference.sgd_step_scalars`
    with the grad scaler's ``1/grad_scale`` (:mod:`fastamp.optim.engine.context`); ``found_inf``
    and ``args`` are not used (``is_first`` reads the count before the step).
    """
    gm = grad_mul(grad_scale, counts.device)
    return _R.sgd_step_scalars(lr, counts, gm)


class SGD(FusedOptimizer):
    r"""Fused SGD (momentum, dampening, Nesterov, weight decay) with exact masters, amp-aware and sync-free.

    The update is :class:`torch.optim.SGD`'s, done in one fused pass per group of tensors
    that reads the grad (fp32, fp16 or bf16, still scaled when a grad scaler drives the
    step), the master and the momentum buffer, and writes them and the param in its own
    dtype (see :func:`fastamp.reference.sgd_`). All maths is fp32, one rounding per
    operation; torch's ``add(alpha=)`` may fuse a multiply-add, so fp32 results agree with
    torch within ``tests/tolerances.py``'s ``SGD_VS_TORCH`` budget, not bit for bit.

    Example::

        >>> model = model.to(torch.bfloat16)
        >>> opt = fastamp.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, master_weights="remainder")
        >>> scaler = torch.amp.GradScaler()      # or fastamp.Scaler(), or none for bf16
        >>> for x, y in loader:
        ...     opt.zero_grad()
        ...     scaler.scale(loss_fn(model(x), y)).backward()
        ...     scaler.step(opt)                 # no host sync; a skipped step changes nothing
        ...     scaler.update()

    Args:
        params (iterable): params or dicts defining param groups (as in torch.optim).
        lr (float or Tensor, optional): learning rate (default: 1e-3).
        momentum (float, optional): momentum factor (default: 0); finite, >= 0.
        dampening (float, optional): dampening for momentum (default: 0); finite, >= 0.
        weight_decay (float, optional): L2 penalty added to the gradient (default: 0);
            finite, >= 0. Every hyperparameter is validated at construction, in
            ``add_param_group``, in ``load_state_dict`` and at every step, before anything
            changes; unlike torch, NaN ``momentum``/``weight_decay``, inf values and a bad
            ``dampening`` (which torch does not check) are refused.
        nesterov (bool, optional): Nesterov momentum (default: False); needs ``momentum > 0``
            and ``dampening == 0``.
        maximize (bool, optional): maximize the objective (default: False).
        master_weights (bool, None, "remainder" or "ulp8", optional): as in :class:`fastamp.optim.AdamW`:
            ``None``/``True`` fp32 masters for fp16/bf16 params, ``"remainder"`` int16
            remainders for bf16 params (bit-identical master trajectory, 2 bytes instead of
            4), ``"ulp8"`` an int8 correction in units of the param's ulp (with
            ``state_format="q8"``; 1 byte), ``False`` none.
        stochastic_rounding (bool, optional): bf16 params without a master are rounded
            stochastically (default False; with ``master_weights=None`` bf16 params then go
            without a master).
        seed (int, optional): seed of the counter-based random bits (default 0), see
            :class:`fastamp.optim.AdamW`.
        state_format (str, optional): ``None`` (default): an fp32 momentum buffer. ``"q8"``:
            8-bit block-scaled (:mod:`fastamp.reference.q8`, the first-moment code of
            :class:`fastamp.optim.AdamW`'s ``state_format="q8"``), 1 + 1/32 bytes per element
            instead of 4 (bf16 params with remainder masters: 7.03 B/param of param + grad +
            state instead of 10). Bit for bit this SGD with the buffer replaced by
            ``decode(encode(.))`` after every step (op ``sgd_q8_``: fused on the native CPU
            backend, as fast as the dense step; elsewhere the dense kernel composed with the codec).
        lowbit_min_numel (int, optional): params with fewer elements keep an fp32 buffer under
            ``state_format="q8"`` (default 4096).
        state_rounding (str, optional): ``"stochastic"`` (default; random bits of stream
            ``4 * tensor_id + 1``) or ``"nearest"``, as in :class:`fastamp.optim.AdamW`.
        backend (str, optional): force a kernel backend (see :mod:`fastamp.backends`).

    State per param: ``momentum_buffer`` (fp32, when ``momentum != 0``, as torch's key) and
    ``step`` (fp32 0-dim device tensor: the number of applied steps, when ``momentum != 0``;
    torch has no such key). The buffer is created zeroed and the kernel initialises it to the
    first applied step's grad (``step == 0``), so a first step skipped on overflow leaves it
    uninitialised exactly as torch's skipped ``step()`` does, with no host sync. Under
    ``state_format="q8"``, ``momentum_buffer_q`` (uint8, the param's shape) and
    ``momentum_buffer_scale`` (uint8, one per 32 elements) in place of the buffer. Masters and
    ``rng`` as in :class:`fastamp.optim.AdamW`.

    Shared storage, atomic steps, state resets (``state[p]`` replaced, cleared or deleted;
    ``step`` written) and layout changes are handled as in :class:`fastamp.optim.AdamW`.

    Amp: the ``grad_scale``/``found_inf`` protocol of :class:`fastamp.optim.AdamW`
    (``_step_supports_amp_scaling = True``): any non-zero ``found_inf`` skips the step on the
    device, leaving params, masters, buffers, ``step`` and ``rng`` bit-identical.

    ``state_dict`` / ``load_state_dict``: a :class:`torch.optim.SGD` state dict loads (a
    present ``momentum_buffer`` counts as initialised: ``step = 1``; torch's buffers of
    low-precision params are widened to fp32), and torch loads ours (it ignores ``step``
    and casts the buffer to the param dtype). One difference: after only skipped steps our
    buffer exists (zero, ``step == 0``) where torch's is None; torch, loading it, treats it
    as initialised, which matters only with ``dampening != 0``. ``state_dict(master_format=
    "fp32")`` exports remainder masters as fp32, ``moment_format="fp32"`` q8 buffers as fp32
    ``momentum_buffer`` (torch's layout; native -> fp32 -> native is bit-exact).
    """

    _NAME = _NAME
    _RULE = "sgd"
    _COUNT_BEFORE = False
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params,
        lr: Union[float, Tensor] = 1e-3,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        master_weights: Union[bool, str, None] = None,
        stochastic_rounding: bool = False,
        seed: int = 0,
        state_format: str | None = None,
        lowbit_min_numel: int = 4096,
        state_rounding: str = "stochastic",
        backend: str | None = None,
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
            "master_weights": master_weights,
            "stochastic_rounding": stochastic_rounding,
            "seed": seed,
            "state_format": state_format,
            "lowbit_min_numel": lowbit_min_numel,
            "state_rounding": state_rounding,
        }
        self._init_fused(params, defaults, backend)

    # ---- hooks -------------------------------------------------------------------------
    def _validate_group(self, group: dict[str, Any], where: str, check_tensor_lr: bool = False) -> None:
        _validate_group(group, where, check_tensor_lr, self._lr_checks())

    def _group_setdefaults(self) -> dict[str, Any]:
        return {**super()._group_setdefaults(), "nesterov": False}

    def _plan_key(self, group: dict[str, Any]) -> tuple:
        return super()._plan_key(group) + (group["momentum"] != 0,)

    def _moment_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _rule_hyper(self, group: dict[str, Any]) -> tuple[float, ...]:
        return (float(group["momentum"]), float(group["dampening"]), float(group["weight_decay"]))

    def _rule_flags(self, group: dict[str, Any]) -> int:
        return super()._rule_flags(group) | (_R.NESTEROV if group["nesterov"] else 0)

    def _init_state(self, p: Tensor, st: dict[str, Any], group: dict[str, Any], kind: str) -> float | None:
        if group["momentum"] == 0:
            return None
        created = None
        if "step" not in st:
            created = 1.0 if _formats.held(st, "momentum_buffer") is not None else 0.0
            st["step"] = torch.full((), created, dtype=torch.float32, device=p.device)
        # create (zeroed: the kernel sets it to the first applied step's grad), or convert once
        # when the group's state_format changed or a state of another format was loaded
        _formats.convert(p, st, "momentum_buffer", self._moment_format(group, p, kind))
        return created

    # ---- torch.compile (see fastamp.optim.engine.traced) -----------------------------------------
    def _step_scalars(
        self, group: dict[str, Any], counts: Tensor | None, found_inf: Tensor | None, grad_scale: Tensor | None, dev
    ) -> Tensor:
        lr = group["lr"]
        if not isinstance(lr, Tensor) and not _checks.float_lr_in_range(lr):
            # a guard for dynamo (see float_lr_in_range): the group's checks refused such an lr already
            raise AssertionError(f"{_NAME}: an lr out of range reached the step: {lr}")
        if counts is None:  # no momentum: is_first is not used
            counts = torch.zeros((), dtype=torch.float32, device=dev)
        return _traced.step_scalars("sgd", counts, None, grad_scale, _traced.lr_tensor(lr), [])

    # ---- state_dict ----------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class (either ``master_format``) or of :class:`torch.optim.SGD`.

        ``momentum_buffer`` and masters are loaded as fp32, ``step`` as an fp32 0-dim tensor;
        a torch state without ``step`` gets ``step = 1`` where a buffer exists (torch's
        ``None`` buffers are dropped: uninitialised). Validated before anything changes.
        """
        if isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict):
            cleaned = {}
            for k, v in state_dict["state"].items():
                if isinstance(v, dict) and "momentum_buffer" in v and v["momentum_buffer"] is None:
                    v = {key: val for key, val in v.items() if key != "momentum_buffer"}
                cleaned[k] = v
            state_dict = {**state_dict, "state": cleaned}

        _state_dict.load_state_dict(
            self,
            state_dict,
            opt_name=_NAME,
            required_group_keys=("lr", "momentum", "dampening", "weight_decay", "nesterov"),
            validate_group=functools.partial(_validate_group, check_tensor_lr=True),  # off the hot path
            required_state_keys=lambda g: (),
            fp32_state_keys=("momentum_buffer", "master_param"),
            drop_state_keys=_masters.unkept_master_keys,
        )
        for group in self.param_groups:
            if group["momentum"] == 0:
                continue
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" not in st and _formats.held(st, "momentum_buffer") is not None:
                    st["step"] = torch.ones((), dtype=torch.float32, device=p.device)
        self._after_load()
