// Persistent launch tables of fastamp::adamw_ on the CPU (used by csrc/direct_call.cpp).
//
// An optimizer's launch plan calls the same op with the same params and state tensors at
// every step; only the grads are new. A table holds those tensors (strong references), their
// data pointers, element counts and the op's chunk list, checked in full once when it is
// made. A run checks, in one pass, what can change between two steps without the optimizer
// noticing (each tensor's data pointer, element count, dtype and contiguity, so a `.data`
// rebind, a resize or a dtype view is seen) and the new grads (dense CPU, one kernel dtype,
// contiguous, as many elements as their param), then runs adamw_'s kernel, bit for bit the
// op's. Anything else declines (false, nothing written): the caller takes the op.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <optional>

namespace fastamp {
namespace cpu {

struct AdamWTable;

struct AdamWTableDeleter {
  void operator()(AdamWTable* t) const;
};
using AdamWTablePtr = std::unique_ptr<AdamWTable, AdamWTableDeleter>;

// A table of adamw_'s tensors; throws c10::Error (the op's message) on what the op refuses.
AdamWTablePtr adamw_table_new(at::TensorList params, at::TensorList masters, at::TensorList exp_avgs,
                              at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, bool amsgrad);

int64_t adamw_table_size(const AdamWTable& table);

// adamw_(table's tensors, grads, ...) when everything fits the table: true; false when it
// declines (nothing written). Throws c10::Error (nothing written) on what the op refuses.
bool adamw_table_run(AdamWTable& table, at::TensorList grads, const at::Tensor& step_scalars,
                     const std::optional<at::Tensor>& found_inf, double beta1, double beta2, double eps, bool amsgrad,
                     bool maximize);

}  // namespace cpu
}  // namespace fastamp
