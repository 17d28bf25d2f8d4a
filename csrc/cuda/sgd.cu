// CUDA kernel of fastamp::sgd_ (semantics: fastamp/reference/; per-element maths:
// math::sgd_element, split_master/join_master and the stochastic rounding helpers in
// csrc/fastamp_math.h). No torch header: the binding is csrc/cuda/bindings.cpp.
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

// Table rows: param, grad, master (fp32, int16 remainder or null), momentum buffer (fp32
// or null), the tensor's RNG stream as a tag, and its step scalars (its row of an [n, 3]
// step_scalars or the shared [3], read once per chunk).
constexpr int kDepth = kSgdDepth;
using Table = detail::TableView<kDepth>;

// Elements per thread per iteration: one 16-byte access for fp32 lists.
constexpr int kVec = 4;

template <typename PE, typename GE>
__global__ void __launch_bounds__(kBlockSize)
    sgd_kernel(const Table table, MasterKind master_kind, const float* __restrict__ found_inf,
               const int64_t* __restrict__ rng, math::SgdHyper hyper) {
  using PS = typename PE::storage_t;
  using GS = typename GE::storage_t;
  constexpr bool kBf16Param = PE::kDType == DType::kBFloat16;
  // The skip decision stays on the device: a non-zero (or NaN) flag means nothing is written.
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  const bool fp32_master = master_kind == MasterKind::kFloat32;
  const bool rem_master = kBf16Param && master_kind == MasterKind::kRemainder;
  // Stochastic rounding only where there is no master and the param is bf16.
  const bool stochastic = kBf16Param && master_kind == MasterKind::kNone && rng != nullptr;
  const uint64_t seed = stochastic ? static_cast<uint64_t>(rng[0]) : 0u;
  const uint64_t counter = stochastic ? static_cast<uint64_t>(rng[1]) : 0u;

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
    float* master = fp32_master ? static_cast<float*>(row[2]) : nullptr;
    int16_t* remainder = rem_master ? static_cast<int16_t*>(row[2]) : nullptr;
    float* buf = hyper.has_momentum ? static_cast<float*>(row[3]) : nullptr;
    const uint32_t key = stochastic ? math::sr_stream_key(seed, counter, detail::row_as_tag(row[4])) : 0u;
    const float* sc = static_cast<const float*>(row[5]);
    math::SgdStepScalars s;
    s.lr = sc[0];
    s.grad_mul = sc[1];
    s.first = sc[2];
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
cudaError_t launch_sgd(const PlannedLaunch& l, const Table& view, MasterKind master_kind, const float* found_inf,
                       const int64_t* rng, const math::SgdHyper& hyper, cudaStream_t stream) {
  sgd_kernel<PE, GE><<<static_cast<int>(l.grid), kBlockSize, 0, stream>>>(view, master_kind, found_inf, rng, hyper);
  return cudaGetLastError();
}

template <typename PE>
cudaError_t launch_sgd_grad(DType grad, const PlannedLaunch& l, const Table& view, MasterKind master_kind,
                            const float* found_inf, const int64_t* rng, const math::SgdHyper& hyper,
                            cudaStream_t stream) {
  switch (grad) {
    case DType::kFloat32:
      return launch_sgd<PE, detail::F32>(l, view, master_kind, found_inf, rng, hyper, stream);
    case DType::kFloat16:
      return launch_sgd<PE, detail::F16>(l, view, master_kind, found_inf, rng, hyper, stream);
    case DType::kBFloat16:
      return launch_sgd<PE, detail::BF16>(l, view, master_kind, found_inf, rng, hyper, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t sgd(const SgdTensorRef* tensors, int64_t num_tensors, MasterKind master_kind, const float* step_scalars,
                int64_t scalar_stride, const float* found_inf, const int64_t* rng, double momentum, double dampening,
                double weight_decay, bool nesterov, bool maximize, TableMemory& tables, cudaStream_t stream) {
  // Rounded from doubles exactly as the reference's _f32(momentum), _f32(1.0 - dampening), ...
  math::SgdHyper hyper;
  hyper.momentum = static_cast<float>(momentum);
  hyper.one_minus_dampening = static_cast<float>(1.0 - dampening);
  hyper.weight_decay = static_cast<float>(weight_decay);
  hyper.has_momentum = momentum != 0.0;
  hyper.has_weight_decay = weight_decay != 0.0;
  hyper.nesterov = nesterov;
  hyper.maximize = maximize;
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
      plan_sgd(param.data(), grad.data(), numel.data(), num_tensors, capturing, detail::current_sm_count());
  auto ptrs_of = [&](int64_t i, void** row) {
    const SgdTensorRef& r = tensors[i];
    row[0] = r.param;
    row[1] = const_cast<void*>(r.grad);
    row[2] = master_kind == MasterKind::kNone ? nullptr : r.master;
    row[3] = hyper.has_momentum ? r.momentum_buffer : nullptr;
    row[4] = detail::tag_as_row(r.rng_stream);
    row[5] = detail::scalars_as_row(step_scalars, i, scalar_stride);
  };
  auto launch = [&](const PlannedLaunch& l, const Table& view) -> cudaError_t {
    const auto grad = static_cast<DType>(l.group % 3);
    switch (static_cast<DType>(l.group / 3)) {
      case DType::kFloat32:
        return launch_sgd_grad<detail::F32>(grad, l, view, master_kind, found_inf, rng, hyper, stream);
      case DType::kFloat16:
        return launch_sgd_grad<detail::F16>(grad, l, view, master_kind, found_inf, rng, hyper, stream);
      case DType::kBFloat16:
        return launch_sgd_grad<detail::BF16>(grad, l, view, master_kind, found_inf, rng, hyper, stream);
    }
    return cudaErrorInvalidValue;
  };
  return detail::run_plan<kDepth>(plan, numel.data(), ptrs_of, capturing, tables, stream, launch);
}

}  // namespace cuda
}  // namespace fastamp
