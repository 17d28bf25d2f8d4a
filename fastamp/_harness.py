"""What ``fastamp.compare`` and the microbenchmarks (``benchmarks/``) both need.

The header every result file starts with (machine, versions, commit, command line), the
device and its synchronisation, timing (interleaved rounds, median), a progress bar, and the
CSV / Markdown writers. It lives in the package because ``fastamp-compare`` must run from an
installed fastamp, where ``benchmarks/`` is not; ``benchmarks/common.py`` imports it from here.
"""

from __future__ import annotations

import csv
import datetime
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Callable

import torch

# Where git is asked for the commit: the checkout fastamp runs from (an editable install). From
# an installed wheel this is site-packages: "unknown", or the commit of a checkout it sits in.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def resolve_device(arg: str | None) -> torch.device:
    if arg is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(arg)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was requested but torch.cuda.is_available() is False")
    return dev


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], object], device: torch.device, inner: int = 1) -> float:
    """Seconds per call of ``fn``, over ``inner`` back-to-back calls between two synchronisations."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / inner


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    rounds: int | None = None,
    budget_s: float = 2.0,
    warmup: int = 2,
    min_rounds: int = 3,
    max_rounds: int = 30,
) -> dict[str, dict[str, float]]:
    """Median and min seconds per call of each function, timed in interleaved rounds.

    Rounds alternate between the functions so that load from other processes on a shared
    machine hits all of them alike. The number of rounds adapts to ``budget_s`` per
    function (at least ``min_rounds``); on CUDA each round times a batch of calls large
    enough to hide launch latency and the synchronize.
    """
    est: dict[str, float] = {}
    inner: dict[str, int] = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        t = time_once(fn, device, 1)
        inner[name] = max(1, min(1000, int(0.02 / max(t, 1e-7)))) if device.type == "cuda" else 1
        est[name] = t
    if rounds is None:
        slowest = max(est.values()) if est else 0.0
        rounds = int(min(max_rounds, max(min_rounds, budget_s / max(slowest, 1e-6))))
    samples: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(time_once(fn, device, inner[name]))
    out = {}
    for name, s in samples.items():
        s.sort()
        out[name] = {"median_s": s[len(s) // 2], "min_s": s[0], "rounds": len(s)}
    return out


def _run(cmd: Sequence[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=ROOT).stdout.strip()
    except Exception:
        return ""


def cpu_model() -> str:
    for line in _run(["lscpu"]).splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def git_commit() -> str:
    sha = _run(["git", "rev-parse", "--short=12", "HEAD"]) or "unknown"
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return sha + ("-dirty" if dirty else "")


def command_line() -> str:
    """This process's command line, written so that it can be run again.

    ``python -m pkg`` when started as a module (``sys.argv[0]`` is then the path of
    ``pkg/__main__.py``), the bare name for a console script such as ``fastamp-compare``,
    ``python`` and the arguments otherwise (a script, ``python -c``).
    """
    args = [shlex.quote(a) for a in sys.argv[1:]]
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        module = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return " ".join(["python", "-m", module] + args)
    if not sys.argv[0].endswith(".py") and os.path.isfile(sys.argv[0]):
        return " ".join([os.path.basename(sys.argv[0])] + args)
    return "python " + " ".join(shlex.quote(a) for a in sys.argv)


def machine_info(device: torch.device) -> dict[str, str]:
    """Date, machine, versions, commit and command line: the header of every result file."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": f"{cpu_model()}, {os.cpu_count()} logical CPUs, torch threads {torch.get_num_threads()}, "
        f"capability {torch.backends.cpu.get_cpu_capability()}",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "command": command_line(),
        "device": str(device),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = "not importable"
    try:
        from fastamp.ops import registry

        info["fastamp_build"] = (
            str(registry.build_info()) if registry.NATIVE_LOADED else f"native not loaded: {registry.NATIVE_ERROR}"
        )
        isa = registry.cpu_isa()
        if isa is not None:
            # FASTAMP_CPU_ISA may force a narrower one than the machine's, which the cpu line's
            # torch capability does not show
            forced = os.environ.get("FASTAMP_CPU_ISA")
            info["fastamp_cpu_isa"] = isa + (f" (FASTAMP_CPU_ISA={forced})" if forced else "")
    except Exception as e:
        info["fastamp_build"] = f"unknown ({e})"
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = str(torch.version.cuda)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    if load is not None:
        info["load_avg_at_start"] = " ".join(f"{x:.2f}" for x in load)
    return info


class Progress:
    """A plain stderr progress bar (redrawn in place on a terminal, one line per 10% otherwise)."""

    def __init__(self, total: int, label: str = "", stream=None, enabled: bool = True):
        self.total = max(1, total)
        self.n = 0
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.t0 = time.perf_counter()
        self._last_decile = -1

    def update(self, k: int = 1, msg: str = "") -> None:
        self.n = min(self.total, self.n + k)
        if not self.enabled:
            return
        frac = self.n / self.total
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        width = 28
        bar = "#" * int(width * frac) + "-" * (width - int(width * frac))
        line = f"{self.label} [{bar}] {self.n}/{self.total} {elapsed:5.0f}s eta {eta:4.0f}s {msg}"
        if self.tty:
            # never wider than the terminal: a wrapped line is no longer redrawn in place by "\r"
            # and scrolls at every update (a fixed 150 columns did on an 80-column terminal)
            columns = max(20, shutil.get_terminal_size().columns - 1)
            self.stream.write("\r" + line[:columns].ljust(columns))
            if self.n == self.total:
                self.stream.write("\n")
        else:
            decile = int(frac * 10)
            if decile != self._last_decile or self.n == self.total:
                self._last_decile = decile
                self.stream.write(line + "\n")
        self.stream.flush()


def fmt(v, digits: int = 3) -> str:
    if v is None or v == "":
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf"
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.{digits}g}"
        return f"{v:.{digits}f}" if abs(v) < 10 else f"{v:.{max(1, digits - 2)}f}"
    return str(v)


def markdown_table(
    rows: list[dict[str, object]], cols: Sequence[tuple[str, str]], cell: Callable[[object], str] = fmt
) -> str:
    """A Markdown table: ``cols`` are (row key, header) pairs; ``cell`` writes each value."""
    head = "| " + " | ".join(h for _, h in cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    body = ["| " + " | ".join(cell(r.get(k)) for k, _ in cols) + " |" for r in rows]
    return "\n".join([head, sep] + body)


def write_csv(path: str, rows: list[dict[str, object]]) -> None:
    keys: list[str] = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow(r)


def unscale_and_clip(scaler, optimizer, params, max_norm: float) -> None:
    """Clip the grads of a scaled step the way each scaler does it best.

    ``fastamp.Scaler``: its fused ``clip_grad_norm_`` (checked first: it subclasses
    ``torch.amp.GradScaler``); torch's scaler: ``unscale_`` + ``clip_grad_norm_(foreach=True)``.
    """
    import fastamp

    if isinstance(scaler, fastamp.Scaler):
        scaler.clip_grad_norm_(optimizer, max_norm)
    else:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
