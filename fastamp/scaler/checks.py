"""Host-side checks of the Scaler's settings: the values torch leaves unchecked.

Every scale-like value (init_scale, new_scale, a loaded scale, the factors and bounds) must
be a real number, finite, > 0 and still so in fp32, because the scale is an fp32 tensor:
1e39 would be inf there and 0 would make every step overflow forever. Each check raises
before anything is changed, naming the method (``where``) and the argument. Also the
refusal of an optimizer under gradient release, whose scaler calls ``h.backward`` makes.
"""

from __future__ import annotations

import math
import numbers
import operator
import struct
from typing import Any

import torch
from torch import Tensor

_FP32_MAX = float(torch.finfo(torch.float32).max)


def _to_fp32(v: float) -> float:
    """``v`` rounded to fp32 (to nearest even, as ``torch.full`` / ``fill_`` store it); inf on overflow."""
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def _positive_fp32(where: str, name: str, v: Any) -> float:
    """``v`` as a Python float if it is a real number, finite, > 0, and still so in fp32.

    Refused: bools, non-reals, NaN, +-inf, 0 and negatives, values that overflow fp32 (1e39
    is a finite double but inf in fp32) and positive values that round to 0 in fp32. numpy
    scalars are accepted (``numbers.Real``).
    """
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{where}: {name} must be a real number, got {type(v).__name__}")
    f = float(v)
    if math.isfinite(f) and f > 0 and 0 < _to_fp32(f) < math.inf:
        return f
    raise ValueError(
        f"{where}: {name} must be finite, > 0 and representable in fp32 (at most {_FP32_MAX!r}, "
        f"not rounding to 0), got {v!r}"
    )


def _int_in(where: str, name: str, v: Any, lo: int, hi: int, rule: str) -> int:
    """``v`` as a Python int if it is an integer (``operator.index``: numpy ints too, not bools) in [lo, hi]."""
    if not isinstance(v, bool):
        try:
            i = operator.index(v)
        except TypeError:
            i = None
        if i is not None and lo <= i <= hi:
            return i
    raise ValueError(f"{where}: {name} must be {rule}, got {v!r}")


_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1


def _growth_factor(where: str, v: Any) -> float:
    f = _positive_fp32(where, "growth_factor", v)
    if not f > 1:
        raise ValueError(f"{where}: growth_factor must be > 1, got {v!r}")
    return f


def _backoff_factor(where: str, v: Any) -> float:
    f = _positive_fp32(where, "backoff_factor", v)
    if not f < 1:
        raise ValueError(f"{where}: backoff_factor must be in (0, 1), got {v!r}")
    return f


def _growth_interval(where: str, v: Any) -> int:
    return _int_in(where, "growth_interval", v, 0, _INT64_MAX, "an int >= 0 (0: never grow)")


def _hysteresis(where: str, v: Any) -> int:
    return _int_in(where, "hysteresis", v, 1, _INT32_MAX, f"an int >= 1 (at most {_INT32_MAX})")


def _scale_bounds(where: str, min_scale: Any, max_scale: Any) -> tuple[float | None, float | None]:
    lo = None if min_scale is None else _positive_fp32(where, "min_scale", min_scale)
    hi = None if max_scale is None else _positive_fp32(where, "max_scale", max_scale)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"{where}: min_scale ({lo!r}) must be <= max_scale ({hi!r})")
    return lo, hi


def _clamp(v: float, lo: float | None, hi: float | None) -> float:
    if lo is not None and v < lo:
        return lo
    if hi is not None and v > hi:
        return hi
    return v


def _check_scale_settings(
    where: str, scale_name: str, scale, growth_factor, backoff_factor, growth_interval
) -> tuple[float, float, float, int]:
    """Host-side checks of the scale settings torch leaves unchecked; returns them as Python numbers.

    Python numbers (not numpy scalars) are kept, so that :meth:`Scaler.state_dict` loads with
    ``torch.load(weights_only=True)``.
    """
    return (
        _positive_fp32(where, scale_name, scale),
        _growth_factor(where, growth_factor),
        _backoff_factor(where, backoff_factor),
        _growth_interval(where, growth_interval),
    )


def _check_state_dict(
    state_dict: dict[str, Any], hysteresis: int, min_scale: float | None, max_scale: float | None
) -> dict[str, Any]:
    """The settings a ``fastamp.Scaler`` or ``torch.amp.GradScaler`` state dict holds, checked.

    ``hysteresis``, ``min_scale``, ``max_scale``: the scaler's own, kept where the dict (a
    torch one) lacks them. Raises torch's errors for an empty dict or a missing torch key,
    and the constructor's for a bad value. Returns the scaler's attributes by name, the
    scale clamped into the (loaded, else configured) bounds.
    """
    if len(state_dict) == 0:
        raise RuntimeError(
            "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
        )
    missing = [
        k
        for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
        if k not in state_dict
    ]
    if missing:
        raise KeyError(missing[0])
    # everything is checked before anything is assigned (a bad dict leaves the scaler as it was)
    where = "fastamp.Scaler.load_state_dict"
    scale, growth_factor, backoff_factor, growth_interval = _check_scale_settings(
        where,
        "scale",
        state_dict["scale"],
        state_dict["growth_factor"],
        state_dict["backoff_factor"],
        state_dict["growth_interval"],
    )
    hysteresis = _hysteresis(where, state_dict.get("hysteresis", hysteresis))
    growth_tracker = _int_in(
        where, "_growth_tracker", state_dict["_growth_tracker"], 0, _INT32_MAX, f"an int >= 0 and <= {_INT32_MAX}"
    )
    hysteresis_tracker = _int_in(
        where,
        "_hysteresis_tracker",
        state_dict.get("_hysteresis_tracker", hysteresis),
        0,
        hysteresis,
        f"an int >= 0 and <= hysteresis ({hysteresis})",
    )
    skipped_steps = _int_in(where, "skipped_steps", state_dict.get("skipped_steps", 0), 0, _INT64_MAX, "an int >= 0")
    last_skipped = state_dict.get("last_step_skipped", False)
    if not isinstance(last_skipped, (bool, numbers.Integral)) or last_skipped not in (0, 1):
        raise ValueError(f"{where}: last_step_skipped must be a bool, got {last_skipped!r}")
    min_scale, max_scale = _scale_bounds(
        where, state_dict.get("min_scale", min_scale), state_dict.get("max_scale", max_scale)
    )
    scale = _clamp(scale, min_scale, max_scale)
    return {
        "_init_scale": scale,
        "_growth_factor": growth_factor,
        "_backoff_factor": backoff_factor,
        "_growth_interval": growth_interval,
        "_init_growth_tracker": growth_tracker,
        "_hysteresis": hysteresis,
        "_init_hysteresis_tracker": hysteresis_tracker,
        "_min_scale": min_scale,
        "_max_scale": max_scale,
        "_init_skipped_steps": skipped_steps,
        "_init_last_step_skipped": bool(last_skipped),
    }


def _check_new_scale(new_scale: Any, device_type: str | None) -> float:
    """``update(new_scale)``'s value: a real number, or a 1-element tensor on the scaler's device type.

    torch's AssertionError for a wrong kind of tensor; ValueError unless finite, > 0 and
    representable in fp32 (a tensor is read on the host for that: one sync).
    """
    where = "fastamp.Scaler.update"
    if isinstance(new_scale, numbers.Real) and not isinstance(new_scale, bool):
        return _positive_fp32(where, "new_scale", new_scale)
    reason = (
        "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
        "torch.FloatTensor with requires_grad=False."
    )
    if not isinstance(new_scale, Tensor):
        raise AssertionError(reason)
    if new_scale.device.type != device_type:
        raise AssertionError(reason)
    if new_scale.numel() != 1:
        raise AssertionError(reason)
    if new_scale.requires_grad is True:
        raise AssertionError(reason)
    return _positive_fp32(where, "new_scale", new_scale.item())


def _refuse_released(optimizer: Any, name: str) -> None:
    """Refuse ``scaler.<name>(optimizer)`` on an optimizer under :func:`fastamp.release`, before anything changes.

    Its grads are gone once ``h.backward`` returns: a leftover call of the ordinary loop would find
    none, record no inf check, and leave an iteration that ``update()`` refuses to end.
    """
    if getattr(optimizer, "_release", None) is not None:
        raise RuntimeError(
            f"fastamp.Scaler.{name}: the optimizer is under gradient release (fastamp.release): h.backward(loss) "
            "already scales the loss, checks and clips the grads, steps the optimizer, calls scaler.update() and "
            f"frees the grads; drop scaler.{name}(...) and scaler.update() from the loop (each step is "
            "h.backward(loss) alone), or call h.remove() to go back to the ordinary loop"
        )
