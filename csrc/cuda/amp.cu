// CUDA kernels of fastamp::unscale_check_, unscale_check_stats_, unscale_check_partials_,
// sumsq_fold and update_scale_ (semantics:
// fastamp/reference/; per-element maths: csrc/fastamp_math.h). No torch header: the
// binding is csrc/cuda/bindings.cpp.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "../fastamp_math.h"
#include "launchers.h"
#include "multi_tensor.cuh"

namespace fastamp {
namespace cuda {
namespace {

using detail::kBlockSize;
using detail::TableView;

constexpr int kUnscaleIlp = 4;  // vectors in flight per thread

// A block takes a contiguous range of its launch's chunks (launch_plan.h), one chunk at a
// time. Each thread walks groups of VEC consecutive elements: group j = base + threadIdx.x
// + k * kBlockSize. A full group of an aligned tensor is one 16-byte access, anything else
// is element by element, but the groups, and the order a thread accumulates their squares
// in, do not depend on the path, so the per-chunk sum of squares has the same bits
// whatever the tensor's alignment (and whichever block runs the chunk).
// STATS: table rows 1 and 2 point at the tensor's counts row (int64 x 3) and absmax (fp32);
// each block adds its chunk's totals there with integer atomics (exact in any order).
// SLOTS (unscale_check_partials_): table row 1 points at the tensor's own fp64 slots; chunk k
// of the tensor writes its partial (the value unscale_check_ writes at its launch-order
// ordinal) to slot k, and `partials` is unused.
template <typename E, bool STATS, bool SLOTS, typename Table>
__global__ void __launch_bounds__(kBlockSize)
    unscale_check_kernel(const Table table, float* __restrict__ found_inf, const float* __restrict__ inv_scale_ptr,
                         double* __restrict__ partials, int64_t first_chunk, bool write_back, bool compute_sumsq) {
  using S = typename E::storage_t;
  constexpr int VEC = 16 / static_cast<int>(sizeof(S));
  using P = detail::Pack<S, VEC>;
  __shared__ double smem[kBlockSize / 32];
  __shared__ detail::HealthCounts stats_smem[STATS ? kBlockSize / 32 : 1];

  const float inv_scale = *inv_scale_ptr;
  int64_t first = 0;
  int64_t last = 0;
  block_chunk_range(table.num_chunks, gridDim.x, blockIdx.x, &first, &last);
  if (first >= last) return;
  detail::ChunkWalker<Table::kDepth> walk(table, first);
  for (int64_t chunk = first; chunk < last; ++chunk) {
    const detail::ChunkLocation loc = walk.locate(chunk);
    void* const* row = table.entries[loc.tensor].ptrs;
    S* base_ptr = static_cast<S*>(row[0]);
    const bool vec_ok = detail::is_aligned_for_pack<S, VEC>(base_ptr);
    S* data = base_ptr + loc.offset;
    const int64_t n = loc.n;
    const int64_t groups = (n + VEC - 1) / VEC;

    bool bad = false;
    float acc = 0.0f;
    detail::HealthCounts stats{0u, 0u, 0u, 0u};
    for (int64_t g0 = 0; g0 < groups; g0 += static_cast<int64_t>(kUnscaleIlp) * kBlockSize) {
      S vals[kUnscaleIlp][VEC];
#pragma unroll
      for (int k = 0; k < kUnscaleIlp; ++k) {
        const int64_t j = g0 + threadIdx.x + static_cast<int64_t>(k) * kBlockSize;
        const int64_t e0 = j * VEC;
        if (j < groups) {
          if (vec_ok && e0 + VEC <= n) {
            const P p = *reinterpret_cast<const P*>(data + e0);
#pragma unroll
            for (int e = 0; e < VEC; ++e) vals[k][e] = p.v[e];
          } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) vals[k][e] = (e0 + e < n) ? data[e0 + e] : S(0);
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kUnscaleIlp; ++k) {
        const int64_t j = g0 + threadIdx.x + static_cast<int64_t>(k) * kBlockSize;
        const int64_t e0 = j * VEC;
        if (j < groups) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            if (e0 + e < n) {
              const float x = E::load(vals[k][e]);
              bool element_bad = false;
              const float y = math::unscale_element(x, inv_scale, &element_bad);
              if (compute_sumsq) acc = acc + y * y;
              if (write_back) {
                const S stored = E::store(y);
                if (!E::stored_finite(stored)) element_bad = true;
                vals[k][e] = stored;
              }
              bad = bad || element_bad;
              if constexpr (STATS) {
                const uint32_t abs_bits = math::float_bits(y) & 0x7fffffffu;
                const float abs_y = math::bits_float(abs_bits);
                stats.nonfinite += element_bad ? 1u : 0u;
                stats.zeros += (math::is_finite(x) && abs_bits == 0u) ? 1u : 0u;
                stats.underflow += (abs_y > 0.0f && abs_y < math::kFp16MinNormal) ? 1u : 0u;
                if (math::is_finite(y) && abs_bits > stats.absmax_bits) stats.absmax_bits = abs_bits;
              }
            }
          }
          if (write_back) {
            if (vec_ok && e0 + VEC <= n) {
              P p;
#pragma unroll
              for (int e = 0; e < VEC; ++e) p.v[e] = vals[k][e];
              *reinterpret_cast<P*>(data + e0) = p;
            } else {
#pragma unroll
              for (int e = 0; e < VEC; ++e) {
                if (e0 + e < n) data[e0 + e] = vals[k][e];
              }
            }
          }
        }
      }
    }

    // Every writer stores the same 1.0f, so the race between blocks is benign.
    if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;
    if (compute_sumsq) {
      const double chunk_sum = detail::block_sum_fixed_order(static_cast<double>(acc), smem);
      if (threadIdx.x == 0) {
        if constexpr (SLOTS) {
          static_cast<double*>(row[1])[loc.offset / kChunkSize] = chunk_sum;
        } else {
          partials[first_chunk + chunk] = chunk_sum;
        }
      }
    }
    if constexpr (STATS) {
      const detail::HealthCounts total = detail::block_reduce_health(stats, stats_smem);
      if (threadIdx.x == 0) {
        auto* counts = static_cast<unsigned long long*>(row[1]);
        if (total.nonfinite) atomicAdd(counts + 0, static_cast<unsigned long long>(total.nonfinite));
        if (total.zeros) atomicAdd(counts + 1, static_cast<unsigned long long>(total.zeros));
        if (total.underflow) atomicAdd(counts + 2, static_cast<unsigned long long>(total.underflow));
        // absmax starts at +0.0 and only ever holds non-negative finite floats, whose bits
        // order as the values do.
        if (total.absmax_bits) atomicMax(static_cast<unsigned int*>(row[2]), total.absmax_bits);
      }
    }
  }
}

// The fold of `count` partials, partial(i) for i in [0, count): thread t adds partial(t),
// partial(t + kBlockSize), ... in fp64 from 0, then the block sums the threads' totals in a
// fixed order. sumsq_finalize_kernel and sumsq_fold_kernel both fold with it, so folding
// the same values in the same order gives the same bits. Every thread must call it; the
// result is valid in thread 0.
template <typename Partial>
__device__ __forceinline__ double fold_partials(int64_t count, Partial partial, double* smem /* kBlockSize / 32 */) {
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kBlockSize) acc += partial(i);
  return detail::block_sum_fixed_order(acc, smem);
}

// Second pass: one block sums the per-chunk partials in a fixed order.
__global__ void __launch_bounds__(kBlockSize)
    sumsq_finalize_kernel(const double* __restrict__ partials, int64_t count, float* __restrict__ out) {
  __shared__ double smem[kBlockSize / 32];
  const double total = fold_partials(count, [&](int64_t i) { return partials[i]; }, smem);
  if (threadIdx.x == 0) *out = static_cast<float>(total);
}

// sumsq_fold: sumsq_finalize_kernel's fold of partials[index[0]], partials[index[1]], ...
// An index outside [0, num_partials) reads nothing and makes the result NaN (the binding
// cannot check device values without a host sync).
__global__ void __launch_bounds__(kBlockSize)
    sumsq_fold_kernel(const double* __restrict__ partials, int64_t num_partials, const int64_t* __restrict__ index,
                      int64_t count, float* __restrict__ out) {
  __shared__ double smem[kBlockSize / 32];
  bool bad = false;
  const double total = fold_partials(
      count,
      [&](int64_t i) {
        const int64_t at = index[i];
        const bool inside = at >= 0 && at < num_partials;
        bad = bad || !inside;
        return inside ? partials[at] : 0.0;
      },
      smem);
  if (__syncthreads_or(bad) != 0) {
    if (threadIdx.x == 0) *out = __int_as_float(0x7fc00000);
  } else if (threadIdx.x == 0) {
    *out = static_cast<float>(total);
  }
}

__global__ void update_scale_kernel(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker,
                                    const float* found_inf, double growth_factor, double backoff_factor,
                                    int64_t growth_interval, int64_t hysteresis, double min_scale, double max_scale) {
  math::update_scale(scale, growth_tracker, hysteresis_tracker, *found_inf, growth_factor, backoff_factor,
                     growth_interval, hysteresis, min_scale, max_scale);
}

template <typename E, bool STATS, bool SLOTS, int DEPTH>
cudaError_t launch_unscale_check(const PlannedLaunch& l, const TableView<DEPTH>& view, float* found_inf,
                                 const float* inv_scale, bool write_back, bool compute_sumsq, double* partials,
                                 cudaStream_t stream) {
  unscale_check_kernel<E, STATS, SLOTS, TableView<DEPTH>><<<static_cast<int>(l.grid), kBlockSize, 0, stream>>>(
      view, found_inf, inv_scale, partials, l.first_chunk, write_back, compute_sumsq);
  return cudaGetLastError();
}

// STATS false: plain unscale_check (table depth 1); true: rows for counts and absmax too.
// SLOTS (unscale_check_partials, never with STATS): a row for the grad's slots
// (partials + slot_offsets[i]); write_back is false and compute_sumsq true; no finalize.
template <bool STATS, bool SLOTS = false>
cudaError_t unscale_check_all(const GradRef* grads, int64_t num_grads, float* found_inf, const float* inv_scale,
                              bool write_back, bool compute_sumsq, double* partials, float* sumsq_out, int64_t* counts,
                              float* absmax, TableMemory& tables, cudaStream_t stream,
                              const int64_t* slot_offsets = nullptr) {
  static_assert(!(STATS && SLOTS), "unscale_check_partials keeps no statistics");
  constexpr int kDepth = STATS ? kUnscaleStatsDepth : (SLOTS ? kUnscaleSlotsDepth : kUnscaleDepth);
  bool capturing = false;
  cudaError_t err = detail::stream_is_capturing(stream, &capturing);
  if (err != cudaSuccess) return err;
  std::vector<DType> dtype(static_cast<size_t>(num_grads));
  std::vector<int64_t> numel(static_cast<size_t>(num_grads));
  for (int64_t i = 0; i < num_grads; ++i) {
    dtype[i] = grads[i].dtype;
    numel[i] = grads[i].numel;
  }
  // Chunk ordinals (and so the partials' order) follow dtype, then list order: fixed for a
  // given list.
  const LaunchPlan plan =
      SLOTS ? plan_unscale_check_partials(dtype.data(), numel.data(), num_grads, capturing, detail::current_sm_count())
            : plan_unscale_check(dtype.data(), numel.data(), num_grads, STATS, capturing, detail::current_sm_count());
  auto ptrs_of = [&](int64_t i, void** row) {
    row[0] = grads[i].data;
    if constexpr (STATS) {
      row[1] = counts + 3 * i;
      row[2] = absmax + i;
    }
    if constexpr (SLOTS) row[1] = partials + slot_offsets[i];
  };
  auto launch = [&](const PlannedLaunch& l, const TableView<kDepth>& view) -> cudaError_t {
    switch (static_cast<DType>(l.group)) {
      case DType::kFloat32:
        return launch_unscale_check<detail::F32, STATS, SLOTS>(l, view, found_inf, inv_scale, write_back, compute_sumsq,
                                                               partials, stream);
      case DType::kFloat16:
        return launch_unscale_check<detail::F16, STATS, SLOTS>(l, view, found_inf, inv_scale, write_back, compute_sumsq,
                                                               partials, stream);
      case DType::kBFloat16:
        return launch_unscale_check<detail::BF16, STATS, SLOTS>(l, view, found_inf, inv_scale, write_back,
                                                                compute_sumsq, partials, stream);
    }
    return cudaErrorInvalidValue;
  };
  err = detail::run_plan<kDepth>(plan, numel.data(), ptrs_of, capturing, tables, stream, launch);
  if (err != cudaSuccess || SLOTS) return err;
  if (compute_sumsq) {
    sumsq_finalize_kernel<<<1, kBlockSize, 0, stream>>>(partials, plan.total_chunks, sumsq_out);
    return cudaGetLastError();
  }
  return cudaMemsetAsync(sumsq_out, 0, sizeof(float), stream);
}

}  // namespace

int64_t unscale_check_num_partials(const GradRef* grads, int64_t num_grads) {
  int64_t total = 0;
  for (int64_t i = 0; i < num_grads; ++i) {
    if (grads[i].numel > 0) total += num_chunks(grads[i].numel);
  }
  return total;
}

cudaError_t unscale_check(const GradRef* grads, int64_t num_grads, float* found_inf, const float* inv_scale,
                          bool write_back, bool compute_sumsq, double* partials, float* sumsq_out, TableMemory& tables,
                          cudaStream_t stream) {
  return unscale_check_all<false>(grads, num_grads, found_inf, inv_scale, write_back, compute_sumsq, partials,
                                  sumsq_out, nullptr, nullptr, tables, stream);
}

cudaError_t unscale_check_stats(const GradRef* grads, int64_t num_grads, float* found_inf, const float* inv_scale,
                                bool write_back, bool compute_sumsq, double* partials, float* sumsq_out,
                                int64_t* counts, float* absmax, TableMemory& tables, cudaStream_t stream) {
  if (num_grads > 0) {
    // Overwrite semantics: the kernel only accumulates; all-zero bits are 0 and +0.0f.
    cudaError_t err = cudaMemsetAsync(counts, 0, sizeof(int64_t) * 3 * static_cast<size_t>(num_grads), stream);
    if (err == cudaSuccess) err = cudaMemsetAsync(absmax, 0, sizeof(float) * static_cast<size_t>(num_grads), stream);
    if (err != cudaSuccess) return err;
  }
  return unscale_check_all<true>(grads, num_grads, found_inf, inv_scale, write_back, compute_sumsq, partials, sumsq_out,
                                 counts, absmax, tables, stream);
}

cudaError_t unscale_check_partials(const GradRef* grads, int64_t num_grads, float* found_inf, const float* inv_scale,
                                   double* partials, const int64_t* offsets, TableMemory& tables, cudaStream_t stream) {
  return unscale_check_all<false, true>(grads, num_grads, found_inf, inv_scale, false, true, partials, nullptr, nullptr,
                                        nullptr, tables, stream, offsets);
}

cudaError_t sumsq_fold(const double* partials, int64_t num_partials, const int64_t* index, int64_t count, float* out,
                       cudaStream_t stream) {
  sumsq_fold_kernel<<<1, kBlockSize, 0, stream>>>(partials, num_partials, index, count, out);
  return cudaGetLastError();
}

cudaError_t update_scale(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker, const float* found_inf,
                         double growth_factor, double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                         double min_scale, double max_scale, cudaStream_t stream) {
  update_scale_kernel<<<1, 1, 0, stream>>>(scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor,
                                           backoff_factor, growth_interval, hysteresis, min_scale, max_scale);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace fastamp
