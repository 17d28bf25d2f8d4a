// The generic CPU optimizer kernel of fastamp::optim_ (semantics: fastamp.reference.optim_): what its
// host side (cpu/optim.cpp: checks, chunks, threads, the persistent tables) and its kernels (one
// translation unit per instruction set, cpu/optim_kernels_<isa>.cpp, each compiling every rule)
// share. Private to csrc/cpu/.
//
// A kernel is one update rule (AdamW, SGD, Lion) x the param dtype P x the grad dtype G x the master
// format (fp32, int16 remainder, int8 ulp8, none) x the state format (fp32, bf16, q8 codes): a
// ChunkFn runs it on one chunk of one tensor. What varies within one of them is read at run time
// from Args: the rule's flags (maximize, amsgrad, nesterov: in its Hyper), the number of states
// (AdamW 2 or 3, SGD 0 or 1), and the stochastic rounding of the param and of the states (SR_PARAM,
// SR_STATE).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/isa.h"
#include "optim_rules.h"

namespace fastamp {
namespace cpu {
namespace optim {

// The update rules: csrc/optim_rules.h.
using Rule = RuleId;
// The value optimised: an fp32 master (params of any float dtype), the exact master of a bf16
// param and an int16 remainder, the ulp8 master of a bf16 / fp16 param and an int8 correction, or
// the param itself.
enum class Master : int { kNone = 0, kFp32 = 1, kRemainder = 2, kUlp8 = 3 };
// The rule's states: fp32, bf16, or q8 (uint8 codes and one scale byte per block of 32). A rule
// without states (SGD without momentum) runs as kFp32.
enum class Fmt : int { kFp32 = 0, kBf16 = 1, kQ8 = 2 };

constexpr int kMaxStates = 3;

// Pointers of one chunk of one tensor, at the chunk's first element (the scales at its first block).
struct Span {
  void* param;
  const void* grad;
  void* master;                  // float / int16_t / int8_t, or nullptr
  void* state[kMaxStates];       // state j's values (float or bf16), or its q8 codes
  uint8_t* scales[kMaxStates];   // q8: state j's block scales
  uint64_t index0;               // flat index of the chunk's first element in its tensor (the RNG counter)
  uint32_t key[1 + kMaxStates];  // math::sr_stream_key of streams 4 * tensor_id (param) and + 1 + j (state j)
};

// A call's settings, with the chunk's tensor's row of step scalars.
struct Args {
  float s[4];  // the step-scalar row (the rule's k <= 4 floats; its Scalars via R::scalars)
  // The rule's Hyper (csrc/rules/<name>.h: the hyperparameters in fp32, rounded from optim_'s fp64
  // once as the reference's _f32, and its flags), as set_hyper<R> writes it; hyper_of<R> reads it.
  alignas(8) unsigned char hyper[32];
  int states;  // the states kept: AdamW 2 (3 with amsgrad), SGD 0 or 1, Lion 1
  bool srp;    // SR_PARAM: a bf16 param without a master, or an ulp8 correction, rounded stochastically
  bool srs;    // SR_STATE: bf16 states, or q8 codes, rounded stochastically
};

template <class R>
inline void set_hyper(const double* hyper, int64_t flags, Args& a) {
  using H = typename R::Hyper;
  static_assert(sizeof(H) <= sizeof(a.hyper) && alignof(H) <= 8 && std::is_trivially_copyable_v<H>,
                "Args::hyper holds every rule's Hyper");
  const H h = R::make_hyper(hyper, flags);
  std::memcpy(a.hyper, &h, sizeof(H));
}

template <class R>
inline typename R::Hyper hyper_of(const Args& a) {
  typename R::Hyper h;
  std::memcpy(&h, a.hyper, sizeof(h));
  return h;
}

// Runs the kernel on elements [0, n) of one chunk (n <= kChunkElems).
using ChunkFn = void (*)(const Span&, int64_t n, const Args&);

// The kernel of a rule for one tensor's dtypes and the call's formats; nullptr for a combination the
// checks refuse (remainders need bf16 params, ulp8 corrections bf16 or fp16 ones). pick_<isa> for
// each instruction set, one translation unit each (cpu/optim_kernels_<isa>.cpp, every rule of
// csrc/optim_rules.h), so that they compile in parallel; pick_kernel chooses by `isa`.
ChunkFn pick_scalar(Rule rule, at::ScalarType param, at::ScalarType grad, Master master, Fmt fmt);
#if FASTAMP_X86_SIMD
ChunkFn pick_avx2(Rule rule, at::ScalarType param, at::ScalarType grad, Master master, Fmt fmt);
ChunkFn pick_avx512(Rule rule, at::ScalarType param, at::ScalarType grad, Master master, Fmt fmt);
#endif

inline ChunkFn pick_kernel(Rule rule, Isa isa, at::ScalarType param, at::ScalarType grad, Master master, Fmt fmt) {
#if FASTAMP_X86_SIMD
  if (isa == Isa::Avx512) return pick_avx512(rule, param, grad, master, fmt);
  if (isa == Isa::Avx2) return pick_avx2(rule, param, grad, master, fmt);
#endif
  (void)isa;
  return pick_scalar(rule, param, grad, master, fmt);
}

}  // namespace optim
}  // namespace cpu
}  // namespace fastamp
