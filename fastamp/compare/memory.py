"""Peak memory of a training step on CPU, measured from the allocator (CUDA has its own counters)."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from typing import Any, Callable

import torch
import torch.nn as nn


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return (s.device.type, s.data_ptr(), s.nbytes())


def live_bytes(*objs: Any) -> int:
    """Bytes of the distinct storages of every tensor reachable from ``objs`` (dicts/lists/modules/optimizers)."""
    seen = set()
    total = 0

    def visit(o: Any) -> None:
        nonlocal total
        if isinstance(o, torch.Tensor):
            for t in (o, o.grad) if o.grad is not None else (o,):
                key = _storage_key(t)
                if key not in seen and key[1] != 0:
                    seen.add(key)
                    total += key[2]
        elif isinstance(o, nn.Module):
            for t in list(o.parameters()) + list(o.buffers()):
                visit(t)
        elif isinstance(o, torch.optim.Optimizer):
            for st in o.state.values():
                visit(st)
        elif isinstance(o, dict):
            for v in o.values():
                visit(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                visit(v)
        elif o is not None and hasattr(o, "__dict__") and type(o).__module__.startswith(("torch.amp", "fastamp")):
            visit(vars(o))

    for o in objs:
        visit(o)
    return total


def param_bytes(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages that belong to ``params``: each param, its grad and its optimizer state.

    A storage that another param's optimizer state holds too (the group's rng counter that
    fastamp's params share) is left out: it does not grow with the params.
    """
    holders: dict[tuple, int] = {}
    for st in opt.state.values():
        keys = {_storage_key(t) for t in st.values() if isinstance(t, torch.Tensor)} if isinstance(st, dict) else ()
        for key in keys:
            holders[key] = holders.get(key, 0) + 1
    seen = set()
    for p in params:
        own = [p] + ([p.grad] if p.grad is not None else [])
        state = opt.state.get(p, {})
        own += [t for t in state.values() if isinstance(t, torch.Tensor) and holders.get(_storage_key(t), 0) == 1]
        seen.update(key for key in map(_storage_key, own) if key[1] != 0)
    return sum(key[2] for key in seen)


# What torch's profiler writes straight to the process's stderr (C++, not Python warnings) each
# time it starts and stops: kineto's "USDT: ... profiler_start" / "profiler_stop" (and
# "STAGE:" lines in older kinetos), and c10's one-time note that blocks allocated before
# the profile have no free event (expected: the meter counts them in its start total).
_PROFILER_NOISE = re.compile(
    r"^(?:USDT|STAGE):.*\] (?:profiler_st(?:art|op)|Completed Stage)"
    r"|CPUAllocator\.cpp.*allocated before the profiling started"
)


@contextlib.contextmanager
def _profiler_noise_filtered():
    """Collect what is written to file descriptor 2 inside, and pass on all but :data:`_PROFILER_NOISE`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not _PROFILER_NOISE.search(line))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


class CpuPeakMeter:
    """Peak bytes of torch's CPU allocator over one training step.

    Measured, not computed: the live storages reachable from the model, optimizer, scaler
    and batch at the start of the step (summed, deduplicated by storage), plus the highest
    running total of every allocation and free made during the step, as recorded by
    ``torch.profiler`` with ``profile_memory=True`` (activations, autocast weight copies,
    grads, optimizer temporaries). Python objects and allocator caching are not counted.
    The lines the profiler prints on stderr when it starts and stops are held back; anything
    else written to stderr during the step is passed on after it.
    """

    method = (
        "CPU: live tensor storages at step start (model, optimizer state, scaler, batch) + peak of "
        "torch's CPU allocations during one full training step (torch.profiler, profile_memory=True)"
    )

    def __init__(self):
        self.peak = None

    def measure(self, step_fn: Callable[[], Any], *objs: Any) -> Any:
        from torch.profiler import ProfilerActivity, profile

        base = live_bytes(*objs)
        with _profiler_noise_filtered(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = step_fn()
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        events = [e for e in events if str(e.device_type()).endswith("CPU")]
        events.sort(key=lambda e: e.start_ns())
        cur = peak = 0
        for e in events:
            cur += e.nbytes()
            peak = max(peak, cur)
        self.peak = base + peak
        return out


class CudaPeakMeter:
    """Peak bytes of torch's CUDA allocator over one training step, measured as :class:`CpuPeakMeter` does.

    The live storages reachable from the model, optimizer and scaler at the start of the step,
    plus the highest ``torch.cuda.max_memory_allocated`` reached during the step above what
    was allocated when it started. Other regimes' models, alive at the same time when the
    job interleaves the regimes, are in neither term.
    """

    method = (
        "CUDA: live tensor storages at step start (model, optimizer state, scaler) + torch.cuda.max_memory_allocated "
        "during one full training step above the allocation at its start"
    )

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = None

    def measure(self, step_fn: Callable[[], Any], *objs: Any) -> Any:
        base = live_bytes(*objs)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        start = torch.cuda.memory_allocated(self.device)
        out = step_fn()
        torch.cuda.synchronize(self.device)
        self.peak = base + torch.cuda.max_memory_allocated(self.device) - start
        return out
