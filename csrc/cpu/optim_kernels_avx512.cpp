// The generic optimizer kernel of fastamp::optim_ (cpu/optim.h) for AVX512: cpu/optim_kernels.inc compiled
// for this instruction set only, with every rule of csrc/optim_rules.h x param dtype x grad dtype x
// master format x state format. One translation unit per instruction set (avx512, avx2, scalar), so
// that they compile in parallel and a new rule adds no file here; the host side is cpu/optim.cpp.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "cpu/isa.h"
#include "cpu/optim.h"
#include "cpu/optim_scalar.h"
#include "fastamp_math.h"
#include "optim_rules.h"
#include "q8_math.h"

#if FASTAMP_X86_SIMD
namespace fastamp {
namespace cpu {
namespace optim {
namespace {

#define FASTAMP_ISA_ONLY_AVX512
#define FASTAMP_ISA_KERNELS "cpu/optim_kernels.inc"
#include "cpu/per_isa.inc"  // namespace avx512: the loops of optim_kernels.inc and its pick (optim_pick.inc)
#undef FASTAMP_ISA_ONLY_AVX512

}  // namespace

ChunkFn pick_avx512(Rule rule, at::ScalarType param, at::ScalarType grad, Master master, Fmt fmt) {
  return avx512::pick(rule, param, grad, master, fmt);
}

}  // namespace optim
}  // namespace cpu
}  // namespace fastamp
#endif  // FASTAMP_X86_SIMD
