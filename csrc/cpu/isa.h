// Instruction-set selection for the CPU kernels (private to csrc/cpu/).
//
// Every kernel is compiled once per instruction set into its own namespace, inside a
// region that enables that instruction set for the functions defined there only
// (FASTAMP_ISA_BEGIN_*), so the rest of the library stays baseline x86-64 and a CPU
// without AVX2 never executes an AVX2 instruction. Which one runs is picked per call by
// active_isa(): the best the CPU (and OS) supports, capped by the environment variable
// FASTAMP_CPU_ISA=scalar|avx2|avx512 (for tests and benchmarks of the other paths).
//
// The AVX-512 level needs AVX512F and AVX512BW (16-bit lanes: the gradient statistics of
// fp16/bf16 grads); a CPU with AVX512F only (Xeon Phi) runs the AVX2 kernels.
//
// FMA is deliberately not enabled in the AVX2 target, and the build uses
// -ffp-contract=off, because the reference rounds every multiply and add separately.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define FASTAMP_X86_SIMD 1
#include <immintrin.h>
#else
#define FASTAMP_X86_SIMD 0
#endif

#if FASTAMP_X86_SIMD
#if defined(__clang__)
#define FASTAMP_ISA_BEGIN_AVX2 \
  _Pragma("clang attribute push(__attribute__((target(\"avx2,f16c\"))), apply_to = function)")
#define FASTAMP_ISA_BEGIN_AVX512 \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx2,f16c\"))), apply_to = function)")
#define FASTAMP_ISA_END _Pragma("clang attribute pop")
#else
// GCC 12 reports -Wmaybe-uninitialized inside its own AVX-512 intrinsics (their
// _mm512_undefined_* placeholders); the values are always defined.
#define FASTAMP_ISA_BEGIN_AVX2                                                                    \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,f16c\")") _Pragma("GCC diagnostic push") \
      _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")
#define FASTAMP_ISA_BEGIN_AVX512                                                                                   \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx2,f16c\")") _Pragma("GCC diagnostic push") \
      _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")
#define FASTAMP_ISA_END _Pragma("GCC diagnostic pop") _Pragma("GCC pop_options")
#endif
#endif

namespace fastamp {
namespace cpu {

enum class Isa { Scalar = 0, Avx2 = 1, Avx512 = 2 };

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512:
      return "avx512";
    case Isa::Avx2:
      return "avx2";
    default:
      return "scalar";
  }
}

// The best instruction set this CPU and OS support (__builtin_cpu_supports also checks
// that the OS saves the wide registers).
inline Isa supported_isa() {
#if FASTAMP_X86_SIMD
  static const Isa best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("f16c"))
      return Isa::Avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return Isa::Avx2;
    return Isa::Scalar;
  }();
  return best;
#else
  return Isa::Scalar;
#endif
}

// The instruction set a kernel call uses: supported_isa(), lowered by FASTAMP_CPU_ISA.
// Read on every call (a getenv is negligible next to a kernel) so tests can switch paths.
inline Isa active_isa() {
  const Isa best = supported_isa();
  const char* env = std::getenv("FASTAMP_CPU_ISA");
  if (env == nullptr || *env == '\0') return best;
  Isa want;
  if (std::strcmp(env, "scalar") == 0) {
    want = Isa::Scalar;
  } else if (std::strcmp(env, "avx2") == 0) {
    want = Isa::Avx2;
  } else if (std::strcmp(env, "avx512") == 0) {
    want = Isa::Avx512;
  } else {
    TORCH_CHECK(false, "fastamp: FASTAMP_CPU_ISA must be one of scalar, avx2, avx512, got '", env, "'");
  }
  return static_cast<int>(want) < static_cast<int>(best) ? want : best;
}

}  // namespace cpu
}  // namespace fastamp
