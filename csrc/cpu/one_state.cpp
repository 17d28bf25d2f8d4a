// CPU kernels of the one-state optimizer ops, fastamp::sgd_ and fastamp::lion_ (semantics:
// fastamp/reference/; per-element maths: math::sgd_element, math::lion_element in
// csrc/fastamp_math.h).
//
// Both ops are one update rule over the same storage: the value optimised is an fp32 master
// (params of any float dtype), the exact master rebuilt from a bf16 param and an int16
// remainder (math::join_master / split_master), or the param itself (bf16 rounded
// stochastically when an rng tensor is given, with the counter hash in integer vector lanes),
// plus one fp32 state stream (SGD's momentum buffer, optional; Lion's exp_avg). So everything
// but the rule is written once here, for every rule: the checks, the chunking over all
// tensors of the call (csrc/cpu/multi_tensor.h), the master load/store, the RNG, the ISA
// dispatch and the found_inf skip. A rule is a struct below (its scalar element function,
// its step scalars and hyperparameters) plus its vector step in one_state_kernels.inc.
// Bit-exact with the reference for every instruction set (AVX-512, AVX2, scalar). A non-zero
// (or NaN) found_inf writes nothing. step_scalars is [3] (shared) or [n, 3] (row i for
// tensor i, picked per chunk).
//
// The q8 ops (fastamp::sgd_q8_, fastamp::lion_q8_; semantics: fastamp.reference.sgd_q8_ /
// lion_q8_) are the same rules with the state stored as 8-bit block-scaled codes (the m code of
// csrc/q8_math.h, one scale byte per block of 32 elements): per block, the state is decoded
// exactly, the rule's step runs on it, and it is encoded again over the block's new scale byte,
// in the same pass (no fp32 copy of the state in memory).
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
#include "op_signatures.h"
#include "q8_math.h"

namespace fastamp {
namespace cpu {
namespace {

constexpr int kMasterNone = 0;       // params updated directly
constexpr int kMasterFp32 = 1;       // fp32 master weights
constexpr int kMasterRemainder = 2;  // int16 remainders of bf16 params

// ---- the rules: what differs between the ops ----

// SGD with momentum, dampening, Nesterov, weight decay, maximize; the momentum buffer is the
// state, absent without momentum. step_scalars [lr, grad_mul, is_first]: is_first != 0 marks
// the first applied step (the buffer takes the gradient).
struct SgdRule {
  using Scalars = math::SgdStepScalars;
  using Hyper = math::SgdHyper;
  static constexpr const char* kOp = "sgd_";
  static constexpr const char* kQ8Op = "sgd_q8_";
  static constexpr const char* kState = "momentum_buffers";
  static constexpr const char* kCodes = "momentum_buffer_codes";
  static constexpr const char* kScales = "momentum_buffer_scales";
  static constexpr const char* kScalarLayout = "[lr, grad_mul, is_first]";
  static constexpr bool kStateOptional = true;
  static void element(float* p, float* state, float g, const Scalars& s, const Hyper& h) {
    math::sgd_element(p, state, g, s, h);
  }
};

// Lion; the exp_avg is the state, always present. step_scalars [lr, decay, grad_mul].
struct LionRule {
  using Scalars = math::LionStepScalars;
  using Hyper = math::LionHyper;
  static constexpr const char* kOp = "lion_";
  static constexpr const char* kQ8Op = "lion_q8_";
  static constexpr const char* kState = "exp_avgs";
  static constexpr const char* kCodes = "exp_avg_codes";
  static constexpr const char* kScales = "exp_avg_scales";
  static constexpr const char* kScalarLayout = "[lr, decay, grad_mul]";
  static constexpr bool kStateOptional = false;
  static void element(float* p, float* state, float g, const Scalars& s, const Hyper& h) {
    math::lion_element(p, state, g, s, h);
  }
};

static_assert(sizeof(SgdRule::Scalars) == 3 * sizeof(float) && sizeof(LionRule::Scalars) == 3 * sizeof(float),
              "a rule's Scalars are the 3 floats of a step_scalars row, in order");

// ---- shared by every rule ----

template <class Rule>
struct StepArgs {
  typename Rule::Scalars s;
  typename Rule::Hyper h;
};

// Pointers of one chunk, already offset to its first element.
struct OneStateChunk {
  void* param;
  const void* grad;
  void* master;    // float* (fp32 masters), int16_t* (remainders) or nullptr
  float* state;    // the rule's fp32 state stream; nullptr where the rule runs without it or holds it as q8
  uint8_t* codes;  // the q8 ops: the state's codes (uint8 per element) and scale bytes (one per block)
  uint8_t* scales;
  uint64_t index0;    // flat index of the chunk's first element in its tensor (RNG counter)
  uint32_t key;       // math::sr_stream_key of stream 4 * tensor_id (the param)
  uint32_t code_key;  // the q8 ops: of stream 4 * tensor_id + 1 (the codes)
};

static_assert((uint64_t{1} << 32) % static_cast<uint64_t>(kChunkElems) == 0, "chunks must not cross 2^32");
static_assert(kChunkElems % math::kQ8Block == 0, "chunks must hold whole q8 blocks");
static_assert((1 << 16) % kChunkElems == 0 && kChunkElems % (1 << 14) == 0,
              "the q8 kernels' vector RNG needs chunks of 2^14..2^16 elements (vq8_random16)");

namespace scalar {

// The value optimised at element i (see one_state_kernels.inc load_value / store_value).
template <class P, int KIND>
inline float load_value(const OneStateChunk& c, const P* param, int64_t i) {
  if constexpr (KIND == kMasterFp32) {
    return static_cast<float*>(c.master)[i];
  } else if constexpr (KIND == kMasterRemainder) {
    return math::join_master(param[i].x, static_cast<int16_t*>(c.master)[i]);
  } else {
    return load_float(param + i);
  }
}

template <class P, int KIND, bool RNG>
inline void store_value(const OneStateChunk& c, P* param, int64_t i, float p) {
  if constexpr (KIND == kMasterFp32) {
    static_cast<float*>(c.master)[i] = p;
    store_float(param + i, p);
  } else if constexpr (KIND == kMasterRemainder) {
    math::split_master(p, &param[i].x, &static_cast<int16_t*>(c.master)[i]);
  } else if constexpr (RNG) {
    param[i].x = math::float_to_bf16_bits_sr(p, math::sr_random16(c.key, c.index0 + static_cast<uint64_t>(i)));
  } else {
    store_float(param + i, p);
  }
}

template <class Rule, class P, class G, int KIND, bool STATE, bool RNG>
void one_state_range(const OneStateChunk& c, int64_t begin, int64_t end, const StepArgs<Rule>& a) {
  P* param = static_cast<P*>(c.param);
  const G* grad = static_cast<const G*>(c.grad);
  for (int64_t i = begin; i < end; ++i) {
    float p = load_value<P, KIND>(c, param, i);
    float st = STATE ? c.state[i] : 0.0f;
    Rule::element(&p, &st, load_float(grad + i), a.s, a.h);
    if constexpr (STATE) c.state[i] = st;
    store_value<P, KIND, RNG>(c, param, i, p);
  }
}

template <class Rule, class P, class G, int KIND, bool STATE, bool RNG>
void one_state_chunk(const OneStateChunk& c, int64_t n, const StepArgs<Rule>& a) {
  one_state_range<Rule, P, G, KIND, STATE, RNG>(c, 0, n, a);
}

// Blocks of one chunk from element `begin` (a multiple of 32) to `n` (the last block may be
// partial), the state held as q8 codes: decoded (math::q8_decode_m), stepped, encoded over the
// block's new scale byte (math::q8_encode_m). SRP / SRC as in one_state_q8_chunk.
template <class Rule, class P, class G, int KIND, bool SRP, bool SRC>
void one_state_q8_range(const OneStateChunk& c, int64_t begin, int64_t n, const StepArgs<Rule>& a) {
  constexpr int64_t kBlock = math::kQ8Block;
  P* param = static_cast<P*>(c.param);
  const G* grad = static_cast<const G*>(c.grad);
  for (int64_t b0 = begin; b0 < n; b0 += kBlock) {
    const int64_t len = std::min(kBlock, n - b0);
    const int64_t blk = b0 / kBlock;
    const uint32_t s = c.scales[blk];
    float mnew[kBlock];
    uint32_t mmax = 0;
    for (int64_t j = 0; j < len; ++j) {
      const int64_t i = b0 + j;
      float p = load_value<P, KIND>(c, param, i);
      float st = math::q8_decode_m(c.codes[i], s);
      Rule::element(&p, &st, load_float(grad + i), a.s, a.h);
      store_value<P, KIND, SRP>(c, param, i, p);
      mnew[j] = st;
      mmax = std::max(mmax, math::float_bits(st) & 0x7fffffffu);
    }
    const uint32_t s_new = math::q8_scale_byte(mmax, math::kQ8MScaleMin);
    c.scales[blk] = static_cast<uint8_t>(s_new);
    for (int64_t j = 0; j < len; ++j) {
      const int64_t i = b0 + j;
      const uint32_t r = SRC ? math::sr_random16(c.code_key, c.index0 + static_cast<uint64_t>(i)) : 0u;
      c.codes[i] = static_cast<uint8_t>(math::q8_encode_m<SRC>(mnew[j], s_new, r));
    }
  }
}

template <class Rule, class P, class G, int KIND, bool SRP, bool SRC>
void one_state_q8_chunk(const OneStateChunk& c, int64_t n, const StepArgs<Rule>& a) {
  one_state_q8_range<Rule, P, G, KIND, SRP, SRC>(c, 0, n, a);
}

}  // namespace scalar

#define FASTAMP_ISA_KERNELS "cpu/one_state_kernels.inc"
#include "cpu/per_isa.inc"  // namespaces avx512 and avx2: the loops of one_state_kernels.inc per ISA

template <class Rule>
using ChunkFn = void (*)(const OneStateChunk&, int64_t, const StepArgs<Rule>&);

template <class Rule, class P, class G, int KIND, bool STATE, bool RNG>
ChunkFn<Rule> pick_isa(Isa isa) {
#if FASTAMP_X86_SIMD
  if (isa == Isa::Avx512) return &avx512::one_state_chunk<Rule, P, G, KIND, STATE, RNG>;
  if (isa == Isa::Avx2) return &avx2::one_state_chunk<Rule, P, G, KIND, STATE, RNG>;
#endif
  (void)isa;
  return &scalar::one_state_chunk<Rule, P, G, KIND, STATE, RNG>;
}

template <class Rule, class P, class G, int KIND, bool SRP, bool SRC>
ChunkFn<Rule> pick_isa_q8(Isa isa) {
#if FASTAMP_X86_SIMD
  if (isa == Isa::Avx512) return &avx512::one_state_q8_chunk<Rule, P, G, KIND, SRP, SRC>;
  if (isa == Isa::Avx2) return &avx2::one_state_q8_chunk<Rule, P, G, KIND, SRP, SRC>;
#endif
  (void)isa;
  return &scalar::one_state_q8_chunk<Rule, P, G, KIND, SRP, SRC>;
}

// How the rule's state is held: absent (SGD without momentum), fp32, or q8 codes rounded to
// nearest even or stochastically.
enum class StateMode { kNone, kDense, kQ8, kQ8Stochastic };

template <class Rule, class P, class G, int KIND, bool RNG>
ChunkFn<Rule> pick_state(Isa isa, StateMode mode) {
  if (mode == StateMode::kQ8) return pick_isa_q8<Rule, P, G, KIND, RNG, false>(isa);
  if (mode == StateMode::kQ8Stochastic) return pick_isa_q8<Rule, P, G, KIND, RNG, true>(isa);
  if constexpr (Rule::kStateOptional) {
    if (mode == StateMode::kNone) return pick_isa<Rule, P, G, KIND, false, RNG>(isa);
  }
  return pick_isa<Rule, P, G, KIND, true, RNG>(isa);
}

// Only the combinations the checks allow are instantiated: remainders and stochastic
// rounding exist for bf16 params only.
template <class Rule, class P, class G>
ChunkFn<Rule> pick_mode(Isa isa, int kind, StateMode mode, bool rng) {
  if (kind == kMasterFp32) return pick_state<Rule, P, G, kMasterFp32, false>(isa, mode);
  if constexpr (std::is_same_v<P, c10::BFloat16>) {
    if (kind == kMasterRemainder) return pick_state<Rule, P, G, kMasterRemainder, false>(isa, mode);
    if (rng) return pick_state<Rule, P, G, kMasterNone, true>(isa, mode);
  }
  return pick_state<Rule, P, G, kMasterNone, false>(isa, mode);
}

template <class Rule, class P>
ChunkFn<Rule> pick_grad(at::ScalarType grad_dtype, Isa isa, int kind, StateMode mode, bool rng) {
  switch (grad_dtype) {
    case at::kHalf:
      return pick_mode<Rule, P, c10::Half>(isa, kind, mode, rng);
    case at::kBFloat16:
      return pick_mode<Rule, P, c10::BFloat16>(isa, kind, mode, rng);
    default:
      return pick_mode<Rule, P, float>(isa, kind, mode, rng);
  }
}

template <class Rule>
ChunkFn<Rule> pick_kernel(at::ScalarType param_dtype, at::ScalarType grad_dtype, Isa isa, int kind, StateMode mode,
                          bool rng) {
  switch (param_dtype) {
    case at::kHalf:
      return pick_grad<Rule, c10::Half>(grad_dtype, isa, kind, mode, rng);
    case at::kBFloat16:
      return pick_grad<Rule, c10::BFloat16>(grad_dtype, isa, kind, mode, rng);
    default:
      return pick_grad<Rule, float>(grad_dtype, isa, kind, mode, rng);
  }
}

// The list-length checks that come before the rule's own check of its state list.
void check_list_counts(const char* op, at::TensorList params, at::TensorList grads, at::TensorList masters) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n, "fastamp::", op, ": got ", n, " params but ", grads.size(), " grads");
  TORCH_CHECK(masters.empty() || masters.size() == n, "fastamp::", op,
              ": masters must be empty or have one tensor per param, got ", masters.size(), " masters for ", n,
              " params");
}

// How an op holds the rule's state: `states` (fp32, one per param; empty without a state), or
// for a q8 op `codes` and `scales` (one scale byte per block of 32), rounded stochastically
// when sr_codes; `sr_param`: a bf16 param without a master rounded stochastically.
struct StateLists {
  at::TensorList states;
  at::TensorList codes;
  at::TensorList scales;
  bool has_state;
  bool q8;
  bool sr_param;
  bool sr_codes;
};

// Everything after the list counts: the checks of every tensor (before anything is written),
// the found_inf skip, and the chunked run.
template <class Rule>
void one_state_step(at::TensorList params, at::TensorList grads, at::TensorList masters, const StateLists& sl,
                    const at::Tensor& step_scalars, const std::optional<at::Tensor>& found_inf,
                    const std::optional<at::Tensor>& rng, int64_t rng_base, const typename Rule::Hyper& hyper) {
  const char* const op = sl.q8 ? Rule::kQ8Op : Rule::kOp;
  const size_t n = params.size();
  const int64_t scalar_stride = check_step_scalars(op, step_scalars, n, 3, Rule::kScalarLayout);
  check_found_inf(op, found_inf);
  check_rng(op, rng);
  TORCH_CHECK(rng.has_value() || !(sl.sr_param || sl.sr_codes), "fastamp::", op,
              ": sr_codes / sr_param need rng ([seed, counter], int64), got None");
  if (n == 0) return;
  int kind = kMasterNone;
  at::ScalarType master_dtype = at::kFloat;
  if (!masters.empty()) {
    TORCH_CHECK(masters[0].defined(), "fastamp::", op, ": masters[0] is undefined");
    master_dtype = masters[0].scalar_type();
    TORCH_CHECK(master_dtype == at::kFloat || master_dtype == at::kShort, "fastamp::", op,
                ": masters must be float32 (fp32 master weights) or int16 (remainders of bfloat16 params), got ",
                master_dtype);
    kind = master_dtype == at::kFloat ? kMasterFp32 : kMasterRemainder;
  }
  const StateMode mode = !sl.has_state ? StateMode::kNone
                         : !sl.q8      ? StateMode::kDense
                         : sl.sr_codes ? StateMode::kQ8Stochastic
                                       : StateMode::kQ8;
  std::vector<int64_t> numels(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    check_list_tensor(op, "params", i, p, p, std::nullopt);
    TORCH_CHECK(is_kernel_float(p.scalar_type()), "fastamp::", op, ": params[", i,
                "] must be float32, float16 or bfloat16, got ", p.scalar_type());
    check_list_tensor(op, "grads", i, grads[i], p, std::nullopt);
    TORCH_CHECK(is_kernel_float(grads[i].scalar_type()), "fastamp::", op, ": grads[", i,
                "] must be float32, float16 or bfloat16, got ", grads[i].scalar_type());
    if (kind != kMasterNone) {
      check_list_tensor(op, "masters", i, masters[i], p, master_dtype);
      TORCH_CHECK(kind != kMasterRemainder || p.scalar_type() == at::kBFloat16, "fastamp::", op,
                  ": int16 remainder masters need bfloat16 params, but params[", i, "] is ", p.scalar_type());
    }
    if (sl.q8) {
      check_list_tensor(op, Rule::kCodes, i, sl.codes[i], p, at::kByte);
      check_q8_scales(op, Rule::kScales, i, sl.scales[i], p);
    } else if (sl.has_state) {
      check_list_tensor(op, Rule::kState, i, sl.states[i], p, at::kFloat);
    }
    numels[i] = p.numel();
  }
  if (skip_step(found_inf)) return;

  const float* sc = step_scalars.data_ptr<float>();
  StepArgs<Rule> args;
  args.h = hyper;

  const Isa isa = active_isa();
  std::vector<OneStateChunk> bases(n);
  std::vector<ChunkFn<Rule>> fns(n);
  std::vector<int8_t> elem_sizes(n * 2);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    // random bits only where the reference draws them: bf16 params without a master
    const bool use_rng = sl.sr_param && kind == kMasterNone && p.scalar_type() == at::kBFloat16;
    fns[i] = pick_kernel<Rule>(p.scalar_type(), grads[i].scalar_type(), isa, kind, mode, use_rng);
    elem_sizes[2 * i] = static_cast<int8_t>(p.element_size());
    elem_sizes[2 * i + 1] = static_cast<int8_t>(grads[i].element_size());
    if (numels[i] == 0) continue;
    OneStateChunk& b = bases[i];
    b.param = p.data_ptr();
    b.grad = grads[i].const_data_ptr();
    b.master = kind != kMasterNone ? masters[i].data_ptr() : nullptr;
    b.state = sl.has_state && !sl.q8 ? static_cast<float*>(sl.states[i].data_ptr()) : nullptr;
    b.codes = sl.q8 ? static_cast<uint8_t*>(sl.codes[i].data_ptr()) : nullptr;
    b.scales = sl.q8 ? static_cast<uint8_t*>(sl.scales[i].data_ptr()) : nullptr;
    b.index0 = 0;
    b.key = use_rng ? rng_key(*rng, rng_base, i, 0) : 0u;
    b.code_key = sl.sr_codes ? rng_key(*rng, rng_base, i, 1) : 0u;
  }
  const int64_t master_size = kind == kMasterFp32 ? 4 : 2;
  const std::vector<Chunk> chunks = split_into_chunks(numels);
  parallel_over_chunks(chunks, [&](int64_t cb, int64_t ce) {
    std::optional<DefaultFloatMode> float_mode;  // the q8 codec's (cpu/q8_host.h)
    if (sl.q8) float_mode.emplace();
    for (int64_t c = cb; c < ce; ++c) {
      const Chunk& ch = chunks[static_cast<size_t>(c)];
      const size_t t = static_cast<size_t>(ch.tensor);
      const OneStateChunk& b = bases[t];
      const int64_t o = ch.begin;  // a multiple of kChunkElems, so of 32
      OneStateChunk ptrs = b;
      ptrs.param = static_cast<char*>(b.param) + o * elem_sizes[2 * t];
      ptrs.grad = static_cast<const char*>(b.grad) + o * elem_sizes[2 * t + 1];
      ptrs.master = b.master ? static_cast<char*>(b.master) + o * master_size : nullptr;
      ptrs.state = b.state ? b.state + o : nullptr;
      ptrs.codes = b.codes ? b.codes + o : nullptr;
      ptrs.scales = b.scales ? b.scales + o / math::kQ8Block : nullptr;
      ptrs.index0 = static_cast<uint64_t>(o);
      StepArgs<Rule> a = args;
      // the shared [3] (stride 0) or this tensor's row of [n, 3]: once per chunk
      const float* row = sc + static_cast<int64_t>(t) * scalar_stride;
      a.s = typename Rule::Scalars{row[0], row[1], row[2]};
      fns[t](ptrs, ch.len, a);
    }
  });
}

// ---- the ops ----

math::SgdHyper sgd_hyper(double momentum, double dampening, double weight_decay, bool nesterov, bool maximize) {
  return math::SgdHyper{static_cast<float>(momentum),
                        static_cast<float>(1.0 - dampening),
                        static_cast<float>(weight_decay),
                        momentum != 0.0,
                        weight_decay != 0.0,
                        nesterov,
                        maximize};
}

// 1 - beta in fp64, rounded once, as the reference's _f32(1.0 - beta)
math::LionHyper lion_hyper(double beta1, double beta2, bool maximize) {
  return math::LionHyper{static_cast<float>(beta1), static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
                         static_cast<float>(1.0 - beta2), maximize};
}

// The q8 ops' state lists: one codes and one scales tensor per param.
StateLists q8_lists(const char* op, size_t n, at::TensorList codes, const char* codes_name, at::TensorList scales,
                    const char* scales_name, bool sr_param, bool sr_codes) {
  TORCH_CHECK(codes.size() == n, "fastamp::", op, ": got ", n, " params but ", codes.size(), " ", codes_name);
  TORCH_CHECK(scales.size() == n, "fastamp::", op, ": got ", n, " params but ", scales.size(), " ", scales_name);
  return StateLists{at::TensorList(), codes, scales, true, true, sr_param, sr_codes};
}

void sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList momentum_buffers,
             const at::Tensor& step_scalars, const std::optional<at::Tensor>& found_inf,
             const std::optional<at::Tensor>& rng, int64_t rng_base, double momentum, double dampening,
             double weight_decay, bool nesterov, bool maximize) {
  const size_t n = params.size();
  const bool has_momentum = momentum != 0.0;
  check_list_counts(SgdRule::kOp, params, grads, masters);
  TORCH_CHECK(!has_momentum || momentum_buffers.size() == n, "fastamp::sgd_: momentum=", momentum,
              " needs one momentum_buffers tensor per param, got ", momentum_buffers.size(), " for ", n, " params");
  const StateLists sl{
      has_momentum ? momentum_buffers : at::TensorList(), {}, {}, has_momentum, false, rng.has_value(), false};
  one_state_step<SgdRule>(params, grads, masters, sl, step_scalars, found_inf, rng, rng_base,
                          sgd_hyper(momentum, dampening, weight_decay, nesterov, maximize));
}

void sgd_q8_cpu(at::TensorList params, at::TensorList grads, at::TensorList masters,
                at::TensorList momentum_buffer_codes, at::TensorList momentum_buffer_scales,
                const at::Tensor& step_scalars, const std::optional<at::Tensor>& found_inf,
                const std::optional<at::Tensor>& rng, int64_t rng_base, double momentum, double dampening,
                double weight_decay, bool nesterov, bool maximize, bool sr_param, bool sr_codes) {
  constexpr const char* op = SgdRule::kQ8Op;
  check_list_counts(op, params, grads, masters);
  TORCH_CHECK(momentum != 0.0, "fastamp::sgd_q8_: momentum must be non-zero (the q8 codes hold the momentum buffer)");
  const StateLists sl = q8_lists(op, params.size(), momentum_buffer_codes, SgdRule::kCodes, momentum_buffer_scales,
                                 SgdRule::kScales, sr_param, sr_codes);
  one_state_step<SgdRule>(params, grads, masters, sl, step_scalars, found_inf, rng, rng_base,
                          sgd_hyper(momentum, dampening, weight_decay, nesterov, maximize));
}

void lion_cpu(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList exp_avgs,
              const at::Tensor& step_scalars, const std::optional<at::Tensor>& found_inf,
              const std::optional<at::Tensor>& rng, int64_t rng_base, double beta1, double beta2, bool maximize) {
  const size_t n = params.size();
  check_list_counts(LionRule::kOp, params, grads, masters);
  TORCH_CHECK(exp_avgs.size() == n, "fastamp::lion_: got ", n, " params but ", exp_avgs.size(), " exp_avgs");
  const StateLists sl{exp_avgs, {}, {}, true, false, rng.has_value(), false};
  one_state_step<LionRule>(params, grads, masters, sl, step_scalars, found_inf, rng, rng_base,
                           lion_hyper(beta1, beta2, maximize));
}

void lion_q8_cpu(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList exp_avg_codes,
                 at::TensorList exp_avg_scales, const at::Tensor& step_scalars,
                 const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& rng, int64_t rng_base,
                 double beta1, double beta2, bool maximize, bool sr_param, bool sr_codes) {
  constexpr const char* op = LionRule::kQ8Op;
  check_list_counts(op, params, grads, masters);
  const StateLists sl = q8_lists(op, params.size(), exp_avg_codes, LionRule::kCodes, exp_avg_scales, LionRule::kScales,
                                 sr_param, sr_codes);
  one_state_step<LionRule>(params, grads, masters, sl, step_scalars, found_inf, rng, rng_base,
                           lion_hyper(beta1, beta2, maximize));
}

}  // namespace
}  // namespace cpu
}  // namespace fastamp

TORCH_LIBRARY_IMPL(fastamp, CPU, m) {
  FASTAMP_IMPL(m, sgd_, fastamp::cpu::sgd_cpu);
  FASTAMP_IMPL(m, lion_, fastamp::cpu::lion_cpu);
  FASTAMP_IMPL(m, sgd_q8_, fastamp::cpu::sgd_q8_cpu);
  FASTAMP_IMPL(m, lion_q8_, fastamp::cpu::lion_q8_cpu);
}
