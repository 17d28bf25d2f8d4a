// CUDA kernel of fastamp::adamw_q8_: AdamW on 8-bit block-scaled moments (semantics:
// fastamp/reference/optim.py adamw_q8_; the codec: csrc/q8_math.h, the scalar twin of
// fastamp/reference/q8.py, shared with the CPU kernels; the element maths: math::adamw_element).
// No torch header: the binding is csrc/cuda/bindings.cpp.
//
// Each thread takes 4 consecutive elements, so lanes 8k..8k+7 of a warp hold one q8 block of 32
// (chunks start at multiples of kChunkSize and each pass of the block over a chunk covers
// kBlockSize * 4 elements: every q8 block lies in one group of 8 lanes). Per pass: decode m and v
// from the codes and the block's two scale bytes, run the AdamW update, write the param (and its
// master), then take the block's absmax of the new m and of w = sqrt(v) (the root the update
// took) with three xor-shuffles over the 8 lanes, write the two new scale bytes (the block's
// first lane) and encode the codes over them. The value optimised is an fp32 master (params of
// any float dtype), the exact master of a bf16 param and an int16 remainder, the ulp8 master of
// a bf16 / fp16 param and an int8 correction (math::ulp8_decode_* / ulp8_encode, the correction
// rounded stochastically when sr_param), or the param itself (a bf16 one rounded stochastically
// when sr_param). sr_codes rounds the codes stochastically. Random bits: streams
// 4 * (rng_base + i) + 0 (param / correction), + 1 (m codes), + 2 (v codes), element index =
// flat index in the tensor. Bit-exact with the reference: integer codec, exact decode
// products, IEEE sqrt and division (no fast math, no FMA contraction: --fmad=false).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "../fastamp_math.h"
#include "../q8_math.h"
#include "launchers.h"
#include "multi_tensor.cuh"

namespace fastamp {
namespace cuda {
namespace {

using detail::kBlockSize;

// Table rows: param, grad, master, exp_avg codes, exp_avg scales, exp_avg_sq codes,
// exp_avg_sq scales, rng tag, step scalars.
constexpr int kDepth = kAdamWQ8Depth;
using Table = detail::TableView<kDepth>;

// Elements per thread per pass: one 16-byte access for fp32 lists, 8 bytes for 16-bit ones, 4
// for the codes.
constexpr int kVec = 4;
constexpr int kLanesPerQ8Block = math::kQ8Block / kVec;
static_assert(32 % kLanesPerQ8Block == 0, "a q8 block's lanes must lie in one warp");
static_assert(kChunkSize % (kBlockSize * kVec) == 0, "a pass must not cross a chunk");

// As adamw_kernel: at least 2 blocks per SM (up to 128 registers), so that values live across
// the IEEE division and square root slow-path calls need not spill (tests/tools/test_cuda_ptxas.py).
constexpr int kQ8MinBlocks = 2;

__device__ __forceinline__ math::AdamWStepScalars load_step_scalars(const void* row) {
  const float* sc = static_cast<const float*>(row);
  math::AdamWStepScalars s;
  s.step_size = sc[0];
  s.bc2_sqrt = sc[1];
  s.decay = sc[2];
  s.grad_mul = sc[3];
  return s;
}

// The maximum of x over the 8 lanes holding one q8 block (every lane of the warp calls it).
__device__ __forceinline__ uint32_t q8_block_max(uint32_t x) {
#pragma unroll
  for (int off = 1; off < kLanesPerQ8Block; off <<= 1) {
    const uint32_t y = __shfl_xor_sync(0xffffffffu, x, off);
    x = y > x ? y : x;
  }
  return x;
}

template <typename PE, typename GE>
__global__ void __launch_bounds__(kBlockSize, kQ8MinBlocks)
    adamw_q8_kernel(const Table table, MasterKind master_kind, const float* __restrict__ found_inf,
                    const int64_t* __restrict__ rng, math::AdamWHyper hyper, bool maximize, bool sr_param,
                    bool sr_codes) {
  using PS = typename PE::storage_t;
  using GS = typename GE::storage_t;
  constexpr bool kBf16Param = PE::kDType == DType::kBFloat16;
  constexpr bool kFp16Param = PE::kDType == DType::kFloat16;
  // The skip decision stays on the device: a non-zero (or NaN) flag means nothing is written.
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  const bool fp32_master = master_kind == MasterKind::kFloat32;
  const bool rem_master = kBf16Param && master_kind == MasterKind::kRemainder;
  const bool ulp8_master = (kBf16Param || kFp16Param) && master_kind == MasterKind::kUlp8;
  // the param's random bits only where the reference draws them: bf16 params without a master,
  // ulp8 corrections
  const bool sr_p = sr_param && rng != nullptr && ((kBf16Param && master_kind == MasterKind::kNone) || ulp8_master);
  const bool sr_c = sr_codes && rng != nullptr;
  const uint64_t seed = rng != nullptr ? static_cast<uint64_t>(rng[0]) : 0u;
  const uint64_t counter = rng != nullptr ? static_cast<uint64_t>(rng[1]) : 0u;

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
    int8_t* correction = ulp8_master ? static_cast<int8_t*>(row[2]) : nullptr;
    uint8_t* m_codes = static_cast<uint8_t*>(row[3]);
    uint8_t* m_scales = static_cast<uint8_t*>(row[4]);
    uint8_t* v_codes = static_cast<uint8_t*>(row[5]);
    uint8_t* v_scales = static_cast<uint8_t*>(row[6]);
    const uint32_t stream = detail::row_as_tag(row[7]);
    const math::AdamWStepScalars s = load_step_scalars(row[8]);
    const uint32_t key_p = sr_p ? math::sr_stream_key(seed, counter, stream) : 0u;
    const uint32_t key_m = sr_c ? math::sr_stream_key(seed, counter, stream + 1u) : 0u;
    const uint32_t key_v = sr_c ? math::sr_stream_key(seed, counter, stream + 2u) : 0u;
    // Chunk offsets are multiples of kVec, so aligned tensors stay aligned chunk by chunk.
    const bool aligned = detail::is_aligned_for_pack<PS, kVec>(param) && detail::is_aligned_for_pack<GS, kVec>(grad) &&
                         (!fp32_master || detail::is_aligned_for_pack<float, kVec>(master)) &&
                         (!rem_master || detail::is_aligned_for_pack<int16_t, kVec>(remainder)) &&
                         (!ulp8_master || detail::is_aligned_for_pack<int8_t, kVec>(correction)) &&
                         detail::is_aligned_for_pack<uint8_t, kVec>(m_codes) &&
                         detail::is_aligned_for_pack<uint8_t, kVec>(v_codes);
    // Every thread runs every pass (the shuffles take the whole warp); lanes past the chunk's
    // end hold no element (count 0) and contribute 0 to their block's maxima.
    for (int64_t base = 0; base < loc.n; base += static_cast<int64_t>(kBlockSize) * kVec) {
      const int64_t local = base + static_cast<int64_t>(threadIdx.x) * kVec;
      const int64_t left = loc.n - local;
      const int count = left <= 0 ? 0 : (left < kVec ? static_cast<int>(left) : kVec);
      const int64_t e0 = loc.offset + local;
      const int64_t blk = e0 / math::kQ8Block;
      const bool vec = aligned && count == kVec;
      // the block's scale bytes, read by each of its lanes before its first lane rewrites them
      // (after the shuffles, which every lane reaches only once its decode has used them)
      const uint32_t sm = count > 0 ? m_scales[blk] : 0u;
      const uint32_t sv = count > 0 ? v_scales[blk] : 0u;
      PS p_raw[kVec];
      GS g_raw[kVec];
      uint8_t cm[kVec], cv[kVec];
      float w_raw[kVec] = {0.0f, 0.0f, 0.0f, 0.0f};
      int16_t r_raw[kVec] = {0, 0, 0, 0};
      int8_t c_raw[kVec] = {0, 0, 0, 0};
      if (!fp32_master) detail::load_group(param, e0, count, vec, p_raw);
      detail::load_group(grad, e0, count, vec, g_raw);
      if (fp32_master) detail::load_group(master, e0, count, vec, w_raw);
      if (rem_master) detail::load_group(remainder, e0, count, vec, r_raw);
      if (ulp8_master) detail::load_group(correction, e0, count, vec, c_raw);
      detail::load_group(m_codes, e0, count, vec, cm);
      detail::load_group(v_codes, e0, count, vec, cv);
      float mnew[kVec] = {0.0f, 0.0f, 0.0f, 0.0f};
      float wnew[kVec] = {0.0f, 0.0f, 0.0f, 0.0f};
      uint32_t mmax = 0u, wmax = 0u;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        if (e < count) {
          float p;
          if (fp32_master) {
            p = w_raw[e];
          } else if constexpr (kBf16Param) {
            p = rem_master    ? math::join_master(p_raw[e], r_raw[e])
                : ulp8_master ? math::ulp8_decode_bf16(p_raw[e], c_raw[e])
                              : PE::load(p_raw[e]);
          } else if constexpr (kFp16Param) {
            p = ulp8_master ? math::ulp8_decode_fp16(p_raw[e], c_raw[e]) : PE::load(p_raw[e]);
          } else {
            p = PE::load(p_raw[e]);
          }
          float m = math::q8_decode_m(cm[e], sm);
          float v = math::q8_decode_v(cv[e], sv);
          float vmax = 0.0f;
          math::adamw_element(&p, &m, &v, &vmax, GE::load(g_raw[e]), s, hyper, false, maximize);
          const uint32_t r_p = sr_p ? math::sr_random16(key_p, static_cast<uint64_t>(e0 + e)) : 0u;
          if (fp32_master) {
            w_raw[e] = p;
            p_raw[e] = PE::store(p);
          } else if (ulp8_master) {
            if constexpr (kBf16Param || kFp16Param) {
              if (sr_p) {
                math::ulp8_encode<kFp16Param, true>(p, r_p, &p_raw[e], &c_raw[e]);
              } else {
                math::ulp8_encode<kFp16Param, false>(p, 0u, &p_raw[e], &c_raw[e]);
              }
            }
          } else if constexpr (kBf16Param) {
            if (rem_master) {
              math::split_master(p, &p_raw[e], &r_raw[e]);
            } else if (sr_p) {
              p_raw[e] = math::float_to_bf16_bits_sr(p, r_p);
            } else {
              p_raw[e] = PE::store(p);
            }
          } else {
            p_raw[e] = PE::store(p);
          }
          const float w = sqrtf(v);  // the root adamw_element took (correctly rounded)
          mnew[e] = m;
          wnew[e] = w;
          const uint32_t am = math::float_bits(m) & 0x7fffffffu;
          const uint32_t aw = math::float_bits(w) & 0x7fffffffu;
          mmax = am > mmax ? am : mmax;
          wmax = aw > wmax ? aw : wmax;
        }
      }
      detail::store_group(param, e0, count, vec, p_raw);
      if (fp32_master) detail::store_group(master, e0, count, vec, w_raw);
      if (rem_master) detail::store_group(remainder, e0, count, vec, r_raw);
      if (ulp8_master) detail::store_group(correction, e0, count, vec, c_raw);
      const uint32_t s_m = math::q8_scale_byte(q8_block_max(mmax), math::kQ8MScaleMin);
      const uint32_t s_w = math::q8_scale_byte(q8_block_max(wmax), math::kQ8WScaleMin);
      if (count > 0 && (threadIdx.x % kLanesPerQ8Block) == 0) {
        m_scales[blk] = static_cast<uint8_t>(s_m);
        v_scales[blk] = static_cast<uint8_t>(s_w);
      }
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        if (e < count) {
          const auto index = static_cast<uint64_t>(e0 + e);
          if (sr_c) {
            cm[e] = static_cast<uint8_t>(math::q8_encode_m<true>(mnew[e], s_m, math::sr_random16(key_m, index)));
            cv[e] = static_cast<uint8_t>(math::q8_encode_w<true>(wnew[e], s_w, math::sr_random16(key_v, index)));
          } else {
            cm[e] = static_cast<uint8_t>(math::q8_encode_m<false>(mnew[e], s_m, 0u));
            cv[e] = static_cast<uint8_t>(math::q8_encode_w<false>(wnew[e], s_w, 0u));
          }
        }
      }
      detail::store_group(m_codes, e0, count, vec, cm);
      detail::store_group(v_codes, e0, count, vec, cv);
    }
  }
}

template <typename PE, typename GE>
cudaError_t launch_adamw_q8(const PlannedLaunch& l, const Table& view, MasterKind master_kind, const float* found_inf,
                            const int64_t* rng, const math::AdamWHyper& hyper, bool maximize, bool sr_param,
                            bool sr_codes, cudaStream_t stream) {
  adamw_q8_kernel<PE, GE><<<static_cast<int>(l.grid), kBlockSize, 0, stream>>>(view, master_kind, found_inf, rng, hyper,
                                                                               maximize, sr_param, sr_codes);
  return cudaGetLastError();
}

template <typename PE>
cudaError_t launch_adamw_q8_grad(DType grad, const PlannedLaunch& l, const Table& view, MasterKind master_kind,
                                 const float* found_inf, const int64_t* rng, const math::AdamWHyper& hyper,
                                 bool maximize, bool sr_param, bool sr_codes, cudaStream_t stream) {
  switch (grad) {
    case DType::kFloat32:
      return launch_adamw_q8<PE, detail::F32>(l, view, master_kind, found_inf, rng, hyper, maximize, sr_param, sr_codes,
                                              stream);
    case DType::kFloat16:
      return launch_adamw_q8<PE, detail::F16>(l, view, master_kind, found_inf, rng, hyper, maximize, sr_param, sr_codes,
                                              stream);
    case DType::kBFloat16:
      return launch_adamw_q8<PE, detail::BF16>(l, view, master_kind, found_inf, rng, hyper, maximize, sr_param,
                                               sr_codes, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t adamw_q8(const AdamWQ8TensorRef* tensors, int64_t num_tensors, MasterKind master_kind,
                     const float* step_scalars, int64_t scalar_stride, const float* found_inf, const int64_t* rng,
                     double beta1, double beta2, double eps, bool maximize, bool sr_param, bool sr_codes,
                     TableMemory& tables, cudaStream_t stream) {
  if (master_kind != MasterKind::kNone && master_kind != MasterKind::kFloat32 &&
      master_kind != MasterKind::kRemainder && master_kind != MasterKind::kUlp8) {
    return cudaErrorInvalidValue;
  }
  if ((sr_param || sr_codes) && rng == nullptr) return cudaErrorInvalidValue;
  // Rounded from doubles exactly as the reference's _f32(beta1), _f32(1.0 - beta1), ...
  math::AdamWHyper hyper;
  hyper.beta1 = static_cast<float>(beta1);
  hyper.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  hyper.beta2 = static_cast<float>(beta2);
  hyper.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  hyper.eps = static_cast<float>(eps);
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
      plan_adamw_q8(param.data(), grad.data(), numel.data(), num_tensors, capturing, detail::current_sm_count());
  auto ptrs_of = [&](int64_t i, void** row) {
    const AdamWQ8TensorRef& r = tensors[i];
    row[0] = r.param;
    row[1] = const_cast<void*>(r.grad);
    row[2] = master_kind == MasterKind::kNone ? nullptr : r.master;
    row[3] = r.exp_avg_codes;
    row[4] = r.exp_avg_scales;
    row[5] = r.exp_avg_sq_codes;
    row[6] = r.exp_avg_sq_scales;
    row[7] = detail::tag_as_row(r.rng_stream);
    row[8] = detail::scalars_as_row(step_scalars, i, scalar_stride);
  };
  auto launch = [&](const PlannedLaunch& l, const Table& view) -> cudaError_t {
    const auto g = static_cast<DType>(l.group % 3);
    switch (static_cast<DType>(l.group / 3)) {
      case DType::kFloat32:
        return launch_adamw_q8_grad<detail::F32>(g, l, view, master_kind, found_inf, rng, hyper, maximize, sr_param,
                                                 sr_codes, stream);
      case DType::kFloat16:
        return launch_adamw_q8_grad<detail::F16>(g, l, view, master_kind, found_inf, rng, hyper, maximize, sr_param,
                                                 sr_codes, stream);
      case DType::kBFloat16:
        return launch_adamw_q8_grad<detail::BF16>(g, l, view, master_kind, found_inf, rng, hyper, maximize, sr_param,
                                                  sr_codes, stream);
    }
    return cudaErrorInvalidValue;
  };
  return detail::run_plan<kDepth>(plan, numel.data(), ptrs_of, capturing, tables, stream, launch);
}

}  // namespace cuda
}  // namespace fastamp
