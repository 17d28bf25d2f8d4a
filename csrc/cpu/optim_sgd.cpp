// The generic optimizer kernel of fastamp::optim_ (cpu/optim.h) for the rule SGD: its instances for
// every param dtype x grad dtype x master format x state format, per instruction set. One translation
// unit per rule, so that the rules compile in parallel; the host side is cpu/optim.cpp.
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
#include "q8_math.h"

namespace fastamp {
namespace cpu {
namespace optim {
namespace {

#define FASTAMP_ISA_KERNELS "cpu/optim_kernels.inc"
#include "cpu/per_isa.inc"  // namespaces avx512 and avx2: the loops of optim_kernels.inc per ISA

#include "cpu/optim_pick.inc"  // pick_rule<Rule>

}  // namespace

ChunkFn pick_sgd(Isa isa, at::ScalarType param, at::ScalarType grad, Master master, Fmt fmt) {
  return pick_rule<SgdRule>(isa, param, grad, master, fmt);
}

}  // namespace optim
}  // namespace cpu
}  // namespace fastamp
