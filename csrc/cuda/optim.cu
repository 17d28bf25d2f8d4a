// fastamp::optim_ on CUDA: the call handed to its rule's launcher (optim_adamw.cu, optim_sgd.cu,
// optim_lion.cu, each instantiating the kernel template of optim.cuh). No torch header: the
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
    case OptimRule::kAdamW:
      return detail::optim_adamw(tensors, num_tensors, call, tables, stream);
    case OptimRule::kSgd:
      return detail::optim_sgd(tensors, num_tensors, call, tables, stream);
    case OptimRule::kLion:
      return detail::optim_lion(tensors, num_tensors, call, tables, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace fastamp
