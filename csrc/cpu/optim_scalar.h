// The generic optimizer kernel of fastamp::optim_, scalar: the portable path and the tails of the
// vector loops (cpu/optim_kernels.inc). Private to csrc/cpu/ (the rule translation units).
//
// Written once each: a master format's load and store, a state format's load and store (the codec of csrc/q8_math.h
// for q8, one block of 32 at a time). A rule's element maths is its R::element (csrc/rules/<name>.h),
// with its Scalars from the chunk's row (R::scalars) and its Hyper from Args (hyper_of<R>). Bit for
// bit fastamp.reference.optim_.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu/optim.h"
#include "cpu/scalar_ops.h"
#include "fastamp_math.h"
#include "optim_rules.h"
#include "q8_math.h"

namespace fastamp {
namespace cpu {
namespace optim {

// Whether a param of dtype P in master format K is rounded stochastically under SR_PARAM (the
// reference: the ulp8 correction of any param, a bf16 param without a master).
template <class P, Master K>
constexpr bool kParamSr = K == Master::kUlp8 || (K == Master::kNone && std::is_same_v<P, c10::BFloat16>);

// The chunks hold whole q8 blocks, and the vector RNGs need their flat indices to share the high
// 32 bits (and, for the q8 kernel's block RNG, the bits above 16).
static_assert(math::kQ8Block == 32, "q8 blocks of 32");

namespace scalar {

// ---- master formats ----

template <class P, Master K>
inline float load_master(const Span& c, int64_t i) {
  const P* param = static_cast<const P*>(c.param);
  if constexpr (K == Master::kFp32) {
    return static_cast<const float*>(c.master)[i];
  } else if constexpr (K == Master::kRemainder) {
    return math::join_master(param[i].x, static_cast<const int16_t*>(c.master)[i]);
  } else if constexpr (K == Master::kUlp8) {
    const int8_t corr = static_cast<const int8_t*>(c.master)[i];
    return std::is_same_v<P, c10::Half> ? math::ulp8_decode_fp16(param[i].x, corr)
                                        : math::ulp8_decode_bf16(param[i].x, corr);
  } else {
    return load_float(param + i);
  }
}

// The new value p of element i in the master format; srp: SR_PARAM (applied where kParamSr).
template <class P, Master K>
inline void store_master(const Span& c, int64_t i, float p, bool srp) {
  P* param = static_cast<P*>(c.param);
  if constexpr (K == Master::kFp32) {
    static_cast<float*>(c.master)[i] = p;
    store_float(param + i, p);
  } else if constexpr (K == Master::kRemainder) {
    math::split_master(p, &param[i].x, &static_cast<int16_t*>(c.master)[i]);
  } else if constexpr (K == Master::kUlp8) {
    constexpr bool kFp16 = std::is_same_v<P, c10::Half>;
    int8_t* corr = static_cast<int8_t*>(c.master) + i;
    if (srp) {
      const uint32_t r = math::sr_random16(c.key[0], c.index0 + static_cast<uint64_t>(i));
      math::ulp8_encode<kFp16, true>(p, r, &param[i].x, corr);
    } else {
      math::ulp8_encode<kFp16, false>(p, 0u, &param[i].x, corr);
    }
  } else if constexpr (std::is_same_v<P, c10::BFloat16>) {
    if (srp) {
      param[i].x = math::float_to_bf16_bits_sr(p, math::sr_random16(c.key[0], c.index0 + static_cast<uint64_t>(i)));
    } else {
      store_float(param + i, p);
    }
  } else {
    store_float(param + i, p);
  }
}

// ---- dense state formats: fp32, bf16 (to nearest even, or stochastically under SR_STATE) ----

template <Fmt F>
inline float load_state(const void* base, int64_t i) {
  if constexpr (F == Fmt::kBf16) {
    return math::bf16_bits_to_float(static_cast<const c10::BFloat16*>(base)[i].x);
  } else {
    return static_cast<const float*>(base)[i];
  }
}

template <Fmt F>
inline void store_state(void* base, int64_t i, float v, bool srs, uint32_t key, uint64_t index) {
  if constexpr (F == Fmt::kBf16) {
    c10::BFloat16* t = static_cast<c10::BFloat16*>(base) + i;
    t->x = srs ? math::float_to_bf16_bits_sr(v, math::sr_random16(key, index)) : math::float_to_bf16_bits(v);
  } else {
    static_cast<float*>(base)[i] = v;
  }
}

// Elements [begin, end) of one chunk, dense states.
template <class R, class P, class G, Master K, Fmt F>
void dense_range(const Span& c, int64_t begin, int64_t end, const Args& a) {
  const G* grad = static_cast<const G*>(c.grad);
  const bool srp = kParamSr<P, K> && a.srp;
  const bool srs = F == Fmt::kBf16 && a.srs;
  const typename R::Scalars sc = R::scalars(a.s);
  const typename R::Hyper h = hyper_of<R>(a);
  for (int64_t i = begin; i < end; ++i) {
    const uint64_t index = c.index0 + static_cast<uint64_t>(i);
    float p = load_master<P, K>(c, i);
    float s[R::kMaxStates] = {};
    for (int j = 0; j < a.states; ++j) s[j] = load_state<F>(c.state[j], i);
    R::element(&p, s, load_float(grad + i), sc, h);
    for (int j = 0; j < a.states; ++j) store_state<F>(c.state[j], i, s[j], srs, c.key[1 + j], index);
    store_master<P, K>(c, i, p, srp);
  }
}

template <class R, class P, class G, Master K, Fmt F>
void dense_chunk(const Span& c, int64_t n, const Args& a) {
  dense_range<R, P, G, K, F>(c, 0, n, a);
}

// ---- the q8 state format ----
//
// Blocks of one chunk from element `begin` (a multiple of 32) to `n` (the last block may be
// partial): each state decoded (math::q8_decode_m / q8_decode_v), the rule stepped, and each new
// state encoded over its block's new scale byte (a v-coded state as w = sqrt_rn(v)), its codes
// rounded stochastically (stream 4 * tensor_id + 1 + j) under SR_STATE.
template <class R, class P, class G, Master K>
void q8_range(const Span& c, int64_t begin, int64_t n, const Args& a) {
  constexpr int64_t kBlock = math::kQ8Block;
  constexpr int kMax = R::kMaxStates;
  const G* grad = static_cast<const G*>(c.grad);
  const bool srp = kParamSr<P, K> && a.srp;
  const int ns = a.states;
  const typename R::Scalars sc = R::scalars(a.s);
  const typename R::Hyper h = hyper_of<R>(a);
  for (int64_t b0 = begin; b0 < n; b0 += kBlock) {
    const int64_t len = std::min(kBlock, n - b0);
    const int64_t blk = b0 / kBlock;
    uint32_t old_scale[kMax] = {};
    for (int j = 0; j < ns; ++j) old_scale[j] = c.scales[j][blk];
    float fresh[kMax][kBlock];
    uint32_t top[kMax] = {};
    for (int64_t e = 0; e < len; ++e) {
      const int64_t i = b0 + e;
      float p = load_master<P, K>(c, i);
      float s[kMax] = {};
      for (int j = 0; j < ns; ++j) {
        const uint32_t code = static_cast<const uint8_t*>(c.state[j])[i];
        s[j] = R::root_coded(j) ? math::q8_decode_v(code, old_scale[j]) : math::q8_decode_m(code, old_scale[j]);
      }
      R::element(&p, s, load_float(grad + i), sc, h);
      store_master<P, K>(c, i, p, srp);
      for (int j = 0; j < ns; ++j) {
        const float x = R::root_coded(j) ? sqrtf(s[j]) : s[j];  // correctly rounded, as the reference's sqrt_rn
        fresh[j][e] = x;
        top[j] = std::max(top[j], math::float_bits(x) & 0x7fffffffu);
      }
    }
    for (int j = 0; j < ns; ++j) {
      const bool v = R::root_coded(j);
      const uint32_t s_new = math::q8_scale_byte(top[j], v ? math::kQ8WScaleMin : math::kQ8MScaleMin);
      c.scales[j][blk] = static_cast<uint8_t>(s_new);
      uint8_t* codes = static_cast<uint8_t*>(c.state[j]);
      for (int64_t e = 0; e < len; ++e) {
        const int64_t i = b0 + e;
        uint32_t q;
        if (a.srs) {
          const uint32_t r = math::sr_random16(c.key[1 + j], c.index0 + static_cast<uint64_t>(i));
          q = v ? math::q8_encode_w<true>(fresh[j][e], s_new, r) : math::q8_encode_m<true>(fresh[j][e], s_new, r);
        } else {
          q = v ? math::q8_encode_w<false>(fresh[j][e], s_new, 0u) : math::q8_encode_m<false>(fresh[j][e], s_new, 0u);
        }
        codes[i] = static_cast<uint8_t>(q);
      }
    }
  }
}

template <class R, class P, class G, Master K>
void q8_chunk(const Span& c, int64_t n, const Args& a) {
  q8_range<R, P, G, K>(c, 0, n, a);
}

}  // namespace scalar
}  // namespace optim
}  // namespace cpu
}  // namespace fastamp
