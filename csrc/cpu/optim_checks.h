// Argument checks of the CPU optimizer op optim_ and its tables (cpu/optim.cpp); private to
// csrc/cpu/. Every message reads "fastamp::<op>: what is wrong, got ...".
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace fastamp {
namespace cpu {

inline bool is_kernel_float(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

// One tensor of an op's list: defined, CPU, dense, of `dtype` (when given), contiguous, and
// with as many elements as params[i].
inline void check_list_tensor(const char* op, const char* list, size_t i, const at::Tensor& t, const at::Tensor& param,
                              std::optional<at::ScalarType> dtype) {
  TORCH_CHECK(t.defined(), "fastamp::", op, ": ", list, "[", i, "] is undefined");
  TORCH_CHECK(t.device().is_cpu(), "fastamp::", op, ": ", list, "[", i, "] must be a CPU tensor, got device ",
              t.device());
  TORCH_CHECK(t.layout() == at::kStrided, "fastamp::", op, ": ", list, "[", i,
              "] must be a dense (strided) tensor, got layout ", t.layout());
  if (dtype) {
    TORCH_CHECK(t.scalar_type() == *dtype, "fastamp::", op, ": ", list, "[", i, "] must have dtype ", *dtype, ", got ",
                t.scalar_type());
  }
  TORCH_CHECK(t.is_contiguous(), "fastamp::", op, ": ", list, "[", i, "] must be contiguous, got strides ",
              t.strides());
  TORCH_CHECK(t.numel() == param.numel(), "fastamp::", op, ": ", list, "[", i, "] has ", t.numel(),
              " elements but params[", i, "] has ", param.numel());
}

// step_scalars: `k` fp32 shared by every tensor (shape [k]) or one row of `k` per tensor
// (shape [n, k], row i for tensor i). Returns the row stride in floats: 0 (shared) or k.
inline int64_t check_step_scalars(const char* op, const at::Tensor& t, size_t n, int64_t k, const char* layout) {
  TORCH_CHECK(t.device().is_cpu(), "fastamp::", op, ": step_scalars must be a CPU tensor, got device ", t.device());
  const bool shared = t.dim() == 1 && t.size(0) == k;
  const bool rows = t.dim() == 2 && t.size(0) == static_cast<int64_t>(n) && t.size(1) == k;
  TORCH_CHECK(t.scalar_type() == at::kFloat && (shared || rows) && t.is_contiguous(), "fastamp::", op,
              ": step_scalars must be a contiguous float32 tensor of shape [", k, "] or [", n, ", ", k, "] (", layout,
              " shared by all tensors, or one row per tensor), got dtype ", t.scalar_type(), ", shape ", t.sizes(),
              " and strides ", t.strides());
  return rows ? k : 0;
}

inline void check_found_inf(const char* op, const std::optional<at::Tensor>& found_inf) {
  if (!found_inf) return;
  TORCH_CHECK(found_inf->device().is_cpu(), "fastamp::", op, ": found_inf must be a CPU tensor, got device ",
              found_inf->device());
  TORCH_CHECK(found_inf->scalar_type() == at::kFloat && found_inf->numel() == 1, "fastamp::", op,
              ": found_inf must be a 1-element float32 tensor, got dtype ", found_inf->scalar_type(), " and shape ",
              found_inf->sizes());
}

// Non-zero (or NaN) found_inf skips the whole step. A CPU tensor: reading it is no device sync.
inline bool skip_step(const std::optional<at::Tensor>& found_inf) {
  return found_inf && *found_inf->data_ptr<float>() != 0.0f;
}

inline void check_rng(const char* op, const std::optional<at::Tensor>& rng) {
  if (!rng) return;
  TORCH_CHECK(rng->device().is_cpu(), "fastamp::", op, ": rng must be a CPU tensor, got device ", rng->device());
  TORCH_CHECK(rng->scalar_type() == at::kLong && rng->numel() == 2 && rng->is_contiguous(), "fastamp::", op,
              ": rng must be a contiguous int64 tensor of 2 elements [seed, counter], got dtype ", rng->scalar_type(),
              " and shape ", rng->sizes());
}

}  // namespace cpu
}  // namespace fastamp
