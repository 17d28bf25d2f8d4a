// The update rules and state formats of the CUDA optim_ kernel (optim.cuh): the per-element
// maths of fastamp/reference/optim.py's RULES (math::adamw_element, sgd_element, lion_element
// from csrc/fastamp_math.h) and the state codecs (fp32, bf16, the q8 codes of csrc/q8_math.h) as
// types the one kernel template takes, so that a rule or a format is written once and runs with
// every master format, dtype pair and flag.
//
// A Rule provides:
//   kId, kMaxStates, kScalars     its OptimRule, the most states it keeps, its step scalars per row
//   Hyper, make_hyper(h, flags)   per-call constants (rounded from the hyper doubles once, as the
//                                 reference's _f32) and its flags, passed by value to the kernel
//   num_states(hyper)             the states this call keeps (uniform over a launch)
//   Scalars, scalars(row)         a tensor's step scalars, read once per chunk
//   root_coded(j)                 whether state j is stored by the q8 code of a root ("v": w = sqrt(v))
//   element(&p, s, g, sc, hyper)  the fp32 update of one element: value p, states s[0..num_states)
// A state format provides kId, kQ8, storage_t, and for the dense ones load / store (rounding to
// nearest-even, or stochastically with 16 random bits).
#pragma once

#include <cstdint>

#include "../fastamp_math.h"
#include "../optim_flags.h"
#include "../q8_math.h"
#include "launch_plan.h"

namespace fastamp {
namespace cuda {
namespace detail {

struct AdamWRule {
  static constexpr OptimRule kId = OptimRule::kAdamW;
  static constexpr int kMaxStates = 3;  // exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad)
  static constexpr int kScalars = 4;    // [step_size, bc2_sqrt, decay, grad_mul]
  struct Hyper {
    math::AdamWHyper h;
    bool amsgrad, maximize;
  };
  using Scalars = math::AdamWStepScalars;
  static Hyper make_hyper(const double* hyper, int64_t flags) {
    Hyper r;
    r.h.beta1 = static_cast<float>(hyper[0]);
    r.h.one_minus_beta1 = static_cast<float>(1.0 - hyper[0]);
    r.h.beta2 = static_cast<float>(hyper[1]);
    r.h.one_minus_beta2 = static_cast<float>(1.0 - hyper[1]);
    r.h.eps = static_cast<float>(hyper[2]);
    r.amsgrad = (flags & optim_flags::kAmsgrad) != 0;
    r.maximize = (flags & optim_flags::kMaximize) != 0;
    return r;
  }
  static __host__ __device__ __forceinline__ int num_states(const Hyper& h) { return h.amsgrad ? 3 : 2; }
  static __device__ __forceinline__ Scalars scalars(const float* sc) {
    Scalars s;
    s.step_size = sc[0];
    s.bc2_sqrt = sc[1];
    s.decay = sc[2];
    s.grad_mul = sc[3];
    return s;
  }
  static __host__ __device__ constexpr bool root_coded(int j) { return j > 0; }
  static __device__ __forceinline__ void element(float* p, float (&s)[kMaxStates], float g, const Scalars& sc,
                                                 const Hyper& h) {
    math::adamw_element(p, &s[0], &s[1], &s[2], g, sc, h.h, h.amsgrad, h.maximize);
  }
};

struct SgdRule {
  static constexpr OptimRule kId = OptimRule::kSgd;
  static constexpr int kMaxStates = 1;  // momentum_buffer, kept only with a momentum
  static constexpr int kScalars = 3;    // [lr, grad_mul, is_first]
  using Hyper = math::SgdHyper;
  using Scalars = math::SgdStepScalars;
  static Hyper make_hyper(const double* hyper, int64_t flags) {
    Hyper r;
    r.momentum = static_cast<float>(hyper[0]);
    r.one_minus_dampening = static_cast<float>(1.0 - hyper[1]);
    r.weight_decay = static_cast<float>(hyper[2]);
    // decided on the doubles, as the reference's `momentum != 0` and `weight_decay != 0`
    r.has_momentum = hyper[0] != 0.0;
    r.has_weight_decay = hyper[2] != 0.0;
    r.nesterov = (flags & optim_flags::kNesterov) != 0;
    r.maximize = (flags & optim_flags::kMaximize) != 0;
    return r;
  }
  static __host__ __device__ __forceinline__ int num_states(const Hyper& h) { return h.has_momentum ? 1 : 0; }
  static __device__ __forceinline__ Scalars scalars(const float* sc) {
    Scalars s;
    s.lr = sc[0];
    s.grad_mul = sc[1];
    s.first = sc[2];
    return s;
  }
  static __host__ __device__ constexpr bool root_coded(int) { return false; }
  static __device__ __forceinline__ void element(float* p, float (&s)[kMaxStates], float g, const Scalars& sc,
                                                 const Hyper& h) {
    math::sgd_element(p, &s[0], g, sc, h);
  }
};

struct LionRule {
  static constexpr OptimRule kId = OptimRule::kLion;
  static constexpr int kMaxStates = 1;  // exp_avg
  static constexpr int kScalars = 3;    // [lr, decay, grad_mul]
  using Hyper = math::LionHyper;
  using Scalars = math::LionStepScalars;
  static Hyper make_hyper(const double* hyper, int64_t flags) {
    Hyper r;
    r.beta1 = static_cast<float>(hyper[0]);
    r.one_minus_beta1 = static_cast<float>(1.0 - hyper[0]);
    r.beta2 = static_cast<float>(hyper[1]);
    r.one_minus_beta2 = static_cast<float>(1.0 - hyper[1]);
    r.maximize = (flags & optim_flags::kMaximize) != 0;
    return r;
  }
  static __host__ __device__ __forceinline__ int num_states(const Hyper&) { return 1; }
  static __device__ __forceinline__ Scalars scalars(const float* sc) {
    Scalars s;
    s.lr = sc[0];
    s.decay = sc[1];
    s.grad_mul = sc[2];
    return s;
  }
  static __host__ __device__ constexpr bool root_coded(int) { return false; }
  static __device__ __forceinline__ void element(float* p, float (&s)[kMaxStates], float g, const Scalars& sc,
                                                 const Hyper& h) {
    math::lion_element(p, &s[0], g, sc, h);
  }
};

// fp32 states: exact, no random bits.
struct F32State {
  static constexpr StateFormat kId = StateFormat::kFloat32;
  static constexpr bool kQ8 = false;
  static constexpr bool kRounds = false;
  using storage_t = float;
  static __device__ __forceinline__ float load(float s) { return s; }
  static __device__ __forceinline__ float store(float x, bool, uint32_t) { return x; }
};

// bf16 states: rounded to nearest-even, or stochastically (reference.formats._store_lowp).
struct Bf16State {
  static constexpr StateFormat kId = StateFormat::kBFloat16;
  static constexpr bool kQ8 = false;
  static constexpr bool kRounds = true;
  using storage_t = uint16_t;
  static __device__ __forceinline__ float load(uint16_t s) { return math::bf16_bits_to_float(s); }
  static __device__ __forceinline__ uint16_t store(float x, bool stochastic, uint32_t rand16) {
    return stochastic ? math::float_to_bf16_bits_sr(x, rand16) : math::float_to_bf16_bits(x);
  }
};

// q8 states: uint8 codes (storage_t) shaped like the param and a scale byte per block of 32;
// the block-wise codec is the kernel's (it takes the block's lanes, optim.cuh).
struct Q8State {
  static constexpr StateFormat kId = StateFormat::kQ8;
  static constexpr bool kQ8 = true;
  static constexpr bool kRounds = true;
  using storage_t = uint8_t;
};

}  // namespace detail
}  // namespace cuda
}  // namespace fastamp
