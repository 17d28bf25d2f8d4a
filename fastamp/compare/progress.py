"""The job's progress line (tqdm) and its ETA, computed from each regime's measured step cost.

Regimes differ in cost by up to 100x on a CPU (an fp16 CNN step against an fp32 one), so a
rate averaged over all steps so far says little about the steps left. The ETA here sums,
over the regimes, the steps each has left times its own measured wall time per step.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Hashable, Mapping
from typing import IO

# Step 0 builds optimizer state and warms caches: a cost estimate uses it only until a
# later step of the same regime has been timed.
_FIRST_STEP = 0


def eta_seconds(remaining: Mapping[Hashable, int], cost_s: Mapping[Hashable, float]) -> float | None:
    """Seconds left: the sum over regimes of steps left x that regime's seconds per step.

    None while a regime with steps left has no measured cost yet.
    """
    total = 0.0
    for key, n in remaining.items():
        if n <= 0:
            continue
        c = cost_s.get(key)
        if c is None:
            return None
        total += n * c
    return total


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


_BAR_FORMAT = "{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} steps [{elapsed}, eta {eta}]{postfix}"


def _tqdm_class():
    try:
        from tqdm import tqdm
    except ImportError:
        return None

    class _EtaBar(tqdm):
        """tqdm whose ``{eta}`` field is the job's own estimate, not tqdm's rate average."""

        eta = "?"

        @property
        def format_dict(self):
            d = super().format_dict
            d["eta"] = self.eta
            return d

    return _EtaBar


class JobProgress:
    """Progress over every (model, regime)'s steps: one line redrawn in place on a terminal.

    On a terminal the line is tqdm's, as wide as the terminal and no wider; elsewhere (a
    log file, a pipe) one line per 10% is written. ``record(key, wall_s, estimate=...)``
    counts a step; steps with ``estimate=False`` (profiled ones) do not feed the cost.
    """

    def __init__(self, steps: Mapping[Hashable, int], enabled: bool = True, stream: IO[str] | None = None):
        self.remaining = dict(steps)
        self.total = sum(self.remaining.values())
        self.samples: dict[Hashable, list[float]] = {k: [] for k in self.remaining}
        self.first: dict[Hashable, float] = {}
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.n = 0
        self.t0 = time.perf_counter()
        self._decile = -1
        self.tqdm_missing = False
        self.bar = None
        if not enabled:
            return
        cls = _tqdm_class()
        if cls is None:
            self.tqdm_missing = True
            return
        self._cls = cls
        if getattr(self.stream, "isatty", lambda: False)():
            self.bar = cls(
                total=self.total, desc="compare", file=self.stream, dynamic_ncols=True,
                bar_format=_BAR_FORMAT, mininterval=0.5, leave=True,
            )  # fmt: skip

    def costs(self) -> dict[Hashable, float]:
        out = {}
        for k in self.remaining:
            if self.samples[k]:
                out[k] = statistics.median(self.samples[k])
            elif k in self.first:
                out[k] = self.first[k]
        return out

    def eta(self) -> float | None:
        return eta_seconds(self.remaining, self.costs())

    def record(self, key: Hashable, wall_s: float, step: int, estimate: bool = True, label: str = "") -> None:
        self.remaining[key] -= 1
        self.n += 1
        if estimate:
            if step == _FIRST_STEP:
                self.first[key] = wall_s
            else:
                self.samples[key].append(wall_s)
        if not self.enabled or self.tqdm_missing:
            return
        eta = format_eta(self.eta())
        if self.bar is not None:
            self.bar.eta = eta
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
            return
        decile = int(10 * self.n / max(1, self.total))
        if decile != self._decile or self.n == self.total:
            self._decile = decile
            line = self._cls.format_meter(
                self.n, self.total, time.perf_counter() - self.t0, ncols=80, prefix="compare",
                bar_format=_BAR_FORMAT, postfix=label, eta=eta,
            )  # fmt: skip
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
