"""Was the machine busy with other work while the job ran? Measured before and during the run.

A step time measured while other processes compete for the CPUs is not the machine's step
time. The job therefore measures, rather than assumes, how busy the machine was:

- before the run, the 1-minute load average and a short sample of ``/proc/stat`` while the
  job itself sleeps (every busy CPU-second in it is another process's), reported as facts:
  a burst of other work that ends before the job starts does not make it a loaded run;
- during the run, ``/proc/stat`` again (CPU time of all processes, and the hypervisor's
  steal) minus the job's own CPU time, and the job's share: its CPU time over the wall time
  its threads could have used. A thread that waits for a CPU has a share below 1.

:func:`assess` turns two :class:`Snapshot` s into a verdict; the readers are module
attributes so that a test can inject a busy machine.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

# Below this share of its wall time on a CPU, the job's threads were waiting for one.
MIN_SHARE = 0.85
# Other processes' average CPU use above (CPUs - the job's threads + this) leaves the job
# fewer CPUs than threads: the same contention, seen from the machine's side.
SPARE_MARGIN = 0.25
# More than this fraction of the machine's time stolen by the hypervisor.
MAX_STEAL = 0.05


@dataclass
class CpuTimes:
    """Seconds of CPU time since boot, summed over all CPUs (the ``cpu`` line of ``/proc/stat``)."""

    busy: float
    idle: float
    steal: float

    @property
    def total(self) -> float:
        return self.busy + self.idle + self.steal


def read_proc_stat(path: str = "/proc/stat") -> CpuTimes | None:
    """The machine's CPU times from ``path``; None where there is no such file (not Linux)."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    v = [int(x) / tick for x in fields[1:]] + [0.0] * 8
    user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
    # guest time is already counted in user and nice
    return CpuTimes(busy=user + nice + system + irq + softirq, idle=idle + iowait, steal=steal)


def read_loadavg() -> tuple[float, float, float] | None:
    return os.getloadavg() if hasattr(os, "getloadavg") else None


@dataclass
class Snapshot:
    wall: float
    job_cpu: float
    stat: CpuTimes | None
    loadavg: tuple[float, float, float] | None


def snapshot() -> Snapshot:
    """Wall clock, this process's CPU time (all threads), the machine's CPU times, the load average."""
    return Snapshot(time.perf_counter(), time.process_time(), read_proc_stat(), read_loadavg())


@dataclass
class Interval:
    """What the machine did between two snapshots, in CPUs (CPU-seconds per second)."""

    seconds: float
    job_cpus: float
    others_cpus: float | None
    steal_frac: float | None

    @classmethod
    def between(cls, a: Snapshot, b: Snapshot) -> Interval:
        dt = max(b.wall - a.wall, 1e-9)
        job = (b.job_cpu - a.job_cpu) / dt
        others = steal = None
        if a.stat is not None and b.stat is not None:
            busy = (b.stat.busy - a.stat.busy) / dt
            others = max(0.0, busy - job)
            total = b.stat.total - a.stat.total
            steal = (b.stat.steal - a.stat.steal) / total if total > 0 else 0.0
        return cls(dt, job, others, steal)


@dataclass
class LoadVerdict:
    under_load: bool
    summary: str
    reasons: list[str] = field(default_factory=list)
    share: float | None = None
    others_before: float | None = None
    others_during: float | None = None

    def banner(self) -> str:
        """One line for the top of the report and the PNG's title."""
        if not self.under_load:
            return ""
        return "UNDER LOAD: " + "; ".join(self.reasons)


def probe_before(seconds: float = 0.5) -> tuple[Snapshot, Interval]:
    """Sample the machine for ``seconds`` while this process sleeps: the load others put on it."""
    a = snapshot()
    time.sleep(seconds)
    b = snapshot()
    return b, Interval.between(a, b)


def _cpus(x: float) -> str:
    return f"{x:.2f}"


def assess(
    before: Interval | None,
    start: Snapshot,
    end: Snapshot,
    nproc: int,
    threads: int,
) -> LoadVerdict:
    """Judge whether other work competed with the job's ``threads`` on ``nproc`` CPUs."""
    during = Interval.between(start, end)
    share = during.job_cpus / max(1, threads)
    spare_limit = nproc - threads + SPARE_MARGIN
    reasons = []
    if share < MIN_SHARE:
        reasons.append(
            f"the job's {threads} thread{'s' if threads > 1 else ''} had a CPU {100 * share:.0f}% of the wall time "
            f"(a free machine gives about 100%)"
        )
    if during.others_cpus is not None and during.others_cpus > spare_limit:
        reasons.append(f"other processes kept {_cpus(during.others_cpus)} of the {nproc} CPUs busy during the run")
    if during.steal_frac is not None and during.steal_frac > MAX_STEAL:
        reasons.append(f"the hypervisor took {100 * during.steal_frac:.0f}% of the CPU time (steal)")
    facts = [f"the job's share of a CPU per thread {100 * share:.0f}%"]
    if during.others_cpus is not None:
        facts.append(f"other processes used {_cpus(during.others_cpus)} of {nproc} CPUs during the run")
    if before is not None and before.others_cpus is not None:
        facts.append(f"{_cpus(before.others_cpus)} in the {before.seconds:.1f} s before it")
    if during.steal_frac is not None:
        facts.append(f"steal {100 * during.steal_frac:.1f}%")
    if start.loadavg is not None:
        facts.append(f"load average {start.loadavg[0]:.2f} at the start")
    if end.loadavg is not None:
        facts.append(f"{end.loadavg[0]:.2f} at the end (the job itself counts {threads})")
    verdict = "under load" if reasons else "not loaded"
    summary = f"{verdict}: " + ", ".join(facts) + " (/proc/stat, the job's CPU time, os.getloadavg)"
    return LoadVerdict(
        under_load=bool(reasons),
        summary=summary,
        reasons=reasons,
        share=share,
        others_before=None if before is None else before.others_cpus,
        others_during=during.others_cpus,
    )
