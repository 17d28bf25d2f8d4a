// fastamp::optim_ on CUDA: the call handed to its state format's launcher (optim_fp32.cu,
// optim_bf16.cu, optim_q8.cu, each instantiating the kernel template of optim.cuh for the rules of
// csrc/optim_rules.h that list the format). No torch header: the
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
  switch (call.format) {
    case StateFormat::kFloat32:
      return detail::optim_fp32(tensors, num_tensors, call, tables, stream);
    case StateFormat::kBFloat16:
      return detail::optim_bf16(tensors, num_tensors, call, tables, stream);
    case StateFormat::kQ8:
      return detail::optim_q8(tensors, num_tensors, call, tables, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace fastamp
