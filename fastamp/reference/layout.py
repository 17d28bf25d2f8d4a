"""What each optimizer-state format stores per tensor, as data: streams, dtypes, lengths, bytes per param.

The engine asks this table how much to allocate and what a state_dict holds (the key names are
those of ``shared/design/memory-formats.md`` §6), and the bytes-per-param benchmark compares
its measurements with it. Everything is a function of ``numel`` only; the lowbit size threshold
(``lowbit_min_numel``) is the engine's policy and is not applied here.

    >>> state_bytes_per_param(master="ulp8", moments="q8", n_moments=2)   # bf16 param + grad
    7.0625
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastamp.reference.q8 import num_blocks


@dataclass(frozen=True)
class Stream:
    """One tensor of state: its state_dict key, dtype and number of elements for a param of ``numel``."""

    key: str
    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


MOMENT_FORMATS = ("fp32", "q8")
MASTER_FORMATS = ("fp32", "remainder", "ulp8", "none")


def moment_streams(fmt: str, key: str, numel: int) -> list[Stream]:
    """The tensors of one moment (``key``: ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``) in format ``fmt``.

    ``fp32``: ``key`` fp32 [numel]. ``q8``: ``key_q`` uint8 [numel] (the codes; stored in the
    param's shape) and ``key_scale`` uint8 [ceil(numel / 32)].
    """
    if fmt == "fp32":
        return [Stream(key, torch.float32, numel)]
    if fmt == "q8":
        return [Stream(f"{key}_q", torch.uint8, numel), Stream(f"{key}_scale", torch.uint8, num_blocks(numel))]
    raise ValueError(f"moment format must be one of {MOMENT_FORMATS}, got {fmt!r}")


def master_streams(fmt: str, numel: int) -> list[Stream]:
    """The master-weight tensors besides the 16-bit param: fp32 copy, int16 remainder (bf16), int8 ulp8, or none."""
    table = {
        "fp32": [Stream("master", torch.float32, numel)],
        "remainder": [Stream("master_remainder", torch.int16, numel)],
        "ulp8": [Stream("master_ulp8", torch.int8, numel)],
        "none": [],
    }
    if fmt not in table:
        raise ValueError(f"master format must be one of {MASTER_FORMATS}, got {fmt!r}")
    return table[fmt]


_MOMENT_KEYS = {1: ("momentum_buffer",), 2: ("exp_avg", "exp_avg_sq")}


def state_bytes_per_param(
    master: str,
    moments: str,
    n_moments: int = 2,
    numel: int | None = None,
    param_bytes: int = 2,
    grad_bytes: int = 2,
) -> float:
    """Bytes per parameter of param + grad + master + moments for one tensor of ``numel`` elements.

    ``numel=None`` gives the large-tensor limit (q8: 1 + 1/32 B per moment). ``n_moments``: 2
    (AdamW: ``exp_avg``, ``exp_avg_sq``), 1 (SGD momentum) or 0.
    """
    if n_moments not in (0, 1, 2):
        raise ValueError(f"n_moments must be 0, 1 or 2, got {n_moments}")
    n = 32 * 2**20 if numel is None else int(numel)
    if n <= 0:
        raise ValueError(f"numel must be positive, got {numel}")
    streams = master_streams(master, n)
    for key in _MOMENT_KEYS.get(n_moments, ()):
        streams += moment_streams(moments, key, n)
    return param_bytes + grad_bytes + sum(s.nbytes for s in streams) / n
