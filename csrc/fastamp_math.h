// Per-element maths shared by the CPU (csrc/cpu/) and CUDA (csrc/cuda/) kernels. The update rules'
// element maths is in their own headers, csrc/rules/<name>.h (listed by csrc/optim_rules.h).
//
// This header is the C++ mirror of fastamp/reference/: every function here has a
// Python twin there, and the kernels must agree with the reference bit for bit unless a
// test's tolerance table says otherwise. It includes no torch header, so the CUDA kernels
// compile with plain nvcc. All maths is fp32 (fp64 only where torch uses it for scalars);
// build with -ffp-contract=off / --fmad=false so no FMA changes a rounding.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FASTAMP_HD __host__ __device__ __forceinline__
#else
#define FASTAMP_HD inline
#endif

namespace fastamp {
namespace math {

// ---- dtype conversions (bit level, so CPU and GPU round identically) ----

FASTAMP_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

FASTAMP_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

FASTAMP_HD float bf16_bits_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// Round-to-nearest-even fp32 -> bf16, NaN stays NaN (quiet), as torch's .bfloat16().
FASTAMP_HD uint16_t float_to_bf16_bits(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// fp16 <-> fp32 by bit manipulation (round-to-nearest-even, subnormals, inf/nan kept).
FASTAMP_HD float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return bits_float(sign);
    // subnormal: value = mant * 2^-24, exactly representable in fp32
    float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

FASTAMP_HD uint16_t float_to_half_bits(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t au = u & 0x7fffffffu;
  if (au > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((au >> 13) & 0x3ffu));
  if (au >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520 -> inf
  if (au < 0x38800000u) {
    // result is subnormal (or zero) in fp16: round |f| / 2^-24 to nearest even integer
    if (au < 0x33000000u) return sign;  // < 2^-25: rounds to zero (2^-25 itself ties to 0)
    const uint32_t e = au >> 23;
    const uint32_t m = (au & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // (113 - e) + 13
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t v = au - 0x38000000u;  // rebias exponent 127 -> 15
  v += 0xfffu + ((v >> 13) & 1u);
  return static_cast<uint16_t>(sign | (v >> 13));
}

FASTAMP_HD bool is_finite(float x) { return (float_bits(x) & 0x7f800000u) != 0x7f800000u; }

// ---- unscale and check (fastamp::unscale_check_) ----
//
// x is the scaled gradient element already converted to fp32, inv_scale the fp32
// reciprocal of the scale (times the clip coefficient, where used). Returns the
// unscaled fp32 value and sets *bad when the element must raise found_inf:
//   - x is inf/nan (what torch checks), or
//   - x * inv_scale is inf/nan in fp32: overflow that unscaling itself creates
//     (scale < 1, or scale == 0 giving inv_scale == inf and 0 * inf == nan). torch
//     misses this case; see docs and tests/test_amp_ops.py.
// Whether the value rounded back to a 16-bit grad overflows is checked by the caller
// (only when it writes the grad back): fp16 overflows at |y| >= 65520, bf16 above
// 0x7f7f7fff (the largest value that rounds to bf16 max).
FASTAMP_HD float unscale_element(float x, float inv_scale, bool* bad) {
  const float y = x * inv_scale;
  if (!is_finite(x) || !is_finite(y)) *bad = true;
  return y;
}

// ---- scale update (fastamp::update_scale_) ----
//
// With hysteresis == 1, min_scale == 0 and max_scale == inf this is exactly
// torch._amp_update_scale_ (any non-zero found_inf, NaN included, backs off; growth on
// the growth_interval-th consecutive clean step, tested with ==; growth refused if the
// grown scale is not finite, the tracker still resets).
// hysteresis: an overflow step decrements hysteresis_tracker; the scale backs off only
// when it reaches 0 (so N-1 consecutive overflows are tolerated, their steps still
// skipped). Every clean step refills the tracker to `hysteresis`; once exhausted,
// every further consecutive overflow backs off until a clean step.
FASTAMP_HD void update_scale(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker, float found_inf,
                             double growth_factor, double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                             double min_scale, double max_scale) {
  if (found_inf != 0.0f) {  // true for NaN too
    *growth_tracker = 0;
    int32_t h = *hysteresis_tracker - 1;
    if (h <= 0) {
      float backed = static_cast<float>(static_cast<double>(*scale) * backoff_factor);
      const float lo = static_cast<float>(min_scale);
      if (backed < lo) backed = lo;
      *scale = backed;
      h = 0;
    }
    *hysteresis_tracker = h;
  } else {
    *hysteresis_tracker = static_cast<int32_t>(hysteresis);
    const int32_t successful = *growth_tracker + 1;
    if (static_cast<int64_t>(successful) == growth_interval) {
      float grown = static_cast<float>(static_cast<double>(*scale) * growth_factor);
      const float hi = static_cast<float>(max_scale);
      if (grown > hi) grown = hi;
      if (is_finite(grown)) *scale = grown;
      *growth_tracker = 0;
    } else {
      *growth_tracker = successful;
    }
  }
}

// ---- low-bit master state (fastamp::adamw_bf16_, fastamp::sgd_) ----
//
// Mirrors of fastamp/reference/: split_master / join_master / sr_random16 /
// round_bf16_stochastic. All integer maths is uint32 with wrap-around.

FASTAMP_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// Per-tensor part of the counter-based hash: everything but the element index.
FASTAMP_HD uint32_t sr_stream_key(uint64_t seed, uint64_t counter, uint32_t stream) {
  uint32_t h = mix32(static_cast<uint32_t>(seed) ^ 0x9E3779B9u);
  h = mix32(h ^ static_cast<uint32_t>(counter));
  return mix32(h ^ stream);
}

// 16 random bits for element `index` of the stream keyed by sr_stream_key(...).
FASTAMP_HD uint32_t sr_random16(uint32_t key, uint64_t index) {
  const uint32_t h = mix32(key ^ static_cast<uint32_t>(index >> 32));
  return mix32(h ^ static_cast<uint32_t>(index)) & 0xffffu;
}

// fp32 -> bf16 by stochastic rounding (unbiased); NaN rounds as float_to_bf16_bits.
FASTAMP_HD uint16_t float_to_bf16_bits_sr(float f, uint32_t rand16) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return float_to_bf16_bits(f);
  return static_cast<uint16_t>((u + rand16) >> 16);
}

// fp32 master -> bf16 param (nearest, ties away from zero) + exact int16 remainder.
// (No 16-bit remainder can be exact under ties-to-even: see reference.split_master.)
FASTAMP_HD void split_master(float master, uint16_t* param_bits, int16_t* remainder) {
  const uint32_t u = float_bits(master);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *param_bits = static_cast<uint16_t>((u >> 16) | 0x0040u);
    *remainder = 0;
    return;
  }
  const uint32_t hi = (u + 0x8000u) >> 16;
  *param_bits = static_cast<uint16_t>(hi);
  *remainder = static_cast<int16_t>(static_cast<uint16_t>(u - (hi << 16)));
}

FASTAMP_HD float join_master(uint16_t param_bits, int16_t remainder) {
  return bits_float((static_cast<uint32_t>(param_bits) << 16) + static_cast<uint32_t>(static_cast<int32_t>(remainder)));
}

// ---- gradient health (fastamp::unscale_check_stats_) ----
// Per element, with y = x * inv_scale (fp32): zero if x finite and y == 0; fp16 underflow if
// 0 < |y| < 2^-14; absmax over finite y. Non-finite counting uses unscale_element's flag
// (plus the store check when writing back).
constexpr float kFp16MinNormal = 6.103515625e-05f;  // 2^-14

}  // namespace math
}  // namespace fastamp
