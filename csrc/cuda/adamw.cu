// CUDA kernels of fastamp::adamw_ and fastamp::adamw_bf16_ (semantics: fastamp/reference.py;
// per-element maths: math::adamw_element, split_master/join_master and the stochastic
// rounding helpers in csrc/fastamp_math.h). No torch header: the binding is
// csrc/cuda/bindings.cpp.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "../fastamp_math.h"
#include "launchers.h"
#include "multi_tensor.cuh"

namespace fastamp {
namespace cuda {
namespace {

using detail::kBlockSize;

// Table rows: param, grad, master, exp_avg, exp_avg_sq, max_exp_avg_sq.
constexpr int kDepth = 6;
using Table = detail::TableFor<kDepth>;

// Elements per thread per iteration: one 16-byte access for the fp32 lists, 8 bytes for
// 16-bit params/grads.
constexpr int kVec = 4;

template <typename PE, typename GE>
__device__ __forceinline__ void adamw_group(typename PE::storage_t* __restrict__ param,
                                            const typename GE::storage_t* __restrict__ grad,
                                            float* __restrict__ master, float* __restrict__ exp_avg,
                                            float* __restrict__ exp_avg_sq, float* __restrict__ max_exp_avg_sq,
                                            int64_t e0, int count, bool vectorised,
                                            const math::AdamWStepScalars& s, const math::AdamWHyper& h,
                                            bool amsgrad, bool maximize) {
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

// At most 64 registers (4 blocks per SM): memory-bound, so occupancy beats registers.
template <typename PE, typename GE>
__global__ void __launch_bounds__(kBlockSize, 4)
    adamw_kernel(const __grid_constant__ Table table, const float* __restrict__ step_scalars,
                 const float* __restrict__ found_inf, math::AdamWHyper hyper, bool amsgrad, bool maximize) {
  using PS = typename PE::storage_t;
  using GS = typename GE::storage_t;
  // The skip decision stays on the device: a non-zero (or NaN) flag means nothing is written.
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  math::AdamWStepScalars s;
  s.step_size = step_scalars[0];
  s.bc2_sqrt = step_scalars[1];
  s.decay = step_scalars[2];
  s.grad_mul = step_scalars[3];

  for (int64_t chunk = blockIdx.x; chunk < table.num_chunks; chunk += gridDim.x) {
    const detail::ChunkLocation loc = detail::locate_chunk(table, chunk);
    const int t = loc.tensor;
    PS* param = static_cast<PS*>(table.ptrs[0][t]);
    const GS* grad = static_cast<const GS*>(table.ptrs[1][t]);
    float* master = static_cast<float*>(table.ptrs[2][t]);
    float* exp_avg = static_cast<float*>(table.ptrs[3][t]);
    float* exp_avg_sq = static_cast<float*>(table.ptrs[4][t]);
    float* max_exp_avg_sq = static_cast<float*>(table.ptrs[5][t]);
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
      adamw_group<PE, GE>(param, grad, master, exp_avg, exp_avg_sq, max_exp_avg_sq, e0, count,
                          aligned && count == kVec, s, hyper, amsgrad, maximize);
    }
  }
}

template <typename PE, typename GE>
cudaError_t adamw_combo(const AdamWTensorRef* tensors, int64_t num_tensors, const float* step_scalars,
                        const float* found_inf, const math::AdamWHyper& hyper, bool amsgrad, bool maximize,
                        cudaStream_t stream) {
  auto builder = detail::make_builder<kDepth>([&](const Table& table, int64_t) -> cudaError_t {
    adamw_kernel<PE, GE><<<detail::grid_for_chunks(table.num_chunks), kBlockSize, 0, stream>>>(
        table, step_scalars, found_inf, hyper, amsgrad, maximize);
    return cudaGetLastError();
  });
  for (int64_t i = 0; i < num_tensors; ++i) {
    const AdamWTensorRef& r = tensors[i];
    if (r.param_dtype != PE::kDType || r.grad_dtype != GE::kDType || r.numel <= 0) continue;
    void* ptrs[kDepth] = {r.param,     const_cast<void*>(r.grad), r.master, r.exp_avg,
                          r.exp_avg_sq, amsgrad ? r.max_exp_avg_sq : nullptr};
    const cudaError_t err = builder.add(ptrs, r.numel);
    if (err != cudaSuccess) return err;
  }
  return builder.flush();
}

template <typename PE>
cudaError_t adamw_param_dtype(const AdamWTensorRef* tensors, int64_t num_tensors, const float* step_scalars,
                              const float* found_inf, const math::AdamWHyper& hyper, bool amsgrad, bool maximize,
                              cudaStream_t stream) {
  cudaError_t err = adamw_combo<PE, detail::F32>(tensors, num_tensors, step_scalars, found_inf, hyper, amsgrad,
                                                 maximize, stream);
  if (err == cudaSuccess) {
    err = adamw_combo<PE, detail::F16>(tensors, num_tensors, step_scalars, found_inf, hyper, amsgrad, maximize,
                                       stream);
  }
  if (err == cudaSuccess) {
    err = adamw_combo<PE, detail::BF16>(tensors, num_tensors, step_scalars, found_inf, hyper, amsgrad, maximize,
                                        stream);
  }
  return err;
}

// ---- adamw_bf16_ ----

// Table rows: param (bf16), grad, remainder (int16 or null), exp_avg, exp_avg_sq,
// max_exp_avg_sq (moment dtype), and the tensor's RNG stream as a tag.
constexpr int kBf16Depth = 7;
using Bf16Table = detail::TableFor<kBf16Depth>;

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
__global__ void __launch_bounds__(kBlockSize)
    adamw_bf16_kernel(const __grid_constant__ Bf16Table table, const float* __restrict__ step_scalars,
                      const float* __restrict__ found_inf, const int64_t* __restrict__ rng, math::AdamWHyper hyper,
                      bool amsgrad, bool maximize) {
  using GS = typename GE::storage_t;
  using MS = typename ME::storage_t;
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  math::AdamWStepScalars s;
  s.step_size = step_scalars[0];
  s.bc2_sqrt = step_scalars[1];
  s.decay = step_scalars[2];
  s.grad_mul = step_scalars[3];
  const bool stochastic = rng != nullptr;
  const uint64_t seed = stochastic ? static_cast<uint64_t>(rng[0]) : 0u;
  const uint64_t counter = stochastic ? static_cast<uint64_t>(rng[1]) : 0u;

  for (int64_t chunk = blockIdx.x; chunk < table.num_chunks; chunk += gridDim.x) {
    const detail::ChunkLocation loc = detail::locate_chunk(table, chunk);
    const int t = loc.tensor;
    uint16_t* param = static_cast<uint16_t*>(table.ptrs[0][t]);
    const GS* grad = static_cast<const GS*>(table.ptrs[1][t]);
    int16_t* remainder = static_cast<int16_t*>(table.ptrs[2][t]);
    MS* exp_avg = static_cast<MS*>(table.ptrs[3][t]);
    MS* exp_avg_sq = static_cast<MS*>(table.ptrs[4][t]);
    MS* max_exp_avg_sq = static_cast<MS*>(table.ptrs[5][t]);
    const bool has_rem = remainder != nullptr;
    // Keys of the streams 4 * tensor_id + k (k: 0 param, 1 exp_avg, 2 exp_avg_sq, 3 max).
    uint32_t key[4] = {0u, 0u, 0u, 0u};
    if (stochastic) {
      const uint32_t stream = detail::row_as_tag(table.ptrs[6][t]);
      key[0] = math::sr_stream_key(seed, counter, stream);
      if constexpr (ME::kDType == DType::kBFloat16) {  // fp32 moments take no random bits
#pragma unroll
        for (int k = 1; k < 4; ++k) key[k] = math::sr_stream_key(seed, counter, stream + static_cast<uint32_t>(k));
      }
    }
    const bool aligned = detail::is_aligned_for_pack<uint16_t, kVec>(param) &&
                         detail::is_aligned_for_pack<GS, kVec>(grad) &&
                         (!has_rem || detail::is_aligned_for_pack<int16_t, kVec>(remainder)) &&
                         detail::is_aligned_for_pack<MS, kVec>(exp_avg) &&
                         detail::is_aligned_for_pack<MS, kVec>(exp_avg_sq) &&
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
            p_raw[e] = stochastic ? math::float_to_bf16_bits_sr(p, math::sr_random16(key[0], static_cast<uint64_t>(index)))
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
cudaError_t adamw_bf16_combo(const AdamWBf16TensorRef* tensors, int64_t num_tensors, const float* step_scalars,
                             const float* found_inf, const int64_t* rng, const math::AdamWHyper& hyper, bool amsgrad,
                             bool maximize, cudaStream_t stream) {
  auto builder = detail::make_builder<kBf16Depth>([&](const Bf16Table& table, int64_t) -> cudaError_t {
    adamw_bf16_kernel<GE, ME><<<detail::grid_for_chunks(table.num_chunks), kBlockSize, 0, stream>>>(
        table, step_scalars, found_inf, rng, hyper, amsgrad, maximize);
    return cudaGetLastError();
  });
  for (int64_t i = 0; i < num_tensors; ++i) {
    const AdamWBf16TensorRef& r = tensors[i];
    if (r.grad_dtype != GE::kDType || r.numel <= 0) continue;
    void* ptrs[kBf16Depth] = {r.param,      const_cast<void*>(r.grad),           r.remainder,
                              r.exp_avg,    r.exp_avg_sq, amsgrad ? r.max_exp_avg_sq : nullptr,
                              detail::tag_as_row(r.rng_stream)};
    const cudaError_t err = builder.add(ptrs, r.numel);
    if (err != cudaSuccess) return err;
  }
  return builder.flush();
}

template <typename ME>
cudaError_t adamw_bf16_moment(const AdamWBf16TensorRef* tensors, int64_t num_tensors, const float* step_scalars,
                              const float* found_inf, const int64_t* rng, const math::AdamWHyper& hyper, bool amsgrad,
                              bool maximize, cudaStream_t stream) {
  cudaError_t err = adamw_bf16_combo<detail::F32, ME>(tensors, num_tensors, step_scalars, found_inf, rng, hyper,
                                                      amsgrad, maximize, stream);
  if (err == cudaSuccess) {
    err = adamw_bf16_combo<detail::F16, ME>(tensors, num_tensors, step_scalars, found_inf, rng, hyper, amsgrad,
                                            maximize, stream);
  }
  if (err == cudaSuccess) {
    err = adamw_bf16_combo<detail::BF16, ME>(tensors, num_tensors, step_scalars, found_inf, rng, hyper, amsgrad,
                                             maximize, stream);
  }
  return err;
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

cudaError_t adamw(const AdamWTensorRef* tensors, int64_t num_tensors, const float* step_scalars,
                  const float* found_inf, double beta1, double beta2, double eps, bool amsgrad, bool maximize,
                  cudaStream_t stream) {
  const math::AdamWHyper hyper = make_hyper(beta1, beta2, eps);
  cudaError_t err =
      adamw_param_dtype<detail::F32>(tensors, num_tensors, step_scalars, found_inf, hyper, amsgrad, maximize, stream);
  if (err == cudaSuccess) {
    err = adamw_param_dtype<detail::F16>(tensors, num_tensors, step_scalars, found_inf, hyper, amsgrad, maximize,
                                         stream);
  }
  if (err == cudaSuccess) {
    err = adamw_param_dtype<detail::BF16>(tensors, num_tensors, step_scalars, found_inf, hyper, amsgrad, maximize,
                                          stream);
  }
  return err;
}

cudaError_t adamw_bf16(const AdamWBf16TensorRef* tensors, int64_t num_tensors, DType moment_dtype,
                       const float* step_scalars, const float* found_inf, const int64_t* rng, double beta1,
                       double beta2, double eps, bool amsgrad, bool maximize, cudaStream_t stream) {
  const math::AdamWHyper hyper = make_hyper(beta1, beta2, eps);
  if (moment_dtype == DType::kBFloat16) {
    return adamw_bf16_moment<detail::BF16>(tensors, num_tensors, step_scalars, found_inf, rng, hyper, amsgrad,
                                           maximize, stream);
  }
  if (moment_dtype != DType::kFloat32) return cudaErrorInvalidValue;
  return adamw_bf16_moment<detail::F32>(tensors, num_tensors, step_scalars, found_inf, rng, hyper, amsgrad, maximize,
                                        stream);
}

}  // namespace cuda
}  // namespace fastamp
