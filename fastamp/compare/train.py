"""One regime's training run, step by step: the loop, its timing, its memory, its losses and loss scales.

A :class:`RegimeRun` holds one regime's model and optimizer and runs its steps a block at a
time, so that the job can interleave the regimes (every regime then sees the same load from
other processes). :func:`train_regime` runs one regime start to finish.

The first block, steps 0-6, sets up and measures: steps 0-1 warm up (the optimizer state is
created at step 0), step 2 is measured for peak memory, step 3 warms the caches again after
the memory profiler, steps 4-6 are profiled op by op (``torch.profiler``; the report takes
each op's least time over the three, as an op preempted by another process only looks
longer). Then blocks of :data:`BLOCK` steps: the first step of each block runs untimed, because
it finds the caches full of the previous regime's data (measured: an fp32 GPT step right
after an fp16 CNN step took 1.4 ms longer), and the others are timed. On CPU each timed step
is timed on its own, by wall clock and by the process's CPU time; on CUDA the timed steps of
a block together, between two synchronisations.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from fastamp._harness import sync, unscale_and_clip
from fastamp.compare.hotspots import OpProfile, profile_step
from fastamp.compare.memory import CpuPeakMeter, CudaPeakMeter, live_bytes, param_bytes
from fastamp.compare.models import bn_running_var_max
from fastamp.compare.regimes import build_regime

MEMORY_STEP = 2
PROFILED_STEPS = (4, 5, 6)
FIRST_TIMED_BLOCK = 7
# steps per block after the first: one untimed step, then timed ones (more on CUDA, where a
# block's timed steps share one pair of synchronisations)
BLOCK = {"cpu": 4, "cuda": 10}
MIN_STEPS = FIRST_TIMED_BLOCK + 2
# The table's step time is this quantile of the timed steps. Another process can only make a
# step longer (CPU time too: it refills the caches the other process used), so a low quantile
# is nearer the step's own time than the median; not the minimum, which would pick the
# cheaper steps an fp16 scaler skips (about 7% of the steps here).
STEP_QUANTILE = 0.25
# The params the 7B projection is measured on: those of at least this many elements, the size
# from which fastamp's 8-bit formats apply (AdamW's lowbit_min_numel default). A 7B model is made
# of such tensors; a small model also has its biases, norms and small embeddings, whose state is
# larger per param (fp32 moments, fp32 LayerNorm params).
LARGE_NUMEL = 4096


@dataclass
class RegimeResult:
    model: str
    regime: str
    peak_mem_bytes: float = float("nan")
    # the live storages of params, grads, buffers, optimizer state and scaler right after the memory step,
    # and the param elements: the training state per param (no activations), measured
    state_bytes: float = float("nan")
    n_params: int = 0
    # the same for the params of at least LARGE_NUMEL elements alone (each param, its grad, its own
    # optimizer state): what the 7B projection is computed from
    large_state_bytes: float = float("nan")
    large_params: int = 0
    # the step time the table shows: the lower quartile (STEP_QUANTILE) of the timed steps, by ``clock``
    step_ms: float = float("nan")
    step_wall_ms: float = float("nan")
    step_cpu_ms: float = float("nan")
    clock: str = "wall"
    timed_steps: int = 0
    # (step, wall seconds, CPU seconds) of every timed step (on CUDA a block's mean per step)
    step_times: list[tuple[int, float, float]] = field(default_factory=list)
    final_loss: float = float("nan")
    initial_loss: float = float("nan")
    skipped_steps: Any = "-"
    bn_var_max: float | None = None
    final_scale: Any = "-"
    nonfinite_losses: int = 0
    error: str = ""
    losses: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    # steps whose update the optimizer skipped (its step counter did not move); None without a scaler
    skipped_at: list[int] | None = None
    init_scale: float | None = None
    # fastamp pitfall guards that fired during the run (AmpPitfallWarning keys, first-fired order)
    guards: list[str] = field(default_factory=list)
    op_profile: OpProfile | None = None
    speed_vs_fp32: float = float("nan")
    convergence_pct: float = float("nan")


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (the nearest rank below, no interpolation)."""
    v = sorted(values)
    return v[int(q * (len(v) - 1))]


def _lr_at(step: int, steps: int, base_lr: float) -> float:
    """Linear warmup over 5% of the steps, then cosine decay to 10% of ``base_lr``."""
    warm = max(1, steps // 20)
    if step < warm:
        return base_lr * (step + 1) / warm
    prog = (step - warm) / max(1, steps - warm)
    return base_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))


def _step_count(opt: torch.optim.Optimizer) -> float | None:
    for st in opt.state.values():
        s = st.get("step")
        if s is not None:
            return float(s)
    return None


_GUARD_KEY = re.compile(r"^fastamp \[([a-z0-9_]+)\]")


@contextlib.contextmanager
def pitfalls_recorded(into: list[str]):
    """Record the keys of the :class:`fastamp.AmpPitfallWarning` raised inside instead of printing them.

    The compare job runs deliberately bad regimes (``model.half()``, no masters) whose guards
    fire by design: the report lists them per regime. Any other warning is shown as usual.
    """
    from fastamp import AmpPitfallWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AmpPitfallWarning)
        yield
    for w in caught:
        if issubclass(w.category, AmpPitfallWarning):
            m = _GUARD_KEY.match(str(w.message))
            key = m.group(1) if m else str(w.message)
            if key not in into:
                into.append(key)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def _step_counter(opt: torch.optim.Optimizer) -> torch.Tensor:
    """A device copy of the optimizer's step counter (0 before its first step), read without a sync."""
    for st in opt.state.values():
        s = st.get("step")
        if s is not None:
            return s.detach().clone().reshape(()).float() if torch.is_tensor(s) else torch.tensor(float(s))
    return torch.zeros(())


class RegimeRun:
    """One regime's model, optimizer and scaler, trained a few steps per :meth:`advance` call.

    ``growth_interval`` goes to every scaler (torch's and fastamp's alike). The pitfall
    warnings fastamp raises are recorded in ``result.guards``, not printed. The loop has
    no host sync; a timed chunk synchronises the device at its two ends only.
    """

    def __init__(
        self,
        model_name: str,
        regime: str,
        base_model: nn.Module,
        data,
        device: torch.device,
        steps: int,
        lr: float,
        clip: float,
        growth_interval: int = 2000,
        measure_memory: bool = True,
        profile_ops: bool = True,
        cpu_clock: bool = False,
    ):
        self.result = RegimeResult(model_name, regime)
        self.data, self.device, self.steps, self.lr, self.clip = data, device, steps, lr, clip
        self.measure_memory, self.profile_ops = measure_memory, profile_ops
        # CPU time measures the work of a step even while other processes hold the CPU; it is
        # the step's time only when one thread does the work (more threads add their waits)
        self.result.clock = "cpu" if cpu_clock and device.type == "cpu" else "wall"
        self.next_step = 0
        self.losses: list[torch.Tensor] = []
        self.scales: list[torch.Tensor] = []
        self.counters: list[torch.Tensor] = []
        self.profiles: list[OpProfile] = []
        with pitfalls_recorded(self.result.guards):
            self.model = copy.deepcopy(base_model).to(device)
            self.opt, self.scaler, self.autocast_dtype, self.in_dtype = build_regime(
                regime, self.model, lr, device, growth_interval
            )
        if self.scaler is not None:
            self.result.init_scale = float(self.scaler.get_scale())
        # gradient release: backward steps the optimizer (and clips, with a second backward) and frees the grads
        self.release = None
        if regime.endswith("-release"):
            import fastamp

            self.release = fastamp.release(self.model, self.opt, max_norm=clip if clip > 0 else None)
        # the drop-in regime keeps torch's loop (unscale_ + clip_grad_norm_), not fastamp's fused clip
        self.torch_loop = regime == "fastamp-scaler-fp16"
        self.params = list(self.model.parameters())
        self.loss_fn = type(self.model).loss

    @property
    def done(self) -> bool:
        return self.next_step >= self.steps

    def _autocast(self):
        dt = self.autocast_dtype
        return torch.autocast(self.device.type, dtype=dt or torch.float32, enabled=dt is not None)

    def _one_step(self, step: int) -> None:
        x, y = self.data.train_batch(step)
        if self.in_dtype is not None and x.is_floating_point():
            x = x.to(self.in_dtype)
        opt, scaler = self.opt, self.scaler
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, self.steps, self.lr)
        opt.zero_grad(set_to_none=True)
        with self._autocast():
            loss = self.loss_fn(self.model(x), y)
        if self.release is not None:
            self.release.backward(loss)  # = loss.backward(); clip; opt.step(); opt.zero_grad(set_to_none=True)
        elif scaler is not None:
            scaler.scale(loss).backward()
            if self.clip > 0 and self.torch_loop:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
            elif self.clip > 0:
                unscale_and_clip(scaler, opt, self.params, self.clip)
            scaler.step(opt)
            scaler.update()
            self.scales.append(scaler._get_scale_async().detach().clone().reshape(()))
            self.counters.append(_step_counter(opt))
        else:
            loss.backward()
            if self.clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
            opt.step()
        self.losses.append(loss.detach().float().reshape(()))

    def chunk(self) -> int:
        """How many steps the next :meth:`advance` runs: the set-up block, then :data:`BLOCK` (a lone last step joins it)."""
        left = self.steps - self.next_step
        if self.next_step == 0:
            return min(FIRST_TIMED_BLOCK, left)
        n = min(BLOCK.get(self.device.type, BLOCK["cuda"]), left)
        return left if left - n == 1 else n

    def advance(self, n: int | None = None) -> list[tuple[int, float, bool]]:
        """Run the next block (``n`` steps, default :meth:`chunk`); return (step, wall seconds, timed) per step."""
        first = self.next_step
        n = min(self.chunk() if n is None else n, self.steps - first)
        dev = self.device
        out: list[tuple[int, float, bool]] = []
        with pitfalls_recorded(self.result.guards):
            if first < FIRST_TIMED_BLOCK:
                for step in range(first, first + n):
                    t0 = time.perf_counter()
                    if step == MEMORY_STEP and self.measure_memory:
                        meter = CudaPeakMeter(dev) if dev.type == "cuda" else CpuPeakMeter()
                        meter.measure(lambda s=step: self._one_step(s), self.model, self.opt, self.scaler)
                        self.result.peak_mem_bytes = float(meter.peak)
                        self.result.state_bytes = float(live_bytes(self.model, self.opt, self.scaler))
                        self.result.n_params = sum(p.numel() for p in self.model.parameters())
                        large = [p for p in self.model.parameters() if p.numel() >= LARGE_NUMEL]
                        if large:
                            self.result.large_state_bytes = float(param_bytes(large, self.opt))
                            self.result.large_params = sum(p.numel() for p in large)
                    elif step in PROFILED_STEPS and self.profile_ops:
                        self.profiles.append(profile_step(lambda s=step: self._one_step(s), dev))
                    else:
                        self._one_step(step)
                    sync(dev)
                    out.append((step, time.perf_counter() - t0, False))
            else:
                t0 = time.perf_counter()
                self._one_step(first)  # untimed: it refills the caches
                sync(dev)
                out.append((first, time.perf_counter() - t0, False))
                out += self._timed(first + 1, n - 1)
        self.next_step = first + n
        return out

    def _timed(self, first: int, n: int) -> list[tuple[int, float, bool]]:
        if n <= 0:
            return []
        if self.device.type != "cpu":
            t0, c0 = time.perf_counter(), time.process_time()
            for step in range(first, first + n):
                self._one_step(step)
            sync(self.device)
            wall, cpu = (time.perf_counter() - t0) / n, (time.process_time() - c0) / n
            self.result.step_times += [(step, wall, cpu) for step in range(first, first + n)]
            return [(step, wall, True) for step in range(first, first + n)]
        out = []
        for step in range(first, first + n):
            t0, c0 = time.perf_counter(), time.process_time()
            self._one_step(step)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            self.result.step_times.append((step, wall, cpu))
            out.append((step, wall, True))
        return out

    def finish(self) -> RegimeResult:
        """Evaluate on held-out batches (in the regime's own precision) and fill the result."""
        res = self.result
        if self.profiles:
            res.op_profile = OpProfile.fastest(self.profiles)
        if res.step_times:
            res.timed_steps = len(res.step_times)
            res.step_wall_ms = quantile([w for _, w, _ in res.step_times], STEP_QUANTILE) * 1e3
            res.step_cpu_ms = quantile([c for _, _, c in res.step_times], STEP_QUANTILE) * 1e3
            res.step_ms = res.step_cpu_ms if res.clock == "cpu" else res.step_wall_ms
        with pitfalls_recorded(res.guards):
            self.model.eval()
            with torch.no_grad():
                vals = []
                for x, y in self.data.val_batches():
                    if self.in_dtype is not None and x.is_floating_point():
                        x = x.to(self.in_dtype)
                    with self._autocast():
                        vals.append(self.loss_fn(self.model(x), y).float())
                res.final_loss = float(torch.stack(vals).mean())
        res.bn_var_max = bn_running_var_max(self.model)
        res.losses = torch.stack(self.losses).cpu().tolist() if self.losses else []
        res.nonfinite_losses = sum(1 for v in res.losses if not math.isfinite(v))
        res.initial_loss = res.losses[0] if res.losses else float("nan")
        if self.scaler is not None:
            res.scales = torch.stack(self.scales).cpu().tolist()
            res.final_scale = float(self.scaler.get_scale())
            count = _step_count(self.opt)
            res.skipped_steps = self.steps - int(count) if count is not None else "?"
            seen = torch.stack(self.counters).cpu().tolist()
            res.skipped_at = [i for i, c in enumerate(seen) if c == (seen[i - 1] if i else 0.0)]
        return res


def train_regime(
    model_name: str,
    regime: str,
    base_model: nn.Module,
    data,
    device: torch.device,
    steps: int,
    lr: float,
    clip: float,
    measure_memory: bool = True,
    progress: Callable[[], None] | None = None,
    growth_interval: int = 2000,
    profile_ops: bool = False,
    cpu_clock: bool = False,
) -> RegimeResult:
    """Train a copy of ``base_model`` for ``steps`` steps under ``regime``, start to finish."""
    run = RegimeRun(
        model_name, regime, base_model, data, device, steps, lr, clip, growth_interval=growth_interval,
        measure_memory=measure_memory, profile_ops=profile_ops, cpu_clock=cpu_clock,
    )  # fmt: skip
    while not run.done:
        ran = run.advance()
        if progress:
            for _ in ran:
                progress()
    return run.finish()
