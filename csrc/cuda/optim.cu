// fastamp::optim_ on CUDA: the call handed to its rule's launcher (optim_<name>.cu for each rule of
// csrc/optim_rules.h, each instantiating the kernel template of optim.cuh). No torch header: the
// binding is csrc/cuda/bindings.cpp.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "launchers.h"
#include "optim_combos.h"

namespace fastamp {
namespace cuda {

bool optim_compiled(OptimRule rule, StateFormat format) { return optim_combo_listed(rule, format); }

cudaError_t optim(const OptimTensorRef* tensors, int64_t num_tensors, const OptimCall& call, TableMemory& tables,
                  cudaStream_t stream) {
  if (!optim_compiled(call.rule, call.format)) return cudaErrorInvalidValue;
  switch (call.rule) {
#define FASTAMP_CUDA_OPTIM_CASE_(Name, name, max_states) \
  case OptimRule::k##Name:                               \
    return detail::optim_##name(tensors, num_tensors, call, tables, stream);
    FASTAMP_OPTIM_RULES(FASTAMP_CUDA_OPTIM_CASE_)
#undef FASTAMP_CUDA_OPTIM_CASE_
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace fastamp
