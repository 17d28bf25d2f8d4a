// The CUDA kernel of fastamp::optim_: one template, an update rule x a state format x the (param,
// grad) dtypes (semantics: fastamp.reference.optim_; the rules: csrc/rules/<name>.h, listed by
// csrc/optim_rules.h; the state formats: optim_formats.cuh, the codecs: csrc/q8_math.h). Each
// optim_<format>.cu instantiates it for the rules whose kCudaStates list its format
// (optim_combos.h) and the 9 dtype pairs; the master format, the flags and the state count are
// run-time branches, uniform over a launch.
//
// Each thread takes 4 consecutive elements per pass; a pass of the block covers kBlockSize * 4
// elements of one chunk of its tensor (launch_plan.h: chunks of 64K elements, found by the
// table's walker). Per element: the value optimised is decoded from its master format (fp32
// master; bf16 param + int16 remainder; bf16 / fp16 param + int8 ulp8 correction; the param
// itself), the states from theirs, the rule's element update runs in fp32 (one rounding per
// operation: --fmad=false, IEEE sqrt and division), and everything is encoded back: the param
// rounded to nearest-even (stochastically for a bf16 param without a master under SR_PARAM), the
// master split again, bf16 states rounded to nearest-even or stochastically (SR_STATE). q8 states:
// lanes 8k..8k+7 of a warp hold one q8 block of 32 (chunks and passes start on multiples of 32);
// after the update each lane takes the block's absmax of the new state (of its root for a
// root-coded one, AdamW's v) with three xor-shuffles, the block's first lane writes the new scale
// byte and every lane encodes its codes over it, as csrc/q8_math.h specifies. Random bits: stream
// 4 * (rng_base + i) for the param (or ulp8 correction), + 1 + j for state j, element index =
// flat index in the tensor. A non-zero (or NaN) found_inf returns before anything is read.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "../fastamp_math.h"
#include "../q8_math.h"
#include "launch_plan.h"
#include "launchers.h"
#include "multi_tensor.cuh"
#include "optim_combos.h"
#include "optim_formats.cuh"

namespace fastamp {
namespace cuda {
namespace detail {

// Elements per thread per pass: one 16-byte access for fp32 rows, 8 bytes for 16-bit ones, 4 for
// q8 codes and int8 corrections.
constexpr int kOptimVec = 4;
constexpr int kLanesPerQ8Block = math::kQ8Block / kOptimVec;
static_assert(32 % kLanesPerQ8Block == 0, "a q8 block's lanes must lie in one warp");
static_assert(kChunkSize % (kBlockSize * kOptimVec) == 0, "a pass must not cross a chunk");
static_assert((kBlockSize * kOptimVec) % math::kQ8Block == 0, "a pass must start on a q8 block");

// At least 2 blocks per SM (up to 128 registers): each element's IEEE division and square root
// have a slow path that ptxas emits as a subroutine call, and values live across those calls
// spilled whenever the budget was tight or unset (with nvcc 13.0: 4-16 bytes in some dtype
// variants of the former AdamW kernels at 64 or 80 registers or no bound, none at 2 blocks).
// tests/tools/test_cuda_ptxas.py holds every instance to 0 spill bytes. Two blocks of 256
// threads with 48-80 bytes of loads in flight per thread still cover an SM's share of the
// bandwidth-latency product (~25 KB on H100).
constexpr int kOptimMinBlocks = 2;

// The call's constants besides the rule's hyperparameters.
struct OptimArgs {
  const float* found_inf;  // null or 1 fp32
  const int64_t* rng;      // [seed, counter], read only when a flag below draws random bits
  const float* step_scalars;
  int64_t scalar_stride;  // 0 (one shared row) or the rule's scalar count (row i of [n, k])
  uint64_t rng_base;
  MasterKind master;
  bool sr_param;  // SR_PARAM: a bf16 param without a master, or an ulp8 correction, rounded stochastically
  bool sr_state;  // SR_STATE: bf16 states or q8 codes rounded stochastically
};

// A tensor's list index in the last row of its table entry.
inline void* index_as_row(int64_t i) { return reinterpret_cast<void*>(static_cast<uintptr_t>(i)); }
__device__ __forceinline__ int64_t row_as_index(const void* p) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
}

// Internal linkage, as table_fill_kernel: each optim_<format>.cu instantiates its own format.
namespace {

// The maximum of x over the 8 lanes holding one q8 block (every lane of the warp calls it).
__device__ __forceinline__ uint32_t q8_block_max(uint32_t x) {
#pragma unroll
  for (int off = 1; off < kLanesPerQ8Block; off <<= 1) {
    const uint32_t y = __shfl_xor_sync(0xffffffffu, x, off);
    x = y > x ? y : x;
  }
  return x;
}

template <typename Rule, typename PE, typename GE, typename SF>
__global__ void __launch_bounds__(kBlockSize, kOptimMinBlocks)
    optim_kernel(const TableView<optim_depth(Rule::kId, SF::kId)> table, const OptimArgs args,
                 const typename Rule::Hyper hyper) {
  constexpr int kDepth = optim_depth(Rule::kId, SF::kId);
  constexpr int kVec = kOptimVec;
  constexpr int kS = Rule::kMaxStates;
  constexpr int kStreams = state_streams(SF::kId);
  using PS = typename PE::storage_t;
  using GS = typename GE::storage_t;
  using SS = typename SF::storage_t;
  using Scalars = typename Rule::Scalars;
  constexpr bool kBf16Param = PE::kDType == DType::kBFloat16;
  constexpr bool kFp16Param = PE::kDType == DType::kFloat16;
  // The skip decision stays on the device: a non-zero (or NaN) flag means nothing is written.
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;
  const bool fp32_master = args.master == MasterKind::kFloat32;
  const bool rem_master = kBf16Param && args.master == MasterKind::kRemainder;
  const bool ulp8_master = (kBf16Param || kFp16Param) && args.master == MasterKind::kUlp8;
  // the param's random bits only where the reference draws them: a bf16 param without a master,
  // an ulp8 correction
  const bool sr_p = args.sr_param && ((kBf16Param && args.master == MasterKind::kNone) || ulp8_master);
  const bool sr_s = SF::kRounds && args.sr_state;
  const int ns = Rule::num_states(hyper);
  const bool draws = sr_p || sr_s;
  const uint64_t seed = draws ? static_cast<uint64_t>(args.rng[0]) : 0u;
  const uint64_t counter = draws ? static_cast<uint64_t>(args.rng[1]) : 0u;

  int64_t first = 0;
  int64_t last = 0;
  block_chunk_range(table.num_chunks, gridDim.x, blockIdx.x, &first, &last);
  if (first >= last) return;
  ChunkWalker<kDepth> walk(table, first);
  for (int64_t chunk = first; chunk < last; ++chunk) {
    const ChunkLocation loc = walk.locate(chunk);
    void* const* row = table.entries[loc.tensor].ptrs;
    PS* param = static_cast<PS*>(row[0]);
    const GS* grad = static_cast<const GS*>(row[1]);
    float* master = fp32_master ? static_cast<float*>(row[2]) : nullptr;
    int16_t* remainder = rem_master ? static_cast<int16_t*>(row[2]) : nullptr;
    int8_t* correction = ulp8_master ? static_cast<int8_t*>(row[2]) : nullptr;
    SS* state[kS];
    uint8_t* scales[kS];
#pragma unroll
    for (int j = 0; j < kS; ++j) {
      state[j] = static_cast<SS*>(row[kOptimFirstStateRow + j * kStreams]);
      scales[j] = SF::kQ8 ? static_cast<uint8_t*>(row[kOptimFirstStateRow + j * kStreams + kStreams - 1]) : nullptr;
    }
    const int64_t index = row_as_index(row[kDepth - 1]);
    // read once per chunk: per-tensor scalars cost nothing per element
    const Scalars sc = Rule::scalars(args.step_scalars + index * args.scalar_stride);
    // the low 32 bits of 4 * (rng_base + i): reference.sr_random16 masks the stream to 32 bits
    const auto stream = static_cast<uint32_t>((args.rng_base + static_cast<uint64_t>(index)) * 4u);
    const uint32_t key_p = sr_p ? math::sr_stream_key(seed, counter, stream) : 0u;
    uint32_t key_s[kS];
#pragma unroll
    for (int j = 0; j < kS; ++j) {
      key_s[j] = sr_s && j < ns ? math::sr_stream_key(seed, counter, stream + 1u + static_cast<uint32_t>(j)) : 0u;
    }
    // Chunk offsets are multiples of kVec, so aligned tensors stay aligned chunk by chunk.
    bool aligned = is_aligned_for_pack<PS, kVec>(param) && is_aligned_for_pack<GS, kVec>(grad) &&
                   (!fp32_master || is_aligned_for_pack<float, kVec>(master)) &&
                   (!rem_master || is_aligned_for_pack<int16_t, kVec>(remainder)) &&
                   (!ulp8_master || is_aligned_for_pack<int8_t, kVec>(correction));
#pragma unroll
    for (int j = 0; j < kS; ++j) aligned = aligned && (j >= ns || is_aligned_for_pack<SS, kVec>(state[j]));
    // q8: every thread runs every pass (the shuffles take the whole warp); lanes past the chunk's
    // end hold no element (count 0) and contribute 0 to their block's maxima.
    for (int64_t base = 0; base < loc.n; base += static_cast<int64_t>(kBlockSize) * kVec) {
      const int64_t local = base + static_cast<int64_t>(threadIdx.x) * kVec;
      const int64_t left = loc.n - local;
      const int count = left <= 0 ? 0 : (left < kVec ? static_cast<int>(left) : kVec);
      if constexpr (!SF::kQ8) {
        if (count == 0) break;  // the last pass only
      }
      const int64_t e0 = loc.offset + local;
      const int64_t blk = e0 / math::kQ8Block;
      const bool vec = aligned && count == kVec;
      PS p_raw[kVec];
      GS g_raw[kVec];
      float w_raw[kVec] = {0.0f, 0.0f, 0.0f, 0.0f};
      int16_t r_raw[kVec] = {0, 0, 0, 0};
      int8_t c_raw[kVec] = {0, 0, 0, 0};
      SS s_raw[kS][kVec] = {};
      // q8: the block's scale bytes, read by each of its lanes before its first lane rewrites them
      // (after the shuffles, which every lane reaches only once its decode has used them)
      uint32_t scale_in[kS];
      if (!fp32_master) load_group(param, e0, count, vec, p_raw);
      load_group(grad, e0, count, vec, g_raw);
      if (fp32_master) load_group(master, e0, count, vec, w_raw);
      if (rem_master) load_group(remainder, e0, count, vec, r_raw);
      if (ulp8_master) load_group(correction, e0, count, vec, c_raw);
#pragma unroll
      for (int j = 0; j < kS; ++j) {
        if (j < ns) load_group(state[j], e0, count, vec, s_raw[j]);
        scale_in[j] = SF::kQ8 && j < ns && count > 0 ? scales[j][blk] : 0u;
      }
      // q8: the new states (their roots for root-coded ones) until the block's scale is known
      float s_new[kS][kVec];
      uint32_t amax[kS];
#pragma unroll
      for (int j = 0; j < kS; ++j) amax[j] = 0u;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        if (e < count) {
          const auto idx = static_cast<uint64_t>(e0 + e);
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
          float s[kS];
#pragma unroll
          for (int j = 0; j < kS; ++j) {
            if constexpr (SF::kQ8) {
              s[j] = j >= ns               ? 0.0f
                     : Rule::root_coded(j) ? math::q8_decode_v(s_raw[j][e], scale_in[j])
                                           : math::q8_decode_m(s_raw[j][e], scale_in[j]);
            } else {
              s[j] = j < ns ? SF::load(s_raw[j][e]) : 0.0f;
            }
          }
          Rule::element(&p, s, GE::load(g_raw[e]), sc, hyper);
          const uint32_t r_p = sr_p ? math::sr_random16(key_p, idx) : 0u;
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
#pragma unroll
          for (int j = 0; j < kS; ++j) {
            if (j < ns) {
              if constexpr (SF::kQ8) {
                const float x = Rule::root_coded(j) ? sqrtf(s[j]) : s[j];  // the root is correctly rounded
                s_new[j][e] = x;
                const uint32_t a = math::float_bits(x) & 0x7fffffffu;
                amax[j] = a > amax[j] ? a : amax[j];
              } else {
                s_raw[j][e] = SF::store(s[j], sr_s, sr_s ? math::sr_random16(key_s[j], idx) : 0u);
              }
            }
          }
        }
      }
      store_group(param, e0, count, vec, p_raw);
      if (fp32_master) store_group(master, e0, count, vec, w_raw);
      if (rem_master) store_group(remainder, e0, count, vec, r_raw);
      if (ulp8_master) store_group(correction, e0, count, vec, c_raw);
      if constexpr (SF::kQ8) {
#pragma unroll
        for (int j = 0; j < kS; ++j) {
          if (j < ns) {  // uniform over the grid: every lane reaches the shuffles
            const bool root = Rule::root_coded(j);
            const uint32_t sb =
                math::q8_scale_byte(q8_block_max(amax[j]), root ? math::kQ8WScaleMin : math::kQ8MScaleMin);
            if (count > 0 && (threadIdx.x % kLanesPerQ8Block) == 0) scales[j][blk] = static_cast<uint8_t>(sb);
#pragma unroll
            for (int e = 0; e < kVec; ++e) {
              if (e < count) {
                const float x = s_new[j][e];
                uint32_t code;
                if (sr_s) {
                  const uint32_t r = math::sr_random16(key_s[j], static_cast<uint64_t>(e0 + e));
                  code = root ? math::q8_encode_w<true>(x, sb, r) : math::q8_encode_m<true>(x, sb, r);
                } else {
                  code = root ? math::q8_encode_w<false>(x, sb, 0u) : math::q8_encode_m<false>(x, sb, 0u);
                }
                s_raw[j][e] = static_cast<SS>(code);
              }
            }
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kS; ++j) {
        if (j < ns) store_group(state[j], e0, count, vec, s_raw[j]);
      }
    }
  }
}

template <typename Rule, typename SF, typename PE, typename GE>
cudaError_t launch_optim(const PlannedLaunch& l, const TableView<optim_depth(Rule::kId, SF::kId)>& view,
                         const OptimArgs& args, const typename Rule::Hyper& hyper, cudaStream_t stream) {
  optim_kernel<Rule, PE, GE, SF><<<static_cast<int>(l.grid), kBlockSize, 0, stream>>>(view, args, hyper);
  return cudaGetLastError();
}

template <typename Rule, typename SF, typename PE>
cudaError_t launch_optim_grad(DType grad, const PlannedLaunch& l,
                              const TableView<optim_depth(Rule::kId, SF::kId)>& view, const OptimArgs& args,
                              const typename Rule::Hyper& hyper, cudaStream_t stream) {
  switch (grad) {
    case DType::kFloat32:
      return launch_optim<Rule, SF, PE, F32>(l, view, args, hyper, stream);
    case DType::kFloat16:
      return launch_optim<Rule, SF, PE, F16>(l, view, args, hyper, stream);
    case DType::kBFloat16:
      return launch_optim<Rule, SF, PE, BF16>(l, view, args, hyper, stream);
  }
  return cudaErrorInvalidValue;
}

// One (rule, state format): plan_optim's launches, one per (param, grad) dtype pair.
template <typename Rule, typename SF>
cudaError_t run_optim_format(const OptimTensorRef* tensors, int64_t num_tensors, const OptimCall& call,
                             TableMemory& tables, cudaStream_t stream) {
  constexpr int kDepth = optim_depth(Rule::kId, SF::kId);
  constexpr int kStateRows = kDepth - kOptimFixedRows;
  static_assert(sizeof(TableEntry<kDepth>) == optim_entry_bytes(Rule::kId, SF::kId), "table entry layout");
  static_assert(kStateRows <= kOptimMaxStateTensors, "more state rows than a tensor ref holds");
  const typename Rule::Hyper hyper = Rule::make_hyper(call.hyper, call.flags);
  const int ns = Rule::num_states(hyper);
  const bool sr_param = (call.flags & optim_flags::kSrParam) != 0;
  const bool sr_state = (call.flags & optim_flags::kSrState) != 0;
  if (ns != call.num_states || ((sr_param || sr_state) && call.rng == nullptr)) return cudaErrorInvalidValue;
  OptimArgs args;
  args.found_inf = call.found_inf;
  args.rng = call.rng;
  args.step_scalars = call.step_scalars;
  args.scalar_stride = call.scalar_stride;
  args.rng_base = static_cast<uint64_t>(call.rng_base);
  args.master = call.master;
  args.sr_param = sr_param;
  args.sr_state = sr_state;
  bool capturing = false;
  const cudaError_t err = stream_is_capturing(stream, &capturing);
  if (err != cudaSuccess) return err;
  std::vector<DType> param(static_cast<size_t>(num_tensors));
  std::vector<DType> grad(static_cast<size_t>(num_tensors));
  std::vector<int64_t> numel(static_cast<size_t>(num_tensors));
  for (int64_t i = 0; i < num_tensors; ++i) {
    param[i] = tensors[i].param_dtype;
    grad[i] = tensors[i].grad_dtype;
    numel[i] = tensors[i].numel;
  }
  const LaunchPlan plan = plan_optim(Rule::kId, SF::kId, param.data(), grad.data(), numel.data(), num_tensors,
                                     capturing, current_sm_count());
  const int live_rows = ns * state_streams(SF::kId);
  const bool has_master = call.master != MasterKind::kNone;
  auto ptrs_of = [&](int64_t i, void** row) {
    const OptimTensorRef& r = tensors[i];
    row[0] = r.param;
    row[1] = const_cast<void*>(r.grad);
    row[2] = has_master ? r.master : nullptr;
    for (int k = 0; k < kStateRows; ++k) row[kOptimFirstStateRow + k] = k < live_rows ? r.states[k] : nullptr;
    row[kDepth - 1] = index_as_row(i);
  };
  auto launch = [&](const PlannedLaunch& l, const TableView<kDepth>& view) -> cudaError_t {
    const auto g = static_cast<DType>(l.group % 3);
    switch (static_cast<DType>(l.group / 3)) {
      case DType::kFloat32:
        return launch_optim_grad<Rule, SF, F32>(g, l, view, args, hyper, stream);
      case DType::kFloat16:
        return launch_optim_grad<Rule, SF, F16>(g, l, view, args, hyper, stream);
      case DType::kBFloat16:
        return launch_optim_grad<Rule, SF, BF16>(g, l, view, args, hyper, stream);
    }
    return cudaErrorInvalidValue;
  };
  return run_plan<kDepth>(plan, numel.data(), ptrs_of, capturing, tables, stream, launch);
}

// A state format's launcher: the rules whose kCudaStates list it (optim_combos.h), instantiated
// here; any other rule or format is refused (cudaErrorInvalidValue, nothing enqueued).
template <typename SF>
cudaError_t run_optim(const OptimTensorRef* tensors, int64_t num_tensors, const OptimCall& call, TableMemory& tables,
                      cudaStream_t stream) {
  if (call.format != SF::kId) return cudaErrorInvalidValue;
  switch (call.rule) {
#define FASTAMP_CUDA_OPTIM_RULE_CASE_(Name, name)                                           \
  case OptimRule::k##Name:                                                                  \
    if constexpr (optim_combo_listed(OptimRule::k##Name, SF::kId)) {                        \
      return run_optim_format<rules::Name, SF>(tensors, num_tensors, call, tables, stream); \
    }                                                                                       \
    break;
    FASTAMP_OPTIM_RULES(FASTAMP_CUDA_OPTIM_RULE_CASE_)
#undef FASTAMP_CUDA_OPTIM_RULE_CASE_
  }
  return cudaErrorInvalidValue;
}

}  // namespace
}  // namespace detail
}  // namespace cuda
}  // namespace fastamp
