// Host-side pieces shared by the CPU kernels of the q8 ops (fastamp::adamw_q8_ in adamw_q8.cpp,
// fastamp::sgd_q8_ / lion_q8_ in one_state.cpp): the check of a scale list and the float mode
// the vector codec (cpu/q8_vec.inc) computes in. Private to csrc/cpu/.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "cpu/isa.h"
#include "q8_math.h"

namespace fastamp {
namespace cpu {

// A scale list's tensor: defined, CPU, dense, uint8, contiguous, 1-D of ceil(numel / 32) bytes.
inline void check_q8_scales(const char* op, const char* list, size_t i, const at::Tensor& t, const at::Tensor& param) {
  TORCH_CHECK(t.defined(), "fastamp::", op, ": ", list, "[", i, "] is undefined");
  TORCH_CHECK(t.device().is_cpu(), "fastamp::", op, ": ", list, "[", i, "] must be a CPU tensor, got device ",
              t.device());
  TORCH_CHECK(t.layout() == at::kStrided, "fastamp::", op, ": ", list, "[", i,
              "] must be a dense (strided) tensor, got layout ", t.layout());
  TORCH_CHECK(t.scalar_type() == at::kByte, "fastamp::", op, ": ", list, "[", i, "] must have dtype ", at::kByte,
              ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "fastamp::", op, ": ", list, "[", i, "] must be contiguous, got strides ",
              t.strides());
  const int64_t blocks = (param.numel() + math::kQ8Block - 1) / math::kQ8Block;
  TORCH_CHECK(t.dim() == 1 && t.numel() == blocks, "fastamp::", op, ": ", list, "[", i, "] must be 1-D with ", blocks,
              " scale bytes (one per block of 32 of the ", param.numel(), " elements of params[", i, "]), got shape ",
              t.sizes());
}

// The vector codec computes with fp32 subnormals and round-to-nearest (as the reference does): a
// thread set to flush-to-zero / denormals-are-zero or another rounding mode (as
// torch.set_flush_denormal(True) does) runs its part of a q8 kernel with the default mode, which
// it gets back afterwards.
class DefaultFloatMode {
 public:
#if FASTAMP_X86_SIMD
  static constexpr unsigned kControl = 0xE040u;  // MXCSR: flush-to-zero, rounding mode, denormals-are-zero
  DefaultFloatMode() : saved_(_mm_getcsr() & kControl) {
    if (saved_ != 0) _mm_setcsr(_mm_getcsr() & ~kControl);
  }
  ~DefaultFloatMode() {
    if (saved_ != 0) _mm_setcsr(_mm_getcsr() | saved_);
  }

 private:
  unsigned saved_;
#endif
};

}  // namespace cpu
}  // namespace fastamp
