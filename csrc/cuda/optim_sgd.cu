// The CUDA kernels of fastamp::optim_ with SGD's rule: optim.cuh's template for the state formats
// optim_combos.h lists for it, each for the 9 (param, grad) dtype pairs.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "launchers.h"
#include "optim.cuh"

namespace fastamp {
namespace cuda {
namespace detail {

cudaError_t optim_sgd(const OptimTensorRef* tensors, int64_t num_tensors, const OptimCall& call, TableMemory& tables,
                      cudaStream_t stream) {
  return run_optim<SgdRule>(tensors, num_tensors, call, tables, stream);
}

}  // namespace detail
}  // namespace cuda
}  // namespace fastamp
