"""Fused, amp-aware optimizers with fp32 master weights for fp16/bf16 params."""

from fastamp.optim.adamw import AdamW

__all__ = ["AdamW"]
