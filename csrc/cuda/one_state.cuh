// The one-state optimizer family of fastamp's CUDA kernels: fastamp::sgd_ (sgd.cu) and
// fastamp::lion_ (lion.cu). Both keep the same storage (fp32 masters, int16 remainders of bf16
// params, or none, bf16 params then rounded stochastically when rng is given) and one fp32 state
// per param, take 3 step scalars per tensor and skip on found_inf; only the per-element update
// differs. So one kernel template, instantiated per rule, does the loads, stores, master formats,
// RNG and skip for both, and a new rule of this shape gets all of it (and its fixes) for free.
//
// A Rule provides:
//   Hyper:                   per-call constants, passed by value as a kernel argument
//   Scalars:                 a tensor's step scalars, read once per chunk by scalars(sc)
//   has_state(hyper):        whether the state row is read and written (sgd_ without momentum
//                            has none)
//   element(&p, &state, g, scalars, hyper): the fp32 update of one element (fastamp_math.h)
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "../fastamp_math.h"
#include "launchers.h"
#include "multi_tensor.cuh"

namespace fastamp {
namespace cuda {
namespace detail {

// Table rows: param, grad, master (fp32, int16 remainder or null), the state (fp32 or null),
// the tensor's RNG stream as a tag, and its step scalars (its row of an [n, 3] step_scalars or
// the shared [3], read once per chunk).
using OneStateTable = TableView<kOneStateDepth>;

// Elements per thread per iteration: one 16-byte access for fp32 rows.
constexpr int kOneStateVec = 4;

// Internal linkage, as table_fill_kernel: each .cu instantiates its own rule.
namespace {

template <typename Rule, typename PE, typename GE>
__global__ void __launch_bounds__(kBlockSize)
    one_state_kernel(const OneStateTable table, MasterKind master_kind, const float* __restrict__ found_inf,
                     const int64_t* __restrict__ rng, const typename Rule::Hyper hyper) {
  constexpr int kVec = kOneStateVec;
  using PS = typename PE::storage_t;
  using GS = typename GE::storage_t;
  constexpr bool kBf16Param = PE::kDType == DType::kBFloat16;
  // The skip decision stays on the device: a non-zero (or NaN) flag means nothing is written.
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  const bool fp32_master = master_kind == MasterKind::kFloat32;
  const bool rem_master = kBf16Param && master_kind == MasterKind::kRemainder;
  // Stochastic rounding only where there is no master and the param is bf16.
  const bool stochastic = kBf16Param && master_kind == MasterKind::kNone && rng != nullptr;
  const bool has_state = Rule::has_state(hyper);
  const uint64_t seed = stochastic ? static_cast<uint64_t>(rng[0]) : 0u;
  const uint64_t counter = stochastic ? static_cast<uint64_t>(rng[1]) : 0u;

  int64_t first = 0;
  int64_t last = 0;
  block_chunk_range(table.num_chunks, gridDim.x, blockIdx.x, &first, &last);
  if (first >= last) return;
  ChunkWalker<kOneStateDepth> walk(table, first);
  for (int64_t chunk = first; chunk < last; ++chunk) {
    const ChunkLocation loc = walk.locate(chunk);
    void* const* row = table.entries[loc.tensor].ptrs;
    PS* param = static_cast<PS*>(row[0]);
    const GS* grad = static_cast<const GS*>(row[1]);
    float* master = fp32_master ? static_cast<float*>(row[2]) : nullptr;
    int16_t* remainder = rem_master ? static_cast<int16_t*>(row[2]) : nullptr;
    float* state = has_state ? static_cast<float*>(row[3]) : nullptr;
    const uint32_t key = stochastic ? math::sr_stream_key(seed, counter, row_as_tag(row[4])) : 0u;
    const typename Rule::Scalars s = Rule::scalars(static_cast<const float*>(row[5]));
    const bool aligned = is_aligned_for_pack<PS, kVec>(param) && is_aligned_for_pack<GS, kVec>(grad) &&
                         (!fp32_master || is_aligned_for_pack<float, kVec>(master)) &&
                         (!rem_master || is_aligned_for_pack<int16_t, kVec>(remainder)) &&
                         (!has_state || is_aligned_for_pack<float, kVec>(state));
    const int64_t groups = (loc.n + kVec - 1) / kVec;
    for (int64_t j = threadIdx.x; j < groups; j += kBlockSize) {
      const int64_t local = j * kVec;
      const int64_t left = loc.n - local;
      const int count = left < kVec ? static_cast<int>(left) : kVec;
      const int64_t e0 = loc.offset + local;
      const bool vec = aligned && count == kVec;
      PS p_raw[kVec];
      GS g_raw[kVec];
      float m_raw[kVec] = {0.0f, 0.0f, 0.0f, 0.0f};
      int16_t r_raw[kVec] = {0, 0, 0, 0};
      float st_raw[kVec] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (!fp32_master) load_group(param, e0, count, vec, p_raw);
      load_group(grad, e0, count, vec, g_raw);
      if (fp32_master) load_group(master, e0, count, vec, m_raw);
      if (rem_master) load_group(remainder, e0, count, vec, r_raw);
      if (has_state) load_group(state, e0, count, vec, st_raw);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        if (e < count) {
          float p;
          if (fp32_master) {
            p = m_raw[e];
          } else if constexpr (kBf16Param) {
            p = rem_master ? math::join_master(p_raw[e], r_raw[e]) : PE::load(p_raw[e]);
          } else {
            p = PE::load(p_raw[e]);
          }
          Rule::element(&p, &st_raw[e], GE::load(g_raw[e]), s, hyper);
          if (fp32_master) {
            m_raw[e] = p;
            p_raw[e] = PE::store(p);
          } else if constexpr (kBf16Param) {
            if (rem_master) {
              math::split_master(p, &p_raw[e], &r_raw[e]);
            } else if (stochastic) {
              p_raw[e] = math::float_to_bf16_bits_sr(p, math::sr_random16(key, static_cast<uint64_t>(e0 + e)));
            } else {
              p_raw[e] = PE::store(p);
            }
          } else {
            p_raw[e] = PE::store(p);
          }
        }
      }
      store_group(param, e0, count, vec, p_raw);
      if (fp32_master) store_group(master, e0, count, vec, m_raw);
      if (rem_master) store_group(remainder, e0, count, vec, r_raw);
      if (has_state) store_group(state, e0, count, vec, st_raw);
    }
  }
}

}  // namespace

template <typename Rule, typename PE, typename GE>
cudaError_t launch_one_state_kernel(const PlannedLaunch& l, const OneStateTable& view, MasterKind master_kind,
                                    const float* found_inf, const int64_t* rng, const typename Rule::Hyper& hyper,
                                    cudaStream_t stream) {
  one_state_kernel<Rule, PE, GE>
      <<<static_cast<int>(l.grid), kBlockSize, 0, stream>>>(view, master_kind, found_inf, rng, hyper);
  return cudaGetLastError();
}

template <typename Rule, typename PE>
cudaError_t launch_one_state_grad(DType grad, const PlannedLaunch& l, const OneStateTable& view, MasterKind master_kind,
                                  const float* found_inf, const int64_t* rng, const typename Rule::Hyper& hyper,
                                  cudaStream_t stream) {
  switch (grad) {
    case DType::kFloat32:
      return launch_one_state_kernel<Rule, PE, F32>(l, view, master_kind, found_inf, rng, hyper, stream);
    case DType::kFloat16:
      return launch_one_state_kernel<Rule, PE, F16>(l, view, master_kind, found_inf, rng, hyper, stream);
    case DType::kBFloat16:
      return launch_one_state_kernel<Rule, PE, BF16>(l, view, master_kind, found_inf, rng, hyper, stream);
  }
  return cudaErrorInvalidValue;
}

// The launcher of every op of the family: plan_one_state's launches, one per (param, grad)
// dtype pair, each instantiating the rule's kernel for that pair (9 per rule).
template <typename Rule>
cudaError_t run_one_state(const OneStateTensorRef* tensors, int64_t num_tensors, MasterKind master_kind,
                          const float* step_scalars, int64_t scalar_stride, const float* found_inf, const int64_t* rng,
                          const typename Rule::Hyper& hyper, TableMemory& tables, cudaStream_t stream) {
  bool capturing = false;
  const cudaError_t err = stream_is_capturing(stream, &capturing);
  if (err != cudaSuccess) return err;
  const bool has_state = Rule::has_state(hyper);
  std::vector<DType> param(static_cast<size_t>(num_tensors));
  std::vector<DType> grad(static_cast<size_t>(num_tensors));
  std::vector<int64_t> numel(static_cast<size_t>(num_tensors));
  for (int64_t i = 0; i < num_tensors; ++i) {
    param[i] = tensors[i].param_dtype;
    grad[i] = tensors[i].grad_dtype;
    numel[i] = tensors[i].numel;
  }
  const LaunchPlan plan =
      plan_one_state(param.data(), grad.data(), numel.data(), num_tensors, capturing, current_sm_count());
  auto ptrs_of = [&](int64_t i, void** row) {
    const OneStateTensorRef& r = tensors[i];
    row[0] = r.param;
    row[1] = const_cast<void*>(r.grad);
    row[2] = master_kind == MasterKind::kNone ? nullptr : r.master;
    row[3] = has_state ? r.state : nullptr;
    row[4] = tag_as_row(r.rng_stream);
    row[5] = scalars_as_row(step_scalars, i, scalar_stride);
  };
  auto launch = [&](const PlannedLaunch& l, const OneStateTable& view) -> cudaError_t {
    const auto grad = static_cast<DType>(l.group % 3);
    switch (static_cast<DType>(l.group / 3)) {
      case DType::kFloat32:
        return launch_one_state_grad<Rule, F32>(grad, l, view, master_kind, found_inf, rng, hyper, stream);
      case DType::kFloat16:
        return launch_one_state_grad<Rule, F16>(grad, l, view, master_kind, found_inf, rng, hyper, stream);
      case DType::kBFloat16:
        return launch_one_state_grad<Rule, BF16>(grad, l, view, master_kind, found_inf, rng, hyper, stream);
    }
    return cudaErrorInvalidValue;
  };
  return run_plan<kOneStateDepth>(plan, numel.data(), ptrs_of, capturing, tables, stream, launch);
}

}  // namespace detail
}  // namespace cuda
}  // namespace fastamp
