// The (update rule, state format) pairs the CUDA kernel of fastamp::optim_ is compiled for: each
// rule's kCudaStates (csrc/rules/<name>.h), every rule with fp32 states (SGD without momentum keeps
// none and runs the fp32 instance). Each pair is instantiated for the 9 (param dtype, grad dtype)
// pairs, in the file of its state format (optim_fp32.cu, optim_bf16.cu, optim_q8.cu); the master
// format, the flags (maximize, amsgrad, nesterov, stochastic rounding) and the state count are
// run-time branches of each instance, uniform over a launch. tests/tools/test_cuda_compile.py and
// test_cuda_ptxas.py read the rules' kCudaStates to count the instances they expect; the binding
// refuses a pair not listed before touching anything.
//
// Host-only C++ (no CUDA header), read by optim.cu (optim_compiled) and the kernel template.
#pragma once

#include "launch_plan.h"

namespace fastamp {
namespace cuda {

// The kStates* bit of a state format (csrc/optim_rules.h).
constexpr unsigned state_format_bit(StateFormat format) {
  return format == StateFormat::kFloat32    ? kStatesFp32
         : format == StateFormat::kBFloat16 ? kStatesBf16
         : format == StateFormat::kQ8       ? kStatesQ8
                                            : 0u;
}

constexpr bool optim_combo_listed(OptimRule rule, StateFormat format) {
#define FASTAMP_OPTIM_COMBO_IS_(Name, name) \
  if (rule == OptimRule::k##Name) return (rules::Name::kCudaStates & state_format_bit(format)) != 0;
  FASTAMP_OPTIM_RULES(FASTAMP_OPTIM_COMBO_IS_)
#undef FASTAMP_OPTIM_COMBO_IS_
  return false;
}

}  // namespace cuda
}  // namespace fastamp
