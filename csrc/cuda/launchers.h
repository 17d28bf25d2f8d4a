// Plain C++ interface of fastamp's CUDA kernels (csrc/cuda/amp.cu; optim.cu and the instances of
// optim.cuh's kernel, optim_<format>.cu).
//
// Raw device pointers, 64-bit sizes, a dtype enum and a stream: no torch, ATen or c10
// header, so the kernels compile with bare nvcc (tests/tools/test_cuda_compile.py) and the torch
// binding (csrc/cuda/bindings.cpp) stays a thin validation layer. Every launcher only
// enqueues work on `stream` (no host sync; its one launch table comes from the caller's
// TableMemory) and returns the first CUDA error it saw (cudaSuccess otherwise). The
// launches it makes are those of csrc/cuda/launch_plan.h. Semantics are those of
// fastamp/reference/.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "launch_plan.h"

namespace fastamp {
namespace cuda {

// Memory for the launch table of one op call, provided by the caller (the binding uses
// torch's caching allocators), so the kernels stay torch-free. The launcher asks at most
// once per call for device() and, unless the stream is capturing a CUDA graph, staging()
// then upload(), all before its first kernel. The methods may throw (allocation failure).
class TableMemory {
 public:
  // `bytes` of device memory on the current device, valid for all work the launcher
  // enqueues on `stream` (stream-ordered: reusable only by work enqueued after it there).
  virtual void* device(size_t bytes) = 0;
  // `bytes` (the device buffer's size) of page-locked host memory to pack the table in.
  virtual void* staging(size_t bytes) = 0;
  // Enqueues a non-blocking copy of the whole staging buffer into the device buffer on
  // `stream` and keeps the staging buffer from reuse until the stream has run the copy.
  virtual cudaError_t upload(cudaStream_t stream) = 0;

 protected:
  ~TableMemory() = default;
};

// ---- fastamp::unscale_check_ ----

struct GradRef {
  void* data;     // contiguous, on the current device; written only when write_back
  int64_t numel;  // may be 0
  DType dtype;
};

// Number of fp64 per-chunk partials `unscale_check` needs in `partials` when
// compute_sumsq is true (0 is valid: then `partials` may be null).
int64_t unscale_check_num_partials(const GradRef* grads, int64_t num_grads);

// found_inf: 1 fp32, set to 1.0 when any element is flagged, never reset.
// inv_scale: 1 fp32. sumsq_out: 1 fp32, always written (0 unless compute_sumsq).
// The sum of squares is reduced in a fixed order (per-thread fp32, then fp64 per chunk
// and across chunks), so it is reproducible run to run and independent of alignment.
cudaError_t unscale_check(const GradRef* grads, int64_t num_grads, float* found_inf, const float* inv_scale,
                          bool write_back, bool compute_sumsq, double* partials, float* sumsq_out, TableMemory& tables,
                          cudaStream_t stream);

// fastamp::unscale_check_stats_: unscale_check plus per-tensor health statistics written in
// the same pass. counts: int64 [num_grads, 3] (non-finite, zeros, fp16 underflow), absmax:
// fp32 [num_grads], both contiguous and overwritten (zeroed on `stream`, then accumulated
// per chunk with integer atomics: exact, so the result is the same every run).
cudaError_t unscale_check_stats(const GradRef* grads, int64_t num_grads, float* found_inf, const float* inv_scale,
                                bool write_back, bool compute_sumsq, double* partials, float* sumsq_out,
                                int64_t* counts, float* absmax, TableMemory& tables, cudaStream_t stream);

// ---- fastamp::unscale_check_partials_ and fastamp::sumsq_fold (gradient release) ----

// unscale_check without write_back, with compute_sumsq, keeping the per-chunk partials:
// chunk k of grad i (num_chunks(numel) of them; none for an empty grad) writes its fp64
// partial, the value unscale_check writes at that chunk's launch-order ordinal, to
// partials[offsets[i] + k]. Nothing is folded and no other slot is written. found_inf and
// inv_scale as unscale_check. offsets: host array, one per grad; the caller checks that
// every grad's slots lie inside `partials`.
cudaError_t unscale_check_partials(const GradRef* grads, int64_t num_grads, float* found_inf, const float* inv_scale,
                                   double* partials, const int64_t* offsets, TableMemory& tables, cudaStream_t stream);

// out (1 fp32) = the fold unscale_check makes of its partials (per-thread fp64 strided sums,
// then a fixed-order block sum, rounded once to fp32), applied to partials[index[0]],
// partials[index[1]], ..., partials[index[count - 1]]: index (device, int64) listing
// unscale_check's partials in its order gives its sum of squares bit for bit. An index
// outside [0, num_partials) makes out NaN. One single-block launch.
cudaError_t sumsq_fold(const double* partials, int64_t num_partials, const int64_t* index, int64_t count, float* out,
                       cudaStream_t stream);

// ---- fastamp::update_scale_ ----

cudaError_t update_scale(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker, const float* found_inf,
                         double growth_factor, double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                         double min_scale, double max_scale, cudaStream_t stream);

// ---- fastamp::optim_: one update rule x a master format x a state format (optim.cuh) ----

// The value optimised for each param: its fp32 master (any float param), the exact master of a
// bf16 param and an int16 remainder, the ulp8 master of a bf16 / fp16 param and an int8
// correction (reference/ulp8.py), or the param itself.
enum class MasterKind : int32_t { kNone = 0, kFloat32 = 1, kRemainder = 2, kUlp8 = 3 };

// The most state tensors of one param: AdamW's three states as q8 codes + scales.
constexpr int kOptimMaxStateTensors = 6;

struct OptimTensorRef {
  void* param;       // param_dtype, rewritten
  const void* grad;  // grad_dtype, read only
  void* master;      // by the call's master kind: float, int16 or int8, numel elements; or null
  // The param's state tensors, state by state (the rule's order): one tensor each (fp32 or bf16,
  // numel elements), or two for q8 (uint8 codes of numel elements, then ceil(numel / 32) scale
  // bytes); null past the call's states.
  void* states[kOptimMaxStateTensors];
  int64_t numel;  // of the param, grad, master and dense states / codes
  DType param_dtype;
  DType grad_dtype;
};

struct OptimCall {
  OptimRule rule;
  StateFormat format;  // of every state (kFloat32 when the rule keeps none)
  MasterKind master;   // of every param
  int num_states;      // the states the rule keeps with these hyper and flags
  double hyper[3];     // AdamW [beta1, beta2, eps]; SGD [momentum, dampening, weight_decay]; Lion [beta1, beta2]
  int64_t flags;       // csrc/optim_flags.h
  // fp32 on the device: tensor i reads step_scalars + i * scalar_stride (0: one shared row of the
  // rule's k scalars; k: row i of [n, k]).
  const float* step_scalars;
  int64_t scalar_stride;
  const float* found_inf;  // null, or 1 fp32 read on the device: non-zero (NaN too) writes nothing
  const int64_t* rng;      // null, or int64 [seed, counter] on the device (read under the SR flags)
  int64_t rng_base;        // tensor i draws the streams 4 * (rng_base + i) + k (k = 0 param, 1 + j state j)
};

// Whether this build has the kernels of (rule, format): the table of optim_combos.h.
bool optim_compiled(OptimRule rule, StateFormat format);

// The semantics of fastamp.reference.optim_. One launch per (param, grad) dtype pair among the
// tensors, each over the table of launch_plan.h's plan_optim. cudaErrorInvalidValue (nothing
// enqueued) for a combination this build lacks or a call the kernels cannot take (SR flags
// without rng, a state count the rule cannot keep).
cudaError_t optim(const OptimTensorRef* tensors, int64_t num_tensors, const OptimCall& call, TableMemory& tables,
                  cudaStream_t stream);

namespace detail {
// The state formats' launchers optim() hands a call to, one translation unit each (optim_fp32.cu,
// optim_bf16.cu, optim_q8.cu: every rule whose kCudaStates lists the format), so that the instances
// compile in parallel.
#define FASTAMP_CUDA_OPTIM_DECL_(fmt)                                                                \
  cudaError_t optim_##fmt(const OptimTensorRef* tensors, int64_t num_tensors, const OptimCall& call, \
                          TableMemory& tables, cudaStream_t stream);
FASTAMP_CUDA_OPTIM_DECL_(fp32)
FASTAMP_CUDA_OPTIM_DECL_(bf16)
FASTAMP_CUDA_OPTIM_DECL_(q8)
#undef FASTAMP_CUDA_OPTIM_DECL_
}  // namespace detail

}  // namespace cuda
}  // namespace fastamp
