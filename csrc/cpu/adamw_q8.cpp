// CPU kernel of fastamp::adamw_q8_: AdamW on 8-bit block-scaled moments (semantics:
// fastamp/reference/optim.py adamw_q8_; the codec: fastamp/reference/q8.py, whose scalar twin
// is csrc/q8_math.h; the element maths: math::adamw_element of csrc/fastamp_math.h).
//
// One pass over all tensors of the call, cut into the fixed chunks of csrc/cpu/multi_tensor.h
// (multiples of 32 elements, so no q8 block crosses a chunk seam), spread over threads. Per
// block of 32: decode m and v from their codes and the block's two scale bytes, run the AdamW
// update, write the param (and its master), then encode the new m and w = sqrt(v) (the sqrt the
// update itself computed) over the new block scales. The value optimised is an fp32 master
// (params of any float dtype), the exact master of a bf16 param and an int16 remainder
// (math::join_master / split_master), the ulp8 master of a bf16 / fp16 param and an int8
// correction (math::ulp8_decode_* / ulp8_encode, the correction rounded stochastically when
// sr_param), or the param itself (a bf16 one rounded stochastically when sr_param). sr_codes
// rounds the codes stochastically with streams 4 * (rng_base + i) + 1 (m) and + 2 (v), the param
// (or correction) with stream 4 * (rng_base + i), element index = flat index in the tensor.
// Bit-exact with the reference for every instruction set (AVX-512, AVX2, scalar). A non-zero (or
// NaN) found_inf writes nothing. step_scalars is [4] (shared) or [n, 4].
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu/isa.h"
#include "cpu/multi_tensor.h"
#include "cpu/optim_checks.h"
#include "cpu/q8_host.h"
#include "cpu/scalar_ops.h"
#include "fastamp_math.h"
#include "host_prefetch.h"
#include "op_signatures.h"
#include "q8_math.h"

namespace fastamp {
namespace cpu {
namespace {

constexpr int kMasterNone = 0;       // params updated directly
constexpr int kMasterFp32 = 1;       // fp32 master weights
constexpr int kMasterRemainder = 2;  // int16 remainders of bf16 params
constexpr int kMasterUlp8 = 3;       // int8 ulp8 corrections of bf16 / fp16 params

constexpr int64_t kBlock = math::kQ8Block;
static_assert(kChunkElems % kBlock == 0, "chunks must hold whole q8 blocks");
static_assert((uint64_t{1} << 32) % static_cast<uint64_t>(kChunkElems) == 0, "chunks must not cross 2^32");
static_assert((1 << 16) % kChunkElems == 0 && kChunkElems % (1 << 14) == 0,
              "the vector RNG needs chunks of 2^14..2^16 elements (vq8_random16)");

struct Q8Args {
  math::AdamWStepScalars s;
  math::AdamWHyper h;
  bool maximize;
};

// Pointers of one chunk, already offset to its first element (scales to its first block).
struct Q8Chunk {
  void* param;
  const void* grad;
  void* master;  // float* (fp32 masters), int16_t* (remainders), int8_t* (ulp8) or nullptr
  uint8_t* m_codes;
  uint8_t* m_scales;
  uint8_t* v_codes;
  uint8_t* v_scales;
  uint64_t index0;  // flat index of the chunk's first element in its tensor (RNG counter)
  uint32_t key[3];  // math::sr_stream_key of streams 4 * tensor_id + k: param, m, v
};

namespace scalar {

// Blocks of one chunk from element `begin` (a multiple of 32) to `n` (the last block may be
// partial). KIND: the master; SRP: the bf16 param without master, or the ulp8 correction,
// rounded stochastically; SRC: the codes rounded stochastically.
template <class P, class G, int KIND, bool SRP, bool SRC>
void q8_range(const Q8Chunk& c, int64_t begin, int64_t n, const Q8Args& a) {
  P* param = static_cast<P*>(c.param);
  const G* grad = static_cast<const G*>(c.grad);
  for (int64_t b0 = begin; b0 < n; b0 += kBlock) {
    const int64_t len = std::min(kBlock, n - b0);
    const int64_t blk = b0 / kBlock;
    const uint32_t sm = c.m_scales[blk], sv = c.v_scales[blk];
    float mnew[kBlock], wnew[kBlock];
    uint32_t mmax = 0, wmax = 0;
    for (int64_t j = 0; j < len; ++j) {
      const int64_t i = b0 + j;
      float p;
      if constexpr (KIND == kMasterFp32) {
        p = static_cast<float*>(c.master)[i];
      } else if constexpr (KIND == kMasterRemainder) {
        p = math::join_master(param[i].x, static_cast<int16_t*>(c.master)[i]);
      } else if constexpr (KIND == kMasterUlp8) {
        const int8_t corr = static_cast<int8_t*>(c.master)[i];
        p = std::is_same_v<P, c10::Half> ? math::ulp8_decode_fp16(param[i].x, corr)
                                         : math::ulp8_decode_bf16(param[i].x, corr);
      } else {
        p = load_float(param + i);
      }
      float m = math::q8_decode_m(c.m_codes[i], sm);
      float v = math::q8_decode_v(c.v_codes[i], sv);
      float vmax = 0.0f;
      math::adamw_element(&p, &m, &v, &vmax, load_float(grad + i), a.s, a.h, false, a.maximize);
      if constexpr (KIND == kMasterFp32) {
        static_cast<float*>(c.master)[i] = p;
        store_float(param + i, p);
      } else if constexpr (KIND == kMasterRemainder) {
        math::split_master(p, &param[i].x, &static_cast<int16_t*>(c.master)[i]);
      } else if constexpr (KIND == kMasterUlp8) {
        const uint32_t r = SRP ? math::sr_random16(c.key[0], c.index0 + static_cast<uint64_t>(i)) : 0u;
        math::ulp8_encode<std::is_same_v<P, c10::Half>, SRP>(p, r, &param[i].x, &static_cast<int8_t*>(c.master)[i]);
      } else if constexpr (SRP) {
        param[i].x = math::float_to_bf16_bits_sr(p, math::sr_random16(c.key[0], c.index0 + static_cast<uint64_t>(i)));
      } else {
        store_float(param + i, p);
      }
      const float w = sqrtf(v);  // the sqrt adamw_element took (correctly rounded)
      mnew[j] = m;
      wnew[j] = w;
      mmax = std::max(mmax, math::float_bits(m) & 0x7fffffffu);
      wmax = std::max(wmax, math::float_bits(w) & 0x7fffffffu);
    }
    const uint32_t s_m = math::q8_scale_byte(mmax, math::kQ8MScaleMin);
    const uint32_t s_w = math::q8_scale_byte(wmax, math::kQ8WScaleMin);
    c.m_scales[blk] = static_cast<uint8_t>(s_m);
    c.v_scales[blk] = static_cast<uint8_t>(s_w);
    for (int64_t j = 0; j < len; ++j) {
      const int64_t i = b0 + j;
      const uint64_t index = c.index0 + static_cast<uint64_t>(i);
      const uint32_t rm = SRC ? math::sr_random16(c.key[1], index) : 0u;
      const uint32_t rv = SRC ? math::sr_random16(c.key[2], index) : 0u;
      c.m_codes[i] = static_cast<uint8_t>(math::q8_encode_m<SRC>(mnew[j], s_m, rm));
      c.v_codes[i] = static_cast<uint8_t>(math::q8_encode_w<SRC>(wnew[j], s_w, rv));
    }
  }
}

template <class P, class G, int KIND, bool SRP, bool SRC>
void q8_chunk(const Q8Chunk& c, int64_t n, const Q8Args& a) {
  q8_range<P, G, KIND, SRP, SRC>(c, 0, n, a);
}

}  // namespace scalar

#define FASTAMP_ISA_KERNELS "cpu/adamw_q8_kernels.inc"
#include "cpu/per_isa.inc"  // namespaces avx512 and avx2: the loops of adamw_q8_kernels.inc per ISA

using Q8ChunkFn = void (*)(const Q8Chunk&, int64_t, const Q8Args&);

template <class P, class G, int KIND, bool SRP, bool SRC>
Q8ChunkFn pick_isa(Isa isa) {
#if FASTAMP_X86_SIMD
  if (isa == Isa::Avx512) return &avx512::q8_chunk<P, G, KIND, SRP, SRC>;
  if (isa == Isa::Avx2) return &avx2::q8_chunk<P, G, KIND, SRP, SRC>;
#endif
  (void)isa;
  return &scalar::q8_chunk<P, G, KIND, SRP, SRC>;
}

template <class P, class G, int KIND, bool SRP>
Q8ChunkFn pick_codes(Isa isa, bool sr_codes) {
  return sr_codes ? pick_isa<P, G, KIND, SRP, true>(isa) : pick_isa<P, G, KIND, SRP, false>(isa);
}

// Only the combinations the checks allow are instantiated: remainders and a stochastically
// rounded param exist for bf16 params only, ulp8 corrections for bf16 and fp16 params.
template <class P, class G>
Q8ChunkFn pick_mode(Isa isa, int kind, bool sr_param, bool sr_codes) {
  if (kind == kMasterFp32) return pick_codes<P, G, kMasterFp32, false>(isa, sr_codes);
  if constexpr (!std::is_same_v<P, float>) {
    if (kind == kMasterUlp8) {
      return sr_param ? pick_codes<P, G, kMasterUlp8, true>(isa, sr_codes)
                      : pick_codes<P, G, kMasterUlp8, false>(isa, sr_codes);
    }
  }
  if constexpr (std::is_same_v<P, c10::BFloat16>) {
    if (kind == kMasterRemainder) return pick_codes<P, G, kMasterRemainder, false>(isa, sr_codes);
    if (sr_param) return pick_codes<P, G, kMasterNone, true>(isa, sr_codes);
  }
  return pick_codes<P, G, kMasterNone, false>(isa, sr_codes);
}

template <class P>
Q8ChunkFn pick_grad(at::ScalarType grad_dtype, Isa isa, int kind, bool sr_param, bool sr_codes) {
  switch (grad_dtype) {
    case at::kHalf:
      return pick_mode<P, c10::Half>(isa, kind, sr_param, sr_codes);
    case at::kBFloat16:
      return pick_mode<P, c10::BFloat16>(isa, kind, sr_param, sr_codes);
    default:
      return pick_mode<P, float>(isa, kind, sr_param, sr_codes);
  }
}

Q8ChunkFn pick_kernel(at::ScalarType param_dtype, at::ScalarType grad_dtype, Isa isa, int kind, bool sr_param,
                      bool sr_codes) {
  switch (param_dtype) {
    case at::kHalf:
      return pick_grad<c10::Half>(grad_dtype, isa, kind, sr_param, sr_codes);
    case at::kBFloat16:
      return pick_grad<c10::BFloat16>(grad_dtype, isa, kind, sr_param, sr_codes);
    default:
      return pick_grad<float>(grad_dtype, isa, kind, sr_param, sr_codes);
  }
}

void adamw_q8_cpu(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList exp_avg_codes,
                  at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_codes, at::TensorList exp_avg_sq_scales,
                  const at::Tensor& step_scalars, const std::optional<at::Tensor>& found_inf,
                  const std::optional<at::Tensor>& rng, int64_t rng_base, double beta1, double beta2, double eps,
                  bool maximize, bool sr_param, bool sr_codes) {
  constexpr const char* op = "adamw_q8_";
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n, "fastamp::adamw_q8_: got ", n, " params but ", grads.size(), " grads");
  TORCH_CHECK(masters.empty() || masters.size() == n,
              "fastamp::adamw_q8_: masters must be empty or have one tensor per param, got ", masters.size(),
              " masters for ", n, " params");
  const std::pair<const char*, at::TensorList> state_lists[] = {{"exp_avg_codes", exp_avg_codes},
                                                                {"exp_avg_scales", exp_avg_scales},
                                                                {"exp_avg_sq_codes", exp_avg_sq_codes},
                                                                {"exp_avg_sq_scales", exp_avg_sq_scales}};
  for (const auto& [name, list] : state_lists) {
    TORCH_CHECK(list.size() == n, "fastamp::adamw_q8_: got ", n, " params but ", list.size(), " ", name);
  }
  const int64_t scalar_stride = check_step_scalars(op, step_scalars, n, 4, "[step_size, bc2_sqrt, decay, grad_mul]");
  check_found_inf(op, found_inf);
  check_rng(op, rng);
  TORCH_CHECK(rng.has_value() || !(sr_param || sr_codes),
              "fastamp::adamw_q8_: sr_codes / sr_param need rng ([seed, counter], int64), got None");
  if (n == 0) return;
  int kind = kMasterNone;
  at::ScalarType master_dtype = at::kFloat;
  if (!masters.empty()) {
    TORCH_CHECK(masters[0].defined(), "fastamp::adamw_q8_: masters[0] is undefined");
    master_dtype = masters[0].scalar_type();
    TORCH_CHECK(master_dtype == at::kFloat || master_dtype == at::kShort || master_dtype == at::kChar,
                "fastamp::adamw_q8_: masters must be float32 (fp32 master weights), int16 (remainders of "
                "bfloat16 params) or int8 (ulp8 corrections of bfloat16 / float16 params), got ",
                master_dtype);
    kind = master_dtype == at::kFloat ? kMasterFp32 : master_dtype == at::kShort ? kMasterRemainder : kMasterUlp8;
  }
  const float* sc = step_scalars.data_ptr<float>();
  Q8Args args;
  args.h = math::AdamWHyper{static_cast<float>(beta1), static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
                            static_cast<float>(1.0 - beta2), static_cast<float>(eps)};
  args.maximize = maximize;
  // math::sr_stream_key of stream 4 * (rng_base + i) + k is mix32(stream_base ^ stream)
  uint32_t stream_base = 0;
  if (rng) {
    const int64_t* r = rng->data_ptr<int64_t>();
    stream_base = math::mix32(math::mix32(static_cast<uint32_t>(r[0]) ^ 0x9E3779B9u) ^ static_cast<uint32_t>(r[1]));
  }
  auto stream_key = [&](size_t i, uint32_t k) {
    return math::mix32(stream_base ^
                       (static_cast<uint32_t>((static_cast<uint64_t>(rng_base) + static_cast<uint64_t>(i)) * 4u) + k));
  };

  // One pass over the params checks every tensor and takes its pointers (nothing is written
  // before it ends). Its host time is mostly cache misses on the tensors' TensorImpl and
  // StorageImpl objects (7 per param) when there are thousands of small params: they are
  // prefetched a few params ahead.
  const Isa isa = active_isa();
  std::vector<int64_t> numels(n);
  std::vector<Q8Chunk> bases(n);
  std::vector<Q8ChunkFn> fns(n);
  std::vector<int8_t> elem_sizes(n * 2);
  const at::TensorList lists[] = {params,           grads, masters, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes,
                                  exp_avg_sq_scales};
  for (size_t i = 0; i < n; ++i) {
    for (const at::TensorList& list : lists) prefetch_tensors_ahead<4>(list, i);
    const at::Tensor& p = params[i];
    check_list_tensor(op, "params", i, p, p, std::nullopt);
    TORCH_CHECK(is_kernel_float(p.scalar_type()), "fastamp::adamw_q8_: params[", i,
                "] must be float32, float16 or bfloat16, got ", p.scalar_type());
    check_list_tensor(op, "grads", i, grads[i], p, std::nullopt);
    TORCH_CHECK(is_kernel_float(grads[i].scalar_type()), "fastamp::adamw_q8_: grads[", i,
                "] must be float32, float16 or bfloat16, got ", grads[i].scalar_type());
    if (kind != kMasterNone) {
      check_list_tensor(op, "masters", i, masters[i], p, master_dtype);
      TORCH_CHECK(kind != kMasterRemainder || p.scalar_type() == at::kBFloat16,
                  "fastamp::adamw_q8_: int16 remainder masters need bfloat16 params, but params[", i, "] is ",
                  p.scalar_type());
      TORCH_CHECK(kind != kMasterUlp8 || p.scalar_type() == at::kBFloat16 || p.scalar_type() == at::kHalf,
                  "fastamp::adamw_q8_: int8 (ulp8) masters need bfloat16 or float16 params, but params[", i, "] is ",
                  p.scalar_type());
    }
    check_list_tensor(op, "exp_avg_codes", i, exp_avg_codes[i], p, at::kByte);
    check_list_tensor(op, "exp_avg_sq_codes", i, exp_avg_sq_codes[i], p, at::kByte);
    check_q8_scales(op, "exp_avg_scales", i, exp_avg_scales[i], p);
    check_q8_scales(op, "exp_avg_sq_scales", i, exp_avg_sq_scales[i], p);
    numels[i] = p.numel();
    // the param's random bits only where the reference draws them: ulp8 corrections, and bf16
    // params without a master
    const bool srp = sr_param && (kind == kMasterUlp8 || (kind == kMasterNone && p.scalar_type() == at::kBFloat16));
    fns[i] = pick_kernel(p.scalar_type(), grads[i].scalar_type(), isa, kind, srp, sr_codes);
    elem_sizes[2 * i] = static_cast<int8_t>(p.element_size());
    elem_sizes[2 * i + 1] = static_cast<int8_t>(grads[i].element_size());
    if (numels[i] == 0) continue;
    Q8Chunk& b = bases[i];
    b.param = p.data_ptr();
    b.grad = grads[i].const_data_ptr();
    b.master = kind != kMasterNone ? masters[i].data_ptr() : nullptr;
    b.m_codes = static_cast<uint8_t*>(exp_avg_codes[i].data_ptr());
    b.m_scales = static_cast<uint8_t*>(exp_avg_scales[i].data_ptr());
    b.v_codes = static_cast<uint8_t*>(exp_avg_sq_codes[i].data_ptr());
    b.v_scales = static_cast<uint8_t*>(exp_avg_sq_scales[i].data_ptr());
    b.index0 = 0;
    b.key[0] = srp ? stream_key(i, 0) : 0u;
    b.key[1] = sr_codes ? stream_key(i, 1) : 0u;
    b.key[2] = sr_codes ? stream_key(i, 2) : 0u;
  }
  if (skip_step(found_inf)) return;

  const int64_t master_size = kind == kMasterFp32 ? 4 : kind == kMasterRemainder ? 2 : 1;
  const std::vector<Chunk> chunks = split_into_chunks(numels);
  parallel_over_chunks_dynamic(chunks, [&](int64_t cb, int64_t ce) {
    const DefaultFloatMode float_mode;
    for (int64_t c = cb; c < ce; ++c) {
      const Chunk& ch = chunks[static_cast<size_t>(c)];
      const size_t t = static_cast<size_t>(ch.tensor);
      const Q8Chunk& b = bases[t];
      const int64_t o = ch.begin;  // a multiple of kChunkElems, so of 32
      Q8Chunk ptrs = b;
      ptrs.param = static_cast<char*>(b.param) + o * elem_sizes[2 * t];
      ptrs.grad = static_cast<const char*>(b.grad) + o * elem_sizes[2 * t + 1];
      ptrs.master = b.master ? static_cast<char*>(b.master) + o * master_size : nullptr;
      ptrs.m_codes = b.m_codes + o;
      ptrs.v_codes = b.v_codes + o;
      ptrs.m_scales = b.m_scales + o / kBlock;
      ptrs.v_scales = b.v_scales + o / kBlock;
      ptrs.index0 = static_cast<uint64_t>(o);
      Q8Args a = args;
      // the shared [4] (stride 0) or this tensor's row of [n, 4]: once per chunk
      const float* row = sc + static_cast<int64_t>(t) * scalar_stride;
      a.s = math::AdamWStepScalars{row[0], row[1], row[2], row[3]};
      fns[t](ptrs, ch.len, a);
    }
  });
}

}  // namespace
}  // namespace cpu
}  // namespace fastamp

TORCH_LIBRARY_IMPL(fastamp, CPU, m) { FASTAMP_IMPL(m, adamw_q8_, fastamp::cpu::adamw_q8_cpu); }
