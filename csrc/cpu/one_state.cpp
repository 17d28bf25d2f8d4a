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
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <optional>
#include <type_traits>
#include <vector>

#include "cpu/isa.h"
#include "cpu/multi_tensor.h"
#include "cpu/optim_checks.h"
#include "cpu/scalar_ops.h"
#include "fastamp_math.h"
#include "op_signatures.h"

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
  static constexpr const char* kState = "momentum_buffers";
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
  static constexpr const char* kState = "exp_avgs";
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
  void* master;     // float* (fp32 masters), int16_t* (remainders) or nullptr
  float* state;     // the rule's fp32 state stream; nullptr where the rule runs without it
  uint64_t index0;  // flat index of the chunk's first element in its tensor (RNG counter)
  uint32_t key;     // math::sr_stream_key of stream 4 * tensor_id
};

static_assert((uint64_t{1} << 32) % static_cast<uint64_t>(kChunkElems) == 0, "chunks must not cross 2^32");

namespace scalar {

template <class Rule, class P, class G, int KIND, bool STATE, bool RNG>
void one_state_range(const OneStateChunk& c, int64_t begin, int64_t end, const StepArgs<Rule>& a) {
  P* param = static_cast<P*>(c.param);
  const G* grad = static_cast<const G*>(c.grad);
  for (int64_t i = begin; i < end; ++i) {
    float p;
    if constexpr (KIND == kMasterFp32) {
      p = static_cast<float*>(c.master)[i];
    } else if constexpr (KIND == kMasterRemainder) {
      p = math::join_master(param[i].x, static_cast<int16_t*>(c.master)[i]);
    } else {
      p = load_float(param + i);
    }
    float st = STATE ? c.state[i] : 0.0f;
    Rule::element(&p, &st, load_float(grad + i), a.s, a.h);
    if constexpr (STATE) c.state[i] = st;
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
}

template <class Rule, class P, class G, int KIND, bool STATE, bool RNG>
void one_state_chunk(const OneStateChunk& c, int64_t n, const StepArgs<Rule>& a) {
  one_state_range<Rule, P, G, KIND, STATE, RNG>(c, 0, n, a);
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

template <class Rule, class P, class G, int KIND, bool RNG>
ChunkFn<Rule> pick_state(Isa isa, bool has_state) {
  if constexpr (Rule::kStateOptional) {
    if (!has_state) return pick_isa<Rule, P, G, KIND, false, RNG>(isa);
  }
  return pick_isa<Rule, P, G, KIND, true, RNG>(isa);
}

// Only the combinations the checks allow are instantiated: remainders and stochastic
// rounding exist for bf16 params only.
template <class Rule, class P, class G>
ChunkFn<Rule> pick_mode(Isa isa, int kind, bool has_state, bool rng) {
  if (kind == kMasterFp32) return pick_state<Rule, P, G, kMasterFp32, false>(isa, has_state);
  if constexpr (std::is_same_v<P, c10::BFloat16>) {
    if (kind == kMasterRemainder) return pick_state<Rule, P, G, kMasterRemainder, false>(isa, has_state);
    if (rng) return pick_state<Rule, P, G, kMasterNone, true>(isa, has_state);
  }
  return pick_state<Rule, P, G, kMasterNone, false>(isa, has_state);
}

template <class Rule, class P>
ChunkFn<Rule> pick_grad(at::ScalarType grad_dtype, Isa isa, int kind, bool has_state, bool rng) {
  switch (grad_dtype) {
    case at::kHalf:
      return pick_mode<Rule, P, c10::Half>(isa, kind, has_state, rng);
    case at::kBFloat16:
      return pick_mode<Rule, P, c10::BFloat16>(isa, kind, has_state, rng);
    default:
      return pick_mode<Rule, P, float>(isa, kind, has_state, rng);
  }
}

template <class Rule>
ChunkFn<Rule> pick_kernel(at::ScalarType param_dtype, at::ScalarType grad_dtype, Isa isa, int kind, bool has_state,
                          bool rng) {
  switch (param_dtype) {
    case at::kHalf:
      return pick_grad<Rule, c10::Half>(grad_dtype, isa, kind, has_state, rng);
    case at::kBFloat16:
      return pick_grad<Rule, c10::BFloat16>(grad_dtype, isa, kind, has_state, rng);
    default:
      return pick_grad<Rule, float>(grad_dtype, isa, kind, has_state, rng);
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

// Everything after the list counts: the checks of every tensor (before anything is written),
// the found_inf skip, and the chunked run. `states` is empty when has_state is false.
template <class Rule>
void one_state_step(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList states,
                    bool has_state, const at::Tensor& step_scalars, const std::optional<at::Tensor>& found_inf,
                    const std::optional<at::Tensor>& rng, int64_t rng_base, const typename Rule::Hyper& hyper) {
  constexpr const char* op = Rule::kOp;
  const size_t n = params.size();
  const int64_t scalar_stride = check_step_scalars(op, step_scalars, n, 3, Rule::kScalarLayout);
  check_found_inf(op, found_inf);
  check_rng(op, rng);
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
    if (has_state) check_list_tensor(op, Rule::kState, i, states[i], p, at::kFloat);
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
    const bool use_rng = rng.has_value() && kind == kMasterNone && p.scalar_type() == at::kBFloat16;
    fns[i] = pick_kernel<Rule>(p.scalar_type(), grads[i].scalar_type(), isa, kind, has_state, use_rng);
    elem_sizes[2 * i] = static_cast<int8_t>(p.element_size());
    elem_sizes[2 * i + 1] = static_cast<int8_t>(grads[i].element_size());
    if (numels[i] == 0) continue;
    bases[i] = OneStateChunk{p.data_ptr(),
                             grads[i].const_data_ptr(),
                             kind != kMasterNone ? masters[i].data_ptr() : nullptr,
                             has_state ? static_cast<float*>(states[i].data_ptr()) : nullptr,
                             0,
                             use_rng ? rng_key(*rng, rng_base, i, 0) : 0u};
  }
  const int64_t master_size = kind == kMasterFp32 ? 4 : 2;
  const std::vector<Chunk> chunks = split_into_chunks(numels);
  parallel_over_chunks(chunks, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      const Chunk& ch = chunks[static_cast<size_t>(c)];
      const size_t t = static_cast<size_t>(ch.tensor);
      const OneStateChunk& b = bases[t];
      const int64_t o = ch.begin;
      const OneStateChunk ptrs{static_cast<char*>(b.param) + o * elem_sizes[2 * t],
                               static_cast<const char*>(b.grad) + o * elem_sizes[2 * t + 1],
                               b.master ? static_cast<char*>(b.master) + o * master_size : nullptr,
                               b.state ? b.state + o : nullptr,
                               static_cast<uint64_t>(o),
                               b.key};
      StepArgs<Rule> a = args;
      // the shared [3] (stride 0) or this tensor's row of [n, 3]: once per chunk
      const float* row = sc + static_cast<int64_t>(t) * scalar_stride;
      a.s = typename Rule::Scalars{row[0], row[1], row[2]};
      fns[t](ptrs, ch.len, a);
    }
  });
}

// ---- the ops ----

void sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList momentum_buffers,
             const at::Tensor& step_scalars, const std::optional<at::Tensor>& found_inf,
             const std::optional<at::Tensor>& rng, int64_t rng_base, double momentum, double dampening,
             double weight_decay, bool nesterov, bool maximize) {
  const size_t n = params.size();
  const bool has_momentum = momentum != 0.0;
  check_list_counts(SgdRule::kOp, params, grads, masters);
  TORCH_CHECK(!has_momentum || momentum_buffers.size() == n, "fastamp::sgd_: momentum=", momentum,
              " needs one momentum_buffers tensor per param, got ", momentum_buffers.size(), " for ", n, " params");
  const math::SgdHyper h{static_cast<float>(momentum),
                         static_cast<float>(1.0 - dampening),
                         static_cast<float>(weight_decay),
                         has_momentum,
                         weight_decay != 0.0,
                         nesterov,
                         maximize};
  one_state_step<SgdRule>(params, grads, masters, has_momentum ? momentum_buffers : at::TensorList(), has_momentum,
                          step_scalars, found_inf, rng, rng_base, h);
}

void lion_cpu(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList exp_avgs,
              const at::Tensor& step_scalars, const std::optional<at::Tensor>& found_inf,
              const std::optional<at::Tensor>& rng, int64_t rng_base, double beta1, double beta2, bool maximize) {
  const size_t n = params.size();
  check_list_counts(LionRule::kOp, params, grads, masters);
  TORCH_CHECK(exp_avgs.size() == n, "fastamp::lion_: got ", n, " params but ", exp_avgs.size(), " exp_avgs");
  // 1 - beta in fp64, rounded once, as the reference's _f32(1.0 - beta)
  const math::LionHyper h{static_cast<float>(beta1), static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
                          static_cast<float>(1.0 - beta2), maximize};
  one_state_step<LionRule>(params, grads, masters, exp_avgs, true, step_scalars, found_inf, rng, rng_base, h);
}

}  // namespace
}  // namespace cpu
}  // namespace fastamp

TORCH_LIBRARY_IMPL(fastamp, CPU, m) {
  FASTAMP_IMPL(m, sgd_, fastamp::cpu::sgd_cpu);
  FASTAMP_IMPL(m, lion_, fastamp::cpu::lion_cpu);
}
