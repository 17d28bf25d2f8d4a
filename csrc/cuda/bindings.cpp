// CUDA registrations of fastamp's native ops: validation and the current stream here, the
// kernels behind the torch-free interface of launchers.h (amp.cu; optim.cu and its instances
// optim_<format>.cu). Built only
// when setup.py finds nvcc and a CUDA-enabled torch. Nothing here reads a device value on
// the host; temporaries (the launch table included) come from torch's caching allocators
// on the current stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "launchers.h"
#include "op_signatures.h"
#include "optim_flags.h"

namespace fastamp {
namespace cuda {
namespace {

DType kernel_dtype(const char* op, const char* what, int64_t i, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "fastamp::", op, ": ", what, "[", i, "] must be float32, float16 or bfloat16, got ",
                  t.scalar_type());
  }
  return DType::kFloat32;  // unreachable
}

void check_cuda_scalar(const char* op, const char* what, const at::Tensor& t, at::ScalarType dtype,
                       const at::Device& device) {
  TORCH_CHECK(t.is_cuda(), "fastamp::", op, ": ", what, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.device() == device, "fastamp::", op, ": ", what, " is on ", t.device(), " but expected ", device);
  TORCH_CHECK(t.scalar_type() == dtype, "fastamp::", op, ": ", what, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.numel() == 1, "fastamp::", op, ": ", what, " must have 1 element, got ", t.numel());
}

void check_list_tensor(const char* op, const char* what, int64_t i, const at::Tensor& t, const at::Device& device,
                       int64_t numel) {
  TORCH_CHECK(t.defined(), "fastamp::", op, ": ", what, "[", i, "] is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, "fastamp::", op, ": ", what, "[", i, "] must be strided (dense), got ",
              t.layout());
  TORCH_CHECK(t.device() == device, "fastamp::", op, ": ", what, "[", i, "] is on ", t.device(), " but expected ",
              device);
  TORCH_CHECK(t.is_contiguous(), "fastamp::", op, ": ", what, "[", i, "] must be contiguous");
  if (numel >= 0) {
    TORCH_CHECK(t.numel() == numel, "fastamp::", op, ": ", what, "[", i, "] has ", t.numel(), " elements but params[",
                i, "] has ", numel);
  }
}

void check_launch(const char* op, cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "fastamp::", op, ": CUDA error: ", cudaGetErrorString(err));
}

// The launch table of one op call, from torch's caching allocators. The device buffer is
// allocated on the current stream, where every kernel reading it is enqueued, so freeing
// it when the op returns is stream-ordered (no record_stream needed); during graph capture
// it comes from the capture's private pool. The pinned staging buffer is copied with
// copy_(non_blocking=true), which records an event so the host allocator reuses it only
// once the copy has run.
class TorchTableMemory final : public TableMemory {
 public:
  explicit TorchTableMemory(const at::Device& device) : device_(device) {}

  void* device(size_t bytes) override {
    device_table_ = at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().device(device_).dtype(at::kByte));
    return device_table_.data_ptr();
  }

  void* staging(size_t bytes) override {
    staging_ = at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    return staging_.data_ptr();
  }

  cudaError_t upload(cudaStream_t stream) override {
    TORCH_INTERNAL_ASSERT(stream == c10::cuda::getCurrentCUDAStream(device_.index()).stream(),
                          "fastamp: launch tables are uploaded on the current stream");
    TORCH_INTERNAL_ASSERT(device_table_.numel() == staging_.numel(), "fastamp: launch table buffers differ in size");
    device_table_.copy_(staging_, /*non_blocking=*/true);
    return cudaSuccess;
  }

 private:
  at::Device device_;
  at::Tensor device_table_;
  at::Tensor staging_;
};

// unscale_check_ and, with counts/absmax, unscale_check_stats_.
at::Tensor unscale_check_impl(const char* op, at::TensorList grads, const at::Tensor& found_inf,
                              const at::Tensor& inv_scale, bool write_back, bool compute_sumsq,
                              const at::Tensor* counts, const at::Tensor* absmax) {
  TORCH_CHECK(found_inf.is_cuda(), "fastamp::", op, ": found_inf must be a CUDA tensor, got device ",
              found_inf.device());
  const at::Device device = found_inf.device();
  check_cuda_scalar(op, "found_inf", found_inf, at::kFloat, device);
  check_cuda_scalar(op, "inv_scale", inv_scale, at::kFloat, device);
  std::vector<GradRef> refs;
  refs.reserve(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    check_list_tensor(op, "grads", static_cast<int64_t>(i), g, device, -1);
    const DType dt = kernel_dtype(op, "grads", static_cast<int64_t>(i), g);
    refs.push_back(GradRef{g.numel() > 0 ? g.data_ptr() : nullptr, g.numel(), dt});
  }
  const auto num_grads = static_cast<int64_t>(grads.size());
  if (counts != nullptr) {
    TORCH_CHECK(counts->device() == device, "fastamp::", op, ": counts is on ", counts->device(), " but expected ",
                device);
    TORCH_CHECK(counts->scalar_type() == at::kLong, "fastamp::", op, ": counts must be int64, got ",
                counts->scalar_type());
    TORCH_CHECK(counts->dim() == 2 && counts->size(0) == num_grads && counts->size(1) == 3, "fastamp::", op,
                ": counts must have shape [", num_grads, ", 3], got ", counts->sizes());
    TORCH_CHECK(counts->is_contiguous(), "fastamp::", op, ": counts must be contiguous");
    TORCH_CHECK(absmax->device() == device, "fastamp::", op, ": absmax is on ", absmax->device(), " but expected ",
                device);
    TORCH_CHECK(absmax->scalar_type() == at::kFloat, "fastamp::", op, ": absmax must be float32, got ",
                absmax->scalar_type());
    TORCH_CHECK(absmax->dim() == 1 && absmax->size(0) == num_grads, "fastamp::", op, ": absmax must have shape [",
                num_grads, "], got ", absmax->sizes());
    TORCH_CHECK(absmax->is_contiguous(), "fastamp::", op, ": absmax must be contiguous");
  }

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  TorchTableMemory tables(device);
  at::Tensor sumsq = at::empty({}, found_inf.options());
  at::Tensor partials;
  double* partials_ptr = nullptr;
  if (compute_sumsq) {
    const int64_t n = unscale_check_num_partials(refs.data(), static_cast<int64_t>(refs.size()));
    if (n > 0) {
      partials = at::empty({n}, found_inf.options().dtype(at::kDouble));
      partials_ptr = partials.data_ptr<double>();
    }
  }
  if (counts != nullptr) {
    check_launch(op, unscale_check_stats(refs.data(), num_grads, found_inf.data_ptr<float>(),
                                         inv_scale.data_ptr<float>(), write_back, compute_sumsq, partials_ptr,
                                         sumsq.data_ptr<float>(), num_grads > 0 ? counts->data_ptr<int64_t>() : nullptr,
                                         num_grads > 0 ? absmax->data_ptr<float>() : nullptr, tables, stream));
  } else {
    check_launch(op, unscale_check(refs.data(), num_grads, found_inf.data_ptr<float>(), inv_scale.data_ptr<float>(),
                                   write_back, compute_sumsq, partials_ptr, sumsq.data_ptr<float>(), tables, stream));
  }
  return sumsq;
}

at::Tensor unscale_check_cuda(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale,
                              bool write_back, bool compute_sumsq) {
  return unscale_check_impl("unscale_check_", grads, found_inf, inv_scale, write_back, compute_sumsq, nullptr, nullptr);
}

at::Tensor unscale_check_stats_cuda(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale,
                                    bool write_back, bool compute_sumsq, const at::Tensor& counts,
                                    const at::Tensor& absmax) {
  return unscale_check_impl("unscale_check_stats_", grads, found_inf, inv_scale, write_back, compute_sumsq, &counts,
                            &absmax);
}

// Gradient release's check pass: grad i's chunk partials (unscale_check_'s values) into
// partials[offsets[i] ..], num_chunks(numel) of them; nothing folded, grads not written.
void unscale_check_partials_cuda(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale,
                                 const at::Tensor& partials, at::IntArrayRef offsets) {
  constexpr const char* op = "unscale_check_partials_";
  TORCH_CHECK(found_inf.is_cuda(), "fastamp::", op, ": found_inf must be a CUDA tensor, got device ",
              found_inf.device());
  const at::Device device = found_inf.device();
  check_cuda_scalar(op, "found_inf", found_inf, at::kFloat, device);
  check_cuda_scalar(op, "inv_scale", inv_scale, at::kFloat, device);
  TORCH_CHECK(partials.is_cuda(), "fastamp::", op, ": partials must be a CUDA tensor, got device ", partials.device());
  TORCH_CHECK(partials.device() == device, "fastamp::", op, ": partials is on ", partials.device(), " but expected ",
              device);
  TORCH_CHECK(partials.scalar_type() == at::kDouble, "fastamp::", op, ": partials must have dtype Double, got ",
              partials.scalar_type());
  TORCH_CHECK(partials.dim() == 1 && partials.is_contiguous(), "fastamp::", op,
              ": partials must be a contiguous 1-D tensor, got shape ", partials.sizes());
  TORCH_CHECK(offsets.size() == grads.size(), "fastamp::", op, ": offsets must have one entry per grad (", grads.size(),
              "), got ", offsets.size());
  std::vector<GradRef> refs;
  refs.reserve(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    check_list_tensor(op, "grads", static_cast<int64_t>(i), g, device, -1);
    const DType dt = kernel_dtype(op, "grads", static_cast<int64_t>(i), g);
    const int64_t k = g.numel() > 0 ? num_chunks(g.numel()) : 0;
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] <= partials.numel() - k, "fastamp::", op, ": offsets[", i,
                "] = ", offsets[i], " leaves no room for the ", k, " partials of grads[", i, "] in ", partials.numel(),
                " slots");
    refs.push_back(GradRef{g.numel() > 0 ? g.data_ptr() : nullptr, g.numel(), dt});
  }
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  TorchTableMemory tables(device);
  check_launch(op, unscale_check_partials(refs.data(), static_cast<int64_t>(refs.size()), found_inf.data_ptr<float>(),
                                          inv_scale.data_ptr<float>(), partials.data_ptr<double>(), offsets.data(),
                                          tables, stream));
}

// unscale_check_'s fold of partials[index] in index order (index on the device; an index out
// of range makes the result NaN: checking it here would read device memory on the host).
at::Tensor sumsq_fold_cuda(const at::Tensor& partials, const at::Tensor& index) {
  constexpr const char* op = "sumsq_fold";
  TORCH_CHECK(partials.is_cuda(), "fastamp::", op, ": partials must be a CUDA tensor, got device ", partials.device());
  const at::Device device = partials.device();
  TORCH_CHECK(partials.scalar_type() == at::kDouble, "fastamp::", op, ": partials must have dtype Double, got ",
              partials.scalar_type());
  TORCH_CHECK(partials.dim() == 1 && partials.is_contiguous(), "fastamp::", op,
              ": partials must be a contiguous 1-D tensor, got shape ", partials.sizes());
  TORCH_CHECK(index.device() == device, "fastamp::", op, ": index is on ", index.device(), " but partials on ", device,
              " (keep the index on the device: it is read there)");
  TORCH_CHECK(index.scalar_type() == at::kLong, "fastamp::", op, ": index must have dtype Long, got ",
              index.scalar_type());
  TORCH_CHECK(index.dim() == 1 && index.is_contiguous(), "fastamp::", op,
              ": index must be a contiguous 1-D tensor, got shape ", index.sizes());
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  at::Tensor out = at::empty({}, partials.options().dtype(at::kFloat));
  check_launch(op, sumsq_fold(partials.data_ptr<double>(), partials.numel(), index.data_ptr<int64_t>(), index.numel(),
                              out.data_ptr<float>(), stream));
  return out;
}

void update_scale_cuda(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& hysteresis_tracker,
                       const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                       int64_t growth_interval, int64_t hysteresis, double min_scale, double max_scale) {
  constexpr const char* op = "update_scale_";
  TORCH_CHECK(scale.is_cuda(), "fastamp::", op, ": scale must be a CUDA tensor, got device ", scale.device());
  const at::Device device = scale.device();
  check_cuda_scalar(op, "scale", scale, at::kFloat, device);
  check_cuda_scalar(op, "growth_tracker", growth_tracker, at::kInt, device);
  check_cuda_scalar(op, "hysteresis_tracker", hysteresis_tracker, at::kInt, device);
  check_cuda_scalar(op, "found_inf", found_inf, at::kFloat, device);

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  check_launch(op, update_scale(scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
                                hysteresis_tracker.data_ptr<int32_t>(), found_inf.data_ptr<float>(), growth_factor,
                                backoff_factor, growth_interval, hysteresis, min_scale, max_scale, stream));
}

// step_scalars: `count` fp32 shared by every tensor (shape [count]) or one row per tensor (shape
// [n, count], row i for tensor i). Returns the row stride in floats: 0 (shared) or count.
int64_t check_step_scalars(const char* op, const at::Tensor& t, const at::Device& device, size_t n, int64_t count) {
  TORCH_CHECK(t.device() == device, "fastamp::", op, ": step_scalars is on ", t.device(), " but params are on ",
              device);
  const bool shared = t.dim() == 1 && t.size(0) == count;
  const bool rows = t.dim() == 2 && t.size(0) == static_cast<int64_t>(n) && t.size(1) == count;
  TORCH_CHECK(t.scalar_type() == at::kFloat && (shared || rows) && t.is_contiguous(), "fastamp::", op,
              ": step_scalars must be a contiguous float32 tensor of shape [", count, "] or [", n, ", ", count,
              "] (shared by all tensors, or one row per tensor), got dtype ", t.scalar_type(), ", shape ", t.sizes(),
              " and strides ", t.strides());
  return rows ? count : 0;
}

// optim_'s found_inf and rng (step_scalars: check_step_scalars).
const float* optional_found_inf(const char* op, const std::optional<at::Tensor>& found_inf, const at::Device& device) {
  if (!found_inf.has_value() || !found_inf->defined()) return nullptr;
  check_cuda_scalar(op, "found_inf", *found_inf, at::kFloat, device);
  return found_inf->data_ptr<float>();
}

const int64_t* optional_rng(const char* op, const std::optional<at::Tensor>& rng, const at::Device& device) {
  if (!rng.has_value() || !rng->defined()) return nullptr;
  TORCH_CHECK(rng->device() == device, "fastamp::", op, ": rng is on ", rng->device(), " but params are on ", device);
  TORCH_CHECK(rng->scalar_type() == at::kLong, "fastamp::", op, ": rng must be int64 [seed, counter], got ",
              rng->scalar_type());
  TORCH_CHECK(rng->numel() == 2 && rng->is_contiguous(), "fastamp::", op,
              ": rng must be a contiguous 2-element tensor [seed, counter], got shape ", rng->sizes());
  return rng->data_ptr<int64_t>();
}

// ---- optim_: the one optimizer op (semantics: fastamp.reference.optim_) ----

// The rules: csrc/optim_rules.h's kRuleDefs.

const char* state_format_name(StateFormat f) {
  return f == StateFormat::kQ8 ? "q8 (uint8)" : (f == StateFormat::kBFloat16 ? "bfloat16" : "float32");
}

// The name of state j's list `s` (of `per`) in messages: the per-rule ops' names, the state's key
// plus "s" (exp_avgs, momentum_buffers) or, for q8, "_codes" / "_scales" (exp_avg_sq_codes).
std::string state_list_name(const char* key, int per, int s) {
  return std::string(key) + (per == 1 ? "s" : (s == 0 ? "_codes" : "_scales"));
}

// What the states list holds, for the message of a wrong count: "expected 2 exp_avgs, 2
// exp_avg_sqs; amsgrad needs 2 max_exp_avg_sqs (each its n tensors, in this order)".
std::string expected_states(const RuleDef& info, int num_states, int per, size_t n, bool amsgrad) {
  if (num_states == 0) return "expected no state tensors (momentum 0 keeps none)";
  std::string text = "expected";
  for (int j = 0; j < num_states; ++j) {
    for (int s = 0; s < per; ++s) {
      const bool amsgrad_list = amsgrad && j == 2;
      text += (j == 0 && s == 0) ? " " : (amsgrad_list && s == 0 ? "; amsgrad needs " : ", ");
      text += std::to_string(n) + " " + state_list_name(info.keys[j], per, s);
    }
  }
  return text + " (the lists one after another, each one tensor per param)";
}

// State tensor states[flat], which is tensor i of the list `name`: on the device, dense, contiguous,
// of the call's state dtype, and `numel` elements (codes, dense states) or a 1-D tensor of
// ceil(numel / 32) scale bytes.
void* check_optim_state(const std::string& name, size_t flat, int64_t i, const at::Tensor& t, const at::Device& device,
                        at::ScalarType dtype, int64_t numel, bool scales) {
  constexpr const char* op = "optim_";
  TORCH_CHECK(t.defined(), "fastamp::", op, ": states[", flat, "]: ", name, "[", i, "] is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, "fastamp::", op, ": states[", flat, "]: ", name, "[", i,
              "] must be strided (dense), got ", t.layout());
  TORCH_CHECK(t.device() == device, "fastamp::", op, ": states[", flat, "]: ", name, "[", i, "] is on ", t.device(),
              " but expected ", device);
  TORCH_CHECK(t.is_contiguous(), "fastamp::", op, ": states[", flat, "]: ", name, "[", i, "] must be contiguous");
  TORCH_CHECK(t.scalar_type() == dtype, "fastamp::", op, ": states[", flat, "]: ", name, "[", i, "] must be ", dtype,
              " like states[0] (one state format per call), got ", t.scalar_type());
  if (scales) {
    const int64_t blocks = (numel + 31) / 32;
    TORCH_CHECK(t.dim() == 1 && t.numel() == blocks, "fastamp::", op, ": states[", flat, "]: ", name, "[", i,
                "] must be 1-D with ", blocks, " scale bytes (one per block of 32 of the ", numel,
                " elements of params[", i, "]), got shape ", t.sizes());
  } else {
    TORCH_CHECK(t.numel() == numel, "fastamp::", op, ": states[", flat, "]: ", name, "[", i, "] has ", t.numel(),
                " elements but params[", i, "] has ", numel);
  }
  return numel > 0 ? t.data_ptr() : nullptr;
}

void optim_cuda(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList states,
                const at::Tensor& step_scalars, const std::optional<at::Tensor>& found_inf,
                const std::optional<at::Tensor>& rng, int64_t rng_base, c10::string_view rule,
                at::ArrayRef<double> hyper, int64_t flags) {
  constexpr const char* op = "optim_";
  const size_t n = params.size();
  if (n == 0) return;
  const std::string_view rule_name(rule.data(), rule.size());
  const RuleDef* info = find_rule_def(rule_name.data(), rule_name.size());
  TORCH_CHECK(info != nullptr, "fastamp::", op, ": unknown rule '", std::string(rule_name), "'; expected one of ",
              rule_name_list());
  TORCH_CHECK(hyper.size() == static_cast<size_t>(info->hyper), "fastamp::", op, ": rule '", info->name,
              "' takes hyper ", info->hyper_names, ", got ", hyper.size(), " values");
  const int64_t allowed = optim_flags::kMaximize | optim_flags::kSrParam | optim_flags::kSrState | info->flags;
  TORCH_CHECK((flags & ~allowed) == 0, "fastamp::", op, ": flags ", flags, " are not a combination of rule '",
              info->name, "''s ", info->flag_names);
  const int num_states = states_kept(*info, flags, !hyper.empty() && hyper[0] != 0.0);
  TORCH_CHECK(grads.size() == n, "fastamp::", op, ": expected ", n, " grads, got ", grads.size());
  // int16 masters are the remainders of bf16 params: AdamW's messages call them so (adamw_bf16_'s list name),
  // SGD's and Lion's "masters" (their per-rule ops' name), as the CPU kernel's messages do (optim_rules.h)
  const char* masters_name = !masters.empty() && masters[0].defined() && masters[0].scalar_type() == at::kShort
                                 ? info->int16_masters
                                 : "masters";
  TORCH_CHECK(masters.empty() || masters.size() == n, "fastamp::", op, ": expected 0 or ", n, " ", masters_name,
              ", got ", masters.size());
  TORCH_CHECK(params[0].defined() && params[0].is_cuda(), "fastamp::", op,
              ": params[0] must be a CUDA tensor, got device ", params[0].device());
  const at::Device device = params[0].device();

  StateFormat format = StateFormat::kFloat32;
  at::ScalarType state_type = at::kFloat;
  if (num_states > 0 && !states.empty()) {
    TORCH_CHECK(states[0].defined(), "fastamp::", op, ": states[0] is undefined");
    state_type = states[0].scalar_type();
    TORCH_CHECK(state_type == at::kFloat || state_type == at::kBFloat16 || state_type == at::kByte, "fastamp::", op,
                ": states must be float32, bfloat16 or uint8 (q8 codes and scales), got ", state_type);
    format = state_type == at::kByte       ? StateFormat::kQ8
             : state_type == at::kBFloat16 ? StateFormat::kBFloat16
                                           : StateFormat::kFloat32;
  }
  const int per = state_streams(format);
  const size_t want = n * static_cast<size_t>(per * num_states);
  TORCH_CHECK(states.size() == want, "fastamp::", op, ": rule '", info->name, "' keeps ", num_states,
              " state(s) with these hyper and flags in ", state_format_name(format), ": ",
              expected_states(*info, num_states, per, n, (flags & optim_flags::kAmsgrad) != 0), ": ", want,
              " state tensors, got ", states.size());
  TORCH_CHECK(optim_compiled(info->id, format), "fastamp::", op, ": this build has no CUDA kernel of rule '",
              info->name, "' with ", state_format_name(format), " states (csrc/cuda/optim_combos.h)");

  OptimCall call{};
  call.rule = info->id;
  call.format = format;
  call.num_states = num_states;
  for (size_t k = 0; k < hyper.size(); ++k) call.hyper[k] = hyper[k];
  call.flags = flags;
  call.scalar_stride = check_step_scalars(op, step_scalars, device, n, info->scalars);
  call.step_scalars = step_scalars.data_ptr<float>();
  call.found_inf = optional_found_inf(op, found_inf, device);
  call.rng = optional_rng(op, rng, device);
  TORCH_CHECK(call.rng != nullptr || (flags & (optim_flags::kSrParam | optim_flags::kSrState)) == 0, "fastamp::", op,
              ": SR_PARAM / SR_STATE need rng ([seed, counter], int64), got None");
  call.rng_base = rng_base;
  call.master = MasterKind::kNone;
  at::ScalarType master_type = at::kFloat;
  if (!masters.empty()) {
    TORCH_CHECK(masters[0].defined(), "fastamp::", op, ": masters[0] is undefined");
    master_type = masters[0].scalar_type();
    TORCH_CHECK(master_type == at::kFloat || master_type == at::kShort || master_type == at::kChar, "fastamp::", op,
                ": masters[0] must be float32 (fp32 master weights) or an integer correction (remainders[0] must be "
                "int16 for bfloat16 params; ulp8 corrections int8, for bfloat16 / float16 params), got ",
                master_type);
    call.master = master_type == at::kFloat   ? MasterKind::kFloat32
                  : master_type == at::kShort ? MasterKind::kRemainder
                                              : MasterKind::kUlp8;
  }

  std::vector<std::string> list_names;  // of the states list's lists, in order
  for (int j = 0; j < num_states; ++j) {
    for (int s = 0; s < per; ++s) list_names.push_back(state_list_name(info->keys[j], per, s));
  }
  std::vector<OptimTensorRef> refs;
  refs.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    const auto i = static_cast<int64_t>(k);
    const at::Tensor& p = params[k];
    check_list_tensor(op, "params", i, p, device, -1);
    const DType pdt = kernel_dtype(op, "params", i, p);
    const int64_t numel = p.numel();
    check_list_tensor(op, "grads", i, grads[k], device, numel);
    const DType gdt = kernel_dtype(op, "grads", i, grads[k]);
    OptimTensorRef r{};
    r.param = numel > 0 ? p.data_ptr() : nullptr;
    r.grad = numel > 0 ? grads[k].data_ptr() : nullptr;
    if (call.master != MasterKind::kNone) {
      const at::Tensor& m = masters[k];
      check_list_tensor(op, masters_name, i, m, device, numel);
      TORCH_CHECK(m.scalar_type() == master_type, "fastamp::", op, ": ", masters_name, "[", i, "] must be ",
                  call.master == MasterKind::kRemainder ? "int16" : c10::toString(master_type), " like ", masters_name,
                  "[0], got ", m.scalar_type());
      TORCH_CHECK(call.master != MasterKind::kRemainder || p.scalar_type() == at::kBFloat16, "fastamp::", op,
                  ": int16 remainder masters need bfloat16 params: params[", i, "] must be bfloat16, got ",
                  p.scalar_type());
      TORCH_CHECK(call.master != MasterKind::kUlp8 || p.scalar_type() == at::kBFloat16 || p.scalar_type() == at::kHalf,
                  "fastamp::", op, ": int8 ulp8 masters need bfloat16 or float16 params, but params[", i, "] is ",
                  p.scalar_type());
      r.master = numel > 0 ? m.data_ptr() : nullptr;
    }
    for (int l = 0; l < num_states * per; ++l) {
      const size_t flat = static_cast<size_t>(l) * n + k;
      r.states[l] =
          check_optim_state(list_names[l], flat, i, states[flat], device, state_type, numel, per == 2 && l % 2 == 1);
    }
    r.numel = numel;
    r.param_dtype = pdt;
    r.grad_dtype = gdt;
    refs.push_back(r);
  }

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  TorchTableMemory tables(device);
  check_launch(op, optim(refs.data(), static_cast<int64_t>(refs.size()), call, tables, stream));
}

}  // namespace
}  // namespace cuda
}  // namespace fastamp

TORCH_LIBRARY_IMPL(fastamp, CUDA, m) {
  FASTAMP_IMPL(m, unscale_check_, fastamp::cuda::unscale_check_cuda);
  FASTAMP_IMPL(m, update_scale_, fastamp::cuda::update_scale_cuda);
  FASTAMP_IMPL(m, unscale_check_stats_, fastamp::cuda::unscale_check_stats_cuda);
  FASTAMP_IMPL(m, unscale_check_partials_, fastamp::cuda::unscale_check_partials_cuda);
  FASTAMP_IMPL(m, sumsq_fold, fastamp::cuda::sumsq_fold_cuda);
  FASTAMP_IMPL(m, optim_, fastamp::cuda::optim_cuda);
}
