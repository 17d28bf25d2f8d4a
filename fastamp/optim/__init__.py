"""Fused, amp-aware optimizers with exact masters (fp32 or int16 remainders) for fp16/bf16 params."""

from fastamp.optim.rules.adamw import AdamW
from fastamp.optim.rules.lion import Lion
from fastamp.optim.rules.sgd import SGD

__all__ = ["AdamW", "Lion", "SGD"]
