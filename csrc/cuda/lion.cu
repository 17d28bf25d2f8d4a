// CUDA kernel of fastamp::lion_ (semantics: fastamp/reference/; per-element maths:
// math::lion_element in csrc/fastamp_math.h): Lion's rule of the one-state family
// (one_state.cuh: masters, remainders, stochastic rounding, vector loads, the launch plan and
// the found_inf skip, shared with sgd_). No torch header: the binding is csrc/cuda/bindings.cpp.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "../fastamp_math.h"
#include "launchers.h"
#include "one_state.cuh"

namespace fastamp {
namespace cuda {
namespace {

// The state is exp_avg, always present.
struct LionRule {
  using Hyper = math::LionHyper;
  using Scalars = math::LionStepScalars;
  static __host__ __device__ __forceinline__ bool has_state(const Hyper&) { return true; }
  static __device__ __forceinline__ Scalars scalars(const float* sc) {
    Scalars s;
    s.lr = sc[0];
    s.decay = sc[1];
    s.grad_mul = sc[2];
    return s;
  }
  static __device__ __forceinline__ void element(float* p, float* m, float g, const Scalars& s, const Hyper& h) {
    math::lion_element(p, m, g, s, h);
  }
};

}  // namespace

cudaError_t lion(const OneStateTensorRef* tensors, int64_t num_tensors, MasterKind master_kind,
                 const float* step_scalars, int64_t scalar_stride, const float* found_inf, const int64_t* rng,
                 double beta1, double beta2, bool maximize, TableMemory& tables, cudaStream_t stream) {
  // Rounded from doubles exactly as the reference's _f32(beta1), _f32(1.0 - beta1), ...
  math::LionHyper hyper;
  hyper.beta1 = static_cast<float>(beta1);
  hyper.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  hyper.beta2 = static_cast<float>(beta2);
  hyper.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  hyper.maximize = maximize;
  return detail::run_one_state<LionRule>(tensors, num_tensors, master_kind, step_scalars, scalar_stride, found_inf, rng,
                                         hyper, tables, stream);
}

}  // namespace cuda
}  // namespace fastamp
