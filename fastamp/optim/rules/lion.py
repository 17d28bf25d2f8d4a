"""``fastamp.optim.Lion``: fused Lion with fp32 / int16-remainder masters or stochastic rounding, amp skip on device."""

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

__all__ = ["Lion"]

_NAME = "Lion"


def _betas(betas: Any, where: str) -> tuple[float, float]:
    """Two real numbers in [0, 1] (1 included: beta1 = 1 steps by the sign of the momentum alone)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{_NAME}: betas must be a pair (beta1, beta2), got {betas!r}")
    values = []
    for i, b in enumerate(betas):
        if isinstance(b, Tensor):
            raise TypeError(f"{_NAME}: betas[{i}] must be a float, got a Tensor (in {where})")
        _checks.check_real_number(_NAME, f"betas[{i}]", b)
        v = float(b)
        if not 0.0 <= v <= 1.0:
            raise ValueError(_checks.at(f"Invalid beta parameter at index {i}: {b}", where))
        values.append(v)
    return values[0], values[1]


def _validate_group(
    group: dict[str, Any], where: str, check_tensor_lr: bool = False, lr_checks: _checks.TensorLRChecks | None = None
) -> None:
    """The checks of every group (torch has no Lion; the wording follows torch.optim.AdamW's).

    ``lr`` and ``weight_decay`` real, finite, >= 0, within fp32 (a tensor lr read where it
    enters, see :class:`~fastamp.optim.engine.checks.TensorLRChecks`), and ``1 - lr * weight_decay``
    finite in fp32; betas floats in [0, 1].
    """
    lr = _checks.validate_lr(_NAME, group["lr"], check_tensor_lr, where)
    _betas(group["betas"], where)
    weight_decay = _checks.check_hyper(
        _NAME, "weight_decay", group["weight_decay"], where, "Invalid weight_decay value"
    )
    if lr is None and lr_checks is not None and lr_checks.needs_read(group, (weight_decay,)):
        lr = _checks.validate_lr(_NAME, group["lr"], True, where)
    if lr is not None:
        _checks.check_decay(_NAME, lr, weight_decay, where)
        if lr_checks is not None:
            lr_checks.checked(group, (weight_decay,))
    if not isinstance(group["maximize"], bool):
        raise TypeError(f"{_NAME}: maximize must be a bool, got {group['maximize']!r} in {where}")
    _checks.check_lowbit_options(_NAME, group, where)
    _checks.check_state_format(_NAME, group, where)


@_traced.rule_step_scalars("lion")
def _step_scalars_op(
    counts: Tensor, found_inf: Tensor | None, grad_scale: Tensor | None, lr: Tensor, args: list[float]
) -> Tensor:
    """``[lr, decay, grad_mul]`` on ``counts``' device (Lion reads no count: the same row for every tensor).

    The kernel of ``fastamp_optim::step_scalars`` for Lion: :func:`fastamp.reference.lion_step_scalars`
    with the grad scaler's ``1/grad_scale`` (:mod:`fastamp.optim.engine.context`); ``args``: weight_decay.
    """
    (weight_decay,) = args
    dev = counts.device
    gm = grad_mul(grad_scale, dev)
    row = _R.lion_step_scalars(lr, weight_decay, gm, dev)
    # the op's contract: one row per count of a 1-D vector (the optimizer itself passes a 0-dim anchor)
    return row if counts.dim() == 0 else row.expand(*counts.shape, row.numel()).clone()


class Lion(FusedOptimizer):
    r"""Fused Lion (Chen et al. 2023) with exact master weights for fp16/bf16 params, amp-aware and sync-free.

    The update (Lion's "EvoLved Sign Momentum", decoupled weight decay), in one fused pass per
    group of tensors that reads the grad (fp32, fp16 or bf16, still scaled when a grad scaler
    drives the step), the master and ``exp_avg`` and writes them and the param in its own
    dtype (see :func:`fastamp.reference.lion_`; all maths fp32, one rounding per operation)::

        p = p * (1 - lr * weight_decay)
        p = p - lr * sign(beta1 * m + (1 - beta1) * g)
        m = beta2 * m + (1 - beta2) * g

    ``sign`` is 0 where its argument is 0 (that element does not move but for the decay). One
    state tensor per param (``exp_avg``, fp32), so Lion keeps 4 bytes per param of optimizer
    state where AdamW keeps 8. Lion's update has the same size for every element (``lr``), so
    it wants a smaller lr than AdamW (the paper: 3-10x smaller) and a larger weight decay.

    Example::

        >>> model = model.to(torch.bfloat16)
        >>> opt = fastamp.optim.Lion(model.parameters(), lr=1e-4, weight_decay=0.1, master_weights="remainder")
        >>> scaler = fastamp.Scaler()            # or torch.amp.GradScaler(), or none for bf16
        >>> for x, y in loader:
        ...     opt.zero_grad()
        ...     scaler.scale(loss_fn(model(x), y)).backward()
        ...     scaler.step(opt)                 # no host sync; a skipped step changes nothing
        ...     scaler.update()

    Args:
        params (iterable): params or dicts defining param groups (as in torch.optim).
        lr (float or Tensor, optional): learning rate (default: 1e-4); finite, >= 0.
        betas (tuple of two floats, optional): beta1 (the interpolation that gives the
            update's sign) and beta2 (the momentum's decay) (default: (0.9, 0.99)); in [0, 1].
        weight_decay (float, optional): decoupled weight decay (default: 0); finite, >= 0,
            and ``1 - lr * weight_decay`` finite in fp32.
        maximize (bool, optional): maximize the objective (default: False).
        master_weights (bool, None, "remainder" or "ulp8", optional): as in :class:`fastamp.optim.AdamW`
            (``"ulp8"``: an int8 correction per param element, with ``state_format="q8"``).
        stochastic_rounding (bool, optional): as in :class:`fastamp.optim.AdamW` (bf16 params
            without a master rounded stochastically).
        seed (int, optional): seed of the counter-based random bits (default 0).
        state_format (str, optional): ``None`` (default): fp32 ``exp_avg``. ``"q8"``: 8-bit
            block-scaled (the first-moment code of :class:`fastamp.optim.AdamW`'s
            ``state_format="q8"``), 1 + 1/32 bytes per element instead of 4: bf16 params take
            7.03 B/param (param + grad + state) with remainder masters, 5.03 with
            ``stochastic_rounding=True`` and no master. Bit for bit this Lion with ``exp_avg``
            replaced by ``decode(encode(.))`` after every step (op ``lion_q8_``: fused on the
            native CPU backend, as fast as the dense step; elsewhere the dense kernel composed
            with the codec).
        lowbit_min_numel (int, optional): params with fewer elements keep fp32 ``exp_avg``
            under ``state_format="q8"`` (default 4096).
        state_rounding (str, optional): ``"stochastic"`` (default; random bits of stream
            ``4 * tensor_id + 1``) or ``"nearest"``, as in :class:`fastamp.optim.AdamW`.
        backend (str, optional): force a kernel backend (see :mod:`fastamp.backends`).

    Every hyperparameter is validated at construction, in ``add_param_group``, in
    ``load_state_dict`` and at every step, before anything changes.

    State per param: ``exp_avg`` (fp32, the key the common Lion implementations use) and the
    master (``master_param`` fp32, or ``master_remainder`` int16) and ``rng`` as in
    :class:`fastamp.optim.AdamW`. No ``step``: Lion has no bias correction. Under
    ``state_format="q8"``, ``exp_avg_q`` (uint8, the param's shape) and ``exp_avg_scale``
    (uint8, one per 32 elements) in place of ``exp_avg``.

    Shared storage, atomic steps, state resets, layout changes, torch.compile and the amp
    ``grad_scale``/``found_inf`` protocol (a non-zero ``found_inf`` skips the step on the device,
    leaving params, masters, ``exp_avg`` and ``rng`` bit-identical) are as in
    :class:`fastamp.optim.AdamW`.

    ``state_dict`` / ``load_state_dict``: plain tensors; ``state_dict(master_format="fp32")``
    exports remainder masters as fp32 ``master_param``, ``moment_format="fp32"`` q8 moments as
    fp32 ``exp_avg``; a state dict of another Lion that keeps
    ``exp_avg`` per param (of any float dtype: widened to fp32) loads.
    """

    _NAME = _NAME
    _RULE = "lion"
    _COUNT_BEFORE = False
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params,
        lr: Union[float, Tensor] = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
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
            "betas": betas,
            "weight_decay": weight_decay,
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

    def _moment_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg",)

    def _rule_hyper(self, group: dict[str, Any]) -> tuple[float, ...]:
        beta1, beta2 = group["betas"]
        return (float(beta1), float(beta2))

    def _init_state(self, p: Tensor, st: dict[str, Any], group: dict[str, Any], kind: str) -> float | None:
        _formats.convert(p, st, "exp_avg", self._moment_format(group, p, kind))
        return None

    def _step_scalars(
        self, group: dict[str, Any], counts: Tensor | None, found_inf: Tensor | None, grad_scale: Tensor | None, dev
    ) -> Tensor:
        lr, wd = group["lr"], group["weight_decay"]
        if not isinstance(lr, Tensor) and not _checks.float_lr_in_range(lr, 0.0, wd):
            # a guard for dynamo (see float_lr_in_range): the group's checks refused such an lr already
            raise AssertionError(f"{_NAME}: an lr out of range reached the step: {lr}")
        anchor = torch.zeros((), dtype=torch.float32, device=dev)  # no count: one set, on the launch's device
        return _traced.step_scalars("lion", anchor, None, grad_scale, _traced.lr_tensor(lr), [float(wd)])

    # ---- state_dict ----------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class (either ``master_format``) or of another Lion keeping ``exp_avg``.

        ``exp_avg`` and masters are loaded as fp32. Validated before anything changes.
        """

        _state_dict.load_state_dict(
            self,
            state_dict,
            opt_name=_NAME,
            required_group_keys=("lr", "betas", "weight_decay"),
            validate_group=functools.partial(_validate_group, check_tensor_lr=True),  # off the hot path
            required_state_keys=lambda g: ("exp_avg",),
            fp32_state_keys=("exp_avg", "master_param"),
            drop_state_keys=_masters.unkept_master_keys,
        )
        self._after_load()
