// The state formats of the CUDA optim_ kernel (optim.cuh): the state codecs (fp32, bf16, the q8
// codes of csrc/q8_math.h) as types the one kernel template takes, so that a format is written once
// and runs with every rule (csrc/rules/<name>.h), master format, dtype pair and flag.
//
// A state format provides kId, kQ8, kRounds, storage_t, and for the dense ones load / store
// (rounding to nearest-even, or stochastically with 16 random bits).
#pragma once

#include <cstdint>

#include "../fastamp_math.h"
#include "../q8_math.h"
#include "launch_plan.h"

namespace fastamp {
namespace cuda {
namespace detail {

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
