// The (update rule, state format) pairs the CUDA kernel of fastamp::optim_ is compiled for: the one
// list the instances come from. Each pair is instantiated for the 9 (param dtype, grad dtype)
// pairs, in the file of its rule (optim_adamw.cu, optim_sgd.cu, optim_lion.cu); the master format,
// the flags (maximize, amsgrad, nesterov, stochastic rounding) and the state count are run-time
// branches of each instance, uniform over a launch. tests/tools/test_cuda_compile.py and
// test_cuda_ptxas.py read this list to count the instances they expect; the binding refuses a
// pair not listed here before touching anything. SGD without momentum keeps no state: it runs
// the (kSgd, kFloat32) instance.
//
// Only the pairs in use: every rule with fp32 and q8 states, AdamW also with bf16 ones (the
// optimizers' state formats). bf16 states under SGD or Lion are the reference's, compiled by
// adding their rows (9 instances each, ~15 s of nvcc per row for sm_80 + sm_90).
//
// Host-only C++ (no CUDA header), read by optim.cu (optim_compiled) and the kernel template.
#pragma once

#include "launch_plan.h"

// X(rule, state format), with OptimRule and StateFormat enumerators.
#define FASTAMP_CUDA_OPTIM_COMBOS(X) \
  X(kAdamW, kFloat32)                \
  X(kAdamW, kBFloat16)               \
  X(kAdamW, kQ8)                     \
  X(kSgd, kFloat32)                  \
  X(kSgd, kQ8)                       \
  X(kLion, kFloat32)                 \
  X(kLion, kQ8)

namespace fastamp {
namespace cuda {

constexpr bool optim_combo_listed(OptimRule rule, StateFormat format) {
#define FASTAMP_OPTIM_COMBO_IS(r, f) \
  if (rule == OptimRule::r && format == StateFormat::f) return true;
  FASTAMP_CUDA_OPTIM_COMBOS(FASTAMP_OPTIM_COMBO_IS)
#undef FASTAMP_OPTIM_COMBO_IS
  return false;
}

}  // namespace cuda
}  // namespace fastamp
