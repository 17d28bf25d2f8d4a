"""One regime's training run: the loop, its timing, its memory, its losses and loss scales."""

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
from fastamp.compare.memory import CpuPeakMeter
from fastamp.compare.models import bn_running_var_max
from fastamp.compare.regimes import build_regime


@dataclass
class RegimeResult:
    model: str
    regime: str
    peak_mem_bytes: float = float("nan")
    step_ms: float = float("nan")
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
    speed_vs_fp32: float = float("nan")
    convergence_pct: float = float("nan")


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
) -> RegimeResult:
    """Train a copy of ``base_model`` for ``steps`` steps under ``regime``; no host sync inside the loop.

    ``growth_interval`` goes to every scaler (torch's and fastamp's alike). The pitfall
    warnings fastamp raises are recorded in ``guards``, not printed.
    """
    res = RegimeResult(model_name, regime)
    with pitfalls_recorded(res.guards):
        _train(res, base_model, data, device, steps, lr, clip, measure_memory, progress, growth_interval)
    return res


def _train(res, base_model, data, device, steps, lr, clip, measure_memory, progress, growth_interval) -> None:
    regime = res.regime
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        mem_before = torch.cuda.memory_allocated(device)
    model = copy.deepcopy(base_model).to(device)
    opt, scaler, autocast_dtype, in_dtype = build_regime(regime, model, lr, device, growth_interval)
    if scaler is not None:
        res.init_scale = float(scaler.get_scale())
    # the drop-in regime keeps torch's loop (unscale_ + clip_grad_norm_), not fastamp's fused clip
    torch_loop = regime == "fastamp-scaler-fp16"

    params = [p for p in model.parameters()]
    loss_fn = type(model).loss
    losses: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []
    counters: list[torch.Tensor] = []

    def one_step(step: int):
        x, y = data.train_batch(step)
        if in_dtype is not None and x.is_floating_point():
            x = x.to(in_dtype)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, steps, lr)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            loss = loss_fn(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            if clip > 0 and torch_loop:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
            elif clip > 0:
                unscale_and_clip(scaler, opt, params, clip)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler._get_scale_async().detach().clone().reshape(()))
            counters.append(_step_counter(opt))
        else:
            loss.backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
            opt.step()
        losses.append(loss.detach().float().reshape(()))

    # Steps 0-2 warm up (the optimizer state is created at step 0); step 2 is profiled for
    # memory on CPU; the rest are timed.
    warm = min(3, steps)
    meter = CpuPeakMeter()
    timed_from = warm
    for step in range(warm):
        if step == 2 and measure_memory and device.type == "cpu":
            meter.measure(lambda s=step: one_step(s), model, opt, scaler)
        else:
            one_step(step)
        if progress:
            progress()
    sync(device)
    t0 = time.perf_counter()
    for step in range(timed_from, steps):
        one_step(step)
        if progress:
            progress()
    sync(device)
    n_timed = steps - timed_from
    res.step_ms = (time.perf_counter() - t0) / n_timed * 1e3 if n_timed > 0 else float("nan")

    if device.type == "cuda":
        res.peak_mem_bytes = float(torch.cuda.max_memory_allocated(device) - mem_before)
    elif meter.peak is not None:
        res.peak_mem_bytes = float(meter.peak)

    # Validation loss, in the regime's own precision (what the trained model produces).
    model.eval()
    with torch.no_grad():
        vals = []
        for x, y in data.val_batches():
            if in_dtype is not None and x.is_floating_point():
                x = x.to(in_dtype)
            with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
                vals.append(loss_fn(model(x), y).float())
        res.final_loss = float(torch.stack(vals).mean())
    res.bn_var_max = bn_running_var_max(model)
    res.losses = torch.stack(losses).cpu().tolist() if losses else []
    res.nonfinite_losses = sum(1 for v in res.losses if not math.isfinite(v))
    res.initial_loss = res.losses[0] if res.losses else float("nan")
    if scaler is not None:
        res.scales = torch.stack(scales).cpu().tolist()
        res.final_scale = float(scaler.get_scale())
        count = _step_count(opt)
        res.skipped_steps = steps - int(count) if count is not None else "?"
        seen = torch.stack(counters).cpu().tolist()
        res.skipped_at = [i for i, c in enumerate(seen) if c == (seen[i - 1] if i else 0.0)]
