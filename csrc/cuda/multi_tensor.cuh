// Multi-tensor apply for fastamp's CUDA kernels: one launch covers many tensors.
//
// The host packs up to MAX_TENSORS tensors into a ChunkTable passed by value as a kernel
// argument (kept under the 4 KB argument limit every CUDA device accepts, so no H2D copy,
// no allocation, CUDA-graph safe). Each tensor is cut into chunks of kChunkSize elements;
// the table stores, per tensor, its pointers, numel and the ordinal of its first chunk, and
// blocks walk the launch's chunks grid-stride, finding a chunk's tensor by binary search.
// A launch therefore covers any number of chunks (huge tensors need one launch) and only
// the tensor count splits launches. Sizes and offsets are 64-bit throughout.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../fastamp_math.h"
#include "launchers.h"

#if defined(__USE_FAST_MATH__)
#error "fastamp CUDA kernels must be built without --use_fast_math: results must be bit-exact with the reference"
#endif

namespace fastamp {
namespace cuda {
namespace detail {

constexpr int kBlockSize = 256;
// Leaves room for the other kernel arguments under the 4096-byte limit.
constexpr size_t kMaxTableBytes = 3968;

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

inline size_t dtype_size(DType d) { return d == DType::kFloat32 ? 4 : 2; }

// N elements loaded/stored as one naturally aligned access (16 bytes for 4 fp32 or 8 halves).
template <typename S, int N>
struct alignas(sizeof(S) * N) Pack {
  S v[N];
};

template <typename S, int N>
__device__ __forceinline__ bool is_aligned_for_pack(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) % sizeof(Pack<S, N>)) == 0;
}

// ---- the chunk table ----

template <int DEPTH, int MAX_TENSORS>
struct ChunkTable {
  void* ptrs[DEPTH][MAX_TENSORS];
  int64_t numel[MAX_TENSORS];
  int64_t chunk_start[MAX_TENSORS];  // first chunk ordinal of each tensor within this launch
  int64_t num_chunks;                // chunks in this launch
  int32_t num_tensors;
};

// The largest tensor count whose table fits the kernel-argument budget.
template <int DEPTH>
constexpr int max_tensors_for_depth() {
  return static_cast<int>((kMaxTableBytes - 16) / (sizeof(void*) * DEPTH + 2 * sizeof(int64_t)));
}

template <int DEPTH>
using TableFor = ChunkTable<DEPTH, max_tensors_for_depth<DEPTH>()>;

struct ChunkLocation {
  int32_t tensor;
  int64_t offset;  // element offset of the chunk within its tensor
  int64_t n;       // elements in this chunk (1..kChunkSize)
};

// Empty tensors are never put in a table, so chunk_start is strictly increasing.
template <int DEPTH, int MAX_TENSORS>
__device__ __forceinline__ ChunkLocation locate_chunk(const ChunkTable<DEPTH, MAX_TENSORS>& table, int64_t chunk) {
  int32_t lo = 0;
  int32_t hi = table.num_tensors - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) >> 1;
    if (table.chunk_start[mid] <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  ChunkLocation loc;
  loc.tensor = lo;
  loc.offset = (chunk - table.chunk_start[lo]) * kChunkSize;
  const int64_t left = table.numel[lo] - loc.offset;
  loc.n = left < kChunkSize ? left : kChunkSize;
  return loc;
}

// Fills tables tensor by tensor and hands each full (or final) one to
// `launch(const TableFor<DEPTH>& table, int64_t chunks_before)` (chunks_before: chunks of
// the tables launched earlier by this builder), which enqueues a kernel and returns
// cudaGetLastError().
template <int DEPTH, typename Launch>
class ChunkTableBuilder {
 public:
  static constexpr int kMaxTensors = max_tensors_for_depth<DEPTH>();
  using Table = TableFor<DEPTH>;
  static_assert(sizeof(Table) <= kMaxTableBytes, "chunk table exceeds the kernel-argument budget");

  explicit ChunkTableBuilder(Launch launch) : launch_(launch) { reset(); }

  cudaError_t add(void* const* ptrs, int64_t numel) {
    if (numel <= 0) return cudaSuccess;
    const int32_t t = table_.num_tensors;
    for (int d = 0; d < DEPTH; ++d) table_.ptrs[d][t] = ptrs[d];
    table_.numel[t] = numel;
    table_.chunk_start[t] = table_.num_chunks;
    table_.num_chunks += num_chunks(numel);
    table_.num_tensors = t + 1;
    if (table_.num_tensors == kMaxTensors) return flush();
    return cudaSuccess;
  }

  cudaError_t flush() {
    if (table_.num_tensors == 0) return cudaSuccess;
    const cudaError_t err = launch_(table_, chunks_before_);
    chunks_before_ += table_.num_chunks;
    reset();
    return err;
  }

 private:
  void reset() {
    table_.num_chunks = 0;
    table_.num_tensors = 0;
  }

  Launch launch_;
  Table table_;
  int64_t chunks_before_ = 0;
};

template <int DEPTH, typename Launch>
ChunkTableBuilder<DEPTH, Launch> make_builder(Launch launch) {
  return ChunkTableBuilder<DEPTH, Launch>(launch);
}

// Enough blocks to fill the device (grid-stride beyond that); never more than there are chunks.
inline int grid_for_chunks(int64_t chunks) {
  int device = 0;
  int sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) {
    sms = 132;
  }
  const int64_t cap = static_cast<int64_t>(sms) * (2048 / kBlockSize);
  return static_cast<int>(chunks < cap ? chunks : cap);
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
