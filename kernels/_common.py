"""Shared pieces of the Triton kernels: dtype kinds, fp32 load/store helpers, launch tables.

Every kernel reads its tensors through a table of raw ``data_ptr()`` values (multi-tensor
apply): one launch covers every chunk of every tensor of a dtype group. The table is one
int64 tensor on the device, laid out as::

    [ptrs of kind 0 (n_tensors), ..., ptrs of kind K-1, numel (n_tensors),
     chunk -> tensor index (n_chunks), chunk -> first element (n_chunks)]

so a launch needs one host-to-device copy, from pinned memory with ``non_blocking`` on
CUDA (no host sync), and tables are cached by their content.
"""

import math
import struct
from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from fastamp.kernels import interpreted

# dtype kinds, passed to kernels as constexprs. bf16 travels as raw uint16 bits so that the
# rounding is done with integer operations (the interpreter's fp32->bf16 cast is not RNE).
KIND_F32 = 0
KIND_F16 = 1
KIND_BF16 = 2
KIND_F64 = 3
# int16 master remainders (bf16 params, see fastamp.reference.split_master); never converted to fp32
KIND_I16 = 4
DTYPE_KIND = {torch.float32: KIND_F32, torch.float16: KIND_F16, torch.bfloat16: KIND_BF16, torch.float64: KIND_F64}

# Triton >= 3.2 has correctly rounded sqrt/division; plain `tl.sqrt` and `/` lower to
# approximate PTX instructions on NVIDIA GPUs. Older Triton falls back (documented drift).
HAS_RN = hasattr(tl, "sqrt_rn") and hasattr(tl, "div_rn")

# Compile option: no FMA contraction, so every fp32 operation rounds once, as in the reference.
LAUNCH_OPTS = {} if interpreted() else {"enable_fp_fusion": False}


def chunk_config() -> tuple:
    """``(CHUNK, BLOCK)``: elements per program and per inner iteration.

    The interpreter pays per program and per operation, not per element, so it gets large
    blocks; a GPU gets chunks small enough to fill every SM on a few large tensors.
    """
    if interpreted():
        return 4096, 1024
    return 16384, 2048


@triton.jit
def sqrt_rn(x, HAS_RN: tl.constexpr):
    if HAS_RN:
        return tl.sqrt_rn(x)
    else:
        return tl.sqrt(x)


@triton.jit
def div_rn(x, y, HAS_RN: tl.constexpr):
    if HAS_RN:
        return tl.div_rn(x, y)
    else:
        return x / y


@triton.jit
def chunk_of(table_ptr, n_tensors, n_chunks, pid, N_PTR: tl.constexpr):
    """Decode program ``pid``'s entry of a :func:`build_table` table: (tensor, chunk start, tensor numel)."""
    t = tl.load(table_ptr + (N_PTR + 1) * n_tensors + pid)
    start = tl.load(table_ptr + (N_PTR + 1) * n_tensors + n_chunks + pid)
    numel = tl.load(table_ptr + N_PTR * n_tensors + t)
    return t, start, numel


@triton.jit
def load_ptr(table_ptr, slot, KIND: tl.constexpr):
    """The pointer stored at ``table_ptr[slot]``, typed for a tensor of dtype kind ``KIND``."""
    raw = tl.load(table_ptr + slot)
    if KIND == 0:
        return raw.to(tl.pointer_type(tl.float32))
    elif KIND == 1:
        return raw.to(tl.pointer_type(tl.float16))
    elif KIND == 2:
        return raw.to(tl.pointer_type(tl.uint16))
    elif KIND == 3:
        return raw.to(tl.pointer_type(tl.float64))
    else:
        return raw.to(tl.pointer_type(tl.int16))


@triton.jit
def load_f32(ptr, idx, mask, KIND: tl.constexpr):
    """Load elements and convert them to fp32 (exact for fp16/bf16; RNE for fp64)."""
    if KIND == 2:
        bits = tl.load(ptr + idx, mask=mask, other=0).to(tl.uint32)
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + idx, mask=mask, other=0).to(tl.float32)


@triton.jit
def f32_to_bf16_bits(x):
    """Round fp32 to bf16 to nearest even by integer ops; NaN stays a quiet NaN of the same sign."""
    u = x.to(tl.uint32, bitcast=True)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16)
    nan = ((u >> 16) | 0x0040).to(tl.uint16)
    return tl.where((u & 0x7FFFFFFF) > 0x7F800000, nan, rounded)


@triton.jit
def is_finite_f32(x):
    return (x.to(tl.uint32, bitcast=True) & 0x7F800000) != 0x7F800000


@triton.jit
def store_from_f32(ptr, idx, x, mask, KIND: tl.constexpr):
    """Round fp32 ``x`` once to the tensor's dtype and store it; returns the stored value's finiteness."""
    if KIND == 0:
        tl.store(ptr + idx, x, mask=mask)
        return is_finite_f32(x)
    elif KIND == 1:
        h = x.to(tl.float16)
        tl.store(ptr + idx, h, mask=mask)
        return is_finite_f32(h.to(tl.float32))
    elif KIND == 2:
        b = f32_to_bf16_bits(x)
        tl.store(ptr + idx, b, mask=mask)
        return (b & 0x7F80) != 0x7F80
    else:
        tl.store(ptr + idx, x.to(tl.float64), mask=mask)
        return is_finite_f32(x)


# ---- low-bit master state: the twins of reference.sr_random16 / split_master / join_master ----
# All integer maths is uint32 with wrap-around. Measured under TRITON_INTERPRET=1 (numpy
# uint32 arrays) and by definition on a GPU, uint32 multiplication wraps mod 2^32 exactly as
# the reference's _mul32, so no emulation is needed (tests compare the bits).


@triton.jit
def mix32(x):
    """The reference's 32-bit finaliser; ``x`` is uint32."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def sr_base_key(rng_ptr):
    """``mix(mix(seed ^ 0x9E3779B9) ^ counter)`` from the device ``rng = [seed, counter]`` (low 32 bits each)."""
    seed = tl.load(rng_ptr).to(tl.uint32)
    counter = tl.load(rng_ptr + 1).to(tl.uint32)
    return mix32(mix32(seed ^ 0x9E3779B9) ^ counter)


@triton.jit
def sr_stream_key(base_key, tensor_id, K: tl.constexpr):
    """The per-tensor key of stream ``4 * tensor_id + K`` (tensor_id is int64, taken mod 2^32)."""
    stream = (tensor_id * 4 + K).to(tl.uint32)
    return mix32(base_key ^ stream)


@triton.jit
def sr_random16(key, idx):
    """16 random bits (uint32) for the int64 flat element indices ``idx`` of the stream ``key``."""
    # the loop index may be int32 (the interpreter) or int64 (compiled from int64 bounds)
    wide = idx.to(tl.int64)
    hi = (wide >> 32).to(tl.uint32)
    lo = (wide & 0xFFFFFFFF).to(tl.uint32)
    return mix32(mix32(key ^ hi) ^ lo) & 0xFFFF


@triton.jit
def f32_to_bf16_bits_sr(x, rand16):
    """fp32 -> bf16 bits by stochastic rounding (add 16 random bits, truncate); NaN as in f32_to_bf16_bits."""
    u = x.to(tl.uint32, bitcast=True)
    rounded = ((u + rand16) >> 16).to(tl.uint16)
    nan = ((u >> 16) | 0x0040).to(tl.uint16)
    return tl.where((u & 0x7FFFFFFF) > 0x7F800000, nan, rounded)


@triton.jit
def store_bf16_bits(ptr, idx, x, mask, key, SR: tl.constexpr):
    """Store fp32 ``x`` as bf16 bits: stochastically with stream ``key`` when SR, else nearest-even."""
    if SR:
        tl.store(ptr + idx, f32_to_bf16_bits_sr(x, sr_random16(key, idx)), mask=mask)
    else:
        tl.store(ptr + idx, f32_to_bf16_bits(x), mask=mask)


@triton.jit
def store_state(ptr, idx, x, mask, KIND: tl.constexpr, key, SR: tl.constexpr):
    """Store an fp32 optimizer-state value in its dtype (fp32, or bf16 rounded as store_bf16_bits)."""
    if KIND == 2:
        store_bf16_bits(ptr, idx, x, mask, key, SR)
    else:
        tl.store(ptr + idx, x, mask=mask)


@triton.jit
def join_master(pbits, rem):
    """bf16 param bits (uint16) + int16 remainder -> the exact fp32 master."""
    u = (pbits.to(tl.uint32) << 16) + rem.to(tl.int32).to(tl.uint32, bitcast=True)
    return u.to(tl.float32, bitcast=True)


@triton.jit
def split_master(x):
    """fp32 master -> (bf16 param bits uint16, int16 remainder): nearest, ties away from zero.

    NaN gives a quiet NaN param of the same sign and remainder 0, as reference.split_master.
    """
    u = x.to(tl.uint32, bitcast=True)
    hi = (u + 0x8000) >> 16
    rem = (u - (hi << 16)).to(tl.uint16).to(tl.int16, bitcast=True)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    pbits = tl.where(nan, (u >> 16) | 0x0040, hi).to(tl.uint16)
    return pbits, tl.where(nan, 0, rem).to(tl.int16)


def lerp_small(beta1: float) -> bool:
    """torch.lerp's branch for weight ``1 - beta1`` (< 0.5), decided on the fp32 weight like the reference."""
    return to_f32(1.0 - beta1) < 0.5


def to_f32(x: float) -> float:
    """``x`` rounded to the nearest fp32 (inf on overflow), as ``torch.tensor(x, dtype=float32)``."""
    if math.isnan(x) or math.isinf(x):
        return x
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        # struct refuses values that round past FLT_MAX; torch rounds them to inf.
        return math.copysign(math.inf, x)


def f64_bits(x: float) -> int:
    """The IEEE bits of the double ``x`` as a signed int64 (kernels bitcast them back to fp64)."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


_TABLE_CACHE: "OrderedDict[tuple, tuple]" = OrderedDict()
_TABLE_CACHE_SIZE = 64


def build_table(ptr_columns: Sequence[Sequence[int]], numels: Sequence[int], chunk: int, device: torch.device):
    """The launch table for ``n`` tensors and its chunk count: ``(table, n_chunks)``.

    ``ptr_columns`` holds one list of ``data_ptr()`` per pointer kind (each of length n),
    ``numels`` the element counts (all > 0). Cached by content: a table depends only on the
    pointers, sizes and chunk length, so reusing one for other tensors at the same
    addresses is still correct.
    """
    key = (device, chunk, tuple(numels), *(tuple(c) for c in ptr_columns))
    hit = _TABLE_CACHE.get(key)
    if hit is not None:
        _TABLE_CACHE.move_to_end(key)
        return hit
    chunk_tensor = []
    chunk_start = []
    for t, n in enumerate(numels):
        starts = range(0, n, chunk)
        chunk_tensor.extend([t] * len(starts))
        chunk_start.extend(starts)
    values = [p for col in ptr_columns for p in col]
    values.extend(numels)
    values.extend(chunk_tensor)
    values.extend(chunk_start)
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cpu":
        table = host
    else:
        # A pinned source lets the copy run asynchronously; the caching host allocator keeps
        # the buffer alive until the copy has finished.
        table = host.pin_memory().to(device, non_blocking=True)
    result = (table, len(chunk_tensor))
    _TABLE_CACHE[key] = result
    if len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
        _TABLE_CACHE.popitem(last=False)
    return result


def check_runnable(op: str, device: torch.device) -> None:
    if device.type == "cpu" and not interpreted():
        raise RuntimeError(f"fastamp_triton::{op}: Triton runs on CPU tensors only under TRITON_INTERPRET=1")
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"fastamp_triton::{op}: no Triton support for device {device}")
