// The generic CPU optimizer kernel of fastamp::optim_ (semantics: fastamp.reference.optim_): what its
// host side (cpu/optim.cpp: checks, chunks, threads, the persistent tables) and its kernels (one
// translation unit per rule, cpu/optim_<rule>.cpp, each compiling cpu/optim_kernels.inc per
// instruction set) share. Private to csrc/cpu/.
//
// A kernel is one update rule (AdamW, SGD, Lion) x the param dtype P x the grad dtype G x the master
// format (fp32, int16 remainder, int8 ulp8, none) x the state format (fp32, bf16, q8 codes): a
// ChunkFn runs it on one chunk of one tensor. What varies within one of them is read at run time
// from Args: the rule's flags (maximize, amsgrad, nesterov), the number of states (AdamW 2 or 3, SGD
// 0 or 1), and the stochastic rounding of the param and of the states (SR_PARAM, SR_STATE).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

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
  float s[4];  // the step-scalar row (the rule's k <= 4 floats)
  // the hyperparameters in fp32 (1 - beta computed in fp64, rounded once, as the reference's _f32),
  // as each rule's set_hyper (cpu/optim_scalar.h) writes them
  float h[5];
  int states;     // the states kept: AdamW 2 (3 with amsgrad), SGD 0 or 1, Lion 1
  bool maximize;  // MAXIMIZE
  bool amsgrad;   // AdamW: AMSGRAD
  bool nesterov;  // SGD: NESTEROV
  bool has_wd;    // SGD: weight_decay != 0 (in fp64, as the reference tests it)
  bool srp;       // SR_PARAM: a bf16 param without a master, or an ulp8 correction, rounded stochastically
  bool srs;       // SR_STATE: bf16 states, or q8 codes, rounded stochastically
};

// Runs the kernel on elements [0, n) of one chunk (n <= kChunkElems).
using ChunkFn = void (*)(const Span&, int64_t n, const Args&);

// The kernel of a rule for one tensor's dtypes and the call's formats on `isa`; nullptr for a
// combination the checks refuse (remainders need bf16 params, ulp8 corrections bf16 or fp16 ones):
// pick_<name> for each rule of csrc/optim_rules.h, one per translation unit (cpu/optim_<name>.cpp),
// so that the rules compile in parallel.
#define FASTAMP_CPU_PICK_DECL_(Name, name, max_states) \
  ChunkFn pick_##name(Isa isa, at::ScalarType param, at::ScalarType grad, Master master, Fmt fmt);
FASTAMP_OPTIM_RULES(FASTAMP_CPU_PICK_DECL_)
#undef FASTAMP_CPU_PICK_DECL_

}  // namespace optim
}  // namespace cpu
}  // namespace fastamp
