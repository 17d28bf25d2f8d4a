"""Count host syncs in the optimizer part of a fastamp training step on CUDA.

For each available CUDA backend (native, triton) and each configuration below, a small
GPT-style model trains for a few warm-up steps, then for ``--steps`` steps the fastamp part
of the step (``scaler.scale``, ``scaler.clip_grad_norm_``, ``scaler.step``,
``scaler.update``, or ``opt.step`` without a scaler) runs under
``torch.cuda.set_sync_debug_mode("warn")`` (syncs counted from the warnings), and again under
``"error"`` (any sync raises). One of the steps has an inf injected into a grad, so the
skip path is covered. Forward and backward run outside the debug mode: they are torch's.

Configurations:
  fastamp-fp16-clip   fp16 params + fp32 masters, fastamp.Scaler with clip_grad_norm_
  fastamp-bf16        bf16 params + fp32 masters, fastamp.Scaler, no clip
  torch-scaler+fastamp-adamw   fp32 params, torch.amp.GradScaler driving fastamp's AdamW
  torch-reference     torch's own path (GradScaler.unscale_ + clip_grad_norm_ + AdamW(fused=True)),
                      for comparison only

Exit status 1 when a fastamp configuration syncs. Writes ``sync_check.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch

import fastamp
from fastamp import backends
from fastamp._harness import unscale_and_clip
from fastamp.compare import TextData, TinyGPT
from fastamp.optim import AdamW as FastAdamW

CONFIGS = ("fastamp-fp16-clip", "fastamp-bf16", "torch-scaler+fastamp-adamw", "torch-reference")


def _setup(config: str, backend: str | None, device, data, dim: int):
    dev = device.type
    torch.manual_seed(0)
    model = TinyGPT(len(data.vocab), data.seq_len, 2, dim, 4).to(device)
    autocast_dtype = None
    clip = None
    if config == "fastamp-fp16-clip":
        fastamp.cast_model(model, torch.float16)
        opt = FastAdamW(model.parameters(), lr=1e-3, backend=backend)
        scaler = fastamp.Scaler(dev, backend=backend)
        autocast_dtype, clip = torch.float16, 1.0
    elif config == "fastamp-bf16":
        fastamp.cast_model(model, torch.bfloat16)
        opt = FastAdamW(model.parameters(), lr=1e-3, backend=backend)
        scaler = fastamp.Scaler(dev, backend=backend)
        autocast_dtype = torch.bfloat16
    elif config == "torch-scaler+fastamp-adamw":
        opt = FastAdamW(model.parameters(), lr=1e-3, backend=backend)
        scaler = torch.amp.GradScaler(dev)
        autocast_dtype = torch.float16
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        scaler = torch.amp.GradScaler(dev)
        autocast_dtype, clip = torch.float16, 1.0
    return model, opt, scaler, autocast_dtype, clip


def _run(config, backend, device, data, steps: int, mode: str, dim: int = 128):
    """Returns (syncs counted per step, error message or '')."""
    model, opt, scaler, ac_dtype, clip = _setup(config, backend, device, data, dim)
    params = list(model.parameters())
    counts, error = [], ""

    for step in range(3 + steps):
        x, y = data.train_batch(step)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=ac_dtype or torch.float32, enabled=ac_dtype is not None):
            loss = TinyGPT.loss(model(x), y)
        # The sync debug mode exists only for CUDA; a CPU run (--device cpu) only exercises the code.
        measured = step >= 3 and device.type == "cuda"
        # scale() is part of the scaler's path; backward is torch's.
        with _debug(mode if measured else None) as rec:
            scaled = scaler.scale(loss)
        scaled.backward()
        if step == 4:
            params[0].grad.view(-1)[0] = float("inf")
        try:
            with _debug(mode if measured else None) as rec2:
                if clip is not None:
                    unscale_and_clip(scaler, opt, params, clip)
                scaler.step(opt)
                scaler.update()
        except RuntimeError as e:
            error = error or f"step {step}: {e}"
            torch.cuda.set_sync_debug_mode(0)
            continue
        if measured:
            counts.append(rec.count + rec2.count)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return counts, error


class _debug:
    """Context: set_sync_debug_mode(mode) and count the sync warnings raised inside."""

    def __init__(self, mode):
        self.mode, self.count = mode, 0

    def __enter__(self):
        if self.mode is not None:
            self._w = warnings.catch_warnings(record=True)
            self._rec = self._w.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(self.mode)
        return self

    def __exit__(self, *exc):
        if self.mode is not None:
            torch.cuda.set_sync_debug_mode(0)
            self.count = sum(1 for w in self._rec if "synchroniz" in str(w.message).lower())
            self._w.__exit__(*exc)
        return False


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=".")
    p.add_argument("--device", default="cuda", help="cuda; cpu only exercises the code (no sync counting there)")
    p.add_argument("--dim", type=int, default=128, help="model width (multiple of 4)")
    p.add_argument("--seq-len", type=int, default=64)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("sync_check: needs a CUDA device (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    data = TextData(args.seq_len, 8, device, n_chars=20_000)
    report = []
    failed = False
    # On CPU (a dry run of this script) the Triton interpreter is skipped: it is a test tool.
    candidates = ("native", "triton") if device.type == "cuda" else ("native",)
    cuda_backends = [b for b in candidates if backends.available(b, "adamw_", device)[0]]
    if not cuda_backends:
        print("sync_check: no CUDA backend available; checking the torch reference backend", file=sys.stderr)
        cuda_backends = ["torch"]
    for config in CONFIGS:
        for b in cuda_backends if config != "torch-reference" else [None]:
            warn_counts, warn_err = _run(config, b, device, data, args.steps, "warn", args.dim)
            _, err = _run(config, b, device, data, args.steps, "error", args.dim)
            row = {
                "config": config,
                "backend": b or "torch",
                "syncs_per_step": warn_counts,
                "error_mode": "ok" if not err else err[:300],
                "warn_mode_error": warn_err[:300],
            }
            report.append(row)
            bad = config != "torch-reference" and (any(warn_counts) or bool(err))
            failed = failed or bad
            print(
                f"{config:28s} backend={row['backend']:7s} syncs/step={warn_counts} error-mode={row['error_mode']}"
                + ("   <-- FAIL" if bad else "")
            )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sync_check.json"), "w") as f:
        gpu = torch.cuda.get_device_name() if device.type == "cuda" else "none (CPU dry run)"
        json.dump({"torch": torch.__version__, "gpu": gpu, "results": report}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
