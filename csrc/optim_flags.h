// The flags of fastamp::optim_, the one optimizer op (their Python twins: MAXIMIZE ... SR_STATE in
// fastamp/reference/optim.py, which defines what each does). No torch header: the CUDA kernels
// compile with plain nvcc.
#pragma once

#include <cstdint>

namespace fastamp {
namespace optim_flags {

constexpr int64_t kMaximize = 1;  // minimise -loss
constexpr int64_t kAmsgrad = 2;   // AdamW: a third state, max_exp_avg_sq, and its root in the denominator
constexpr int64_t kNesterov = 4;  // SGD: Nesterov momentum
constexpr int64_t kSrParam = 8;   // a bf16 param without a master, or an ulp8 correction, rounded stochastically
constexpr int64_t kSrState = 16;  // bf16 states, or q8 codes, rounded stochastically (stream 4 * id + 1 + j)
constexpr int64_t kAll = kMaximize | kAmsgrad | kNesterov | kSrParam | kSrState;

}  // namespace optim_flags
}  // namespace fastamp
