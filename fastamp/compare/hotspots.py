"""Where a training step's time goes: torch.profiler over a few steps per regime, the top ops.

The report explains the speed column from this measurement: for each low-precision row
much slower than fp32, the op whose time grew the most against fp32's profile of the same
model, with its share of the step. On CPU an op's time is its self CPU time; on CUDA its
self device time (kernels), since the CPU side only launches them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from fastamp._harness import markdown_table
from fastamp.compare.memory import _profiler_noise_filtered

# A row this much slower than fp32 gets a line saying which op took the time.
SLOW_RATIO = 0.67
TOP_N = 3


@dataclass
class OpProfile:
    """Self time per op name (microseconds) in one profiled step (or the least over ``steps``), largest first."""

    device: str
    ops: list[tuple[str, float]] = field(default_factory=list)
    steps: int = 1

    @property
    def total_us(self) -> float:
        return sum(us for _, us in self.ops)

    def us(self, name: str) -> float:
        return next((us for n, us in self.ops if n == name), 0.0)

    def share(self, name: str) -> float:
        return self.us(name) / self.total_us if self.total_us > 0 else float("nan")

    def top(self, n: int = TOP_N) -> list[tuple[str, float]]:
        return self.ops[:n]

    @classmethod
    def fastest(cls, profiles: list[OpProfile]) -> OpProfile:
        """Each op's least self time over the ``profiles`` it appears in, largest first.

        The profiler times ops by the wall clock: an op during which another process held
        the CPU looks longer, never shorter, so the least of a few steps is the op's own time.
        """
        names = list(dict.fromkeys(n for p in profiles for n, _ in p.ops))
        ops = [(n, min(p.us(n) for p in profiles if any(m == n for m, _ in p.ops))) for n in names]
        ops.sort(key=lambda x: -x[1])
        return cls(profiles[0].device if profiles else "cpu", ops, len(profiles))


def _self_us(evt: Any, device: str) -> float:
    if device == "cuda":
        for attr in ("self_device_time_total", "self_cuda_time_total"):
            if hasattr(evt, attr):
                return float(getattr(evt, attr))
        return 0.0
    return float(evt.self_cpu_time_total)


def profile_step(step_fn: Callable[[], Any], device: torch.device) -> OpProfile:
    """Run ``step_fn`` once under torch.profiler and keep each op's self time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with _profiler_noise_filtered(), profile(activities=acts) as prof:
        step_fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    ops = []
    for evt in prof.key_averages():
        us = _self_us(evt, device.type)
        # the profiler's own bookkeeping entries, not ops the step ran
        if us > 0 and not evt.key.startswith(("ProfilerStep", "[memory]")):
            ops.append((evt.key, us))
    ops.sort(key=lambda x: -x[1])
    return OpProfile(device.type, ops)


def _ms(us: float) -> str:
    return f"{us / 1e3:.2f} ms" if us >= 100 else f"{us:.0f} us"


def _short(name: str, width: int = 48) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def top_ops_text(p: OpProfile, n: int = TOP_N) -> str:
    return ", ".join(f"{_short(name)} {100 * us / p.total_us:.0f}%" for name, us in p.top(n))


def hotspot_table(results: list, model: str) -> str:
    """Markdown table: per regime, the profiled step's op time and its top ops with their shares."""
    cells = []
    for r in results:
        if r.model != model or r.error or r.op_profile is None or not r.op_profile.ops:
            continue
        p = r.op_profile
        cells.append({"regime": r.regime, "ops": _ms(p.total_us), "top": top_ops_text(p)})
    if not cells:
        return ""
    device = next(r.op_profile.device for r in results if r.model == model and r.op_profile is not None)
    kind = "device" if device == "cuda" else "CPU"
    cols = [("regime", "regime"), ("ops", f"self {kind} time in ops"), ("top", "top ops (share of that time)")]
    return markdown_table(cells, cols, cell=str)


def slowdown_lines(results: list) -> list[str]:
    """For each row at most :data:`SLOW_RATIO` of fp32's speed: the op that grew the most, and its share."""
    out = []
    by = {(r.model, r.regime): r for r in results if not r.error}
    for r in results:
        base = by.get((r.model, "fp32"))
        if r.error or r is base or base is None or r.op_profile is None or base.op_profile is None:
            continue
        if not (math.isfinite(r.speed_vs_fp32) and r.speed_vs_fp32 <= SLOW_RATIO):
            continue
        p, b = r.op_profile, base.op_profile
        if not p.ops:
            continue
        name, grew = max(((n, us - b.us(n)) for n, us in p.ops), key=lambda x: x[1])
        out.append(
            f"{r.model}/{r.regime} ({r.speed_vs_fp32:.3g}x fp32's speed): {name} took {_ms(p.us(name))} per "
            f"profiled step ({100 * p.share(name):.0f}% of its op time) against {_ms(b.us(name))} in fp32's "
            f"({100 * b.share(name):.0f}%); it accounts for {100 * grew / max(p.total_us - b.total_us, 1e-9):.0f}% "
            f"of the extra time"
        )
    return out


def dominant_ops(results: list) -> dict[str, list[str]]:
    """``{op name: [model/regime, ...]}`` for the op that dominates each slow row (the report's summary)."""
    out: dict[str, list[str]] = {}
    by = {(r.model, r.regime): r for r in results if not r.error}
    for r in results:
        base = by.get((r.model, "fp32"))
        if r.error or base is None or r is base or r.op_profile is None or base.op_profile is None:
            continue
        if not (math.isfinite(r.speed_vs_fp32) and r.speed_vs_fp32 <= SLOW_RATIO) or not r.op_profile.ops:
            continue
        name = max(((n, us - base.op_profile.us(n)) for n, us in r.op_profile.ops), key=lambda x: x[1])[0]
        out.setdefault(name, []).append(f"{r.model}/{r.regime}")
    return out
