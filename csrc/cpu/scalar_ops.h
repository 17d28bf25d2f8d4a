// Scalar element access for the CPU kernels (private to csrc/cpu/): the portable fallback
// and the tails of the vector loops. All conversions are those of csrc/fastamp_math.h.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "fastamp_math.h"

namespace fastamp {
namespace cpu {

inline float load_float(const float* p) { return *p; }
inline float load_float(const c10::Half* p) { return math::half_bits_to_float(p->x); }
inline float load_float(const c10::BFloat16* p) { return math::bf16_bits_to_float(p->x); }

inline void store_float(float* p, float v) { *p = v; }
inline void store_float(c10::Half* p, float v) { p->x = math::float_to_half_bits(v); }
inline void store_float(c10::BFloat16* p, float v) { p->x = math::float_to_bf16_bits(v); }

// Whether the element just written is finite (in its own dtype).
inline bool stored_is_finite(const float* p) { return math::is_finite(*p); }
inline bool stored_is_finite(const c10::Half* p) { return (p->x & 0x7c00u) != 0x7c00u; }
inline bool stored_is_finite(const c10::BFloat16* p) { return (p->x & 0x7f80u) != 0x7f80u; }

// The sum of 16 fp64 lanes in one fixed order, the same for every instruction set.
inline double reduce_lanes16(const double* l) {
  double s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = l[i] + l[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  return ((s4[0] + s4[2]) + (s4[1] + s4[3]));
}

}  // namespace cpu
}  // namespace fastamp
