// CPU kernel of fastamp::adamw_ (semantics: fastamp/reference.py; per-element maths:
// math::adamw_element in csrc/fastamp_math.h).
//
// One pass over all tensors of the call, cut into fixed-size chunks spread over threads
// (csrc/cpu/multi_tensor.h): reads grad, master (or param), m, v (and max v) and writes
// them plus the param rounded to its dtype. Bit-exact with the reference for every
// instruction set (AVX-512, AVX2, scalar). A non-zero (or NaN) found_inf writes nothing.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "cpu/isa.h"
#include "cpu/multi_tensor.h"
#include "cpu/scalar_ops.h"
#include "fastamp_math.h"

namespace fastamp {
namespace cpu {
namespace {

struct AdamWArgs {
  math::AdamWStepScalars s;
  math::AdamWHyper h;
  bool maximize;
};

// Pointers of one chunk, already offset to its first element.
struct AdamWChunk {
  void* param;
  const void* grad;
  float* master;          // nullptr without master weights
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // nullptr without amsgrad
};

namespace scalar {

template <class P, class G, bool MASTER, bool AMSGRAD>
void adamw_range(const AdamWChunk& c, int64_t begin, int64_t end, const AdamWArgs& a) {
  P* param = static_cast<P*>(c.param);
  const G* grad = static_cast<const G*>(c.grad);
  for (int64_t i = begin; i < end; ++i) {
    float p = MASTER ? c.master[i] : load_float(param + i);
    float vmax = AMSGRAD ? c.max_exp_avg_sq[i] : 0.0f;
    math::adamw_element(&p, c.exp_avg + i, c.exp_avg_sq + i, &vmax, load_float(grad + i), a.s, a.h, AMSGRAD,
                        a.maximize);
    if constexpr (AMSGRAD) c.max_exp_avg_sq[i] = vmax;
    if constexpr (MASTER) c.master[i] = p;
    store_float(param + i, p);
  }
}

template <class P, class G, bool MASTER, bool AMSGRAD>
void adamw_chunk(const AdamWChunk& c, int64_t n, const AdamWArgs& a) {
  adamw_range<P, G, MASTER, AMSGRAD>(c, 0, n, a);
}

}  // namespace scalar

#if FASTAMP_X86_SIMD
FASTAMP_ISA_BEGIN_AVX512
namespace avx512 {
#define FASTAMP_VEC_AVX512
#include "cpu/vec_isa.inc"
#undef FASTAMP_VEC_AVX512
#include "cpu/adamw_kernels.inc"
}  // namespace avx512
FASTAMP_ISA_END

FASTAMP_ISA_BEGIN_AVX2
namespace avx2 {
#define FASTAMP_VEC_AVX2
#include "cpu/vec_isa.inc"
#undef FASTAMP_VEC_AVX2
#include "cpu/adamw_kernels.inc"
}  // namespace avx2
FASTAMP_ISA_END
#endif

using AdamWChunkFn = void (*)(const AdamWChunk&, int64_t, const AdamWArgs&);

template <class P, class G, bool MASTER, bool AMSGRAD>
AdamWChunkFn pick_isa(Isa isa) {
#if FASTAMP_X86_SIMD
  if (isa == Isa::Avx512) return &avx512::adamw_chunk<P, G, MASTER, AMSGRAD>;
  if (isa == Isa::Avx2) return &avx2::adamw_chunk<P, G, MASTER, AMSGRAD>;
#endif
  (void)isa;
  return &scalar::adamw_chunk<P, G, MASTER, AMSGRAD>;
}

template <class P, class G>
AdamWChunkFn pick_flags(Isa isa, bool master, bool amsgrad) {
  if (master) return amsgrad ? pick_isa<P, G, true, true>(isa) : pick_isa<P, G, true, false>(isa);
  return amsgrad ? pick_isa<P, G, false, true>(isa) : pick_isa<P, G, false, false>(isa);
}

template <class P>
AdamWChunkFn pick_grad(at::ScalarType grad_dtype, Isa isa, bool master, bool amsgrad) {
  switch (grad_dtype) {
    case at::kHalf:
      return pick_flags<P, c10::Half>(isa, master, amsgrad);
    case at::kBFloat16:
      return pick_flags<P, c10::BFloat16>(isa, master, amsgrad);
    default:
      return pick_flags<P, float>(isa, master, amsgrad);
  }
}

AdamWChunkFn pick_kernel(at::ScalarType param_dtype, at::ScalarType grad_dtype, Isa isa, bool master, bool amsgrad) {
  switch (param_dtype) {
    case at::kHalf:
      return pick_grad<c10::Half>(grad_dtype, isa, master, amsgrad);
    case at::kBFloat16:
      return pick_grad<c10::BFloat16>(grad_dtype, isa, master, amsgrad);
    default:
      return pick_grad<float>(grad_dtype, isa, master, amsgrad);
  }
}

bool is_kernel_float(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

void check_list_tensor(const char* list, size_t i, const at::Tensor& t, const at::Tensor& param,
                       std::optional<at::ScalarType> dtype) {
  TORCH_CHECK(t.defined(), "fastamp::adamw_: ", list, "[", i, "] is undefined");
  TORCH_CHECK(t.device().is_cpu(), "fastamp::adamw_: ", list, "[", i, "] must be a CPU tensor, got device ",
              t.device());
  TORCH_CHECK(t.layout() == at::kStrided, "fastamp::adamw_: ", list, "[", i,
              "] must be a dense (strided) tensor, got layout ", t.layout());
  if (dtype) {
    TORCH_CHECK(t.scalar_type() == *dtype, "fastamp::adamw_: ", list, "[", i, "] must have dtype ", *dtype, ", got ",
                t.scalar_type());
  }
  TORCH_CHECK(t.is_contiguous(), "fastamp::adamw_: ", list, "[", i, "] must be contiguous, got strides ", t.strides());
  TORCH_CHECK(t.numel() == param.numel(), "fastamp::adamw_: ", list, "[", i, "] has ", t.numel(),
              " elements but params[", i, "] has ", param.numel());
}

void adamw_cpu(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList exp_avgs,
               at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, const at::Tensor& step_scalars,
               const std::optional<at::Tensor>& found_inf, double beta1, double beta2, double eps, bool amsgrad,
               bool maximize) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n, "fastamp::adamw_: got ", n, " params but ", grads.size(), " grads");
  TORCH_CHECK(exp_avgs.size() == n, "fastamp::adamw_: got ", n, " params but ", exp_avgs.size(), " exp_avgs");
  TORCH_CHECK(exp_avg_sqs.size() == n, "fastamp::adamw_: got ", n, " params but ", exp_avg_sqs.size(),
              " exp_avg_sqs");
  TORCH_CHECK(masters.empty() || masters.size() == n, "fastamp::adamw_: masters must be empty or have one tensor per "
              "param, got ", masters.size(), " masters for ", n, " params");
  TORCH_CHECK(!amsgrad || max_exp_avg_sqs.size() == n, "fastamp::adamw_: amsgrad needs one max_exp_avg_sqs tensor per "
              "param, got ", max_exp_avg_sqs.size(), " for ", n, " params");
  TORCH_CHECK(step_scalars.device().is_cpu(), "fastamp::adamw_: step_scalars must be a CPU tensor, got device ",
              step_scalars.device());
  TORCH_CHECK(step_scalars.scalar_type() == at::kFloat && step_scalars.numel() == 4 && step_scalars.is_contiguous(),
              "fastamp::adamw_: step_scalars must be a contiguous float32 tensor of 4 elements "
              "[step_size, bc2_sqrt, decay, grad_mul], got dtype ", step_scalars.scalar_type(), " and shape ",
              step_scalars.sizes());
  if (found_inf) {
    TORCH_CHECK(found_inf->device().is_cpu(), "fastamp::adamw_: found_inf must be a CPU tensor, got device ",
                found_inf->device());
    TORCH_CHECK(found_inf->scalar_type() == at::kFloat && found_inf->numel() == 1,
                "fastamp::adamw_: found_inf must be a 1-element float32 tensor, got dtype ", found_inf->scalar_type(),
                " and shape ", found_inf->sizes());
  }
  if (n == 0) return;
  const at::ScalarType param_dtype = params[0].scalar_type();
  const at::ScalarType grad_dtype = grads[0].scalar_type();
  TORCH_CHECK(is_kernel_float(param_dtype), "fastamp::adamw_: params must be float32, float16 or bfloat16, got ",
              param_dtype);
  TORCH_CHECK(is_kernel_float(grad_dtype), "fastamp::adamw_: grads must be float32, float16 or bfloat16, got ",
              grad_dtype);
  const bool use_master = !masters.empty();
  std::vector<int64_t> numels(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    check_list_tensor("params", i, p, p, param_dtype);
    check_list_tensor("grads", i, grads[i], p, grad_dtype);
    check_list_tensor("exp_avgs", i, exp_avgs[i], p, at::kFloat);
    check_list_tensor("exp_avg_sqs", i, exp_avg_sqs[i], p, at::kFloat);
    if (use_master) check_list_tensor("masters", i, masters[i], p, at::kFloat);
    if (amsgrad) check_list_tensor("max_exp_avg_sqs", i, max_exp_avg_sqs[i], p, at::kFloat);
    numels[i] = p.numel();
  }

  if (found_inf) {
    // CPU tensor: reading it is no device sync. Non-zero or NaN skips the whole step.
    if (*found_inf->data_ptr<float>() != 0.0f) return;
  }
  const float* sc = step_scalars.data_ptr<float>();
  AdamWArgs args;
  args.s = math::AdamWStepScalars{sc[0], sc[1], sc[2], sc[3]};
  args.h = math::AdamWHyper{static_cast<float>(beta1), static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
                            static_cast<float>(1.0 - beta2), static_cast<float>(eps)};
  args.maximize = maximize;

  const AdamWChunkFn fn = pick_kernel(param_dtype, grad_dtype, active_isa(), use_master, amsgrad);
  const size_t param_size = params[0].element_size();
  const size_t grad_size = grads[0].element_size();
  std::vector<AdamWChunk> bases(n);
  for (size_t i = 0; i < n; ++i) {
    if (numels[i] == 0) continue;
    bases[i] = AdamWChunk{params[i].data_ptr(),
                          grads[i].data_ptr(),
                          use_master ? masters[i].data_ptr<float>() : nullptr,
                          exp_avgs[i].data_ptr<float>(),
                          exp_avg_sqs[i].data_ptr<float>(),
                          amsgrad ? max_exp_avg_sqs[i].data_ptr<float>() : nullptr};
  }
  const std::vector<Chunk> chunks = split_into_chunks(numels);
  parallel_over_chunks(chunks, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      const Chunk& ch = chunks[static_cast<size_t>(c)];
      const AdamWChunk& b = bases[static_cast<size_t>(ch.tensor)];
      const int64_t o = ch.begin;
      const AdamWChunk ptrs{static_cast<char*>(b.param) + o * static_cast<int64_t>(param_size),
                          static_cast<const char*>(b.grad) + o * static_cast<int64_t>(grad_size),
                          b.master ? b.master + o : nullptr,
                          b.exp_avg + o,
                          b.exp_avg_sq + o,
                          b.max_exp_avg_sq ? b.max_exp_avg_sq + o : nullptr};
      fn(ptrs, ch.len, args);
    }
  });
}

}  // namespace
}  // namespace cpu
}  // namespace fastamp

TORCH_LIBRARY_IMPL(fastamp, CPU, m) { m.impl("adamw_", TORCH_FN(fastamp::cpu::adamw_cpu)); }
