"""Validation shared by fastamp's fused optimizers: dtypes, grads, hyperparameters, backend,
params sharing memory, and the state a launch reads (:class:`_StateValidation`).

Every error names the optimizer and the place of the bad value (param group, index, shape).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fastamp._dtensor import is_dtensor, local_of

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


def check_master_weights_flag(opt_name: str, value: Any, strings: tuple[str, ...] = ("remainder", "ulp8")) -> None:
    if value is not None and not isinstance(value, bool) and not (isinstance(value, str) and value in strings):
        allowed = ", ".join(repr(s) for s in strings)
        raise TypeError(f"{opt_name}: master_weights must be None, True, False or {allowed}, got {value!r}")


def check_lowbit_options(
    opt_name: str, group: dict[str, Any], where: str, master_strings: tuple[str, ...] = ("remainder", "ulp8")
) -> None:
    """Validate ``master_weights``, ``stochastic_rounding`` and ``seed`` of a group."""
    check_master_weights_flag(opt_name, group["master_weights"], master_strings)
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


def check_state_format(opt_name: str, group: dict[str, Any], where: str) -> None:
    """Validate ``state_format``, ``lowbit_min_numel`` and ``state_rounding`` of a group (every rule)."""
    fmt = group["state_format"]
    if fmt is not None and fmt != "q8":
        raise ValueError(f"{opt_name}: state_format must be None (dense moments) or 'q8', got {fmt!r} in {where}")
    n = group["lowbit_min_numel"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise TypeError(f"{opt_name}: lowbit_min_numel must be an int >= 0, got {n!r} in {where}")
    rounding = group["state_rounding"]
    if rounding not in ("stochastic", "nearest"):
        raise ValueError(f"{opt_name}: state_rounding must be 'stochastic' or 'nearest', got {rounding!r} in {where}")
    if group["master_weights"] == "ulp8":
        # every rule's kernels take an ulp8 master beside any state format; the optimizers keep it to
        # the q8 configs it was designed for (a param below lowbit_min_numel gets 'remainder' instead:
        # formats.masters.MasterWeights._kind)
        if fmt != "q8":
            raise ValueError(
                f"{opt_name}: master_weights='ulp8' needs state_format='q8' (the 8-bit master correction is built "
                f"for the 8-bit state configs); use master_weights='remainder' or True with dense states ({where})"
            )
        if group["stochastic_rounding"]:
            raise ValueError(
                f"{opt_name}: stochastic_rounding=True does not combine with master_weights='ulp8': the param is the "
                f"master rounded to nearest, and the correction is rounded per state_rounding ({where})"
            )


FP32_MAX = 3.4028234663852886e38
# fp64 values from here on round to fp32 inf: halfway between FP32_MAX and 2**128, where
# round-to-nearest-even goes up (FP32_MAX's last mantissa bit is odd)
FP32_OVERFLOW = 2.0**128 - 2.0**103


def fits_fp32(x: float) -> bool:
    """Whether an fp64 value rounds to a finite fp32, as the step scalars' ``.float()`` rounds it (NaN: False)."""
    return abs(x) < FP32_OVERFLOW


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


def validate_lr(opt_name: str, lr: Any, check_value: bool, where: str = "the defaults") -> float | None:
    """torch.optim's lr checks and messages, plus finiteness; returns the value checked.

    A tensor lr's value is read when ``check_value`` (construction, ``add_param_group``,
    ``load_state_dict``, and the first step that sees a tensor not yet checked, see
    :class:`TensorLRChecks`); returns None without reading it otherwise: a read at every step
    would be a host sync per step on a device, and one rule holds on every device.
    """
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not lr.is_floating_point():
            raise TypeError(f"{opt_name}: a Tensor lr must be floating point, got {lr.dtype}")
        if not check_value:
            return None
        v = float(lr)
        if not 0.0 <= v <= FP32_MAX:
            raise ValueError(at(f"Invalid learning rate: {lr}", where))
        return v
    return check_hyper(opt_name, "lr", lr, where, "Invalid learning rate")


class TensorLRChecks:
    """Which tensor lr each param group's value was last checked for, and with which settings.

    A step reads a tensor lr (one host read; a sync on a device) only when its group holds a
    tensor other than the one checked last, or when a setting the check depends on changed
    (AdamW: beta1 and weight_decay): the first step after a scheduler or the user put a new
    tensor into the group refuses an out-of-range value before anything changes, and the
    steps after it read nothing. A value written in place into the same tensor (a scheduler's
    ``fill_``, :class:`fastamp.DeviceLR`) is not read again, as in torch's fused optimizers;
    its step may then write inf. The tensors are held (not weakly referenced) so that an
    identity test cannot be fooled by a reused ``id``; groups are keyed by ``id`` and live as
    long as the optimizer.
    """

    def __init__(self) -> None:
        self._seen: dict[int, tuple[Tensor, tuple]] = {}

    def needs_read(self, group: dict[str, Any], settings: tuple) -> bool:
        lr = group["lr"]
        if not isinstance(lr, Tensor):
            return False
        seen = self._seen.get(id(group))
        return seen is None or seen[0] is not lr or seen[1] != settings

    def checked(self, group: dict[str, Any], settings: tuple) -> None:
        lr = group["lr"]
        if isinstance(lr, Tensor):
            self._seen[id(group)] = (lr, settings)


def check_adamw_step_scalars(opt_name: str, lr: float, beta1: float, weight_decay: float, where: str) -> None:
    """Refuse an lr whose fp32 step scalars overflow, before a step writes inf into the params.

    :func:`fastamp.reference.adamw_step_scalars` rounds ``lr / (1 - beta1**count)`` and
    ``1 - lr * weight_decay`` (fp64) to fp32 at every step. torch.optim.AdamW fails there with
    "value cannot be converted to type float without overflow" after its weight decay has
    already changed the params, and its fused kernel writes inf. The step size is largest at a
    count of 1 (the smallest bias correction), which any param of the group can reach (a new
    param, a reset state, a first step skipped on overflow), so it is checked there: the
    refusal does not depend on how far training is. The other scalars cannot overflow:
    ``sqrt(1 - beta2**count)`` lies in [0, 1] and the grad multiplier comes from the scaler.
    """
    bias_correction = 1.0 - beta1
    step_size = lr / bias_correction
    if not fits_fp32(step_size):
        raise ValueError(
            at(
                f"{opt_name}: lr {lr!r} is too large for betas[0] {beta1!r}: a first step's step size "
                f"lr / (1 - beta1) = {step_size:.6g} overflows float32 (max {FP32_MAX:.6g}; torch: 'value cannot be "
                f"converted to type float without overflow') and would write inf into the params; lr must be at "
                f"most about {bias_correction * FP32_MAX:.6g}",
                where,
            )
        )
    check_decay(opt_name, lr, weight_decay, where)


def check_decay(opt_name: str, lr: float, weight_decay: float, where: str) -> None:
    """Refuse an lr and weight_decay whose decoupled decay factor ``1 - lr * weight_decay`` overflows fp32."""
    decay = 1.0 - lr * weight_decay
    if not fits_fp32(decay):
        raise ValueError(
            at(
                f"{opt_name}: lr {lr!r} and weight_decay {weight_decay!r} are too large together: the decay factor "
                f"1 - lr * weight_decay = {decay:.6g} overflows float32 (max {FP32_MAX:.6g}; torch: 'value cannot be "
                "converted to type float without overflow') and would write inf into the params",
                where,
            )
        )


def float_lr_in_range(lr: Any, beta1: Any = None, weight_decay: Any = None) -> bool:
    """Whether a float lr passes ``validate_lr`` (and, given ``beta1``, ``check_adamw_step_scalars``).

    Plain arithmetic and comparisons, for the compiled step: when dynamo makes a float lr a
    graph input (an unspecialised float) instead of a constant, a changed lr no longer
    retraces, so the trace-time validation would not see it; traced, this expression becomes
    a guard on the lr, and an lr set out of range retraces, where the validation refuses it.
    """
    ok = 0.0 <= lr <= FP32_MAX
    if ok and beta1 is not None:
        ok = fits_fp32(lr / (1.0 - beta1)) and fits_fp32(1.0 - lr * weight_decay)
    return ok


def cycles_momentum(group: dict[str, Any]) -> bool:
    """Whether an LR scheduler cycles the group's betas / momentum (OneCycleLR, CyclicLR with
    ``cycle_momentum=True``: the keys they add to the group), which a compiled step cannot take."""
    return "max_momentum" in group or "base_momentum" in group


def check_backend_arg(opt_name: str, backend: Any) -> Any:
    from fastamp.ops import backends

    if backend is not None and backend != "auto" and backend not in backends.BACKENDS:
        raise ValueError(
            f"{opt_name}: unknown backend {backend!r}; expected one of {backends.BACKENDS}, 'auto' or None"
        )
    return None if backend == "auto" else backend


def check_real_number(opt_name: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{opt_name}: {name} must be a real number, got {type(value).__name__}")


def _fmt_shape(t: Any) -> str:
    return str(tuple(t.shape)) if isinstance(t, Tensor) else type(t).__name__


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


class _StateValidation:
    """The checks of the state a step's launches read (see :class:`~fastamp.optim.engine.base.FusedOptimizer`)."""

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
            if (
                t is not None
                and not (type(t) is Tensor and t.shape == shape and t.device == device and t.is_floating_point())
            ) or (key + "_q" in st or key + "_scale" in st):
                from fastamp.optim.formats import moments as _formats

                _formats.check_held(self, gi, i, p, st, key)  # q8 codes (other keys), or a clear error
        if kind == "fp32" or kind == "remainder" or kind == "ulp8":
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
            t = st.get("master_ulp8")
            if t is not None:
                self._check_state_tensor(gi, i, p, "master_ulp8", t, torch.int8, contiguous=True)
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
