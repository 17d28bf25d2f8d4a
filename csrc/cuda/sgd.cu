// CUDA kernel of fastamp::sgd_ (semantics: fastamp/reference/; per-element maths:
// math::sgd_element in csrc/fastamp_math.h): SGD's rule of the one-state family
// (one_state.cuh: masters, remainders, stochastic rounding, vector loads, the launch plan and
// the found_inf skip). No torch header: the binding is csrc/cuda/bindings.cpp.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "../fastamp_math.h"
#include "launchers.h"
#include "one_state.cuh"

namespace fastamp {
namespace cuda {
namespace {

// The state is the momentum buffer, absent without momentum (nothing read or written).
struct SgdRule {
  using Hyper = math::SgdHyper;
  using Scalars = math::SgdStepScalars;
  static __host__ __device__ __forceinline__ bool has_state(const Hyper& h) { return h.has_momentum; }
  static __device__ __forceinline__ Scalars scalars(const float* sc) {
    Scalars s;
    s.lr = sc[0];
    s.grad_mul = sc[1];
    s.first = sc[2];
    return s;
  }
  static __device__ __forceinline__ void element(float* p, float* buf, float g, const Scalars& s, const Hyper& h) {
    math::sgd_element(p, buf, g, s, h);
  }
};

}  // namespace

cudaError_t sgd(const OneStateTensorRef* tensors, int64_t num_tensors, MasterKind master_kind,
                const float* step_scalars, int64_t scalar_stride, const float* found_inf, const int64_t* rng,
                double momentum, double dampening, double weight_decay, bool nesterov, bool maximize,
                TableMemory& tables, cudaStream_t stream) {
  // Rounded from doubles exactly as the reference's _f32(momentum), _f32(1.0 - dampening), ...
  math::SgdHyper hyper;
  hyper.momentum = static_cast<float>(momentum);
  hyper.one_minus_dampening = static_cast<float>(1.0 - dampening);
  hyper.weight_decay = static_cast<float>(weight_decay);
  hyper.has_momentum = momentum != 0.0;
  hyper.has_weight_decay = weight_decay != 0.0;
  hyper.nesterov = nesterov;
  hyper.maximize = maximize;
  return detail::run_one_state<SgdRule>(tensors, num_tensors, master_kind, step_scalars, scalar_stride, found_inf, rng,
                                        hyper, tables, stream);
}

}  // namespace cuda
}  // namespace fastamp
