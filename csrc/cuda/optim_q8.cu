// The CUDA kernels of fastamp::optim_ with q8 states: optim.cuh's template for every rule
// whose kCudaStates lists the format (optim_combos.h), each for the 9 (param, grad) dtype pairs. One
// translation unit per state format, so that they compile in parallel and a new rule adds no file.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "launchers.h"
#include "optim.cuh"

namespace fastamp {
namespace cuda {
namespace detail {

cudaError_t optim_q8(const OptimTensorRef* tensors, int64_t num_tensors, const OptimCall& call, TableMemory& tables,
                     cudaStream_t stream) {
  return run_optim<Q8State>(tensors, num_tensors, call, tables, stream);
}

}  // namespace detail
}  // namespace cuda
}  // namespace fastamp
