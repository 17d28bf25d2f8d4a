// CUDA kernels of fastamp::adamw_ and fastamp::adamw_bf16_ (semantics: fastamp/reference/;
// per-element maths: math::adamw_element, split_master/join_master and the stochastic
// rounding helpers in csrc/fastamp_math.h). No torch header: the binding is
// csrc/cuda/bindings.cpp.
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

// Table rows: param, grad, master, exp_avg, exp_avg_sq, max_exp_avg_sq, step scalars.
constexpr int kDepth = kAdamWDepth;
using Table = detail::TableView<kDepth>;

// Elements per thread per iteration: one 16-byte access for the fp32 lists, 8 bytes for
// 16-bit params/grads.
constexpr int kVec = 4;

// A chunk's step scalars, from its tensor's table row (its row of an [n, 4] step_scalars, or
// the shared [4]): read once per chunk, so per-tensor scalars cost nothing per element.
__device__ __forceinline__ math::AdamWStepScalars load_step_scalars(const void* row) {
  const float* sc = static_cast<const float*>(row);
  math::AdamWStepScalars s;
  s.step_size = sc[0];
  s.bc2_sqrt = sc[1];
  s.decay = sc[2];
  s.grad_mul = sc[3];
  return s;
}

template <typename PE, typename GE>
__device__ __forceinline__ void adamw_group(typename PE::storage_t* __restrict__ param,
                                            const typename GE::storage_t* __restrict__ grad, float* __restrict__ master,
                                            float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                                            float* __restrict__ max_exp_avg_sq, int64_t e0, int count, bool vectorised,
                                            const math::AdamWStepScalars& s, const math::AdamWHyper& h, bool amsgrad,
                                            bool maximize) {
  using PS = typename PE::storage_t;
  using GS = typename GE::storage_t;
  PS p_raw[kVec];
  GS g_raw[kVec];
  float p32[kVec], m[kVec], v[kVec], vmax[kVec];
  if (vectorised) {
    const auto gp = *reinterpret_cast<const detail::Pack<GS, kVec>*>(grad + e0);
    const auto mp = *reinterpret_cast<const detail::Pack<float, kVec>*>(exp_avg + e0);
    const auto vp = *reinterpret_cast<const detail::Pack<float, kVec>*>(exp_avg_sq + e0);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      g_raw[e] = gp.v[e];
      m[e] = mp.v[e];
      v[e] = vp.v[e];
      vmax[e] = 0.0f;
    }
    if (master != nullptr) {
      const auto pp = *reinterpret_cast<const detail::Pack<float, kVec>*>(master + e0);
#pragma unroll
      for (int e = 0; e < kVec; ++e) p32[e] = pp.v[e];
    } else {
      const auto pp = *reinterpret_cast<const detail::Pack<PS, kVec>*>(param + e0);
#pragma unroll
      for (int e = 0; e < kVec; ++e) p32[e] = PE::load(pp.v[e]);
    }
    if (amsgrad) {
      const auto xp = *reinterpret_cast<const detail::Pack<float, kVec>*>(max_exp_avg_sq + e0);
#pragma unroll
      for (int e = 0; e < kVec; ++e) vmax[e] = xp.v[e];
    }
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      if (e < count) {
        g_raw[e] = grad[e0 + e];
        m[e] = exp_avg[e0 + e];
        v[e] = exp_avg_sq[e0 + e];
        p32[e] = master != nullptr ? master[e0 + e] : PE::load(param[e0 + e]);
        vmax[e] = amsgrad ? max_exp_avg_sq[e0 + e] : 0.0f;
      }
    }
  }

#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    if (e < count) {
      math::adamw_element(&p32[e], &m[e], &v[e], &vmax[e], GE::load(g_raw[e]), s, h, amsgrad, maximize);
      p_raw[e] = PE::store(p32[e]);
    }
  }

  if (vectorised) {
    detail::Pack<float, kVec> mp, vp, xp, pp;
    detail::Pack<PS, kVec> lp;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      mp.v[e] = m[e];
      vp.v[e] = v[e];
      xp.v[e] = vmax[e];
      pp.v[e] = p32[e];
      lp.v[e] = p_raw[e];
    }
    *reinterpret_cast<detail::Pack<float, kVec>*>(exp_avg + e0) = mp;
    *reinterpret_cast<detail::Pack<float, kVec>*>(exp_avg_sq + e0) = vp;
    if (amsgrad) *reinterpret_cast<detail::Pack<float, kVec>*>(max_exp_avg_sq + e0) = xp;
    if (master != nullptr) *reinterpret_cast<detail::Pack<float, kVec>*>(master + e0) = pp;
    *reinterpret_cast<detail::Pack<PS, kVec>*>(param + e0) = lp;
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      if (e < count) {
        exp_avg[e0 + e] = m[e];
        exp_avg_sq[e0 + e] = v[e];
        if (amsgrad) max_exp_avg_sq[e0 + e] = vmax[e];
        if (master != nullptr) master[e0 + e] = p32[e];
        param[e0 + e] = p_raw[e];
      }
    }
  }
}

// Register budget of both AdamW kernels: at least 2 blocks per SM (up to 128 registers).
// Each element's IEEE division and square root have a slow path that ptxas emits as a
// subroutine call, and values live across those calls spilled whenever the budget was
// tight or unset: with nvcc 13.0, 4-16 bytes in some dtype variants at 64 (4 blocks), 80
// (3 blocks) or no bound, none at 2 blocks on sm_80 and sm_90 (tests/tools/test_cuda_ptxas.py
// holds every variant to 0). Two blocks of 256 threads with 48-80 bytes of loads in flight
// per thread still cover an SM's share of the bandwidth-latency product (~25 KB on H100).
constexpr int kAdamWMinBlocks = 2;

template <typename PE, typename GE>
__global__ void __launch_bounds__(kBlockSize, kAdamWMinBlocks)
    adamw_kernel(const Table table, const float* __restrict__ found_inf, math::AdamWHyper hyper, bool amsgrad,
                 bool maximize) {
  using PS = typename PE::storage_t;
  using GS = typename GE::storage_t;
  // The skip decision stays on the device: a non-zero (or NaN) flag means nothing is written.
  if (found_inf != nullptr && *found_inf != 0.0f) return;

  int64_t first = 0;
  int64_t last = 0;
  block_chunk_range(table.num_chunks, gridDim.x, blockIdx.x, &first, &last);
  if (first >= last) return;
  detail::ChunkWalker<kDepth> walk(table, first);
  for (int64_t chunk = first; chunk < last; ++chunk) {
    const detail::ChunkLocation loc = walk.locate(chunk);
    void* const* row = table.entries[loc.tensor].ptrs;
    PS* param = static_cast<PS*>(row[0]);
    const GS* grad = static_cast<const GS*>(row[1]);
    float* master = static_cast<float*>(row[2]);
    float* exp_avg = static_cast<float*>(row[3]);
    float* exp_avg_sq = static_cast<float*>(row[4]);
    float* max_exp_avg_sq = static_cast<float*>(row[5]);
    const math::AdamWStepScalars s = load_step_scalars(row[6]);
    // Chunk offsets are multiples of kVec, so aligned tensors stay aligned chunk by chunk.
    const bool aligned = detail::is_aligned_for_pack<PS, kVec>(param) && detail::is_aligned_for_pack<GS, kVec>(grad) &&
                         detail::is_aligned_for_pack<float, kVec>(exp_avg) &&
                         detail::is_aligned_for_pack<float, kVec>(exp_avg_sq) &&
                         (master == nullptr || detail::is_aligned_for_pack<float, kVec>(master)) &&
                         (!amsgrad || detail::is_aligned_for_pack<float, kVec>(max_exp_avg_sq));
    const int64_t groups = (loc.n + kVec - 1) / kVec;
    for (int64_t j = threadIdx.x; j < groups; j += kBlockSize) {
      const int64_t local = j * kVec;
      const int64_t left = loc.n - local;
      const int count = left < kVec ? static_cast<int>(left) : kVec;
      const int64_t e0 = loc.offset + local;
      adamw_group<PE, GE>(param, grad, master, exp_avg, exp_avg_sq, max_exp_avg_sq, e0, count, aligned && count == kVec,
                          s, hyper, amsgrad, maximize);
    }
  }
}

template <typename PE, typename GE>
cudaError_t launch_adamw(const PlannedLaunch& l, const Table& view, const float* found_inf,
                         const math::AdamWHyper& hyper, bool amsgrad, bool maximize, cudaStream_t stream) {
  adamw_kernel<PE, GE><<<static_cast<int>(l.grid), kBlockSize, 0, stream>>>(view, found_inf, hyper, amsgrad, maximize);
  return cudaGetLastError();
}

template <typename PE>
cudaError_t launch_adamw_grad(DType grad, const PlannedLaunch& l, const Table& view, const float* found_inf,
                              const math::AdamWHyper& hyper, bool amsgrad, bool maximize, cudaStream_t stream) {
  switch (grad) {
    case DType::kFloat32:
      return launch_adamw<PE, detail::F32>(l, view, found_inf, hyper, amsgrad, maximize, stream);
    case DType::kFloat16:
      return launch_adamw<PE, detail::F16>(l, view, found_inf, hyper, amsgrad, maximize, stream);
    case DType::kBFloat16:
      return launch_adamw<PE, detail::BF16>(l, view, found_inf, hyper, amsgrad, maximize, stream);
  }
  return cudaErrorInvalidValue;
}

// ---- adamw_bf16_ ----

// Table rows: param (bf16), grad, remainder (int16 or null), exp_avg, exp_avg_sq,
// max_exp_avg_sq (moment dtype), the tensor's RNG stream as a tag, and its step scalars.
constexpr int kBf16Depth = kAdamWBf16Depth;
using Bf16Table = detail::TableView<kBf16Depth>;

// A moment rounded to its storage: fp32 as is; bf16 stochastically with random bits,
// to nearest-even without.
template <typename ME>
__device__ __forceinline__ typename ME::storage_t store_moment(float x, bool stochastic, uint32_t key, int64_t index) {
  if constexpr (ME::kDType == DType::kBFloat16) {
    return stochastic ? math::float_to_bf16_bits_sr(x, math::sr_random16(key, static_cast<uint64_t>(index)))
                      : math::float_to_bf16_bits(x);
  } else {
    return ME::store(x);
  }
}

template <typename GE, typename ME>
__global__ void __launch_bounds__(kBlockSize, kAdamWMinBlocks)
    adamw_bf16_kernel(const Bf16Table table, const float* __restrict__ found_inf, const int64_t* __restrict__ rng,
                      math::AdamWHyper hyper, bool amsgrad, bool maximize) {
  using GS = typename GE::storage_t;
  using MS = typename ME::storage_t;
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  const bool stochastic = rng != nullptr;
  const uint64_t seed = stochastic ? static_cast<uint64_t>(rng[0]) : 0u;
  const uint64_t counter = stochastic ? static_cast<uint64_t>(rng[1]) : 0u;

  int64_t first = 0;
  int64_t last = 0;
  block_chunk_range(table.num_chunks, gridDim.x, blockIdx.x, &first, &last);
  if (first >= last) return;
  detail::ChunkWalker<kBf16Depth> walk(table, first);
  for (int64_t chunk = first; chunk < last; ++chunk) {
    const detail::ChunkLocation loc = walk.locate(chunk);
    void* const* row = table.entries[loc.tensor].ptrs;
    uint16_t* param = static_cast<uint16_t*>(row[0]);
    const GS* grad = static_cast<const GS*>(row[1]);
    int16_t* remainder = static_cast<int16_t*>(row[2]);
    MS* exp_avg = static_cast<MS*>(row[3]);
    MS* exp_avg_sq = static_cast<MS*>(row[4]);
    MS* max_exp_avg_sq = static_cast<MS*>(row[5]);
    const math::AdamWStepScalars s = load_step_scalars(row[7]);
    const bool has_rem = remainder != nullptr;
    // Keys of the streams 4 * tensor_id + k (k: 0 param, 1 exp_avg, 2 exp_avg_sq, 3 max).
    uint32_t key[4] = {0u, 0u, 0u, 0u};
    if (stochastic) {
      const uint32_t stream = detail::row_as_tag(row[6]);
      key[0] = math::sr_stream_key(seed, counter, stream);
      if constexpr (ME::kDType == DType::kBFloat16) {  // fp32 moments take no random bits
#pragma unroll
        for (int k = 1; k < 4; ++k) key[k] = math::sr_stream_key(seed, counter, stream + static_cast<uint32_t>(k));
      }
    }
    const bool aligned =
        detail::is_aligned_for_pack<uint16_t, kVec>(param) && detail::is_aligned_for_pack<GS, kVec>(grad) &&
        (!has_rem || detail::is_aligned_for_pack<int16_t, kVec>(remainder)) &&
        detail::is_aligned_for_pack<MS, kVec>(exp_avg) && detail::is_aligned_for_pack<MS, kVec>(exp_avg_sq) &&
        (!amsgrad || detail::is_aligned_for_pack<MS, kVec>(max_exp_avg_sq));
    const int64_t groups = (loc.n + kVec - 1) / kVec;
    for (int64_t j = threadIdx.x; j < groups; j += kBlockSize) {
      const int64_t local = j * kVec;
      const int64_t left = loc.n - local;
      const int count = left < kVec ? static_cast<int>(left) : kVec;
      const int64_t e0 = loc.offset + local;
      const bool vec = aligned && count == kVec;
      uint16_t p_raw[kVec];
      GS g_raw[kVec];
      int16_t r_raw[kVec] = {0, 0, 0, 0};
      MS m_raw[kVec], v_raw[kVec], x_raw[kVec];
      detail::load_group(param, e0, count, vec, p_raw);
      detail::load_group(grad, e0, count, vec, g_raw);
      if (has_rem) detail::load_group(remainder, e0, count, vec, r_raw);
      detail::load_group(exp_avg, e0, count, vec, m_raw);
      detail::load_group(exp_avg_sq, e0, count, vec, v_raw);
      if (amsgrad) detail::load_group(max_exp_avg_sq, e0, count, vec, x_raw);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        if (e < count) {
          const int64_t index = e0 + e;
          float p = has_rem ? math::join_master(p_raw[e], r_raw[e]) : math::bf16_bits_to_float(p_raw[e]);
          float m = ME::load(m_raw[e]);
          float v = ME::load(v_raw[e]);
          float vmax = amsgrad ? ME::load(x_raw[e]) : 0.0f;
          math::adamw_element(&p, &m, &v, &vmax, GE::load(g_raw[e]), s, hyper, amsgrad, maximize);
          if (has_rem) {
            math::split_master(p, &p_raw[e], &r_raw[e]);
          } else {
            p_raw[e] = stochastic
                           ? math::float_to_bf16_bits_sr(p, math::sr_random16(key[0], static_cast<uint64_t>(index)))
                           : math::float_to_bf16_bits(p);
          }
          m_raw[e] = store_moment<ME>(m, stochastic, key[1], index);
          v_raw[e] = store_moment<ME>(v, stochastic, key[2], index);
          if (amsgrad) x_raw[e] = store_moment<ME>(vmax, stochastic, key[3], index);
        }
      }
      detail::store_group(param, e0, count, vec, p_raw);
      if (has_rem) detail::store_group(remainder, e0, count, vec, r_raw);
      detail::store_group(exp_avg, e0, count, vec, m_raw);
      detail::store_group(exp_avg_sq, e0, count, vec, v_raw);
      if (amsgrad) detail::store_group(max_exp_avg_sq, e0, count, vec, x_raw);
    }
  }
}

template <typename GE, typename ME>
cudaError_t launch_adamw_bf16(const PlannedLaunch& l, const Bf16Table& view, const float* found_inf, const int64_t* rng,
                              const math::AdamWHyper& hyper, bool amsgrad, bool maximize, cudaStream_t stream) {
  adamw_bf16_kernel<GE, ME>
      <<<static_cast<int>(l.grid), kBlockSize, 0, stream>>>(view, found_inf, rng, hyper, amsgrad, maximize);
  return cudaGetLastError();
}

template <typename ME>
cudaError_t adamw_bf16_moment(const AdamWBf16TensorRef* tensors, int64_t num_tensors, const float* step_scalars,
                              int64_t scalar_stride, const float* found_inf, const int64_t* rng,
                              const math::AdamWHyper& hyper, bool amsgrad, bool maximize, TableMemory& tables,
                              cudaStream_t stream) {
  bool capturing = false;
  const cudaError_t err = detail::stream_is_capturing(stream, &capturing);
  if (err != cudaSuccess) return err;
  std::vector<DType> grad(static_cast<size_t>(num_tensors));
  std::vector<int64_t> numel(static_cast<size_t>(num_tensors));
  for (int64_t i = 0; i < num_tensors; ++i) {
    grad[i] = tensors[i].grad_dtype;
    numel[i] = tensors[i].numel;
  }
  const LaunchPlan plan =
      plan_adamw_bf16(grad.data(), numel.data(), num_tensors, capturing, detail::current_sm_count());
  auto ptrs_of = [&](int64_t i, void** row) {
    const AdamWBf16TensorRef& r = tensors[i];
    row[0] = r.param;
    row[1] = const_cast<void*>(r.grad);
    row[2] = r.remainder;
    row[3] = r.exp_avg;
    row[4] = r.exp_avg_sq;
    row[5] = amsgrad ? r.max_exp_avg_sq : nullptr;
    row[6] = detail::tag_as_row(r.rng_stream);
    row[7] = detail::scalars_as_row(step_scalars, i, scalar_stride);
  };
  auto launch = [&](const PlannedLaunch& l, const Bf16Table& view) -> cudaError_t {
    switch (static_cast<DType>(l.group)) {
      case DType::kFloat32:
        return launch_adamw_bf16<detail::F32, ME>(l, view, found_inf, rng, hyper, amsgrad, maximize, stream);
      case DType::kFloat16:
        return launch_adamw_bf16<detail::F16, ME>(l, view, found_inf, rng, hyper, amsgrad, maximize, stream);
      case DType::kBFloat16:
        return launch_adamw_bf16<detail::BF16, ME>(l, view, found_inf, rng, hyper, amsgrad, maximize, stream);
    }
    return cudaErrorInvalidValue;
  };
  return detail::run_plan<kBf16Depth>(plan, numel.data(), ptrs_of, capturing, tables, stream, launch);
}

math::AdamWHyper make_hyper(double beta1, double beta2, double eps) {
  // Rounded from doubles exactly as the reference's _f32(beta1), _f32(1.0 - beta1), ...
  math::AdamWHyper hyper;
  hyper.beta1 = static_cast<float>(beta1);
  hyper.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  hyper.beta2 = static_cast<float>(beta2);
  hyper.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  hyper.eps = static_cast<float>(eps);
  return hyper;
}

}  // namespace

cudaError_t adamw(const AdamWTensorRef* tensors, int64_t num_tensors, const float* step_scalars, int64_t scalar_stride,
                  const float* found_inf, double beta1, double beta2, double eps, bool amsgrad, bool maximize,
                  TableMemory& tables, cudaStream_t stream) {
  const math::AdamWHyper hyper = make_hyper(beta1, beta2, eps);
  bool capturing = false;
  const cudaError_t err = detail::stream_is_capturing(stream, &capturing);
  if (err != cudaSuccess) return err;
  std::vector<DType> param(static_cast<size_t>(num_tensors));
  std::vector<DType> grad(static_cast<size_t>(num_tensors));
  std::vector<int64_t> numel(static_cast<size_t>(num_tensors));
  for (int64_t i = 0; i < num_tensors; ++i) {
    param[i] = tensors[i].param_dtype;
    grad[i] = tensors[i].grad_dtype;
    numel[i] = tensors[i].numel;
  }
  const LaunchPlan plan =
      plan_adamw(param.data(), grad.data(), numel.data(), num_tensors, capturing, detail::current_sm_count());
  auto ptrs_of = [&](int64_t i, void** row) {
    const AdamWTensorRef& r = tensors[i];
    row[0] = r.param;
    row[1] = const_cast<void*>(r.grad);
    row[2] = r.master;
    row[3] = r.exp_avg;
    row[4] = r.exp_avg_sq;
    row[5] = amsgrad ? r.max_exp_avg_sq : nullptr;
    row[6] = detail::scalars_as_row(step_scalars, i, scalar_stride);
  };
  auto launch = [&](const PlannedLaunch& l, const Table& view) -> cudaError_t {
    const auto grad = static_cast<DType>(l.group % 3);
    switch (static_cast<DType>(l.group / 3)) {
      case DType::kFloat32:
        return launch_adamw_grad<detail::F32>(grad, l, view, found_inf, hyper, amsgrad, maximize, stream);
      case DType::kFloat16:
        return launch_adamw_grad<detail::F16>(grad, l, view, found_inf, hyper, amsgrad, maximize, stream);
      case DType::kBFloat16:
        return launch_adamw_grad<detail::BF16>(grad, l, view, found_inf, hyper, amsgrad, maximize, stream);
    }
    return cudaErrorInvalidValue;
  };
  return detail::run_plan<kDepth>(plan, numel.data(), ptrs_of, capturing, tables, stream, launch);
}

cudaError_t adamw_bf16(const AdamWBf16TensorRef* tensors, int64_t num_tensors, DType moment_dtype,
                       const float* step_scalars, int64_t scalar_stride, const float* found_inf, const int64_t* rng,
                       double beta1, double beta2, double eps, bool amsgrad, bool maximize, TableMemory& tables,
                       cudaStream_t stream) {
  const math::AdamWHyper hyper = make_hyper(beta1, beta2, eps);
  if (moment_dtype == DType::kBFloat16) {
    return adamw_bf16_moment<detail::BF16>(tensors, num_tensors, step_scalars, scalar_stride, found_inf, rng, hyper,
                                           amsgrad, maximize, tables, stream);
  }
  if (moment_dtype != DType::kFloat32) return cudaErrorInvalidValue;
  return adamw_bf16_moment<detail::F32>(tensors, num_tensors, step_scalars, scalar_stride, found_inf, rng, hyper,
                                        amsgrad, maximize, tables, stream);
}

}  // namespace cuda
}  // namespace fastamp
