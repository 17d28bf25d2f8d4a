"""Shared pieces of the Triton kernels: dtype kinds, fp32 load/store helpers, launch tables.

Every kernel reads its tensors through a table of raw ``data_ptr()`` values (multi-tensor
apply): one launch covers every chunk of every tensor of a dtype group. The table is one
int64 tensor on the device, laid out as::

    [ptrs of kind 0 (n_tensors), ..., ptrs of kind K-1, numel (n_tensors),
     chunk -> tensor index (n_chunks), chunk -> first element (n_chunks),
     (optimizer tables) tensor -> offset of its step scalars (n_tensors)]

so a launch needs one host-to-device copy, from pinned memory without blocking on CUDA (no
host sync). The optimizer kernel takes its grads' addresses as a second int64 tensor (the one
column a repeated call changes: a planned table stays on the device). See :func:`build_table`
for when tables are cached and how they stay valid under CUDA-graph capture and across
streams, and :func:`optimizer_launches` for the optimizer launchers' plans: a repeated call
with the same params and states reuses its groups and tables and skips the dispatcher
(:func:`call_launcher`).

Memory access: a chunk is ``CHUNK`` elements and starts at a multiple of ``CHUNK``; a program
walks it in blocks of ``BLOCK``. Full blocks are loaded and stored without a mask, only the
last partial block of a tensor is masked, and when every tensor of a launch is 16-byte
aligned (``ALIGNED``) the pointers read from the table carry a ``tl.multiple_of(ptr, 16)``
hint. Together they let Triton emit 16-byte vector loads and stores (``ld.global.v4``): a
pointer cast from an int64 has no known alignment, and a mask against a bound read from
memory hides that a block is full. ``tests/tools/test_triton_aot.py`` checks the PTX for it.
"""

import contextlib
import itertools
import math
import operator
import struct
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Optional

import torch
import triton
import triton.language as tl
from fastamp.kernels import _guards as G
from fastamp.kernels import interpreted

# dtype kinds, passed to kernels as constexprs. bf16 travels as raw uint16 bits so that the
# rounding is done with integer operations (the interpreter's fp32->bf16 cast is not RNE).
KIND_F32 = 0
KIND_F16 = 1
KIND_BF16 = 2
KIND_F64 = 3
# int16 master remainders (bf16 params, see fastamp.reference.split_master); never converted to fp32
KIND_I16 = 4
# int8 ulp8 master corrections and uint8 q8 codes / scale bytes (kernels/formats.py): raw bytes too
KIND_I8 = 5
KIND_U8 = 6
DTYPE_KIND = {torch.float32: KIND_F32, torch.float16: KIND_F16, torch.bfloat16: KIND_BF16, torch.float64: KIND_F64}

# How fp32 square roots and divisions round, the constexpr RN of the kernels that use them:
#   2: inline PTX `sqrt.rn.f32` / `div.rn.f32` (NVIDIA GPUs): IEEE, subnormals kept. Triton 3.2
#      and 3.3 lower tl.sqrt_rn / tl.div_rn to `sqrt.rn.ftz.f32` / `div.rn.ftz.f32`, which flush
#      subnormals to zero (seen in their PTX by tests/tools/test_triton_aot.py; 3.6 and 3.9 do not).
#   1: tl.sqrt_rn / tl.div_rn: the interpreter (numpy, exact) and other GPUs.
#   0: plain tl.sqrt and `/`, approximate on NVIDIA GPUs: Triton without the _rn functions
#      (older than 3.2; documented drift).
HAS_RN = hasattr(tl, "sqrt_rn") and hasattr(tl, "div_rn")
RN = 0 if not HAS_RN else 1 if interpreted() or torch.version.hip else 2

# Compile option: no FMA contraction, so every fp32 operation rounds once, as in the reference.
LAUNCH_OPTS = {} if interpreted() else {"enable_fp_fusion": False}

# GPU launch shape: BLOCK 512 with 4 warps, 4 elements per thread and stream: one 16-byte
# vector of an fp32 stream, one 8-byte vector of a 16-bit stream, two 16-byte ones of an fp64
# stream. Chosen with tests/tools/test_triton_aot.py, which compiles every specialisation for sm_80
# and sm_90 and reads ptxas's report (Triton 3.9): 16 elements per thread (BLOCK 2048, 4
# warps, the old shape) hit the 255-register cap and spilled up to ~520 bytes per thread in
# the AdamW kernels; 8 per thread (BLOCK 1024, 4 warps) still spilled 4-12 bytes in 22 of
# 1412 compiles (at 56-96 registers: ptxas's allocator, not the cap) and took 170-190
# registers with stochastic rounding; 4 per thread in CTAs of 8 warps spilled 4-8 bytes in 2
# (ptxas held them at 64 registers); 4 per thread in CTAs of 4 warps spills in none.
# The q8 states have the same shape: their uint8 code streams then take 4 bytes per thread (one
# 32-bit access, 128 contiguous bytes a warp). At 8 per thread (BLOCK 1024, 4 warps: 8-byte code
# accesses) ptxas spilled 8 bytes in 6 of the 288 compiles of the AdamW-q8 kernel of then with
# Triton 3.9 (and 4-8 bytes in others with `.maxnreg 128`), 12-172 bytes in its CI cover with
# Triton 3.2; at 4 it spills in none. The generic kernel (kernels/optim.py: every rule x format)
# keeps this shape (benchmarks/results/triton_aot.md).
_GPU_CHUNK = 16384
_GPU_SHAPES = {
    "unscale_check": (512, 4),
    "optim": (512, 4),
}
_INTERPRETER_CHUNK, _INTERPRETER_BLOCK = 4096, 1024


def chunk_config() -> tuple:
    """``(CHUNK, BLOCK)``: elements per program and per inner iteration (the default block).

    The interpreter pays per program and per operation, not per element, so it gets large
    blocks; a GPU gets chunks small enough to fill every SM on a few large tensors, walked in
    blocks sized per kernel (:func:`launch_config`).
    """
    if interpreted():
        return _INTERPRETER_CHUNK, _INTERPRETER_BLOCK
    return _GPU_CHUNK, _GPU_SHAPES["optim"][0]


def launch_config(kernel: str) -> tuple:
    """``(CHUNK, BLOCK, options)`` for one of the streaming kernels; ``options`` go to the launch."""
    if interpreted():
        return _INTERPRETER_CHUNK, _INTERPRETER_BLOCK, {}
    block, num_warps = _GPU_SHAPES[kernel]
    return _GPU_CHUNK, block, {**LAUNCH_OPTS, "num_warps": num_warps}


# Launch arguments Triton must not specialise on: counts, flags and settings (a value of 1 or
# a multiple of 16 would otherwise compile another variant) and pointers to tables and
# scalars, whose alignment does not matter. Data pointers are read from the table, and
# ALIGNED says what holds for them. So the compiled variants are exactly the constexpr ones.
NO_SPECIALIZE = (
    "n_tensors",
    "n_chunks",
    "table_ptr",
    "step_scalars_ptr",
    "found_inf_ptr",
    "inv_scale_ptr",
    "rng_ptr",
    "partial_ptr",
    "chunk_counts_ptr",
    "chunk_absmax_ptr",
    "counts_ptr",
    "absmax_ptr",
    "scale_ptr",
    "growth_tracker_ptr",
    "hysteresis_tracker_ptr",
    "growth_factor_bits",
    "backoff_factor_bits",
    "growth_interval",
    "hysteresis",
    "check_found_inf",
    "maximize",
    "lerp_small",
    "nesterov",
    "has_weight_decay",
)


def jit_launched(fn):
    """``triton.jit`` for a launched kernel: no specialisation on the arguments in NO_SPECIALIZE."""
    import inspect

    names = [n for n in inspect.signature(fn).parameters if n in NO_SPECIALIZE]
    return triton.jit(fn, do_not_specialize=names)


def is_aligned(*tensors) -> bool:
    """Every tensor's data starts on a 16-byte boundary (fresh allocations do; views may not)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def device_guard(device: torch.device):
    """Make ``device`` current for a launch: Triton launches on the current device and stream."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


@triton.jit
def neg(x):
    """``-x`` with the sign of zero flipped too (``maximize``'s ``g = -g``, as the reference's ``-g``).

    Triton 3.2 and 3.6 (checked under their interpreters; 3.9 negates) compute unary minus as
    ``0 - x``, which gives ``+0.0`` for ``+0.0``: a -0.0 of the reference became +0.0 downstream
    (the CUDA-build tier's three SGD cases and twelve Lion cases). A product with -1 is exact for
    every value, signed zeros and NaN included, in every Triton.
    """
    return x * -1.0


@triton.jit
def sqrt_rn(x, RN: tl.constexpr):
    """fp32 square root, correctly rounded when RN > 0 (see RN)."""
    if RN == 2:
        return tl.inline_asm_elementwise("sqrt.rn.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    elif RN == 1:
        return tl.sqrt_rn(x)
    else:
        return tl.sqrt(x)


@triton.jit
def div_rn(x, y, RN: tl.constexpr):
    """fp32 division, correctly rounded when RN > 0 (see RN)."""
    if RN == 2:
        return tl.inline_asm_elementwise(
            "div.rn.f32 $0, $1, $2;", "=f,f,f", [x, y], dtype=tl.float32, is_pure=True, pack=1
        )
    elif RN == 1:
        return tl.div_rn(x, y)
    else:
        return x / y


@triton.jit
def chunk_of(table_ptr, n_tensors, n_chunks, pid, N_PTR: tl.constexpr, CHUNK: tl.constexpr):
    """Decode program ``pid``'s entry of a :func:`build_table` table: (tensor, chunk start, tensor numel).

    Chunk starts are multiples of CHUNK (:func:`build_table`), which the hint passes on.
    """
    t = tl.load(table_ptr + (N_PTR + 1) * n_tensors + pid)
    start = tl.load(table_ptr + (N_PTR + 1) * n_tensors + n_chunks + pid)
    numel = tl.load(table_ptr + N_PTR * n_tensors + t)
    return t, tl.multiple_of(start, CHUNK), numel


@triton.jit
def scalar_row(table_ptr, n_tensors, n_chunks, t, step_scalars_ptr, N_PTR: tl.constexpr):
    """The step scalars of launch tensor ``t``: the table's last column holds where they start in
    ``step_scalars`` (its index in the op call times the row stride: k for ``[n, k]``, 0 for the
    shared ``[k]``). Once per program: per-tensor scalars cost nothing per element."""
    return step_scalars_ptr + tl.load(table_ptr + (N_PTR + 1) * n_tensors + 2 * n_chunks + t)


@triton.jit
def block_index(off, BLOCK: tl.constexpr):
    """Element indices ``off + [0, BLOCK)`` of a block; ``off`` is a multiple of BLOCK (chunk start + k * BLOCK)."""
    return tl.multiple_of(off + tl.arange(0, BLOCK), BLOCK)


@triton.jit
def chunk_end(start, numel, found_inf_ptr, check_found_inf, CHUNK: tl.constexpr):
    """End of the chunk; ``start`` (an empty chunk) when ``check_found_inf`` and ``*found_inf_ptr`` != 0 (NaN too).

    ``found_inf_ptr`` must point at readable memory even when it is not checked.
    """
    end = tl.minimum(start + CHUNK, numel)
    skip = (check_found_inf != 0) & (tl.load(found_inf_ptr) != 0)
    return tl.where(skip, start, end)


@triton.jit
def load_ptr(table_ptr, slot, KIND: tl.constexpr, ALIGNED: tl.constexpr):
    """The pointer stored at ``table_ptr[slot]``, typed for a tensor of dtype kind ``KIND``.

    ``ALIGNED``: the launcher checked that the tensor's data is 16-byte aligned.
    """
    raw = tl.load(table_ptr + slot)
    if KIND == 0:
        ptr = raw.to(tl.pointer_type(tl.float32))
    elif KIND == 1:
        ptr = raw.to(tl.pointer_type(tl.float16))
    elif KIND == 2:
        ptr = raw.to(tl.pointer_type(tl.uint16))
    elif KIND == 3:
        ptr = raw.to(tl.pointer_type(tl.float64))
    elif KIND == 4:
        ptr = raw.to(tl.pointer_type(tl.int16))
    elif KIND == 5:
        ptr = raw.to(tl.pointer_type(tl.int8))
    else:
        ptr = raw.to(tl.pointer_type(tl.uint8))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


# Memory helpers: MASKED is False for full blocks (no mask, so 16-byte vector accesses are
# possible) and True for the last, partial block of a tensor. Each holds its tl.load/tl.store
# itself (no deeper helper), so the PTX line info names the calling line: the AOT tier reads
# it to tell the streams apart.


@triton.jit
def load_raw(ptr, idx, mask, MASKED: tl.constexpr):
    """Elements as stored (masked lanes read 0)."""
    if MASKED:
        return tl.load(ptr + idx, mask=mask, other=0)
    else:
        return tl.load(ptr + idx)


@triton.jit
def load_f32(ptr, idx, mask, KIND: tl.constexpr, MASKED: tl.constexpr):
    """Load elements and convert them to fp32 (exact for fp16/bf16; RNE for fp64); masked lanes read 0."""
    if MASKED:
        raw = tl.load(ptr + idx, mask=mask, other=0)
    else:
        raw = tl.load(ptr + idx)
    if KIND == 2:
        return (raw.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return raw.to(tl.float32)


@triton.jit
def store_raw(ptr, idx, x, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + idx, x, mask=mask)
    else:
        tl.store(ptr + idx, x)


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
def store_from_f32(ptr, idx, x, mask, KIND: tl.constexpr, MASKED: tl.constexpr):
    """Round fp32 ``x`` once to the tensor's dtype and store it; returns the stored value's finiteness."""
    if KIND == 0:
        y = x
        finite = is_finite_f32(x)
    elif KIND == 1:
        y = x.to(tl.float16)
        finite = is_finite_f32(y.to(tl.float32))
    elif KIND == 2:
        y = f32_to_bf16_bits(x)
        finite = (y & 0x7F80) != 0x7F80
    else:
        y = x.to(tl.float64)
        finite = is_finite_f32(x)
    if MASKED:
        tl.store(ptr + idx, y, mask=mask)
    else:
        tl.store(ptr + idx, y)
    return finite


# ---- low-bit master state: the twins of reference.sr_random16 / split_master / join_master ----
# All integer maths is uint32 with wrap-around. Measured under TRITON_INTERPRET=1 (numpy
# uint32 arrays) and by definition on a GPU, uint32 multiplication wraps mod 2^32 exactly as
# _mul32 of fastamp/reference/formats.py, so no emulation is needed (tests compare the bits).


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
def sr_block_key(key, off):
    """``mix32(key ^ hi)`` for the block of elements starting at ``off``, ``hi`` its high 32 bits.

    Every index of a block has the high 32 bits of ``off``: blocks start at multiples of
    BLOCK, a power of two that divides 2^32. So the reference's first mix is done once per
    block, not per element (fewer instructions and registers, the same bits).
    """
    return mix32(key ^ (off.to(tl.int64) >> 32).to(tl.uint32))


@triton.jit
def sr_random16(block_key, idx):
    """16 random bits (uint32) for the int64 flat element indices ``idx`` of a block.

    The reference's ``mix(mix(key ^ hi) ^ lo) & 0xFFFF``, with ``block_key`` from
    :func:`sr_block_key`; ``lo`` is the index truncated to 32 bits.
    """
    return mix32(block_key ^ idx.to(tl.uint32)) & 0xFFFF


@triton.jit
def f32_to_bf16_bits_sr(x, rand16):
    """fp32 -> bf16 bits by stochastic rounding (add 16 random bits, truncate); NaN as in f32_to_bf16_bits."""
    u = x.to(tl.uint32, bitcast=True)
    rounded = ((u + rand16) >> 16).to(tl.uint16)
    nan = ((u >> 16) | 0x0040).to(tl.uint16)
    return tl.where((u & 0x7FFFFFFF) > 0x7F800000, nan, rounded)


@triton.jit
def bf16_bits(x, block_key, idx, SR: tl.constexpr):
    """fp32 ``x`` as bf16 bits: stochastically rounded with ``block_key`` (:func:`sr_block_key`) when SR, else nearest-even."""
    if SR:
        return f32_to_bf16_bits_sr(x, sr_random16(block_key, idx))
    else:
        return f32_to_bf16_bits(x)


@triton.jit
def store_state(ptr, idx, x, mask, KIND: tl.constexpr, block_key, SR: tl.constexpr, MASKED: tl.constexpr):
    """Store an fp32 optimizer-state value in its dtype (fp32, or bf16 rounded as :func:`bf16_bits`)."""
    if KIND == 2:
        y = bf16_bits(x, block_key, idx, SR)
    else:
        y = x
    if MASKED:
        tl.store(ptr + idx, y, mask=mask)
    else:
        tl.store(ptr + idx, y)


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


@triton.jit
def nan_maximum(a, b):
    """torch.maximum: NaN if either is NaN."""
    return tl.where((a != a) | (b != b), a + b, tl.maximum(a, b))


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
# Tables made while a CUDA graph was being captured, with their pinned sources: the graph holds
# both addresses (it re-copies the source into the table on every replay), and nothing says
# when the graph dies, so they live as long as the process: a few small tensors per capture.
_CAPTURED_TABLES: list = []


def _table_values(ptr_columns, numels, chunk, rows=None):
    """The table's int64 values as an ``array('q')`` and its chunk count.

    Built with C-level list operations (no Python loop per tensor when every tensor fits in
    one chunk, the many-small-tensors case), and turned into a tensor without a per-element
    conversion (``torch.frombuffer``).
    """
    values = array("q")
    for col in ptr_columns:
        values.extend(col)
    values.extend(numels)
    n = len(numels)
    if n == 0 or max(numels) <= chunk:
        values.extend(range(n))
        values.frombytes(bytes(8 * n))  # every chunk starts at element 0
        if rows is not None:
            values.extend(rows)
        return values, n
    chunk_tensor = []
    chunk_start = []
    for t, k in enumerate(numels):
        starts = range(0, k, chunk)
        chunk_tensor.extend([t] * len(starts))
        chunk_start.extend(starts)
    values.extend(chunk_tensor)
    values.extend(chunk_start)
    if rows is not None:
        values.extend(rows)
    return values, len(chunk_tensor)


def _host_table(values) -> torch.Tensor:
    """An int64 CPU tensor of ``values`` (an ``array('q')``), owning its memory."""
    if len(values) == 0:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(values, dtype=torch.int64).clone()


def build_table(
    ptr_columns: Sequence[Sequence[int]],
    numels: Sequence[int],
    chunk: int,
    device: torch.device,
    rows: Optional[Sequence[int]] = None,
):
    """The launch table for ``n`` tensors and its chunk count: ``(table, n_chunks)``.

    ``ptr_columns`` holds one list of ``data_ptr()`` per pointer kind (each of length n),
    ``numels`` the element counts (all > 0), ``rows`` (optimizer launches) where each tensor's
    step scalars start in ``step_scalars`` (:func:`scalar_row`). Chunk ``c`` of a tensor starts
    at element ``c * chunk``. A table depends only on these values, so a cached one is reused for other
    tensors at the same addresses. On CUDA (call with ``device`` current):

    * eager: the table is copied from pinned memory without blocking on the current stream,
      and cached per (device, stream): a table is only ever used on the stream whose copy
      wrote it, so no launch can read it before the copy is done, and when the cache drops
      it, the caching allocator recycles its memory in that stream's order;
    * while the current stream is capturing a CUDA graph: a new table, written by the graph
      itself (the copy from a pinned buffer is captured, so every replay rewrites the table
      before its kernels read it), never an eager one (whose copy the graph could not order
      against); the table and its pinned source are kept alive for good, so nothing the graph
      points at is ever recycled.
    """
    content = (chunk, tuple(numels), None if rows is None else tuple(rows), *map(tuple, ptr_columns))
    if device.type != "cuda":
        key = (device, None, content)
    elif torch.cuda.is_current_stream_capturing():
        return _captured_table(ptr_columns, numels, chunk, device, rows)
    else:
        key = (device, torch.cuda.current_stream(device).cuda_stream, content)
    hit = _TABLE_CACHE.get(key)
    if hit is not None:
        _TABLE_CACHE.move_to_end(key)
        return hit
    values, n_chunks = _table_values(ptr_columns, numels, chunk, rows)
    host = _host_table(values)
    if device.type == "cpu":
        table = host
    else:
        # The caching host allocator keeps the pinned source alive until the copy has run.
        table = host.pin_memory().to(device, non_blocking=True)
    result = (table, n_chunks)
    _TABLE_CACHE[key] = result
    if len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
        _TABLE_CACHE.popitem(last=False)
    return result


def _captured_table(ptr_columns, numels, chunk, device, rows=None):
    values, n_chunks = _table_values(ptr_columns, numels, chunk, rows)
    return _captured_copy(values, device), n_chunks


def _captured_copy(values, device) -> torch.Tensor:
    """``values`` (an ``array('q')``) in a device tensor written by the graph being captured (see
    :func:`build_table`); it and its pinned source are kept for good."""
    host = _host_table(values).pin_memory()
    table = torch.empty(host.shape, dtype=torch.int64, device=device)
    table.copy_(host, non_blocking=True)
    _CAPTURED_TABLES.append((table, host))
    return table


def check_runnable(op: str, device: torch.device) -> None:
    if device.type == "cpu" and not interpreted():
        raise RuntimeError(f"fastamp_triton::{op}: Triton runs on CPU tensors only under TRITON_INTERPRET=1")
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"fastamp_triton::{op}: no Triton support for device {device}")


def contiguous(tensors):
    """``tensors`` with each non-contiguous one replaced by a contiguous copy (read-only streams)."""
    return [t if t.is_contiguous() else t.contiguous() for t in tensors]


class _Members(list):
    """One launch group's tensor indices, with what :func:`launch_groups` read of every tensor of
    the call (``data_ptr()`` per stream, element counts) for :func:`launch_table` to reuse."""

    __slots__ = ("source", "ptrs", "numels")


def launch_groups(streams, key) -> dict:
    """Indices of the non-empty tensors grouped for one launch each: ``{(*key(i), aligned): [i, ...]}``.

    ``streams`` holds the launch's tensor lists (params first), in table-column order; a tensor
    whose streams are not all 16-byte aligned (views at odd offsets) goes to the kernel compiled
    without the alignment hint. Each tensor's ``data_ptr()`` and element count are read once,
    here, and kept with the group for :func:`launch_table` called with the same ``streams``.
    """
    n = len(streams[0])
    ptrs = [[t.data_ptr() for t in s] for s in streams]
    numels = [t.numel() for t in streams[0]]
    ors = ptrs[0]
    for col in ptrs[1:]:
        ors = list(map(operator.or_, ors, col))
    groups = {}
    for i in range(n):
        if numels[i] == 0:
            continue
        k = (*key(i), not ors[i] & 15)
        members = groups.get(k)
        if members is None:
            members = groups[k] = _Members()
            members.source, members.ptrs, members.numels = streams, ptrs, numels
        members.append(i)
    return groups


def _group_columns(idxs, streams, ids_base, scalar_stride: int) -> tuple:
    """The pointer columns, numels and step-scalar rows of the tensors ``idxs`` (see :func:`launch_table`)."""
    if isinstance(idxs, _Members) and idxs.source is streams:
        if len(idxs) == len(idxs.numels):  # every tensor of the call in this group
            columns, counts = list(idxs.ptrs), idxs.numels
        else:
            columns = [[col[i] for i in idxs] for col in idxs.ptrs]
            counts = [idxs.numels[i] for i in idxs]
    else:
        columns = [[s[i].data_ptr() for i in idxs] for s in streams]
        counts = [streams[0][i].numel() for i in idxs]
    if ids_base is not None:
        columns.append([ids_base + i for i in idxs])
    if scalar_stride == 0:
        rows = [0] * len(idxs)
    elif idxs and idxs[-1] == len(idxs) - 1:  # indices 0..n-1: the whole call
        rows = list(range(0, len(idxs) * scalar_stride, scalar_stride))
    else:
        rows = [i * scalar_stride for i in idxs]
    return columns, counts, rows


def launch_table(idxs, streams, ids_base, chunk: int, device: torch.device, scalar_stride: int, apart=None) -> tuple:
    """The :func:`build_table` table of the tensors ``idxs``: ``(table, n_chunks, n_ptr, column apart)``.

    One column of ``data_ptr()`` per tensor list of ``streams`` (params first: their numels
    count) but ``streams[apart]``, whose addresses are returned apart (a list; None when
    ``apart`` is None), then, unless ``ids_base`` is None, the random stream's tensor ids
    ``ids_base + i`` (the index in the call, not in the group); last, the offsets
    ``i * scalar_stride`` of the tensors' step scalars (:func:`scalar_row`; ``scalar_stride``
    from :func:`checked_scalars`).
    """
    columns, counts, rows = _group_columns(idxs, streams, ids_base, scalar_stride)
    column = None if apart is None else columns.pop(apart)
    table, n_chunks = build_table(columns, counts, chunk, device, rows)
    return table, n_chunks, len(columns), column


# ---- the optimizer launchers' plans, kept across calls with the same tensors ----
#
# A plan holds, per launch group, its table of the persistent columns (the grads' addresses are
# a launch argument of their own), and what the table was built from: every address, element
# count, dtype of the params and state lists (the "persistent" lists: the same tensors step
# after step) and the grads' dtypes. A call whose tensors match all of it reuses the groups and
# tables and writes only this call's grad addresses, into a new small tensor per launch (grads
# are new tensors after every backward): a planned table is never rewritten, and on CUDA it
# stays on the device (one copy of n addresses per step, not of the whole table). The check
# is a few C-level passes over the lists (one C loop per block where fastamp._C and torch have
# them, else ``map`` of a tensor method: no Python code per tensor either way; see _plan_grads
# and _TensorGuards), and it compares values, not identities: a table depends only on these values, so
# another tensor at the same address with the same element count, dtype and layout reads and
# writes exactly what the planned one did, and a tensor replaced, rebound (``.data = ...``),
# resized or restrided in place changes one of them (``.data = x`` moves no version counter,
# so versions would not do). The device is not compared per tensor: a tensor at a planned
# address holds memory of the planned device (CPU and CUDA allocations share one address
# space under CUDA's unified addressing, so no address is valid on two devices).

_PLANS: "OrderedDict[tuple, _Plan]" = OrderedDict()
_PLANS_SIZE = 32
_BLOCK = 1024
_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_is_contiguous = torch.Tensor.is_contiguous
_is_neg = torch.Tensor.is_neg
_dtype_of = operator.attrgetter("dtype")
_device_of = operator.attrgetter("device")
_grad_of = operator.attrgetter("grad")


def _native_check(name: str):
    """``fastamp._C.<name>`` (csrc/plan_check.cpp), or None where the extension is absent or lacks it."""
    try:
        from fastamp import _C
    except (ImportError, OSError):
        return None
    return getattr(_C, name, None)


# A call's grads (new tensors each step) read in one prefetched C loop: addresses, and every
# check of the Python passes in ``_Plan.grad_ptrs`` (numel, dtype, contiguity, device, negated
# view, alignment); NotImplemented for anything but plain tensors, which those passes then read.
_dense_ptrs = _native_check("dense_ptrs")


# The first read of a persistent tensor's metadata is the cost of a repeated call (cache misses
# on memory last touched a step ago). ``plan_grads`` reads a block's addresses, dtypes, element
# counts and contiguity in one C loop and answers True where the block fits (NotImplemented for
# anything but a plain torch.Tensor / nn.Parameter, False for any difference: the Python passes
# then read the block; an extension whose plan_grads takes 6 arguments raises TypeError, and the
# call is planned again, as for any error of a check). It compares
# ``const_data_ptr()``, which, unlike ``data_ptr()``, does not materialise a copy-on-write
# tensor (``torch._lazy_clone``, private: no public API makes one in place); everything else
# it answers as the passes of ``data_ptr()`` and ``dtype`` would.
_plan_grads = _native_check("plan_grads")

# The same check over every persistent list at once, read as one sequence (no joined list, no block
# slices) against the plan's addresses and element counts held as int64 buffers (no Python int
# converted per tensor), and without reading any tensor's ``.grad``: True where everything fits
# and every tensor is a plain torch.Tensor / nn.Parameter, False for any difference, NotImplemented
# (the blocks above then decide) for anything else. None with an extension that lacks it.
_plan_lists = _native_check("plan_lists")


def _tensor_guards():
    """torch's C++ check of tensor metadata (dynamo's ``TensorGuards``), or None where torch lacks it."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except ImportError:
        return None
    return TensorGuards


# A repeated direct call's grads (new tensors each step, of the planned kind) are read by one
# C loop per block that compares each one's Python type, dispatch keys (device type, a lazily
# negated view, sparsity), dtype, device index, requires_grad, sizes and strides with the grads
# of an earlier direct call that passed every check below (dynamo's guard on a compiled
# graph's input tensors: torch._C._dynamo.guards.TensorGuards, built by torch.compile for
# every graph). Its dispatch keys are read in the thread's dispatch state, the same for both
# calls (a direct call is one with the default state, :func:`_direct_allowed`). Only the grads'
# addresses are then read in Python. Where torch has no such class, or it answers False, the
# Python passes below decide.
_TensorGuards = _tensor_guards()


def _guard_of(block):
    """A ``TensorGuards`` of ``block`` (plain torch.Tensor grads that passed every check), or None."""
    if _TensorGuards is None or not all(type(t) is torch.Tensor for t in block):
        return None
    try:
        return _TensorGuards(*block, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    except (TypeError, RuntimeError, ValueError, SystemError):
        return None


class _Plan:
    """The launches of one optimizer call and what they were built from (see above)."""

    __slots__ = ("ptrs", "numels", "dtypes", "grad_dtypes", "launches", "blocks", "grad_guards", "ptr_buf", "numel_buf")

    def __init__(self, flat, grads, launches):
        self.ptrs = list(map(_data_ptr, flat))
        self.numels = list(map(_numel, flat))
        # the same as int64 buffers, for the C checks (plan_lists, dense_ptrs)
        self.ptr_buf = array("q", self.ptrs)
        self.numel_buf = array("q", self.numels)
        self.dtypes = list(map(_dtype_of, flat))
        self.grad_dtypes = list(map(_dtype_of, grads))
        # (group key, n tensors, the table of the persistent columns (never rewritten), the launch's
        # positions among the grads or None (all), n_chunks, n_ptr)
        self.launches = launches
        # per block of the persistent lists, what plan_grads compares: addresses, dtypes, element
        # counts (each tensor contiguous), and the dtype of each tensor's own ``.grad`` (None:
        # none; a param's grad of the planning call, whose contiguity does not matter: flags 1).
        # A block it cannot answer for (a subclass, a ``.grad`` that appeared or changed) is read
        # by the Python passes, as is a block with a non-leaf tensor that requires grad (reading
        # its ``.grad`` warns).
        self.blocks = []
        for s in range(0, len(flat), _BLOCK):
            block = flat[s : s + _BLOCK]
            native = _plan_grads is not None and not any(t.requires_grad and not t.is_leaf for t in block)
            kinds = [None if g is None else g.dtype for g in map(_grad_of, block)] if native else None
            flags = b"\x01" * len(block) if native else None
            self.blocks.append(
                (
                    s,
                    s + len(block),
                    self.ptrs[s : s + _BLOCK],
                    self.dtypes[s : s + _BLOCK],
                    kinds,
                    flags,
                    self.numels[s : s + _BLOCK],
                )
            )
        self.grad_guards = [None] * -(-len(grads) // _BLOCK)  # per block of grads, set by a direct call

    def grad_ptrs(self, persistent, grads, device, direct=False):
        """``(grad addresses, plain)`` if the call fits the plan, else None; ``plain``: every
        tensor is known to be a plain torch.Tensor / nn.Parameter (the C passes say so).
        ``direct``: a call without the dispatcher; only such calls use and build the grads' guards.

        The lists are read in blocks of :data:`_BLOCK` tensors, every property of a block in a
        row: the cost is the memory the tensors' metadata sits in (a params/states tensor
        last touched a step ago is a few cache misses), which a pass per property would pay
        once per property.
        """
        n = len(grads)
        plain = True
        try:
            whole = None if _plan_lists is None else _plan_lists(persistent, self.ptr_buf, self.numel_buf, self.dtypes)
            if whole is False:
                return None
            flat = None if whole is True else list(itertools.chain.from_iterable(persistent))
            if flat is not None and len(flat) != len(self.ptrs):
                return None
            numels = self.numels
            for s, e, bptrs, bdtypes, bkinds, bflags, bnumels in () if flat is None else self.blocks:
                block = flat[s:e]
                # True: the C pass found the block fits, element counts and contiguity included
                if bflags is None or _plan_grads(block, block, bptrs, bdtypes, bkinds, bflags, bnumels) is not True:
                    plain = False
                    if (
                        list(map(_data_ptr, block)) != bptrs
                        or list(map(_dtype_of, block)) != bdtypes
                        or list(map(_numel, block)) != bnumels
                        or not all(map(_is_contiguous, block))
                    ):
                        return None
            gdtypes = self.grad_dtypes
            if _dense_ptrs is not None:
                got = _dense_ptrs(grads, self.numel_buf, gdtypes, device)
                if got is None:
                    return None
                if got is not NotImplemented:
                    # every grad a plain tensor that fits: the passes below would answer the same
                    gptrs = array("q")
                    gptrs.frombytes(got)
                    return gptrs, plain
            gptrs = []
            guards = self.grad_guards
            unguarded = []
            for b, s in enumerate(range(0, n, _BLOCK)):
                e = min(s + _BLOCK, n)  # numels continues past n with the states' counts
                block = grads[s:e]
                if direct and guards[b] is not None and guards[b].check(*block):
                    gptrs += map(_data_ptr, block)
                    continue
                unguarded.append(b)
                gptrs += map(_data_ptr, block)  # raises for a grad without storage (sparse)
                if (
                    list(map(_numel, block)) != numels[s:e]
                    or list(map(_dtype_of, block)) != gdtypes[s:e]
                    or not all(map(_is_contiguous, block))
                    or not set(map(_device_of, block)) <= {device}
                    # a lazily negated view (torch._neg_view) reads as its negation only through
                    # the dispatcher, which materialises it; a direct call would read the raw bits
                    or any(map(_is_neg, block))
                ):
                    return None
        except (RuntimeError, AttributeError, TypeError, ValueError):
            return None
        if any(map(operator.and_, gptrs, itertools.repeat(15))):
            return None
        if unguarded and direct:
            plain = plain and set(map(type, grads)) <= _PLAIN_TYPES
            if plain:
                for b in unguarded:
                    guards[b] = _guard_of(grads[b * _BLOCK : (b + 1) * _BLOCK])
        return gptrs, plain


def _grad_table(gptrs, sel, device: torch.device, capturing: bool = False) -> torch.Tensor:
    """A new int64 tensor of this call's grad addresses (``gptrs``, or its entries ``sel``) on ``device``.

    The only part of a launch's tables written per call (the persistent columns' table is the
    plan's, never rewritten). On CUDA a new device tensor per call, copied on the current stream
    after every earlier launch that read the previous one (the caching host allocator keeps the
    pinned source alive until the copy has run); while capturing a CUDA graph, the graph's own,
    kept for good with its pinned source (:func:`build_table`).
    """
    if sel is not None:
        gptrs = array("q", map(gptrs.__getitem__, sel))
    elif not isinstance(gptrs, array):
        gptrs = array("q", gptrs)
    if capturing:
        return _captured_copy(gptrs, device)
    if not len(gptrs):
        return torch.empty(0, dtype=torch.int64, device=device)
    host = torch.frombuffer(gptrs, dtype=torch.int64)  # shares the array's memory and keeps it alive
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class _Launches(list):
    """The launches of a call, holding (``keep``) the contiguous copies of strided grads that their
    tables point at: the caller keeps the list until its kernels are launched (a copy freed before
    would be memory the next allocation may take: the CPU frees it at once, a CUDA stream in order)."""

    __slots__ = ("keep",)


class Declined(Exception):
    """:func:`optimizer_launches` called with ``direct=True`` for a call it must not take directly (nothing ran)."""


# Tensor types the dispatcher hands to the launcher as they are (nn.Parameter's torch function is disabled).
_PLAIN_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
_PLAIN_TLS = str(torch._C._dispatch_tls_local_include_set())


def _direct_allowed() -> bool:
    """Whether the dispatcher, for plain dense tensors, would do nothing but call the launcher:
    no compile trace, no dispatch or torch-function mode, no profiler recording the op, no
    thread-local dispatch keys beyond the default ones (functionalisation, functorch)."""
    return (
        not (
            torch.compiler.is_compiling()
            or torch._C._len_torch_dispatch_stack()
            or torch._C._len_torch_function_stack()
            or torch.autograd._profiler_enabled()
        )
        and str(torch._C._dispatch_tls_local_include_set()) == _PLAIN_TLS
    )


def call_launcher(op, impl, args: tuple) -> None:
    """Run an optimizer launcher ``impl`` (registered as ``op``) on ``args`` (coerced).

    Through ``torch.ops``, every tensor of every list is boxed and unboxed (~0.2 us each, more
    than everything else a repeated call does). A call that fits a cached plan of tensors the
    dispatcher handed over before (:func:`optimizer_launches`), with only plain tensors and
    nothing the dispatcher would act on (:func:`_direct_allowed`), calls ``impl`` directly:
    what the dispatcher would have done (mutable custom ops move no version counter). Any
    other call, the first one included, goes through ``torch.ops`` as before.
    """
    if _direct_allowed() and all(type(a) in _PLAIN_TYPES for a in args if isinstance(a, torch.Tensor)):
        try:
            impl(*args, direct=True)
            return
        except Declined:
            pass
    op(*args)


def optimizer_launches(
    op: str, device: torch.device, lists, key, chunk: int, stride: int, ids_base, static, direct: bool = False,
    columns=None,
) -> list:  # fmt: skip
    """The launches of an optimizer call: ``[(group key + (aligned,), n_tensors, table, grad_ptrs, n_chunks, n_ptr)]``.

    ``table``: :func:`launch_table`'s, without the grads' column (``n_ptr`` columns); ``grad_ptrs``:
    the grads' addresses, an int64 tensor of ``n_tensors`` on the device.

    ``lists``: the :func:`_guards.guard_lists` specs ``(name, tensors, dtypes, contiguous)`` in
    table-column order, params first and grads second; ``key(i)``: tensor ``i``'s group key
    (dtypes); ``ids_base(group key)``: the random stream's first tensor id or None;
    ``static``: every other argument the launches depend on (flags). Call with ``device``
    current. A call with the tensors of a cached plan (:class:`_Plan`) does no per-tensor
    Python work; any other runs every guard and builds the groups and tables anew.
    ``direct``: called by :func:`call_launcher` without the dispatcher: raises
    :class:`Declined` unless the call fits a plan and every tensor is plain.
    ``columns()``: where a spec of ``lists`` after the grads holds several columns' tensors one
    after the other (optim_'s states), the specs one per column (in the same order): read only
    when the call is planned, so that a repeated call makes no per-column copy of the lists.
    """
    grads = lists[1][1]
    persistent = [lists[0][1], *(spec[1] for spec in lists[2:])]
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" and not capturing else None
    cache_key = (op, static, device, stream, chunk, stride, tuple(map(len, persistent)), len(grads))
    plan = None if capturing else _PLANS.get(cache_key)
    if plan is not None:
        fit = plan.grad_ptrs(persistent, grads, device, direct)
        gptrs = None if fit is None else fit[0]
        if fit is not None and direct and not fit[1]:
            if not set(map(type, grads)).union(*(map(type, lst) for lst in persistent)) <= _PLAIN_TYPES:
                raise Declined(op)
        if gptrs is not None:
            check_runnable(op, device)
            if _PLANS.get(cache_key) is plan:  # (another thread may have dropped it meanwhile)
                _PLANS.move_to_end(cache_key)
            return [
                (gkey, m, table, _grad_table(gptrs, sel, device), n_chunks, n_ptr)
                for gkey, m, table, sel, n_chunks, n_ptr in plan.launches
            ]
    if direct:
        raise Declined(op)
    if columns is not None:
        lists = columns()
        persistent = [lists[0][1], *(spec[1] for spec in lists[2:])]
    G.guard_lists(op, device, [p.numel() for p in lists[0][1]], lists)
    check_runnable(op, device)
    dense = contiguous(grads)
    streams = [persistent[0], dense, *persistent[1:]]
    groups = launch_groups(streams, key)
    cache = not capturing and not any(p & 15 for p in map(_data_ptr, dense))
    launches = []
    n = len(grads)
    for gkey, idxs in groups.items():
        # the table of the persistent columns (a captured one is the graph's own), the grads'
        # addresses apart: the only part of a launch that a planned call writes anew
        table, n_chunks, n_ptr, gcol = launch_table(idxs, streams, ids_base(gkey), chunk, device, stride, apart=1)
        sel = None if len(idxs) == n else list(idxs)
        launches.append((gkey, len(idxs), table, sel, n_chunks, n_ptr, gcol))
    if cache:  # not when capturing (the tables are the graph's) nor with unaligned grads (they regroup)
        plan = _Plan(list(itertools.chain.from_iterable(persistent)), grads, [x[:6] for x in launches])
        _PLANS[cache_key] = plan
        if len(_PLANS) > _PLANS_SIZE:
            _PLANS.popitem(last=False)
    out = _Launches((gkey, m, table, _grad_table(gcol, None, device, capturing), n_chunks, n_ptr)
                    for gkey, m, table, sel, n_chunks, n_ptr, gcol in launches)  # fmt: skip
    out.keep = dense
    return out


def checked_scalars(op: str, device: torch.device, params, step_scalars, count: int, found_inf, rng):
    """An optimizer launcher's scalar guards and its :func:`device_scalars`, plus the step-scalar row stride.

    The ``count`` step scalars (``[count]`` or ``[len(params), count]``), ``found_inf`` and
    ``rng`` (:func:`_guards.guard_scalars`); the tensor lists are guarded by
    :func:`optimizer_launches`. Returns ``(scalars, found_inf, rng, stride)``: ``stride`` 0
    (shared) or ``count`` (one row per tensor), for :func:`launch_table`.
    """
    stride = G.guard_scalars(op, device, step_scalars, len(params), count, found_inf, rng)
    return (*device_scalars(step_scalars, found_inf, rng), stride)


def device_scalars(step_scalars, found_inf, rng):
    """The optimizer launchers' device scalars as the kernels read them.

    ``step_scalars`` flat contiguous fp32 (an ``[n, k]`` one already is: the guards see to it);
    ``found_inf`` fp32 (any non-zero value, NaN included, stays non-zero: a tiny fp64 could
    round to 0); ``rng`` contiguous. Copies only when needed.
    """
    scalars = step_scalars.reshape(-1)
    if scalars.dtype != torch.float32 or not scalars.is_contiguous():
        scalars = scalars.to(torch.float32).contiguous()
    if found_inf is not None and found_inf.dtype != torch.float32:
        found_inf = found_inf.ne(0).to(torch.float32)
    if rng is not None and not rng.is_contiguous():
        rng = rng.contiguous()
    return scalars, found_inf, rng
