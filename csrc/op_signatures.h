// The C++ signature of every op's kernel, one type per op of the table in fastamp/ops/registry.py
// (the dispatcher checks the CPU kernels against the table's schemas when fastamp._C loads).
//
// The dispatcher refuses two kernels of one op whose C++ signatures differ (a CPU kernel
// taking `const at::Tensor&` and a CUDA one taking `at::Tensor&`), and it does so when the
// library is loaded, by aborting the process: every user's `import fastamp` dies, and only
// a build against a CUDA torch shows it. So each backend registers its kernels through
// FASTAMP_IMPL, which checks the kernel against the type below at compile time; a
// mismatch is a compile error in whichever backend drifted (tests/tools/test_cuda_compile.py
// compiles the CUDA bindings against torch's headers on machines without a CUDA torch).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <type_traits>

namespace fastamp {
namespace signature {

using unscale_check_ = at::Tensor(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale,
                                  bool write_back, bool compute_sumsq);

using unscale_check_stats_ = at::Tensor(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale,
                                        bool write_back, bool compute_sumsq, const at::Tensor& counts,
                                        const at::Tensor& absmax);

// gradient release's check pass (fastamp.ops.registry.RELEASE_OPS: CPU kernels only for now)
using unscale_check_partials_ = void(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale,
                                     const at::Tensor& partials, at::IntArrayRef offsets);

using sumsq_fold = at::Tensor(const at::Tensor& partials, const at::Tensor& index);

using update_scale_ = void(const at::Tensor& scale, const at::Tensor& growth_tracker,
                           const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf, double growth_factor,
                           double backoff_factor, int64_t growth_interval, int64_t hysteresis, double min_scale,
                           double max_scale);

using adamw_ = void(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, const at::Tensor& step_scalars,
                    const std::optional<at::Tensor>& found_inf, double beta1, double beta2, double eps, bool amsgrad,
                    bool maximize);

using adamw_bf16_ = void(at::TensorList params, at::TensorList grads, at::TensorList remainders,
                         at::TensorList exp_avgs, at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                         const at::Tensor& step_scalars, const std::optional<at::Tensor>& found_inf,
                         const std::optional<at::Tensor>& rng, int64_t rng_base, double beta1, double beta2, double eps,
                         bool amsgrad, bool maximize);

using sgd_ = void(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList momentum_buffers,
                  const at::Tensor& step_scalars, const std::optional<at::Tensor>& found_inf,
                  const std::optional<at::Tensor>& rng, int64_t rng_base, double momentum, double dampening,
                  double weight_decay, bool nesterov, bool maximize);

using lion_ = void(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList exp_avgs,
                   const at::Tensor& step_scalars, const std::optional<at::Tensor>& found_inf,
                   const std::optional<at::Tensor>& rng, int64_t rng_base, double beta1, double beta2, bool maximize);

// AdamW on 8-bit block-scaled moments (fastamp.ops.registry.Q8_OPS: CPU and CUDA kernels)
using adamw_q8_ = void(at::TensorList params, at::TensorList grads, at::TensorList masters,
                       at::TensorList exp_avg_codes, at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_codes,
                       at::TensorList exp_avg_sq_scales, const at::Tensor& step_scalars,
                       const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& rng,
                       int64_t rng_base, double beta1, double beta2, double eps, bool maximize, bool sr_param,
                       bool sr_codes);

// The one-state rules on 8-bit block-scaled moments (fastamp.ops.registry.Q8_OPS: CPU kernels; the
// other backends compose the rule's dense kernel with the codec)
using sgd_q8_ = void(at::TensorList params, at::TensorList grads, at::TensorList masters,
                     at::TensorList momentum_buffer_codes, at::TensorList momentum_buffer_scales,
                     const at::Tensor& step_scalars, const std::optional<at::Tensor>& found_inf,
                     const std::optional<at::Tensor>& rng, int64_t rng_base, double momentum, double dampening,
                     double weight_decay, bool nesterov, bool maximize, bool sr_param, bool sr_codes);

using lion_q8_ = void(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList exp_avg_codes,
                      at::TensorList exp_avg_scales, const at::Tensor& step_scalars,
                      const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& rng,
                      int64_t rng_base, double beta1, double beta2, bool maximize, bool sr_param, bool sr_codes);

// The one optimizer op: an update rule x a master format x a state format
// (fastamp.ops.registry.GENERIC_OPS; semantics: fastamp.reference.optim_; flags: csrc/optim_flags.h)
using optim_ = void(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList states,
                    const at::Tensor& step_scalars, const std::optional<at::Tensor>& found_inf,
                    const std::optional<at::Tensor>& rng, int64_t rng_base, c10::string_view rule,
                    at::ArrayRef<double> hyper, int64_t flags);

}  // namespace signature
}  // namespace fastamp

// m.impl(op, fn) after a compile-time check that fn has the op's one C++ signature.
#define FASTAMP_IMPL(m, op, fn)                                                                           \
  do {                                                                                                    \
    static_assert(std::is_same<decltype(fn), ::fastamp::signature::op>::value,                            \
                  "fastamp: the kernel registered for " #op                                               \
                  " does not have the C++ signature of csrc/op_signatures.h; the dispatcher would abort " \
                  "the process at import");                                                               \
    (m).impl(#op, TORCH_FN(fn));                                                                          \
  } while (0)
