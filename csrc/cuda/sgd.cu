// CUDA kernel of fastamp::sgd_ (semantics: fastamp/reference.py; per-element maths:
// math::sgd_element, split_master/join_master and the stochastic rounding helpers in
// csrc/fastamp_math.h). No torch header: the binding is csrc/cuda/bindings.cpp.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "../fastamp_math.h"
#include "launchers.h"
#include "multi_tensor.cuh"

namespace fastamp {
namespace cuda {
namespace {

using detail::kBlockSize;

// Table rows: param, grad, master (fp32, int16 remainder or null), momentum buffer (fp32
// or null), and the tensor's RNG stream as a tag.
constexpr int kDepth = 5;
using Table = detail::TableFor<kDepth>;

// Elements per thread per iteration: one 16-byte access for fp32 lists.
constexpr int kVec = 4;

template <typename PE, typename GE>
__global__ void __launch_bounds__(kBlockSize)
    sgd_kernel(const __grid_constant__ Table table, MasterKind master_kind, const float* __restrict__ step_scalars,
               const float* __restrict__ found_inf, const int64_t* __restrict__ rng, math::SgdHyper hyper) {
  using PS = typename PE::storage_t;
  using GS = typename GE::storage_t;
  constexpr bool kBf16Param = PE::kDType == DType::kBFloat16;
  // The skip decision stays on the device: a non-zero (or NaN) flag means nothing is written.
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  math::SgdStepScalars s;
  s.lr = step_scalars[0];
  s.grad_mul = step_scalars[1];
  s.first = step_scalars[2];
  const bool fp32_master = master_kind == MasterKind::kFloat32;
  const bool rem_master = kBf16Param && master_kind == MasterKind::kRemainder;
  // Stochastic rounding only where there is no master and the param is bf16.
  const bool stochastic = kBf16Param && master_kind == MasterKind::kNone && rng != nullptr;
  const uint64_t seed = stochastic ? static_cast<uint64_t>(rng[0]) : 0u;
  const uint64_t counter = stochastic ? static_cast<uint64_t>(rng[1]) : 0u;

  for (int64_t chunk = blockIdx.x; chunk < table.num_chunks; chunk += gridDim.x) {
    const detail::ChunkLocation loc = detail::locate_chunk(table, chunk);
    const int t = loc.tensor;
    PS* param = static_cast<PS*>(table.ptrs[0][t]);
    const GS* grad = static_cast<const GS*>(table.ptrs[1][t]);
    float* master = fp32_master ? static_cast<float*>(table.ptrs[2][t]) : nullptr;
    int16_t* remainder = rem_master ? static_cast<int16_t*>(table.ptrs[2][t]) : nullptr;
    float* buf = hyper.has_momentum ? static_cast<float*>(table.ptrs[3][t]) : nullptr;
    const uint32_t key =
        stochastic ? math::sr_stream_key(seed, counter, detail::row_as_tag(table.ptrs[4][t])) : 0u;
    const bool aligned = detail::is_aligned_for_pack<PS, kVec>(param) && detail::is_aligned_for_pack<GS, kVec>(grad) &&
                         (!fp32_master || detail::is_aligned_for_pack<float, kVec>(master)) &&
                         (!rem_master || detail::is_aligned_for_pack<int16_t, kVec>(remainder)) &&
                         (!hyper.has_momentum || detail::is_aligned_for_pack<float, kVec>(buf));
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
      float b_raw[kVec] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (!fp32_master) detail::load_group(param, e0, count, vec, p_raw);
      detail::load_group(grad, e0, count, vec, g_raw);
      if (fp32_master) detail::load_group(master, e0, count, vec, m_raw);
      if (rem_master) detail::load_group(remainder, e0, count, vec, r_raw);
      if (hyper.has_momentum) detail::load_group(buf, e0, count, vec, b_raw);
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
          math::sgd_element(&p, &b_raw[e], GE::load(g_raw[e]), s, hyper);
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
      detail::store_group(param, e0, count, vec, p_raw);
      if (fp32_master) detail::store_group(master, e0, count, vec, m_raw);
      if (rem_master) detail::store_group(remainder, e0, count, vec, r_raw);
      if (hyper.has_momentum) detail::store_group(buf, e0, count, vec, b_raw);
    }
  }
}

template <typename PE, typename GE>
cudaError_t sgd_combo(const SgdTensorRef* tensors, int64_t num_tensors, MasterKind master_kind,
                      const float* step_scalars, const float* found_inf, const int64_t* rng,
                      const math::SgdHyper& hyper, cudaStream_t stream) {
  auto builder = detail::make_builder<kDepth>([&](const Table& table, int64_t) -> cudaError_t {
    sgd_kernel<PE, GE><<<detail::grid_for_chunks(table.num_chunks), kBlockSize, 0, stream>>>(
        table, master_kind, step_scalars, found_inf, rng, hyper);
    return cudaGetLastError();
  });
  for (int64_t i = 0; i < num_tensors; ++i) {
    const SgdTensorRef& r = tensors[i];
    if (r.param_dtype != PE::kDType || r.grad_dtype != GE::kDType || r.numel <= 0) continue;
    void* ptrs[kDepth] = {r.param, const_cast<void*>(r.grad), master_kind == MasterKind::kNone ? nullptr : r.master,
                          hyper.has_momentum ? r.momentum_buffer : nullptr, detail::tag_as_row(r.rng_stream)};
    const cudaError_t err = builder.add(ptrs, r.numel);
    if (err != cudaSuccess) return err;
  }
  return builder.flush();
}

template <typename PE>
cudaError_t sgd_param_dtype(const SgdTensorRef* tensors, int64_t num_tensors, MasterKind master_kind,
                            const float* step_scalars, const float* found_inf, const int64_t* rng,
                            const math::SgdHyper& hyper, cudaStream_t stream) {
  cudaError_t err =
      sgd_combo<PE, detail::F32>(tensors, num_tensors, master_kind, step_scalars, found_inf, rng, hyper, stream);
  if (err == cudaSuccess) {
    err = sgd_combo<PE, detail::F16>(tensors, num_tensors, master_kind, step_scalars, found_inf, rng, hyper, stream);
  }
  if (err == cudaSuccess) {
    err = sgd_combo<PE, detail::BF16>(tensors, num_tensors, master_kind, step_scalars, found_inf, rng, hyper, stream);
  }
  return err;
}

}  // namespace

cudaError_t sgd(const SgdTensorRef* tensors, int64_t num_tensors, MasterKind master_kind, const float* step_scalars,
                const float* found_inf, const int64_t* rng, double momentum, double dampening, double weight_decay,
                bool nesterov, bool maximize, cudaStream_t stream) {
  // Rounded from doubles exactly as the reference's _f32(momentum), _f32(1.0 - dampening), ...
  math::SgdHyper hyper;
  hyper.momentum = static_cast<float>(momentum);
  hyper.one_minus_dampening = static_cast<float>(1.0 - dampening);
  hyper.weight_decay = static_cast<float>(weight_decay);
  hyper.has_momentum = momentum != 0.0;
  hyper.has_weight_decay = weight_decay != 0.0;
  hyper.nesterov = nesterov;
  hyper.maximize = maximize;
  cudaError_t err =
      sgd_param_dtype<detail::F32>(tensors, num_tensors, master_kind, step_scalars, found_inf, rng, hyper, stream);
  if (err == cudaSuccess) {
    err = sgd_param_dtype<detail::F16>(tensors, num_tensors, master_kind, step_scalars, found_inf, rng, hyper, stream);
  }
  if (err == cudaSuccess) {
    err =
        sgd_param_dtype<detail::BF16>(tensors, num_tensors, master_kind, step_scalars, found_inf, rng, hyper, stream);
  }
  return err;
}

}  // namespace cuda
}  // namespace fastamp
