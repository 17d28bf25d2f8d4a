"""The storage formats of the reference: counter-based random bits, stochastic rounding, bf16 masters.

Pure integer maths in plain torch (int64 tensors holding uint32 values), so the bits are the
same on every device and CPU: :func:`sr_random16` draws 16 random bits per element from
(seed, step counter, stream, index) with no RNG state; :func:`round_bf16_stochastic` rounds
fp32 to bf16 with them; :func:`split_master` / :func:`join_master` keep an exact fp32
master as a bf16 param plus an int16 remainder. :mod:`fastamp.reference` re-exports every
name here (``fastamp.reference.split_master`` etc.) and builds ``adamw_bf16_`` and ``sgd_``
on them. The C++ twins are in ``csrc/fastamp_math.h``, the Triton ones in
``kernels/_common.py``: every backend matches these bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF


def _mul32(a: Tensor, b: int) -> Tensor:
    """(a * b) mod 2^32 for int64 tensors holding uint32 values, without int64 overflow."""
    lo = (a * (b & 0xFFFF)) & _M32
    hi = ((a * (b >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _mix32(x: Tensor) -> Tensor:
    # A 32-bit integer finaliser (xorshift-multiply); identical in C++, CUDA and Triton.
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def sr_random16(seed, counter: Tensor, stream: int, n: int, device, offset: int = 0) -> Tensor:
    """16 random bits per element for stochastic rounding, counter-based (no RNG state).

    ``h = mix(seed ^ 0x9E3779B9); h = mix(h ^ counter); h = mix(h ^ stream);
    h = mix(h ^ (index >> 32)); r = mix(h ^ (index & 0xFFFFFFFF)) & 0xFFFF``, all uint32,
    where ``index`` is the element's flat index, ``counter`` the optimizer's step (a device
    tensor, low 32 bits), and ``stream = 4 * tensor_id + k`` (k: 0 param, 1 exp_avg,
    2 exp_avg_sq, 3 max_exp_avg_sq). Every data-parallel rank with the same seed and param
    order draws the same bits. ``offset``: the bits of elements ``offset .. offset + n - 1``
    (a slice of a tensor gets the bits the whole tensor's elements have).
    """
    seed_t = (
        seed.reshape(()).to(device=device, dtype=torch.int64)
        if isinstance(seed, Tensor)
        else torch.full((), seed, dtype=torch.int64, device=device)
    )
    h = _mix32((seed_t & _M32) ^ 0x9E3779B9)
    h = _mix32(h ^ (counter.reshape(()).to(device=device, dtype=torch.int64) & _M32))
    h = _mix32(h ^ (stream & _M32))
    idx = torch.arange(offset, offset + n, dtype=torch.int64, device=device)
    h = _mix32(h ^ (idx >> 32))
    return _mix32(h ^ (idx & _M32)) & 0xFFFF


def _f32_bits(x: Tensor) -> Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64) & _M32


def _bits_f32(b: Tensor) -> Tensor:
    b = b & _M32
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


def round_bf16_stochastic(x: Tensor, rand16: Tensor) -> Tensor:
    """fp32 -> bf16 by stochastic rounding: add 16 random bits below the bf16 mantissa, truncate.

    Unbiased: rounds up with probability equal to the discarded fraction. NaN stays NaN
    (rounded as torch does); inf stays inf.
    """
    x = x.float().reshape(-1)
    bits = _f32_bits(x)
    up = ((bits + rand16) & _M32) >> 16
    out = _u16_to_bf16(up)
    return torch.where(torch.isnan(x), x.bfloat16(), out)


def _u16_to_bf16(u: Tensor) -> Tensor:
    u = u & 0xFFFF
    return torch.where(u >= 2**15, u - 2**16, u).to(torch.int16).view(torch.bfloat16)


def split_master(master: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 master -> (bf16 param, int16 remainder) with ``join_master`` its exact inverse.

    ``param = (bits(master) + 0x8000) >> 16`` (round to nearest, ties away from zero) and
    ``remainder = bits(master) - (bits(param) << 16)``, which lies in [-0x8000, 0x7fff].

    Why not ties-to-even: the fp32 values that round to nearest-even onto an *even* bf16
    value number 65,537 (both exact ties belong to it), one more than an int16 can tell
    apart, so no 16-bit remainder can be exact under round-to-nearest-even. Away from an
    exact tie (low 16 bits of the master == 0x8000, about 1 element in 65,536) the param is
    identical to ``master.bfloat16()``; at a tie it is the neighbour away from zero, one
    bf16 ulp from it. The master itself is always exact. A NaN master gives a quiet NaN
    param and remainder 0 (its payload is not kept).
    """
    m = master.float()
    bits = _f32_bits(m.reshape(-1)).reshape(m.shape)
    nan = torch.isnan(m)
    hi = ((bits + 0x8000) & _M32) >> 16
    hi = torch.where(nan, (bits >> 16) | 0x40, hi)
    diff = (bits - (hi << 16)) & _M32
    diff = torch.where(nan, torch.zeros_like(diff), diff)
    rem16 = diff & 0xFFFF
    rem = torch.where(rem16 >= 2**15, rem16 - 2**16, rem16).to(torch.int16)
    return _u16_to_bf16(hi), rem


def join_master(param_bf16: Tensor, remainder: Tensor) -> Tensor:
    """(bf16 param, int16 remainder) -> the exact fp32 master."""
    pbits = param_bf16.view(torch.int16).to(torch.int64) & 0xFFFF
    bits = ((pbits << 16) + remainder.to(torch.int64)) & _M32
    return _bits_f32(bits.reshape(-1)).reshape(param_bf16.shape)


def _store_lowp(value: Tensor, dtype: torch.dtype, rand16: Tensor | None) -> Tensor:
    """Round an fp32 result to ``dtype``: stochastic for bf16 when random bits are given."""
    if dtype == torch.bfloat16 and rand16 is not None:
        return round_bf16_stochastic(value, rand16).reshape(value.shape)
    return value.to(dtype)
