// Persistent launch tables of fastamp::optim_ on the CPU (used by csrc/direct_call.cpp).
//
// An optimizer's launch plan calls the same op with the same params, masters and states at every
// step; only the grads (and the step scalars, rng and hyperparameters) are new. A table holds those
// tensors (strong references), their data pointers, element counts and dtypes and the op's chunk
// list, checked in full once when it is made, for any rule and any master and state format. A run
// checks, in one pass, what can change between two steps without the optimizer noticing (each
// tensor's data pointer, element count, dtype and contiguity, so a `.data` rebind, a resize or a
// dtype view is seen) and the new grads (dense CPU, a kernel dtype, contiguous, as many elements as
// their param), then runs optim_'s kernel, bit for bit the op's. Anything else declines (false,
// nothing written): the caller takes the op.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <optional>

namespace fastamp {
namespace cpu {

struct OptimTable;

struct OptimTableDeleter {
  void operator()(OptimTable* t) const;
};
using OptimTablePtr = std::unique_ptr<OptimTable, OptimTableDeleter>;

// A table of optim_'s tensors for `rule` with `flags` (AMSGRAD decides AdamW's states; SGD keeps a
// momentum buffer when `states` is not empty); throws c10::Error (the op's message) on what the op
// refuses.
OptimTablePtr optim_table_new(at::TensorList params, at::TensorList masters, at::TensorList states,
                              c10::string_view rule, int64_t flags);

int64_t optim_table_size(const OptimTable& table);

// optim_(table's tensors, grads, ...) when everything fits the table: true; false when it declines
// (nothing written): another rule, AMSGRAD or SGD's momentum zero where the table's was not (or the
// reverse), a changed tensor, a grad it cannot take. Throws c10::Error (nothing written) on what the
// op refuses.
bool optim_table_run(OptimTable& table, at::TensorList grads, const at::Tensor& step_scalars,
                     const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& rng, int64_t rng_base,
                     c10::string_view rule, at::ArrayRef<double> hyper, int64_t flags);

}  // namespace cpu
}  // namespace fastamp
