// Multi-tensor apply for fastamp's CUDA kernels: one launch covers many tensors.
//
// The launch plan (csrc/cuda/launch_plan.h) gives each non-empty tensor of an op call one
// entry (pointers, numel, first chunk) in a table in device memory, one launch per dtype
// combination. Each tensor is cut into chunks of kChunkSize elements; a block takes a
// contiguous range of its launch's chunks, finds the first chunk's tensor by binary search
// and walks on from there. The table is uploaded once per op call: copied from pinned
// memory without blocking (the caller's TableMemory keeps both buffers alive until the
// stream is past them), or, while the stream is capturing a CUDA graph, written by fill
// kernels that carry it as kernel arguments, so the graph owns its contents. Sizes and
// offsets are 64-bit throughout.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "../fastamp_math.h"
#include "launch_plan.h"
#include "launchers.h"

#if defined(__USE_FAST_MATH__)
#error "fastamp CUDA kernels must be built without --use_fast_math: results must be bit-exact with the reference"
#endif

namespace fastamp {
namespace cuda {
namespace detail {

using cuda::kBlockSize;

// ---- element types: storage <-> fp32 through fastamp_math.h, bit-exact with the CPU ----

struct F32 {
  using storage_t = float;
  static constexpr DType kDType = DType::kFloat32;
  static __device__ __forceinline__ float load(float s) { return s; }
  static __device__ __forceinline__ float store(float f) { return f; }
  static __device__ __forceinline__ bool stored_finite(float s) { return math::is_finite(s); }
};

struct F16 {
  using storage_t = uint16_t;
  static constexpr DType kDType = DType::kFloat16;
  static __device__ __forceinline__ float load(uint16_t s) { return math::half_bits_to_float(s); }
  static __device__ __forceinline__ uint16_t store(float f) { return math::float_to_half_bits(f); }
  static __device__ __forceinline__ bool stored_finite(uint16_t s) { return (s & 0x7c00u) != 0x7c00u; }
};

struct BF16 {
  using storage_t = uint16_t;
  static constexpr DType kDType = DType::kBFloat16;
  static __device__ __forceinline__ float load(uint16_t s) { return math::bf16_bits_to_float(s); }
  static __device__ __forceinline__ uint16_t store(float f) { return math::float_to_bf16_bits(f); }
  static __device__ __forceinline__ bool stored_finite(uint16_t s) { return (s & 0x7f80u) != 0x7f80u; }
};

// N elements loaded/stored as one naturally aligned access (16 bytes for 4 fp32 or 8 halves).
template <typename S, int N>
struct alignas(sizeof(S) * N) Pack {
  S v[N];
};

template <typename S, int N>
__device__ __forceinline__ bool is_aligned_for_pack(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) % sizeof(Pack<S, N>)) == 0;
}

// ---- running a launch plan (csrc/cuda/launch_plan.h) ----

using cuda::ChunkLocation;
using cuda::ChunkWalker;
using cuda::TableView;

// One fill kernel's share of a table under stream capture: the bytes travel as a kernel
// argument, which the graph copies into its node when the launch is captured, so nothing
// on the host has to outlive the capture.
struct TableFill {
  uint4* dst;
  int64_t words;  // 16-byte words to write (<= kFillPayloadBytes / 16)
  uint4 data[kFillPayloadBytes / 16];
};
static_assert(sizeof(TableFill) <= 32764, "a table fill exceeds the kernel-argument space");

// Each translation unit keeps its own copy (internal linkage), so the header can define it.
namespace {
__global__ void __launch_bounds__(kBlockSize) table_fill_kernel(const __grid_constant__ TableFill fill) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kBlockSize;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * kBlockSize + threadIdx.x; w < fill.words; w += stride) {
    fill.dst[w] = fill.data[w];
  }
}
}  // namespace

// Whether `stream` is capturing into a CUDA graph (then no host memory may be the source of
// a copy: the graph would read it again at every replay, long after it was recycled).
inline cudaError_t stream_is_capturing(cudaStream_t stream, bool* capturing) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream, &status);
  *capturing = err == cudaSuccess && status != cudaStreamCaptureStatusNone;
  return err;
}

// SMs of the current device, for sizing grids (a guess only if the query fails).
inline int64_t current_sm_count() {
  int device = 0;
  int sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) {
    return 132;
  }
  return sms;
}

// Packs the plan's table, puts it in device memory from `memory` (one copy from pinned
// staging memory, or fill kernels under capture), then calls
// `launch(const PlannedLaunch&, const TableView<DEPTH>&)` for each planned launch, which
// enqueues its kernel on `stream` and returns cudaGetLastError().
template <int DEPTH, typename PtrsOf, typename Launch>
cudaError_t run_plan(const LaunchPlan& plan, const int64_t* numel, PtrsOf ptrs_of, bool capturing, TableMemory& memory,
                     cudaStream_t stream, Launch launch) {
  if (plan.launches.empty()) return cudaSuccess;
  if (plan.entry_bytes != sizeof(TableEntry<DEPTH>)) return cudaErrorInvalidValue;
  const size_t buffer_bytes = table_buffer_bytes(plan.table_bytes);
  auto* table = static_cast<TableEntry<DEPTH>*>(memory.device(buffer_bytes));
  if (table == nullptr) return cudaErrorMemoryAllocation;
  cudaError_t err = cudaSuccess;
  if (capturing) {
    // The packed table only has to live until each fill's arguments are recorded.
    std::vector<TableEntry<DEPTH>> host(plan.entry_tensor.size());
    pack_table<DEPTH>(plan, numel, ptrs_of, host.data());
    const auto* src = reinterpret_cast<const char*>(host.data());
    auto* dst = reinterpret_cast<char*>(table);
    TableFill fill{};
    for (const FillSegment& seg : fill_segments(plan.table_bytes)) {
      const size_t real = seg.bytes < plan.table_bytes - seg.offset ? seg.bytes : plan.table_bytes - seg.offset;
      fill.dst = reinterpret_cast<uint4*>(dst + seg.offset);
      fill.words = static_cast<int64_t>(seg.bytes / 16);
      std::memset(fill.data, 0, seg.bytes);
      std::memcpy(fill.data, src + seg.offset, real);
      const int blocks = static_cast<int>((fill.words + kBlockSize - 1) / kBlockSize);
      table_fill_kernel<<<blocks, kBlockSize, 0, stream>>>(fill);
      err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
  } else {
    void* staging = memory.staging(buffer_bytes);
    if (staging == nullptr) return cudaErrorMemoryAllocation;
    pack_table<DEPTH>(plan, numel, ptrs_of, staging);
    std::memset(static_cast<char*>(staging) + plan.table_bytes, 0, buffer_bytes - plan.table_bytes);
    err = memory.upload(stream);
  }
  for (size_t k = 0; k < plan.launches.size() && err == cudaSuccess; ++k) {
    const PlannedLaunch& l = plan.launches[k];
    const TableView<DEPTH> view{table + l.first_entry, l.num_tensors, l.num_chunks};
    err = launch(l, view);
  }
  return err;
}

// Fixed-shape block reduction (warp shuffles, then warps in order): the same inputs give
// the same bits every run. Every thread of the block must call it; result valid in thread 0.
__device__ __forceinline__ double block_sum_fixed_order(double v, double* smem /* kBlockSize / 32 */) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  double total = 0.0;
  if (threadIdx.x == 0) {
    for (int w = 0; w < kBlockSize / 32; ++w) total += smem[w];
  }
  __syncthreads();  // smem may be reused by the caller right after
  return total;
}

// Integer block reduction of the gradient-health statistics: three sums and one max of
// uint32 per-thread values (a max over the bits of non-negative floats orders them as the
// floats). Integer maths is exact, so the result does not depend on the order. Every thread
// of the block must call it; results valid in thread 0.
struct HealthCounts {
  uint32_t nonfinite, zeros, underflow, absmax_bits;
};

__device__ __forceinline__ HealthCounts block_reduce_health(HealthCounts c, HealthCounts* smem /* kBlockSize / 32 */) {
  for (int off = 16; off > 0; off >>= 1) {
    c.nonfinite += __shfl_down_sync(0xffffffffu, c.nonfinite, off);
    c.zeros += __shfl_down_sync(0xffffffffu, c.zeros, off);
    c.underflow += __shfl_down_sync(0xffffffffu, c.underflow, off);
    const uint32_t m = __shfl_down_sync(0xffffffffu, c.absmax_bits, off);
    c.absmax_bits = m > c.absmax_bits ? m : c.absmax_bits;
  }
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) smem[warp] = c;
  __syncthreads();
  HealthCounts total{0u, 0u, 0u, 0u};
  if (threadIdx.x == 0) {
    for (int w = 0; w < kBlockSize / 32; ++w) {
      total.nonfinite += smem[w].nonfinite;
      total.zeros += smem[w].zeros;
      total.underflow += smem[w].underflow;
      total.absmax_bits = smem[w].absmax_bits > total.absmax_bits ? smem[w].absmax_bits : total.absmax_bits;
    }
  }
  __syncthreads();
  return total;
}

// A per-tensor 32-bit value (a tensor's RNG stream) carried in a pointer row of a chunk
// table, so the generic table serves kernels that need one integer per tensor.
inline void* tag_as_row(uint32_t v) { return reinterpret_cast<void*>(static_cast<uintptr_t>(v)); }
__device__ __forceinline__ uint32_t row_as_tag(const void* p) {
  return static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p));
}

// Tensor i's step scalars in a pointer row of an optimizer table: its row of an [n, k]
// step_scalars (stride k) or the shared [k] (stride 0).
inline void* scalars_as_row(const float* step_scalars, int64_t i, int64_t stride) {
  return const_cast<float*>(step_scalars + i * stride);
}

// Loads/stores `count` (1..N) elements at p + e0: one N-wide access when `vectorised` (the
// caller checked alignment and count == N), element by element otherwise. Slots past
// `count` are zero on load and never stored.
template <typename S, int N>
__device__ __forceinline__ void load_group(const S* __restrict__ p, int64_t e0, int count, bool vectorised,
                                           S (&out)[N]) {
  if (vectorised) {
    const Pack<S, N> pk = *reinterpret_cast<const Pack<S, N>*>(p + e0);
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = pk.v[e];
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = e < count ? p[e0 + e] : S(0);
  }
}

template <typename S, int N>
__device__ __forceinline__ void store_group(S* __restrict__ p, int64_t e0, int count, bool vectorised,
                                            const S (&in)[N]) {
  if (vectorised) {
    Pack<S, N> pk;
#pragma unroll
    for (int e = 0; e < N; ++e) pk.v[e] = in[e];
    *reinterpret_cast<Pack<S, N>*>(p + e0) = pk;
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      if (e < count) p[e0 + e] = in[e];
    }
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace fastamp
