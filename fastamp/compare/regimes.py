"""The mixed-precision regimes compared, and how each one sets a model and its optimizer up."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

# regime -> (low-precision dtype or None, one-line description for the report)
REGIME_INFO: dict[str, tuple[torch.dtype | None, str]] = {
    "fp32": (None, "fp32 params, torch.optim.AdamW(fused=True)"),
    "torch-amp-fp16": (torch.float16, "fp32 params, autocast(fp16) + torch.amp.GradScaler + AdamW(fused=True)"),
    "fastamp-scaler-fp16": (
        torch.float16,
        "torch-amp-fp16 with fastamp.Scaler as a drop-in for torch.amp.GradScaler: the same fp32 params, "
        "autocast(fp16), AdamW(fused=True) and loop (unscale_ + clip_grad_norm_); its losses, loss scales and "
        "skipped steps must equal torch-amp-fp16's bit for bit",
    ),
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
    "fastamp-bf16-release": (
        torch.bfloat16,
        "as fastamp-bf16-remainder with gradient release: fastamp.release(model, opt, max_norm=clip), each bucket "
        "of params stepped inside backward and its grads freed at once (the global clip runs a second backward); "
        "its training losses must equal fastamp-bf16-remainder's bit for bit",
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
    "fastamp-bf16-remainder-q8": (
        torch.bfloat16,
        'as fastamp-bf16 with AdamW(master_weights="remainder", state_format="q8", seed=0): the exact int16 '
        "remainder master and 8-bit moments, 8.06 bytes per param with the grad at large tensors (tensors under "
        "4,096 elements keep fp32 moments); gpt only",
    ),
    "fastamp-bf16-ulp8-q8": (
        torch.bfloat16,
        'as fastamp-bf16 with AdamW(master_weights="ulp8", state_format="q8", seed=0): an int8 master correction '
        "and 8-bit moments, 7.06 bytes per param with the grad at large tensors (tensors under 4,096 elements keep "
        "fp32 moments and the exact remainder master); gpt only",
    ),
    "fastamp-bf16-sr-q8": (
        torch.bfloat16,
        'as fastamp-bf16 with AdamW(stochastic_rounding=True, state_format="q8", seed=0): no master (the bf16 '
        "params rounded stochastically) and 8-bit moments, 6.06 bytes per param with the grad at large tensors "
        "(tensors under 4,096 elements keep fp32 moments); gpt only",
    ),
    "fastamp-fp16-ulp8-q8": (
        torch.float16,
        'as fastamp-fp16 (fp16 params, fastamp.Scaler) with AdamW(master_weights="ulp8", state_format="q8", '
        "seed=0): an int8 master correction and 8-bit moments, 7.06 bytes per param with the grad at large tensors "
        "(tensors under 4,096 elements keep fp32 moments and an fp32 master); gpt only",
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
# The fastamp.optim.AdamW options of each fastamp regime that changes them (the others: the defaults,
# fp32 masters). The seed is given where random bits are drawn (stochastic rounding, q8 codes).
FASTAMP_OPTIONS: dict[str, dict[str, Any]] = {
    "fastamp-bf16-remainder": {"master_weights": "remainder"},
    "fastamp-bf16-release": {"master_weights": "remainder"},
    "fastamp-bf16-sr": {"stochastic_rounding": True, "seed": 0},
    "fastamp-bf16-10B": {
        "master_weights": "remainder",
        "state_dtype": torch.bfloat16,
        "stochastic_rounding": True,
        "seed": 0,
    },
    "fastamp-bf16-remainder-q8": {"master_weights": "remainder", "state_format": "q8", "seed": 0},
    "fastamp-bf16-ulp8-q8": {"master_weights": "ulp8", "state_format": "q8", "seed": 0},
    "fastamp-bf16-sr-q8": {"stochastic_rounding": True, "state_format": "q8", "seed": 0},
    "fastamp-fp16-ulp8-q8": {"master_weights": "ulp8", "state_format": "q8", "seed": 0},
}
# The 8-bit-state rows (issue 22). On the transformer only: its weight matrices reach
# lowbit_min_numel (4,096 elements) and hold q8 state; most of the CNN's convolutions do not.
Q8_REGIMES = tuple(r for r, kw in FASTAMP_OPTIONS.items() if kw.get("state_format") == "q8")
# Renamed regimes: the old name, refused with the new one named.
RENAMED = {"fastamp-bf16-q8": "fastamp-bf16-ulp8-q8"}
# The regimes cnn-raw12 runs in the full set: the BatchNorm demonstration.
BN_DEMO_REGIMES = ("fp32", "torch-amp-fp16", "fastamp-fp16", "half-fp16-fastamp", "pure-fp16")
# The full set (--full, and the default on CUDA): each row where it shows something. The
# drop-in scaler on the transformer; model.half() with fastamp's optimizer (norm layers in
# fp16) on the CNNs, where BatchNorm is.
FULL_MODEL_REGIMES = {
    "gpt": tuple(r for r in REGIMES if r != "half-fp16-fastamp"),
    "cnn": tuple(r for r in REGIMES if r not in ("fastamp-scaler-fp16", "fastamp-bf16-release", *Q8_REGIMES)),
    "cnn-raw12": BN_DEMO_REGIMES,
}
# The default on CPU. An fp16 CNN step is the costly one there: 8x an fp32 step on a 2-core
# AMD EPYC, about 80x on a 2-core Xeon with AVX512-FP16 (torch's fp16 weight gradient of a
# convolution; the report's op profile shows where each run's time went). The default keeps
# the two fp16 CNN rows that make the BatchNorm point (cast_model's fp32 norm layers against
# model.half() on raw sensor data) and every fp16 row on the transformer, where fp16 costs
# about what fp32 does.
MODEL_REGIMES = {
    "gpt": FULL_MODEL_REGIMES["gpt"],
    "cnn": tuple(r for r in FULL_MODEL_REGIMES["cnn"] if REGIME_INFO[r][0] != torch.float16),
    "cnn-raw12": ("fp32", "fastamp-fp16", "half-fp16-fastamp"),
}


def renamed(regime: str) -> str:
    """`` (renamed: NEW)`` for a regime's old name, else ``""``: for the messages that refuse it."""
    return f" (renamed: {RENAMED[regime]})" if regime in RENAMED else ""


def _regime_dtype(regime: str):
    if regime not in REGIME_INFO:
        raise ValueError(f"fastamp.compare: unknown regime {regime!r}{renamed(regime)}; expected one of {REGIMES}")
    return REGIME_INFO[regime][0]


def build_regime(regime: str, model: nn.Module, lr: float, device: torch.device, growth_interval: int = 2000):
    """Set ``model`` (changed in place) up for ``regime``.

    Every scaler, torch's and fastamp's, gets the same settings: torch's defaults (start at
    2^16, x2 growth, x0.5 backoff) with ``growth_interval``.
    Returns ``(optimizer, scaler or None, autocast dtype or None, input dtype or None)``.
    """
    import fastamp
    from fastamp.optim import AdamW as FastAdamW

    dtype = _regime_dtype(regime)
    autocast_dtype = scaler = in_dtype = None
    if regime == "fp32":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    elif regime == "fastamp-scaler-fp16":
        autocast_dtype = dtype
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
        scaler = fastamp.Scaler(device.type, growth_interval=growth_interval)
    elif regime.startswith("torch-amp"):
        autocast_dtype = dtype
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
        if dtype == torch.float16:
            scaler = torch.amp.GradScaler(device.type, growth_interval=growth_interval)
    elif regime.startswith("fastamp") or regime == "half-fp16-fastamp":
        autocast_dtype = dtype
        if regime == "half-fp16-fastamp":
            model.to(dtype)
        else:
            fastamp.cast_model(model, dtype)
        opt = FastAdamW(model.parameters(), lr=lr, **FASTAMP_OPTIONS.get(regime, {}))
        if dtype == torch.float16:
            scaler = fastamp.Scaler(device.type, growth_interval=growth_interval)
    else:  # pure-*: the whole model, norm layers included, in low precision
        model.to(dtype)
        in_dtype = dtype
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    return opt, scaler, autocast_dtype, in_dtype
