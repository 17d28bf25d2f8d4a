"""``fastamp-compare``: memory, speed and convergence of mixed-precision regimes, end to end.

Trains small real models on data this module generates (no downloads) under each regime
and prints, per model, the table practitioners choose by: peak memory, step time and speed
ratio to fp32, final loss and convergence as a % of fp32, skipped steps and final loss
scale. Writes a CSV of the table, a CSV of the per-step curves and a PNG (loss curves, loss
scale over steps, memory and speed).

Models:
  ``gpt``  a GPT-style character-level transformer (token + position embeddings, causal
           self-attention, LayerNorm, GELU MLP) on text from a small synthetic grammar.
  ``cnn``  a small CNN with BatchNorm (the layer the AMP guides warn about in fp16) on
           synthetic 10-class images, normalised (zero mean, std about 1.6).
  ``cnn-raw12`` the same CNN on the same images delivered as raw 12-bit sensor values
           (integers 0..4095, not normalised, as a camera RAW or a depth / medical sensor
           gives them). The first convolution's outputs then have a variance near 1e6:
           fine in fp16 as values, but above fp16's largest number (65504) as BatchNorm's
           running variance. By default only the regimes that show the difference run
           (fp32, torch-amp-fp16, fastamp-fp16, half-fp16-fastamp, pure-fp16).

Regimes:
  ``fp32``            fp32 params, ``torch.optim.AdamW(fused=True)``.
  ``torch-amp-fp16``  fp32 params, ``autocast(fp16)`` + ``torch.amp.GradScaler`` + fused AdamW.
  ``torch-amp-bf16``  fp32 params, ``autocast(bf16)`` + fused AdamW (bf16 needs no scaler).
  ``fastamp-fp16``    ``fastamp.cast_model(model, fp16)`` (norm layers stay fp32, casts at their
                      boundaries) + fp32 masters in ``fastamp.optim.AdamW`` + ``fastamp.Scaler``,
                      under ``autocast(fp16)``.
  ``fastamp-bf16``    ``cast_model(model, bf16)`` + fp32 masters, under ``autocast(bf16)``.
  ``fastamp-bf16-remainder``  the same with ``master_weights="remainder"``: int16 remainders
                      instead of fp32 masters (exact, 2 bytes per param less).
  ``fastamp-bf16-sr`` the same without masters, ``stochastic_rounding=True, seed=0``.
  ``fastamp-bf16-10B`` remainder masters + bf16 moments with stochastic rounding (10 bytes per
                      param: param 2, remainder 2, moments 2 + 2, grad 2).
  ``half-fp16-fastamp`` ``model.half()`` (BatchNorm / LayerNorm in fp16 too) with everything
                      else as ``fastamp-fp16``: isolates what ``cast_model`` changes.
  ``pure-fp16``       plain ``model.half()`` (BatchNorm and LayerNorm included), torch AdamW on the
                      fp16 params, no masters, no scaler, no autocast: the guides' cautionary row.
  ``pure-bf16``       the same in bf16.

Usage::

    fastamp-compare                                  # all models, all regimes, CPU-sized
    python -m fastamp.compare --device cuda --size large --steps 600
    fastamp-compare --model gpt --regimes fp32,torch-amp-bf16,fastamp-bf16 --steps 100
"""

from __future__ import annotations

import argparse
import copy
import csv
import datetime
import math
import os
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

# regime -> (low-precision dtype or None, one-line description for the report)
REGIME_INFO: dict[str, tuple[torch.dtype | None, str]] = {
    "fp32": (None, "fp32 params, torch.optim.AdamW(fused=True)"),
    "torch-amp-fp16": (torch.float16, "fp32 params, autocast(fp16) + torch.amp.GradScaler + AdamW(fused=True)"),
    "torch-amp-bf16": (torch.bfloat16, "fp32 params, autocast(bf16) + AdamW(fused=True), no scaler"),
    "fastamp-fp16": (
        torch.float16,
        "fastamp.cast_model(model, fp16) (norm layers fp32, casts at their boundaries) + fastamp AdamW "
        "(fp32 masters) + fastamp.Scaler, under autocast(fp16)",
    ),
    "fastamp-bf16": (torch.bfloat16, "fastamp.cast_model(model, bf16) + fastamp AdamW (fp32 masters), autocast(bf16)"),
    "fastamp-bf16-remainder": (
        torch.bfloat16,
        'as fastamp-bf16 with AdamW(master_weights="remainder"): int16 remainders instead of fp32 masters',
    ),
    "fastamp-bf16-sr": (
        torch.bfloat16,
        "as fastamp-bf16 without masters: AdamW(stochastic_rounding=True, seed=0)",
    ),
    "fastamp-bf16-10B": (
        torch.bfloat16,
        'as fastamp-bf16 with AdamW(master_weights="remainder", state_dtype=bf16, stochastic_rounding=True, '
        "seed=0): 10 bytes per param with the grad",
    ),
    "half-fp16-fastamp": (
        torch.float16,
        "plain model.half() (BatchNorm/LayerNorm params and running stats fp16) + fastamp AdamW (fp32 masters) "
        "+ fastamp.Scaler, under autocast(fp16): fastamp-fp16 without cast_model",
    ),
    "pure-fp16": (
        torch.float16,
        "plain model.half() (norm layers included) + torch AdamW(fused=True) on fp16 params: no masters, "
        "no scaler, no autocast",
    ),
    "pure-bf16": (torch.bfloat16, "plain model.to(bf16) + torch AdamW(fused=True): no masters, no autocast"),
}
REGIMES = tuple(REGIME_INFO)
MODELS = ("gpt", "cnn", "cnn-raw12")
# The regimes cnn-raw12 runs unless --regimes names others: the BatchNorm demonstration.
BN_DEMO_REGIMES = ("fp32", "torch-amp-fp16", "fastamp-fp16", "half-fp16-fastamp", "pure-fp16")

# Size presets: "small" is what the defaults run on a 2-core CPU in a few minutes.
SIZES = {
    "tiny": {
        "gpt": {"n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 32, "batch": 8},
        "cnn": {"width": 8, "image": 12, "batch": 16},
        "steps": 12,
    },
    # fp16 matmuls on a CPU without AVX512-FP16/AMX run 10-50x slower than fp32 (measured on
    # the project's 2-core machine), so the CPU default keeps the transformer narrow.
    "small": {
        "gpt": {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 32, "batch": 16},
        "cnn": {"width": 16, "image": 16, "batch": 32},
        "steps": 150,
    },
    "large": {
        "gpt": {"n_layer": 6, "d_model": 384, "n_head": 6, "seq_len": 256, "batch": 64},
        "cnn": {"width": 64, "image": 32, "batch": 256},
        "steps": 600,
    },
}


# ----------------------------------------------------------------------------------------
# Data


_NOUNS = ["cat", "dog", "bird", "fox", "child", "farmer", "robot", "teacher", "horse", "baker"]
_VERBS = ["see", "like", "chase", "find", "follow", "help", "watch", "greet"]
_ADJS = ["small", "red", "quick", "lazy", "happy", "old", "bright", "quiet"]
_PLACES = ["in the garden", "near the river", "under the old tree", "on the hill", "by the gate"]
_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _noun_phrase(rng: random.Random) -> tuple[str, bool]:
    plural = rng.random() < 0.4
    noun = rng.choice(_NOUNS) + ("s" if plural else "")
    adj = rng.choice(_ADJS) + " " if rng.random() < 0.5 else ""
    return f"the {adj}{noun}", plural


def synthetic_text(n_chars: int, seed: int = 0) -> str:
    """Text from a small grammar with agreement, attachment and arithmetic to learn.

    Subject-verb agreement ("the cats see" / "the cat sees"), optional adjectives and
    places, and sums ("three plus four is seven.") that need the operands to predict.
    """
    rng = random.Random(seed)
    parts: list[str] = []
    total = 0
    while total < n_chars:
        if rng.random() < 0.25:
            a, b = rng.randrange(10), rng.randrange(10)
            s = f"{_NUMBERS[a]} plus {_NUMBERS[b]} is {a + b}."
        else:
            subj, plural = _noun_phrase(rng)
            verb = rng.choice(_VERBS)
            verb = verb if plural else (verb + "es" if verb.endswith(("ch", "sh")) else verb + "s")
            obj, _ = _noun_phrase(rng)
            place = " " + rng.choice(_PLACES) if rng.random() < 0.4 else ""
            s = f"{subj} {verb} {obj}{place}."
        parts.append(s)
        total += len(s) + 1
    return " ".join(parts)[:n_chars]


class TextData:
    """Character-level next-token batches from :func:`synthetic_text`, deterministic per step."""

    def __init__(self, seq_len: int, batch: int, device: torch.device, seed: int = 0, n_chars: int = 200_000):
        text = synthetic_text(n_chars, seed)
        self.vocab = sorted(set(text))
        stoi = {c: i for i, c in enumerate(self.vocab)}
        data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
        split = int(0.9 * len(data))
        self.train, self.val = data[:split].to(device), data[split:].to(device)
        self.seq_len, self.batch, self.seed, self.device = seq_len, batch, seed, device

    def _batch(self, src: torch.Tensor, gen: torch.Generator, batch: int):
        idx = torch.randint(0, len(src) - self.seq_len - 1, (batch,), generator=gen)
        offs = torch.arange(self.seq_len + 1)
        rows = src[(idx[:, None] + offs[None, :]).to(src.device)]
        return rows[:, :-1], rows[:, 1:]

    def train_batch(self, step: int):
        return self._batch(self.train, torch.Generator().manual_seed(self.seed * 1_000_003 + step), self.batch)

    def val_batches(self, n: int = 8):
        gen = torch.Generator().manual_seed(self.seed + 12345)
        return [self._batch(self.val, gen, self.batch) for _ in range(n)]


class ImageData:
    """Synthetic 10-class colour images: a smooth per-class prototype, random contrast, shift and noise.

    ``bits=None``: normalised float pixels. ``bits=b``: the same images as raw b-bit sensor
    values, integers in [0, 2^b - 1] (mid-grey 2^(b-1), about 0.15 x 2^b per unit of the
    normalised image, clipped), stored as float32.
    """

    n_classes = 10

    def __init__(self, image: int, batch: int, device: torch.device, seed: int = 0, bits: int | None = None):
        gen = torch.Generator().manual_seed(seed + 7)
        low = torch.randn(self.n_classes, 3, 4, 4, generator=gen)
        self.protos = F.interpolate(low, size=(image, image), mode="bilinear", align_corners=False)
        self.image, self.batch, self.seed, self.device, self.bits = image, batch, seed, device, bits

    def _batch(self, gen: torch.Generator, batch: int):
        y = torch.randint(0, self.n_classes, (batch,), generator=gen)
        contrast = 0.5 + torch.rand(batch, 1, 1, 1, generator=gen)
        x = self.protos[y] * contrast
        shift = int(torch.randint(-2, 3, (1,), generator=gen))
        x = torch.roll(x, shifts=shift, dims=3)
        x = x + 1.5 * torch.randn(x.shape, generator=gen)
        if self.bits is not None:
            top = 2**self.bits - 1
            x = (0.5 * top + 0.15 * 2**self.bits * x).round().clamp(0, top)
        return x.to(self.device), y.to(self.device)

    def train_batch(self, step: int):
        return self._batch(torch.Generator().manual_seed(self.seed * 1_000_003 + step), self.batch)

    def val_batches(self, n: int = 8):
        gen = torch.Generator().manual_seed(self.seed + 12345)
        return [self._batch(gen, self.batch) for _ in range(n)]


# ----------------------------------------------------------------------------------------
# Models


class _Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.n_head = n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = self.qkv(h).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.n_head))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-style decoder: embeddings, pre-LN causal attention blocks, final LayerNorm, LM head."""

    def __init__(self, vocab: int, seq_len: int, n_layer: int, d_model: int, n_head: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear):
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))

    @staticmethod
    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


class SmallCNN(nn.Module):
    """conv-BN-ReLU x2, pool, conv-BN-ReLU x2, global pool, linear."""

    def __init__(self, width: int, n_classes: int = 10):
        super().__init__()
        w = width

        def cbr(cin, cout):
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

        self.net = nn.Sequential(
            *cbr(3, w), *cbr(w, w), nn.MaxPool2d(2), *cbr(w, 2 * w), *cbr(2 * w, 2 * w), nn.AdaptiveAvgPool2d(1),
            nn.Flatten(), nn.Linear(2 * w, n_classes),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @staticmethod
    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), y)


def bn_running_var_max(model: nn.Module) -> float | None:
    """Largest BatchNorm ``running_var`` entry of ``model`` (inf or nan when the statistics broke); None without BN."""
    vals = [
        m.running_var.detach().float().max()
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_var is not None and m.running_var.numel()
    ]
    if not vals:
        return None
    v = torch.stack(vals)
    return float(v.max()) if not torch.isnan(v).any() else float("nan")


# ----------------------------------------------------------------------------------------
# Memory


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


class CpuPeakMeter:
    """Peak bytes of torch's CPU allocator over one training step.

    Measured, not computed: the live storages reachable from the model, optimizer, scaler
    and batch at the start of the step (summed, deduplicated by storage), plus the highest
    running total of every allocation and free made during the step, as recorded by
    ``torch.profiler`` with ``profile_memory=True`` (activations, autocast weight copies,
    grads, optimizer temporaries). Python objects and allocator caching are not counted.
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
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
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


# ----------------------------------------------------------------------------------------
# Training


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
    speed_vs_fp32: float = float("nan")
    convergence_pct: float = float("nan")


def _regime_dtype(regime: str):
    if regime not in REGIME_INFO:
        raise ValueError(f"fastamp.compare: unknown regime {regime!r}; expected one of {REGIMES}")
    return REGIME_INFO[regime][0]


def build_regime(regime: str, model: nn.Module, lr: float, device: torch.device):
    """Set ``model`` (changed in place) up for ``regime``.

    Returns ``(optimizer, scaler or None, autocast dtype or None, input dtype or None)``.
    """
    import fastamp
    from fastamp.optim import AdamW as FastAdamW

    dtype = _regime_dtype(regime)
    autocast_dtype = scaler = in_dtype = None
    if regime == "fp32":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    elif regime.startswith("torch-amp"):
        autocast_dtype = dtype
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
        if dtype == torch.float16:
            scaler = torch.amp.GradScaler(device.type)
    elif regime.startswith("fastamp") or regime == "half-fp16-fastamp":
        autocast_dtype = dtype
        if regime == "half-fp16-fastamp":
            model.to(dtype)
        else:
            fastamp.cast_model(model, dtype)
        kwargs: dict[str, Any] = {}
        if regime == "fastamp-bf16-remainder":
            kwargs = {"master_weights": "remainder"}
        elif regime == "fastamp-bf16-sr":
            kwargs = {"stochastic_rounding": True, "seed": 0}
        elif regime == "fastamp-bf16-10B":
            kwargs = {"master_weights": "remainder", "state_dtype": torch.bfloat16, "stochastic_rounding": True}
            kwargs["seed"] = 0
        opt = FastAdamW(model.parameters(), lr=lr, **kwargs)
        if dtype == torch.float16:
            scaler = fastamp.Scaler(device.type)
    else:  # pure-*: the whole model, norm layers included, in low precision
        model.to(dtype)
        in_dtype = dtype
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    return opt, scaler, autocast_dtype, in_dtype


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
) -> RegimeResult:
    """Train a copy of ``base_model`` for ``steps`` steps under ``regime``; no host sync inside the loop."""
    res = RegimeResult(model_name, regime)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        mem_before = torch.cuda.memory_allocated(device)
    model = copy.deepcopy(base_model).to(device)
    opt, scaler, autocast_dtype, in_dtype = build_regime(regime, model, lr, device)

    params = [p for p in model.parameters()]
    loss_fn = type(model).loss
    losses: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []

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
            if clip > 0:
                if isinstance(scaler, torch.amp.GradScaler):
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
                else:
                    scaler.clip_grad_norm_(opt, clip)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler._get_scale_async().detach().clone().reshape(()))
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
    _sync(device)
    t0 = time.perf_counter()
    for step in range(timed_from, steps):
        one_step(step)
        if progress:
            progress()
    _sync(device)
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
    return res


# ----------------------------------------------------------------------------------------
# Reporting


def _fmt_bytes(b: float) -> str:
    if not math.isfinite(b):
        return "-"
    return f"{b / 2**20:.2f} MiB"


def _fmt(v: Any, nd: int = 3) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.{nd}f}"
    return str(v)


TABLE_COLS = [
    ("regime", "regime"),
    ("peak_mem", "peak memory"),
    ("mem_vs_fp32", "memory vs fp32"),
    ("step_ms", "step (ms)"),
    ("speed_vs_fp32", "speed vs fp32"),
    ("final_loss", "final val loss"),
    ("convergence_pct", "convergence % of fp32"),
    ("skipped_steps", "skipped steps"),
    ("final_scale", "final scale"),
    ("nonfinite_losses", "non-finite losses"),
]


def summarise(results: list[RegimeResult]) -> list[dict[str, Any]]:
    """Fill the ratios to the fp32 row of the same model; return table rows."""
    rows = []
    by_model: dict[str, list[RegimeResult]] = {}
    for r in results:
        by_model.setdefault(r.model, []).append(r)
    for model, rs in by_model.items():
        base = next((r for r in rs if r.regime == "fp32" and not r.error), None)
        for r in rs:
            if base is not None:
                r.speed_vs_fp32 = base.step_ms / r.step_ms if r.step_ms > 0 else float("nan")
                drop_fp32 = base.initial_loss - base.final_loss
                drop = r.initial_loss - r.final_loss
                if math.isfinite(drop) and drop_fp32 > 0:
                    r.convergence_pct = 100.0 * drop / drop_fp32
            rows.append(
                {
                    "model": model,
                    "regime": r.regime,
                    "peak_mem": _fmt_bytes(r.peak_mem_bytes),
                    "peak_mem_bytes": r.peak_mem_bytes,
                    "mem_vs_fp32": (
                        f"{r.peak_mem_bytes / base.peak_mem_bytes:.2f}x"
                        if base is not None and math.isfinite(r.peak_mem_bytes) and base.peak_mem_bytes > 0
                        else "-"
                    ),
                    "step_ms": _fmt(r.step_ms, 2),
                    "speed_vs_fp32": (
                        "-"
                        if not math.isfinite(r.speed_vs_fp32)
                        else f"{r.speed_vs_fp32:.2f}x"
                        if r.speed_vs_fp32 >= 0.1
                        else f"{r.speed_vs_fp32:.3f}x"
                    ),
                    "initial_loss": _fmt(r.initial_loss),
                    "final_loss": _fmt(r.final_loss),
                    "convergence_pct": f"{r.convergence_pct:.1f}%"
                    if math.isfinite(r.convergence_pct)
                    else "diverged"
                    if not math.isfinite(r.final_loss)
                    else "-",
                    "skipped_steps": r.skipped_steps,
                    "final_scale": f"{r.final_scale:g}" if isinstance(r.final_scale, float) else r.final_scale,
                    "nonfinite_losses": r.nonfinite_losses,
                    "bn_running_var_max": "-" if r.bn_var_max is None else f"{r.bn_var_max:.4g}",
                    "error": r.error,
                }
            )
    return rows


# fastamp's rows are judged against torch.amp's with the same low-precision dtype: the final
# validation loss must be within this relative budget. Both runs start from the same weights
# and see the same batches; they differ only in rounding (fastamp stores the params and the
# embedding/LayerNorm inputs in low precision, autocast keeps them fp32), which moves a short
# training run's final loss by well under 1% in our runs; 3% leaves room for other seeds.
# The stochastic-rounding and bf16-moment rows are held to the same budget: they trade
# accuracy for memory, and the check says whether the trade cost more than that here.
CONVERGENCE_RTOL = 0.03
_PAIRS = (
    ("fastamp-fp16", "torch-amp-fp16"),
    ("fastamp-bf16", "torch-amp-bf16"),
    ("fastamp-bf16-remainder", "torch-amp-bf16"),
    ("fastamp-bf16-sr", "torch-amp-bf16"),
    ("fastamp-bf16-10B", "torch-amp-bf16"),
    ("half-fp16-fastamp", "fastamp-fp16"),
)


def _first_nonfinite(losses: list[float]) -> int | None:
    return next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)


def verdicts(results: list[RegimeResult]) -> list[str]:
    """One line per fastamp row vs its reference row, remainder vs fp32 master, and per pure low-precision row."""
    out = []
    by = {(r.model, r.regime): r for r in results if not r.error}
    for model in dict.fromkeys(r.model for r in results):
        for ours, theirs in _PAIRS:
            a, b = by.get((model, ours)), by.get((model, theirs))
            if a is None or b is None:
                continue
            rel = (a.final_loss - b.final_loss) / b.final_loss if b.final_loss else float("nan")
            ok = math.isfinite(rel) and abs(rel) <= CONVERGENCE_RTOL
            out.append(
                f"{model}: {ours} final val loss {a.final_loss:.4f} vs {theirs} {b.final_loss:.4f} "
                f"({100 * rel:+.2f}%): {'within' if ok else 'OUTSIDE'} the {100 * CONVERGENCE_RTOL:.0f}% tolerance"
            )
        a, b = by.get((model, "fastamp-bf16-remainder")), by.get((model, "fastamp-bf16"))
        if a is not None and b is not None and a.losses and len(a.losses) == len(b.losses):
            same = next((i for i, (x, y) in enumerate(zip(a.losses, b.losses)) if x != y), len(a.losses))
            out.append(
                f"{model}: fastamp-bf16-remainder vs fastamp-bf16 (fp32 masters): training losses bit-identical for "
                f"{same} of {len(a.losses)} steps (same master update; at an exact rounding tie, about 1 element in "
                f"65,536, the remainder's bf16 param is the neighbour away from zero, one ulp from the nearest-even "
                f"one, and from then on the two runs see slightly different forwards)"
            )
        for pure in ("pure-fp16", "pure-bf16"):
            r, base = by.get((model, pure)), by.get((model, "fp32"))
            if r is None or base is None:
                continue
            if not math.isfinite(r.final_loss) or r.nonfinite_losses:
                what = (
                    f"diverged ({r.nonfinite_losses} non-finite training losses, the first at step "
                    f"{_first_nonfinite(r.losses)})"
                )
            elif r.convergence_pct < 90:
                what = f"stalls at {r.convergence_pct:.1f}% of fp32's loss reduction"
            else:
                what = f"reaches {r.convergence_pct:.1f}% of fp32's loss reduction"
            out.append(f"{model}: {pure} (plain .to({pure[5:]}), no master weights, no scaler) {what}")
        half, cast, pure = (by.get((model, k)) for k in ("half-fp16-fastamp", "fastamp-fp16", "pure-fp16"))
        if half is not None and cast is not None:
            rel = (half.final_loss - cast.final_loss) / cast.final_loss if cast.final_loss else float("nan")
            if math.isfinite(rel) and abs(rel) <= CONVERGENCE_RTOL and not half.nonfinite_losses:
                line = (
                    f"{model}: norm layers in fp16 (model.half()) trained as well as cast_model's fp32 norm layers "
                    f"here, with fp32 masters and a scaler (half-fp16-fastamp)"
                )
                if pure is not None and (pure.nonfinite_losses or not math.isfinite(pure.final_loss)):
                    line += (
                        "; so pure-fp16's failure comes with its optimizer (torch AdamW with fp16 state, no master, no "
                        "scaler), not from the fp16 norm layers alone"
                    )
            else:
                line = (
                    f"{model}: norm layers in fp16 (model.half(), half-fp16-fastamp) broke the model: final val loss "
                    f"{half.final_loss:.4f} vs {cast.final_loss:.4f} with cast_model's fp32 norm layers"
                )
                if half.bn_var_max is not None and not math.isfinite(half.bn_var_max) and not half.nonfinite_losses:
                    line += (
                        " (its training losses stayed finite: training normalises with each batch's own statistics; "
                        "the fp16 running statistics that evaluation uses overflowed)"
                    )
            out.append(line)
        bn = [r for r in results if r.model == model and not r.error and r.bn_var_max is not None]
        if bn:
            out.append(
                f"{model}: largest BatchNorm running_var after training: "
                + ", ".join(f"{r.regime} {r.bn_var_max:.4g}" for r in bn)
                + " (fp16 holds at most 65504; cast_model keeps these statistics fp32, .half() stores them in fp16)"
            )
    return out


def markdown(rows: list[dict[str, Any]], model: str) -> str:
    mr = [r for r in rows if r["model"] == model]
    head = "| " + " | ".join(h for _, h in TABLE_COLS) + " |"
    sep = "|" + "|".join("---" for _ in TABLE_COLS) + "|"
    body = []
    for r in mr:
        cells = [
            str(r[k]) if not r["error"] or k == "regime" else ("FAILED" if k == "peak_mem" else "")
            for k, _ in TABLE_COLS
        ]
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, sep] + body)


def _smooth(v: list[float], k: int) -> list[float]:
    out, acc, q = [], 0.0, []
    for x in v:
        if not math.isfinite(x):
            out.append(float("nan"))
            continue
        q.append(x)
        acc += x
        if len(q) > k:
            acc -= q.pop(0)
        out.append(acc / len(q))
    return out


def plot(results: list[RegimeResult], rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in results))
    colors = {
        "fp32": "black",
        "torch-amp-fp16": "tab:blue",
        "torch-amp-bf16": "tab:cyan",
        "fastamp-fp16": "tab:red",
        "fastamp-bf16": "tab:orange",
        "fastamp-bf16-remainder": "tab:brown",
        "fastamp-bf16-sr": "tab:green",
        "fastamp-bf16-10B": "tab:pink",
        "half-fp16-fastamp": "tab:gray",
        "pure-fp16": "tab:purple",
        "pure-bf16": "tab:olive",
    }
    styles = {
        "fp32": "-",
        "torch-amp-fp16": "--",
        "torch-amp-bf16": "--",
        "fastamp-bf16-remainder": (0, (5, 1)),
        "half-fp16-fastamp": "-.",
        "pure-fp16": ":",
        "pure-bf16": ":",
    }
    fig, axes = plt.subplots(len(models), 3, figsize=(18, 5.2 * len(models)), squeeze=False)
    for mi, model in enumerate(models):
        ax_l, ax_s, ax_m = axes[mi]
        rs = [r for r in results if r.model == model and not r.error]
        finite_all = [x for r in rs for x in r.losses if math.isfinite(x)]
        for r in rs:
            if not r.losses:
                continue
            k = max(1, len(r.losses) // 25)
            ax_l.plot(
                range(len(r.losses)),
                _smooth(r.losses, k),
                linestyle=styles.get(r.regime, "-"),
                color=colors.get(r.regime),
                label=r.regime + (f" ({r.nonfinite_losses} non-finite)" if r.nonfinite_losses else ""),
                linewidth=1.4,
            )
            bad = next((i for i, v in enumerate(r.losses) if not math.isfinite(v)), None)
            if bad is not None:
                # mark where the loss first became inf/nan: the curve stops there
                last = next((v for v in reversed(r.losses[:bad]) if math.isfinite(v)), r.losses[0])
                ax_l.plot([bad], [last], "x", color=colors.get(r.regime), markersize=10, markeredgewidth=2)
                ax_l.annotate(f"{r.regime}: non-finite from step {bad}", (bad, last), fontsize=7,
                              xytext=(8, 4), textcoords="offset points", color=colors.get(r.regime))  # fmt: skip
        if finite_all:
            lo = min(finite_all)
            hi = max(r.losses[0] for r in rs if r.losses and math.isfinite(r.losses[0]))
            ax_l.set_ylim(lo * 0.9, hi * 1.15)
        ax_l.set_title(f"{model}: training loss (moving average)")
        ax_l.set_xlabel("step")
        ax_l.set_ylabel("loss")
        ax_l.grid(True, alpha=0.3)
        ax_l.legend(fontsize=8)
        any_scale = False
        for r in rs:
            if r.scales:
                any_scale = True
                ax_s.plot(range(len(r.scales)), r.scales, linestyle=styles.get(r.regime, "-"), color=colors.get(r.regime),
                          label=f"{r.regime} (skipped {r.skipped_steps})", linewidth=1.4)  # fmt: skip
        if any_scale and all(len(set(r.scales)) == 1 for r in rs if r.scales):
            ax_s.annotate("no overflow: the scale never backed off", (0.02, 0.05), xycoords="axes fraction", fontsize=8)
        ax_s.set_yscale("log", base=2)
        ax_s.set_title(f"{model}: loss scale after each step (fp16 regimes with a scaler)")
        ax_s.set_xlabel("step")
        ax_s.set_ylabel("scale")
        ax_s.grid(True, alpha=0.3, which="both")
        if any_scale:
            ax_s.legend(fontsize=8)
        mrows = [r for r in rows if r["model"] == model and not r["error"] and math.isfinite(r["peak_mem_bytes"])]
        names = [r["regime"] for r in mrows]
        mem = [r["peak_mem_bytes"] / 2**20 for r in mrows]
        bars = ax_m.barh(names, mem, color=[colors.get(n, "grey") for n in names])
        for b, r in zip(bars, mrows):
            ax_m.annotate(
                f" {r['peak_mem']}, {r['speed_vs_fp32']} speed, conv {r['convergence_pct']}",
                (b.get_width(), b.get_y() + b.get_height() / 2),
                va="center",
                fontsize=8,
            )
        ax_m.invert_yaxis()
        ax_m.set_xlabel("peak memory (MiB)")
        ax_m.set_title(f"{model}: peak memory, speed vs fp32, convergence")
        if mem:
            ax_m.set_xlim(0, max(mem) * 1.9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------------------
# Main


def _machine(device: torch.device) -> dict[str, str]:
    import subprocess

    model_name = platform.processor() or "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                model_name = line.split(":", 1)[1].strip()
    except Exception:
        pass
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": str(device),
        "cpu": f"{model_name}, {os.cpu_count()} logical CPUs, torch threads {torch.get_num_threads()}",
        "torch": torch.__version__,
    }
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sha = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=root, timeout=10
        )
        if sha.returncode == 0:
            info["git_commit"] = sha.stdout.strip()
    except Exception:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    info["command"] = " ".join([os.path.basename(sys.argv[0]) or "fastamp-compare"] + sys.argv[1:])
    return info


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fastamp-compare",
        description="Memory, speed and convergence of fp32, torch.amp, fastamp and pure low-precision training.",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument("--model", default="all", help=f"comma-separated subset of {','.join(MODELS)}, or all (default)")
    p.add_argument(
        "--regimes",
        default=None,
        help=f"comma-separated subset of {','.join(REGIMES)} (default: all; cnn-raw12: {','.join(BN_DEMO_REGIMES)})",
    )
    p.add_argument(
        "--size", default=None, choices=sorted(SIZES), help="size preset (default: small on CPU, large on CUDA)"
    )
    p.add_argument("--steps", type=int, default=None, help="training steps per regime (default: from --size)")
    p.add_argument("--batch-size", type=int, default=None, help="override the preset batch size (both models)")
    p.add_argument("--gpt-layers", type=int, default=None)
    p.add_argument("--gpt-dim", type=int, default=None)
    p.add_argument("--gpt-heads", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--cnn-width", type=int, default=None)
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warmup + cosine to 10%%)")
    p.add_argument("--clip", type=float, default=1.0, help="global grad-norm clip (0 disables)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="fastamp-compare-results", help="directory for the CSV and PNG files")
    p.add_argument("--tag", default=None, help="file name suffix (default: the device type)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


def _progress_bar(total: int, enabled: bool):
    state = {"n": 0, "t0": time.perf_counter(), "label": ""}
    tty = sys.stderr.isatty()

    def tick():
        state["n"] += 1
        if not enabled:
            return
        n = state["n"]
        frac = n / max(1, total)
        el = time.perf_counter() - state["t0"]
        eta = el / frac - el if frac > 0 else 0.0
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        line = f"fastamp-compare [{bar}] {n}/{total} steps {el:5.0f}s eta {eta:4.0f}s {state['label']}"
        if tty:
            sys.stderr.write("\r" + line.ljust(110))
            if n >= total:
                sys.stderr.write("\n")
        elif n == total or n % max(1, total // 10) == 0:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    return tick, state


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = build_parser().parse_args(argv)
    if args.device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("fastamp-compare: --device cuda was requested but torch.cuda.is_available() is False")
    models = list(MODELS) if args.model == "all" else [m.strip() for m in args.model.split(",")]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"fastamp-compare: unknown --model {m!r}; expected some of {','.join(MODELS)}, or all")
    regimes = list(REGIMES) if args.regimes is None else [r.strip() for r in args.regimes.split(",")]
    for r in regimes:
        if r not in REGIMES:
            raise SystemExit(f"fastamp-compare: unknown regime {r!r}; expected some of {','.join(REGIMES)}")
    size = args.size or ("large" if device.type == "cuda" else "small")
    preset = copy.deepcopy(SIZES[size])
    steps = args.steps or preset["steps"]
    if steps < 4:
        raise SystemExit("fastamp-compare: --steps must be at least 4 (3 warm-up steps, then timed ones)")
    g, c = preset["gpt"], preset["cnn"]
    for key, val in (
        ("n_layer", args.gpt_layers),
        ("d_model", args.gpt_dim),
        ("n_head", args.gpt_heads),
        ("seq_len", args.seq_len),
    ):
        if val is not None:
            g[key] = val
    if args.cnn_width is not None:
        c["width"] = args.cnn_width
    if args.image_size is not None:
        c["image"] = args.image_size
    if args.batch_size is not None:
        g["batch"] = c["batch"] = args.batch_size
    if g["d_model"] % g["n_head"]:
        raise SystemExit(f"fastamp-compare: --gpt-dim {g['d_model']} must be divisible by --gpt-heads {g['n_head']}")

    torch.manual_seed(args.seed)
    info = _machine(device)
    info["size"] = f"{size}: gpt {g}, cnn {c}, steps {steps}, lr {args.lr}, clip {args.clip}"
    if hasattr(os, "getloadavg"):
        info["load_avg_at_start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    t_start = time.perf_counter()
    model_regimes = {
        m: [r for r in regimes if r in BN_DEMO_REGIMES] if m == "cnn-raw12" and args.regimes is None else regimes
        for m in models
    }
    tick, pstate = _progress_bar(sum(len(v) for v in model_regimes.values()) * steps, not args.no_progress)

    results: list[RegimeResult] = []
    for model_name in models:
        torch.manual_seed(args.seed)
        if model_name == "gpt":
            data = TextData(g["seq_len"], g["batch"], device, seed=args.seed)
            base = TinyGPT(len(data.vocab), g["seq_len"], g["n_layer"], g["d_model"], g["n_head"])
        else:
            bits = 12 if model_name == "cnn-raw12" else None
            data = ImageData(c["image"], c["batch"], device, seed=args.seed, bits=bits)
            base = SmallCNN(c["width"])
        n_params = sum(p.numel() for p in base.parameters())
        info[f"{model_name}_params"] = f"{n_params:,}"
        # Untimed warm-up so that one-time costs of the process (thread pools, allocator,
        # lazy imports) do not land on whichever regime runs first.
        train_regime(model_name, "fp32", base, data, device, 4, args.lr, args.clip, measure_memory=False)
        for regime in model_regimes[model_name]:
            pstate["label"] = f"{model_name}/{regime}"
            try:
                r = train_regime(model_name, regime, base, data, device, steps, args.lr, args.clip, progress=tick)
            except Exception as e:  # one broken regime must not hide the others' numbers
                r = RegimeResult(model_name, regime, error=f"{type(e).__name__}: {e}")
                print(f"fastamp-compare: {model_name}/{regime} failed: {r.error}", file=sys.stderr)
                for _ in range(steps - (pstate["n"] % steps if pstate["n"] % steps else 0)):
                    tick()
            results.append(r)

    rows = summarise(results)
    info["wall_time"] = f"{time.perf_counter() - t_start:.0f} s for the whole run"
    if hasattr(os, "getloadavg"):
        info["load_avg_at_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    os.makedirs(args.out, exist_ok=True)
    tag = args.tag or device.type
    csv_path = os.path.join(args.out, f"compare-{tag}.csv")
    curves_path = os.path.join(args.out, f"compare-{tag}-curves.csv")
    png_path = os.path.join(args.out, f"compare-{tag}.png")
    md_path = os.path.join(args.out, f"compare-{tag}.md")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    with open(curves_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "regime", "step", "loss", "scale"])
        for r in results:
            for i, loss in enumerate(r.losses):
                w.writerow([r.model, r.regime, i, loss, r.scales[i] if i < len(r.scales) else ""])

    mem_note = (
        "CUDA: torch.cuda.max_memory_allocated over the whole run minus what was allocated before the model "
        "was built (the dataset)"
        if device.type == "cuda"
        else CpuPeakMeter.method
    )
    lines = [f"# fastamp-compare ({device.type})", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    lines += [f"- peak memory: {mem_note}"]
    lines += [
        "- step time: wall-clock mean over the steps after 3 warm-up steps (the memory-profiled step excluded)",
        "- final val loss: mean cross-entropy on 8 held-out batches, evaluated in the regime's own precision",
        "- convergence % of fp32: (first-step loss - final val loss) / the same for fp32, x100",
        "- skipped steps: steps minus the optimizer's step counter (overflow steps skipped on device); "
        "'-' where no scaler is used",
    ]
    if device.type == "cpu":
        lines += [
            "- CPU note: most CPUs (this one included unless it has AMX / AVX512-FP16) have no fast fp16/bf16 "
            "matmul; low-precision matmuls are emulated or converted and are usually slower than fp32 here. The "
            "speed column measures exactly that; the mixed-precision speed-up needs a GPU (or an AMX CPU). "
            "Memory and convergence carry over."
        ]
    lines += [
        "- data: gpt: text of a synthetic grammar; cnn: synthetic 10-class images, normalised; cnn-raw12: the same "
        "images as raw 12-bit sensor values (0..4095, not normalised)",
    ]
    lines += ["", "## Regimes", ""] + [f"- `{r}`: {REGIME_INFO[r][1]}" for r in regimes]
    lines.append("")
    for model_name in models:
        lines += [
            f"## {model_name} ({info.get(model_name + '_params', '?')} params)",
            "",
            markdown(rows, model_name),
            "",
        ]
        for r in rows:
            if r["model"] == model_name and r["error"]:
                lines.append(f"- {r['regime']} failed: {r['error']}")
        lines.append("")
    checks = verdicts(results)
    if checks:
        lines += ["## Convergence checks", ""] + [f"- {c}" for c in checks] + [""]
    text = "\n".join(lines)
    with open(md_path, "w") as f:
        f.write(text)
    print(text)
    if not args.no_plot:
        try:
            plot(
                results,
                rows,
                png_path,
                f"fastamp-compare on {device.type} ({info.get('git_commit', '')}, {info['date']})",
            )
        except Exception as e:
            print(f"fastamp-compare: plot failed: {type(e).__name__}: {e}", file=sys.stderr)
    print(f"wrote {csv_path}, {curves_path}, {md_path}" + ("" if args.no_plot else f", {png_path}"), file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
