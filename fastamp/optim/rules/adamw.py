"""``fastamp.optim.AdamW``: fused AdamW with fp32 / int16-remainder masters or stochastic rounding, amp skip on device."""

from __future__ import annotations

import functools
from typing import Any, Union

import torch
from torch import Tensor

from fastamp.optim.engine import checks as _checks
from fastamp.optim.engine import state_dict as _state_dict
from fastamp.optim.engine import traced as _traced
from fastamp.optim.engine.base import FusedOptimizer
from fastamp.optim.engine.context import counts_after, grad_mul
from fastamp.optim.formats import masters as _masters
from fastamp.optim.formats import moments as _formats
from fastamp.reference import optim as _R

__all__ = ["AdamW"]

_NAME = "AdamW"
_FP32_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")


def _validate_group(
    group: dict[str, Any], where: str, check_tensor_lr: bool = False, lr_checks: _checks.TensorLRChecks | None = None
) -> None:
    """torch.optim.Adam's checks and messages, applied to every group (torch checks only the defaults).

    Stricter than torch where torch lets a value through that would silently wreck the
    run: inf ``lr``/``eps``/``weight_decay`` (and values beyond fp32's range), and an lr whose
    step scalars overflow fp32 (:func:`~fastamp.optim.engine.checks.check_adamw_step_scalars`; a
    tensor lr is read where it enters and not at every step, see
    :class:`~fastamp.optim.engine.checks.TensorLRChecks`). Tensor betas are read here (a host read,
    a sync for device tensors), as at every step.
    """
    lr = _checks.validate_lr(_NAME, group["lr"], check_tensor_lr, where)
    _checks.check_hyper(_NAME, "eps", group["eps"], where, "Invalid epsilon value")
    beta1, _ = _betas(group["betas"], where)
    weight_decay = _checks.check_hyper(
        _NAME, "weight_decay", group["weight_decay"], where, "Invalid weight_decay value"
    )
    settings = (beta1, weight_decay)
    if lr is None and lr_checks is not None and lr_checks.needs_read(group, settings):
        lr = _checks.validate_lr(_NAME, group["lr"], True, where)
    if lr is not None:
        _checks.check_adamw_step_scalars(_NAME, lr, beta1, weight_decay, where)
        if lr_checks is not None:
            lr_checks.checked(group, settings)
    for flag in ("amsgrad", "maximize"):
        if not isinstance(group[flag], bool):
            raise TypeError(f"{_NAME}: {flag} must be a bool, got {group[flag]!r} in {where}")
    _checks.check_lowbit_options(_NAME, group, where)
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
    _check_state_format(group, where)


def _check_state_format(group: dict[str, Any], where: str) -> None:
    """``state_format``, ``lowbit_min_numel`` and ``state_rounding`` of a group, and how they combine with AdamW's options."""
    _checks.check_state_format(_NAME, group, where)
    fmt = group["state_format"]
    if fmt == "q8":
        if group["amsgrad"]:
            raise ValueError(
                f"{_NAME}: amsgrad=True is not supported with state_format='q8' (max_exp_avg_sq has no 8-bit "
                f"format yet); use state_format=None for this group ({where})"
            )
        if group["state_dtype"] != torch.float32:
            raise ValueError(
                f"{_NAME}: state_dtype={group['state_dtype']} does not combine with state_format='q8' (the q8 "
                f"moments replace bf16 ones; tensors below lowbit_min_numel keep fp32 moments); leave state_dtype at "
                f"torch.float32 ({where})"
            )


def _betas(betas: Any, where: str) -> tuple[float, float]:
    """The betas as floats, validated as torch validates them.

    Like torch.optim.AdamW, betas are both numbers or both 1-element tensors (mixed pairs
    are refused with torch's message). Tensor betas are kept as given and read at every
    step, so an in-place change (``beta.fill_(0.95)``) takes effect at the next step, as
    in torch; the fused kernels take them as numbers, so each step reads them on the host.
    """
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{_NAME}: betas must be a pair (beta1, beta2), got {betas!r}")
    values = []
    for i, b in enumerate(betas):
        if isinstance(b, Tensor):
            if b.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")
            if not b.is_floating_point():
                raise TypeError(f"{_NAME}: a Tensor betas[{i}] must be floating point, got {b.dtype}")
            v = float(b)
        else:
            _checks.check_real_number(_NAME, f"betas[{i}]", b)
            v = float(b)
        if not 0.0 <= v < 1.0:
            raise ValueError(_checks.at(f"Invalid beta parameter at index {i}: {b}", where))
        values.append(v)
    if isinstance(betas[0], Tensor) != isinstance(betas[1], Tensor):
        raise ValueError(_checks.at("betas must be either both floats or both Tensors", where))
    return values[0], values[1]


@_traced.rule_step_scalars("adamw")
def _step_scalars_op(
    counts: Tensor, found_inf: Tensor | None, grad_scale: Tensor | None, lr: Tensor, args: list[float]
) -> Tensor:
    """``[n, 4]`` rows ``[step_size, bc2_sqrt, decay, grad_mul]`` (the kernel of ``fastamp_optim::step_scalars``).

    The counts ``counts + (found_inf == 0)`` (``+ 1`` without a scaler), the grad scaler's
    ``1/grad_scale`` (:mod:`fastamp.optim.engine.context`), then
    :func:`fastamp.reference.adamw_step_scalars` over that vector; ``args``: beta1, beta2, weight_decay.
    """
    beta1, beta2, weight_decay = args
    gm = grad_mul(grad_scale, counts.device)
    return _R.adamw_step_scalars(lr, counts_after(counts, found_inf), beta1, beta2, weight_decay, gm)


class AdamW(FusedOptimizer):
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
    remainder + ``state_format="q8"`` 4.06 (exact master, 8-bit moments); ``stochastic_rounding=True``
    (no master) 8, with bf16 moments 4, with q8 moments 2.06.

    Args:
        params (iterable): params or dicts defining param groups (as in torch.optim).
        lr (float or Tensor, optional): learning rate (default: 1e-3). A 1-element tensor
            lr may live on any device; it is copied to each param device without blocking.
            Refused (ValueError, nothing changed) when a step scalar would overflow fp32: the
            first step's step size ``lr / (1 - beta1)`` or the decay ``1 - lr * weight_decay``
            (torch fails there mid-step). A tensor lr's value is read for that at
            construction, ``add_param_group``, ``load_state_dict`` and the first step that
            finds a new tensor in its group (or a changed beta1 / weight_decay), not at every
            step (a host sync per step on a device), nor inside a compiled step: a value
            written into it in place later that overflows writes inf into the params, as
            torch's fused AdamW does.
        betas (Tuple[float, float] or Tuple[Tensor, Tensor], optional): coefficients of the
            running averages of the gradient and its square (default: (0.9, 0.999)), each in
            [0, 1). As in torch, both numbers or both 1-element tensors; tensor betas are kept
            and read at every step, so an in-place change takes effect at the next step (the
            kernels take numbers: the read is a host sync for device tensors).
        eps (float, optional): added to the denominator (default: 1e-8); finite, >= 0.
        weight_decay (float, optional): decoupled weight decay coefficient (default: 1e-2);
            finite, >= 0. Every hyperparameter is validated at construction, in
            ``add_param_group``, in ``load_state_dict`` and at every step (a group edited
            between steps), before anything changes; unlike torch, inf ``lr``/``eps``/
            ``weight_decay`` and values beyond fp32's range are refused.
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
            an element depend only on (seed, its param group's counter, the param's index
            among this optimizer's bf16 params (``2^24 +`` its index among all params for the
            q8 codes of other params), the element's index), so runs are reproducible and
            data-parallel ranks with the same seed round identically. The counter is one per
            param group and device, ``[seed, counter]`` (int64, on the device), held by every
            param's ``state[p]["rng"]`` (the same tensor: a write in place writes the group's);
            it counts the applied steps (``found_inf == 0``) that stepped a param of the group
            on that device, and advances once per step, after its launches, so every launch of
            a step reads the same count whichever params got a grad (which :func:`fastamp.release`
            needs). It is created at the group's first such step with the ``seed`` of then; a
            param whose state is created later joins it. See :mod:`fastamp.optim.engine.rng` for
            loads of per-param counters (made one: the largest) and ``state_dict()`` (a copy
            per param; with ``format="fp32"``, in the param group).
        state_dtype (torch.dtype, optional): ``torch.float32`` (default) or
            ``torch.bfloat16``: moments of bf16 params with remainder masters or without a
            master are stored in bf16 (rounded stochastically with ``stochastic_rounding``,
            else to nearest-even); other params keep fp32 moments. Trade-off: bf16 keeps 8
            mantissa bits, so ``exp_avg_sq`` with ``beta2=0.999`` cannot take increments below
            ~2^-9 of itself with round-to-nearest (it stalls; stochastic rounding keeps it
            unbiased but noisy): expect slightly worse loss than fp32 moments, most visible
            late in training and with small gradients. It buys 4 bytes per param.
        state_format (str, optional): ``None`` (default): dense moments (fp32, or bf16 per
            ``state_dtype``). ``"q8"``: 8-bit block-scaled moments (:mod:`fastamp.reference.q8`),
            1 + 1/32 bytes per moment per element: per block of 32 elements of the flattened
            param a power-of-two scale byte, per element an 8-bit float code (signed E3M4 of
            ``exp_avg``; unsigned E3M5 of ``sqrt(exp_avg_sq)``, never 0 for a nonzero value).
            Each step decodes them (exactly), does the fp32 update of AdamW, then encodes the new
            moments: the result is bit for bit AdamW whose moments are replaced by
            ``decode(encode(.))`` after every step. Stored as ``exp_avg_q`` / ``exp_avg_sq_q``
            (uint8, the param's shape) and ``exp_avg_scale`` / ``exp_avg_sq_scale`` (uint8,
            ``ceil(n / 32)``). Works with every master kind and param dtype, the scalers, clipping,
            ``torch.compile``, DTensor params (see below); not with ``amsgrad`` or
            ``state_dtype=torch.bfloat16`` (refused). Kernels: native CPU and CUDA
            where built, Triton, and the torch reference, byte for byte the same (the CUDA and
            Triton kernels have not run on a GPU yet: ``benchmarks/gpu_check.sh``).
        lowbit_min_numel (int, optional): params with fewer elements keep fp32 moments under
            ``state_format="q8"`` (default 4096: biases and norms, where 8 bits buy little).
        state_rounding (str, optional): how q8 codes are rounded: ``"stochastic"`` (default;
            unbiased, from the counter-based random bits of ``seed``, streams 1 and 2 of the param:
            see ``stochastic_rounding``) or ``"nearest"`` (nearest-even; an EMA step smaller than
            half a code step is then lost: for ablations).
        backend (str, optional): ``"native"``, ``"triton"`` or ``"torch"`` forces the
            kernel backend of this optimizer (an unavailable one raises); ``None`` uses
            :mod:`fastamp.backends` (``FASTAMP_BACKEND`` or the fastest available).

    State per param (created at its first step): ``step`` (fp32 0-dim tensor on the param's
    device, as with torch's ``fused=True``), ``exp_avg`` and ``exp_avg_sq`` (fp32, or bf16 per
    ``state_dtype``), ``max_exp_avg_sq`` (with ``amsgrad``), ``master_param`` (fp32) or
    ``master_remainder`` (int16), ``rng`` (int64 ``[seed, counter]``, with stochastic rounding); with
    ``state_format="q8"``, ``exp_avg_q``, ``exp_avg_scale``, ``exp_avg_sq_q``, ``exp_avg_sq_scale``
    in place of the two moments (params of ``lowbit_min_numel`` elements or more).
    For a DTensor param (FSDP2 ``fully_shard``) the moments and the master are DTensors
    sharded like the param (remainders and ulp8 corrections too, converted per shard) and the
    kernels update each rank's local shard. q8
    moments of a DTensor param: codes sharded like it and scales of shape ``(rows, row_numel /
    32)`` sharded like it, where its shards start on blocks of 32 (sharded on dim 0 with rows
    of a multiple of 32 elements, or replicated: the blocks, and with ``state_rounding=
    "nearest"`` the bits, of one process); other DTensor params keep fp32 moments, with a
    warning (:func:`fastamp.optim.formats.moments.scale_shape`). With stochastic rounding each
    shard draws the random bits of a tensor of its own size (its elements numbered from 0).

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
        ``lr``/``grad_scale``/``found_inf`` lives on a GPU (the copy to the CPU blocks),
        tensor betas on a device (read at every step), and the first ``step()`` after a
        ``step`` count was written from outside or after compiled steps (the counts it can
        no longer vouch for are read once, to validate them).

    .. note::
        Params are updated in one launch per (device, param dtype, grad dtype, master kind,
        moment dtype), each param with the bias corrections of its own ``step`` count (one
        row of step scalars per param, computed on the device), as in torch: a param
        skipped because its grad was None keeps its own count, and so does a param whose
        state was reset: ``state[p]["step"]`` replaced or written in place (``.zero_()``,
        ``.fill_()``, ``+=``), ``state[p]`` replaced, cleared or deleted, a partial state dict
        loaded, a param group added. Under ``torch.compile`` the compiled step reads every
        count at run time: a count replaced or written in place between compiled steps is
        honoured without a retrace (see :mod:`fastamp.optim.engine.traced`).

    .. note::
        Two Parameters over one storage (a weight and its transposed view as separate
        Parameters, or overlapping views) are refused at construction, in
        ``add_param_group`` and at ``step()`` (if made so later), naming both: a fused
        update cannot give both updates, and each would keep its own master and moments.
        Tie weights as one Parameter object (torch.optim updates it once); disjoint views
        of one buffer are fine.

    .. note::
        A step validates everything it will use, in every group (params, grads, every state
        tensor, step counts, hyperparameters, shared memory, the backend) before it changes
        anything: a step that raises leaves params, grads and state bit-identical, and the
        error names the param by group, index and shape.

    .. note::
        The master is the value being optimised. If you change a low-precision param in
        place outside the optimizer after its first step (re-initialisation, loading model
        weights that differ from the optimizer checkpoint), an fp32 master overwrites it at
        the next step: call :meth:`reset_master_weights` after such a change. A remainder
        master detects writes that bump the param's version counter (``param.copy_``,
        ``model.load_state_dict``) and re-syncs to the param with a warning; writes through
        ``param.data`` are invisible: call :meth:`reset_master_weights` after them. Load the
        model's and the optimizer's state from the same checkpoint before the next step.

    ``state_dict()`` holds the state as stored (plain tensors: ``torch.load(weights_only=True)``
    loads it); ``state_dict(master_format="fp32")`` exports remainder masters as exact fp32
    ``master_param``, ``moment_format="fp32"`` q8 and bf16 moments as fp32 ``exp_avg`` /
    ``exp_avg_sq``, and ``format="fp32"`` both: torch.optim.AdamW's layout, each param's state
    exactly torch's keys plus ``master_param``; the random-bit counter (``rng``) then travels in
    its param group as ``group["rng"] = [seed, counter]`` (ints; torch keeps an unknown group key
    as it is, where it would cast a per-param tensor to the param's dtype), and is given back to
    the params that draw random bits on load. :class:`torch.optim.AdamW` loads this export as it
    is, and fastamp loads torch's state dict of it back. Native -> fp32 ->
    native is bit-exact (q8 decodes exactly, and encoding a decoded block gives its bytes back). ``load_state_dict`` accepts both forms
    for either master mode, keeps fp32 state fp32 (torch's would cast it to the param dtype),
    validates the whole dict before changing anything, and accepts a
    :class:`torch.optim.AdamW` state dict (for fp16/bf16 params the masters are then built
    from the params at the next step, and torch's low-precision moments are widened). A
    :class:`torch.optim.AdamW` loads the state dict of an fp32-param instance. float64 and
    complex params are rejected (use torch.optim for them).
    """

    _NAME = _NAME
    _RULE = "adamw"
    _COUNT_BEFORE = True
    _STEP_REQUIRED = True
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
        state_format: str | None = None,
        lowbit_min_numel: int = 4096,
        state_rounding: str = "stochastic",
        backend: str | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "master_weights": master_weights,
            "stochastic_rounding": stochastic_rounding,
            "seed": seed,
            "state_dtype": state_dtype,
            "state_format": state_format,
            "lowbit_min_numel": lowbit_min_numel,
            "state_rounding": state_rounding,
        }
        self._init_fused(params, defaults, backend)

    # ---- hooks -------------------------------------------------------------------------
    def _validate_group(self, group: dict[str, Any], where: str, check_tensor_lr: bool = False) -> None:
        _validate_group(group, where, check_tensor_lr, self._lr_checks())

    def _group_setdefaults(self) -> dict[str, Any]:
        return {
            **super()._group_setdefaults(),
            "amsgrad": False,
            "state_dtype": torch.float32,
        }

    def _moment_format(self, group: dict[str, Any], p: Tensor, kind: str) -> _formats.MomentFormat:
        if self._q8(group, p):
            return _formats.Q8
        return _formats.BF16 if self._moment_dtype(group, p, kind) == torch.bfloat16 else _formats.FP32

    @staticmethod
    def _moment_dtype(group: dict[str, Any], p: Tensor, kind: str) -> torch.dtype:
        if group["state_dtype"] == torch.bfloat16 and p.dtype == torch.bfloat16 and kind != "fp32":
            return torch.bfloat16
        return torch.float32

    def _uses_rng(self, group: dict[str, Any], p: Tensor, st: dict[str, Any], kind: str) -> bool:
        if self._q8(group, p) and group["state_rounding"] == "stochastic":
            return True
        return group["stochastic_rounding"] and (kind == "sr" or self._moment_dtype(group, p, kind) == torch.bfloat16)

    def _plan_key(self, group: dict[str, Any]) -> tuple:
        return super()._plan_key(group) + (
            group["amsgrad"],
            group["state_dtype"],
        )

    def _extra_key(self, group: dict[str, Any], p: Tensor, st: dict[str, Any], kind: str) -> tuple:
        t = st.get("exp_avg")
        return (torch.uint8 if t is None else t.dtype,)  # q8 moments: exp_avg_q

    def _moment_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    def _rule_hyper(self, group: dict[str, Any]) -> tuple[float, ...]:
        beta1, beta2 = group["betas"]
        return (float(beta1), float(beta2), float(group["eps"]))

    def _rule_flags(self, group: dict[str, Any]) -> int:
        return super()._rule_flags(group) | (_R.AMSGRAD if group["amsgrad"] else 0)

    def _hyper(self, group: dict[str, Any]) -> dict[str, Any]:
        betas = group["betas"]
        if isinstance(betas[0], Tensor):
            return {**group, "betas": _betas(betas, "")}
        return group

    def _init_state(self, p: Tensor, st: dict[str, Any], group: dict[str, Any], kind: str) -> float | None:
        fmt = self._moment_format(group, p, kind)
        created = None
        if len(st) == 0:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            created = 0.0
        for key in self._moment_keys(group):
            # create, or convert once when the group's state_dtype / state_format or master kind
            # changed (or a state dict of another format was loaded, or a strided moment
            # assigned), rounding to nearest-even when narrowing
            _formats.convert(p, st, key, fmt)
        return created

    def _step_scalars(
        self, group: dict[str, Any], counts: Tensor | None, found_inf: Tensor | None, grad_scale: Tensor | None, dev
    ) -> Tensor:
        lr = group["lr"]
        beta1, beta2 = group["betas"]
        if not isinstance(lr, Tensor) and not _checks.float_lr_in_range(lr, beta1, group["weight_decay"]):
            # a guard for dynamo (see float_lr_in_range): the group's checks refused such an lr already
            raise AssertionError(f"{_NAME}: an lr out of range reached the step: {lr}")
        args = [float(beta1), float(beta2), float(group["weight_decay"])]
        return _traced.step_scalars("adamw", counts, found_inf, grad_scale, _traced.lr_tensor(lr), args)

    # ---- torch.compile (see fastamp.optim.engine.traced) -----------------------------------------
    def _check_traceable(self, group: dict[str, Any], where: str) -> None:
        super()._check_traceable(group, where)
        if isinstance(group["betas"][0], Tensor):
            raise NotImplementedError(
                f"{_NAME}: tensor betas in {where} cannot be compiled: the kernels take them as numbers, read on the "
                "host at every step; use float betas, or call opt.step() outside the compiled function"
            )

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

        def state_dtype(p: Tensor, group: dict[str, Any], key: str) -> torch.dtype:
            if key == "master_param":
                return torch.float32
            g = {**group, "state_dtype": group.get("state_dtype", torch.float32)}
            kind = _masters.master_kind(g.get("master_weights"), p.dtype, g.get("stochastic_rounding", False))
            return self._moment_dtype(g, p, kind)

        _state_dict.load_state_dict(
            self,
            state_dict,
            opt_name=_NAME,
            required_group_keys=("lr", "betas", "eps", "weight_decay"),
            validate_group=functools.partial(_validate_group, check_tensor_lr=True),  # off the hot path
            required_state_keys=required_state_keys,
            fp32_state_keys=_FP32_STATE,
            group_defaults=lambda g: {"amsgrad": False, "state_dtype": g["state_dtype"]},
            drop_state_keys=_masters.unkept_master_keys,
            state_dtype=state_dtype,
        )
        self._after_load()
