// The q8 moment codec (fastamp::adamw_q8_), scalar: the C++ twin of fastamp/reference/q8.py,
// whose module docstring is the bit-level specification, and the ulp8 master (the twin of
// fastamp/reference/ulp8.py). Shared by the CPU kernels (and the CUDA ones to come); no torch
// header. All integer maths of the codec is 32-bit: every intermediate of the reference is below
// 2^41 only because it keeps `shift` up to 40, and any shift >= 25 gives the same rounding as 25
// (the significand has 24 bits), so the shifts are clamped here.
//
// Layout: codes one uint8 per element, one scale byte per block of 32 elements (the last block
// may be partial; missing elements count as zeros). Scale byte s = max(E(absmax), S_MIN), the
// biased fp32 exponent of the block's largest abs bits; s == 0xFF: the block holds an inf or a
// NaN, every code is 0 and every element decodes to NaN.
#pragma once

#include <cstdint>

#include "fastamp_math.h"

namespace fastamp {
namespace math {

constexpr int kQ8Block = 32;
constexpr uint32_t kQ8MScaleMin = 11;  // m: every decoded nonzero is a normal fp32
constexpr uint32_t kQ8WScaleMin = 75;  // w = sqrt(v): every decoded nonzero v is normal
constexpr uint32_t kQ8Nonfinite = 0xFF;
constexpr int kQ8MMant = 4;  // m: signed E3M4 (bit 7 the sign)
constexpr int kQ8WMant = 5;  // w: unsigned E3M5
constexpr uint32_t kQ8NanBits = 0x7fc00000u;

// K(q): a code magnitude's value in units of 2^-(7+P) of the block scale.
template <int P>
FASTAMP_HD uint32_t q8_code_units(uint32_t q) {
  if (q < (2u << P)) return q;
  return ((1u << P) + (q & ((1u << P) - 1u))) << ((q >> P) - 1u);
}

// 2^k as fp32 for k in [-149, 127], from bits (subnormal powers included).
FASTAMP_HD float q8_pow2(int k) {
  return bits_float(k >= -126 ? static_cast<uint32_t>(k + 127) << 23 : 1u << (k + 149));
}

// reference.q8_decode_m of one element: (-1)^sign * K * 2^(s - 137), exact; NaN where s == 0xFF.
FASTAMP_HD float q8_decode_m(uint32_t code, uint32_t s) {
  if (s == kQ8Nonfinite) return bits_float(kQ8NanBits);
  const float mag = static_cast<float>(q8_code_units<kQ8MMant>(code & 0x7fu)) * q8_pow2(static_cast<int>(s) - 137);
  return bits_float(float_bits(mag) | ((code & 0x80u) << 24));
}

// reference.q8_decode_v of one element: w = K * 2^(s - 138) (exact), v = fp32(w * w); NaN where s == 0xFF.
FASTAMP_HD float q8_decode_v(uint32_t code, uint32_t s) {
  if (s == kQ8Nonfinite) return bits_float(kQ8NanBits);
  const float w = static_cast<float>(q8_code_units<kQ8WMant>(code)) * q8_pow2(static_cast<int>(s) - 138);
  return w * w;
}

// The scale byte of a block from the maximum of its elements' abs bits (bits & 0x7FFFFFFF).
FASTAMP_HD uint32_t q8_scale_byte(uint32_t max_abs_bits, uint32_t scale_min) {
  const uint32_t e = max_abs_bits >> 23;
  return e > scale_min ? e : scale_min;
}

// The code magnitude q of a finite element with abs bits `a` in a block of scale byte s
// (s != 0xFF, and s >= the element's exponent, as the block max guarantees). SR: 16 random
// bits `rand16` added just below the kept mantissa, then truncated; else nearest-even.
template <int P, bool SR>
FASTAMP_HD uint32_t q8_encode_magnitude(uint32_t a, uint32_t s, uint32_t rand16) {
  const uint32_t e = a >> 23;
  const uint32_t sig = (a & 0x7fffffu) | (e > 0 ? 0x800000u : 0u);
  const int ec = static_cast<int>(e > 0 ? e : 1u) + 7 - static_cast<int>(s);
  const int sub = 1 - ec > 0 ? 1 - ec : 0;
  int shift = (23 - P) + sub;  // >= 18
  uint32_t hi, up;
  if constexpr (SR) {
    // the reference clamps shift at 40: shift - 16 <= 24, and sig >> 24 == 0 already
    if (shift > 40) shift = 40;
    hi = shift >= 24 ? 0u : sig >> shift;
    up = (((sig >> (shift - 16)) & 0xffffu) + rand16) >> 16;
  } else {
    if (shift > 25) shift = 25;  // sig < 2^24 <= half: no rounding up from here on, as at 40
    hi = sig >> shift;           // 0 for shift 24, 25
    const uint32_t half = 1u << (shift - 1);
    const uint32_t rem = sig & ((half << 1) - 1u);
    up = (rem > half || (rem == half && (hi & 1u))) ? 1u : 0u;
  }
  const uint32_t base = ec > 1 ? static_cast<uint32_t>(ec - 1) << P : 0u;
  const uint32_t q = base + hi + up;
  const uint32_t qmax = (1u << (P + 3)) - 1u;
  return q < qmax ? q : qmax;
}

// reference.q8_encode_m of one element x in a block of scale byte s (code 0 where s == 0xFF).
template <bool SR>
FASTAMP_HD uint32_t q8_encode_m(float x, uint32_t s, uint32_t rand16) {
  if (s == kQ8Nonfinite) return 0u;
  const uint32_t b = float_bits(x);
  return q8_encode_magnitude<kQ8MMant, SR>(b & 0x7fffffffu, s, rand16) | ((b >> 31) << 7);
}

// reference.q8_encode_v of one element, given w = sqrt_rn(v), in a block of scale byte s
// (w's block): a nonzero w never codes to 0; code 0 where s == 0xFF.
template <bool SR>
FASTAMP_HD uint32_t q8_encode_w(float w, uint32_t s, uint32_t rand16) {
  if (s == kQ8Nonfinite) return 0u;
  const uint32_t a = float_bits(w) & 0x7fffffffu;
  const uint32_t q = q8_encode_magnitude<kQ8WMant, SR>(a, s, rand16);
  return (q == 0u && a > 0u) ? 1u : q;
}

// ---- the ulp8 master (fastamp/reference/ulp8.py, whose module docstring is the specification) ----
//
// A bf16 or fp16 param plus an int8 c: the master's rounding error in units of ulp16(M) / 254.
// Integer maths on the fp32 bits; every intermediate fits in int32 (|D| <= 2^15, |t| < 2^22).
// Right shifts of negative int32 are arithmetic (floor), as the reference's int64 >> is.

constexpr uint32_t kUlp8Fp16MinNormalBits = 0x38800000u;  // 2^-14 as fp32 bits

// round(t / 2^K), ties to even, for signed t (reference ulp8._rne_rshift).
template <int K>
FASTAMP_HD int32_t ulp8_rne_rshift(int32_t t) {
  return (t + ((1 << (K - 1)) - 1) + ((t >> K) & 1)) >> K;
}

// D' = floor((c_mag * 65536 + 127) / 254) for c_mag in [-128, 128], without a division:
// 65536 = 258 * 254 + 4, so D' = 258 c + floor((4 c + 127) / 254), that floor in [-2, 2].
FASTAMP_HD int32_t ulp8_units(int32_t c) {
  return 258 * c + (c >= 32 ? 1 : 0) + (c >= 96 ? 1 : 0) - (c <= -32 ? 1 : 0) - (c <= -96 ? 1 : 0);
}

// reference.ulp8_decode of one element: bf16 param bits p, correction c -> the fp32 master.
FASTAMP_HD float ulp8_decode_bf16(uint16_t p, int8_t c) {
  const uint32_t pb = static_cast<uint32_t>(p) << 16;
  const uint32_t pa = pb & 0x7fffffffu;
  if (pa >= 0x7f800000u) return bits_float(pb);  // inf / NaN: the param itself
  const uint32_t neg = static_cast<uint32_t>(p) >> 15;
  const int32_t c_mag = neg ? -static_cast<int32_t>(c) : static_cast<int32_t>(c);
  const int32_t mag_bits = static_cast<int32_t>(pa) + ulp8_units(c_mag);
  const uint32_t flip = mag_bits < 0 ? 1u : 0u;  // only at p = +-0 with c toward zero
  const uint32_t mag = static_cast<uint32_t>(mag_bits < 0 ? -mag_bits : mag_bits);
  return bits_float(mag | ((neg ^ flip) << 31));
}

// reference.ulp8_decode of one element: fp16 param bits p, correction c -> the fp32 master.
FASTAMP_HD float ulp8_decode_fp16(uint16_t p, int8_t c) {
  const float pf = half_bits_to_float(p);
  const uint32_t pa = float_bits(pf) & 0x7fffffffu;
  if (pa >= 0x7f800000u) return pf;
  const uint32_t neg = static_cast<uint32_t>(p) >> 15;
  const int32_t c_mag = neg ? -static_cast<int32_t>(c) : static_cast<int32_t>(c);
  const int32_t d = ulp8_units(c_mag);
  uint32_t mag, flip = 0u;
  if (pa > kUlp8Fp16MinNormalBits || (pa == kUlp8Fp16MinNormalBits && c_mag >= 0)) {
    mag = static_cast<uint32_t>(static_cast<int32_t>(pa) + ulp8_rne_rshift<3>(d));
  } else {
    // in units of 2^-40: |n40| < 2^27, so the int -> fp32 rounding (nearest even) is the only one
    const int32_t n40 = static_cast<int32_t>((static_cast<uint32_t>(p) & 0x7fffu) << 16) + d;
    flip = n40 < 0 ? 1u : 0u;
    mag = float_bits(static_cast<float>(n40 < 0 ? -n40 : n40) * 0x1p-40f);
  }
  return bits_float(mag | ((neg ^ flip) << 31));
}

// D (the error M - p in units of ulp16(M) / 2^16) of an fp16 master below 2^-14 (abs bits a)
// and its param bits pb: floor(|M| * 2^40) - (pb & 0x7FFF) * 2^16.
FASTAMP_HD int32_t ulp8_fp16_small_error(uint32_t a, uint16_t pb) {
  const uint32_t e = a >> 23;
  const uint32_t sig = (a & 0x7fffffu) | (e > 0 ? 0x800000u : 0u);
  const int sh = static_cast<int>(e > 0 ? e : 1u) - 110;  // <= 2 below 2^-14
  // sig < 2^24: any right shift >= 24 gives 0 (the reference clamps at 40)
  const uint32_t fixed40 = sh >= 0 ? sig << sh : (-sh >= 24 ? 0u : sig >> -sh);
  return static_cast<int32_t>(fixed40) - static_cast<int32_t>((static_cast<uint32_t>(pb) & 0x7fffu) << 16);
}

// reference.ulp8_encode of one element: the fp32 master M -> the param bits (M rounded to
// nearest even, bf16 or fp16 as FP16) and the correction; SR: rounded with 16 random bits.
template <bool FP16, bool SR>
FASTAMP_HD void ulp8_encode(float master, uint32_t rand16, uint16_t* param_bits, int8_t* correction) {
  const uint32_t u = float_bits(master);
  const uint32_t a = u & 0x7fffffffu;
  int32_t d;
  if constexpr (FP16) {
    const uint16_t pb = float_to_half_bits(master);
    *param_bits = pb;
    if ((pb & 0x7c00u) == 0x7c00u) {
      d = 0;  // inf / NaN param (a NaN master, or one that rounds to inf): c = 0
    } else if (a >= kUlp8Fp16MinNormalBits) {
      d = (static_cast<int32_t>(a) - static_cast<int32_t>(float_bits(half_bits_to_float(pb)) & 0x7fffffffu)) * 8;
    } else {
      d = ulp8_fp16_small_error(a, pb);
    }
  } else {
    const uint16_t pb = float_to_bf16_bits(master);
    *param_bits = pb;
    const uint32_t pa = (static_cast<uint32_t>(pb) << 16) & 0x7fffffffu;
    d = pa >= 0x7f800000u ? 0 : static_cast<int32_t>(a) - static_cast<int32_t>(pa);
  }
  const int32_t t = d * 127;
  int32_t c_mag;
  if constexpr (SR) {
    c_mag = (t + static_cast<int32_t>((rand16 & 0xffffu) >> 1)) >> 15;
  } else {
    c_mag = ulp8_rne_rshift<15>(t);
  }
  *correction = static_cast<int8_t>((u >> 31) ? -c_mag : c_mag);
}

}  // namespace math
}  // namespace fastamp
