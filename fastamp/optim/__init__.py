"""Fused, amp-aware optimizers with exact masters (fp32 or int16 remainders) for fp16/bf16 params."""

from fastamp.optim.adamw import AdamW
from fastamp.optim.lion import Lion
from fastamp.optim.sgd import SGD

__all__ = ["AdamW", "Lion", "SGD"]
