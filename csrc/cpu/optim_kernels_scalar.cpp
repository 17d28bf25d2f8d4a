// The generic optimizer kernel of fastamp::optim_ (cpu/optim.h), portable: cpu/optim_scalar.h's loops
// with every rule of csrc/optim_rules.h x param dtype x grad dtype x master format x state format,
// for CPUs without AVX2 (and FASTAMP_CPU_ISA=scalar). Its vector twins are optim_kernels_avx512.cpp
// and optim_kernels_avx2.cpp.
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

namespace fastamp {
namespace cpu {
namespace optim {
namespace scalar {
namespace {

#include "cpu/optim_pick.inc"  // pick over this namespace's dense_chunk and q8_chunk

}  // namespace
}  // namespace scalar

ChunkFn pick_scalar(Rule rule, at::ScalarType param, at::ScalarType grad, Master master, Fmt fmt) {
  return scalar::pick(rule, param, grad, master, fmt);
}

}  // namespace optim
}  // namespace cpu
}  // namespace fastamp
