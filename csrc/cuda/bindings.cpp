// CUDA registrations of fastamp's native ops: validation and the current stream here, the
// kernels behind the torch-free interface of launchers.h (amp.cu, adamw.cu). Built only
// when setup.py finds nvcc and a CUDA-enabled torch. Nothing here reads a device value on
// the host; temporaries come from torch's caching allocator on the current stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "launchers.h"

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
    TORCH_CHECK(t.numel() == numel, "fastamp::", op, ": ", what, "[", i, "] has ", t.numel(),
                " elements but params[", i, "] has ", numel);
  }
}

void check_launch(const char* op, cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "fastamp::", op, ": CUDA error: ", cudaGetErrorString(err));
}

at::Tensor unscale_check_cuda(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale,
                              bool write_back, bool compute_sumsq) {
  constexpr const char* op = "unscale_check_";
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

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
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
  check_launch(op, unscale_check(refs.data(), static_cast<int64_t>(refs.size()), found_inf.data_ptr<float>(),
                                 inv_scale.data_ptr<float>(), write_back, compute_sumsq, partials_ptr,
                                 sumsq.data_ptr<float>(), stream));
  return sumsq;
}

void update_scale_cuda(at::Tensor& scale, at::Tensor& growth_tracker, at::Tensor& hysteresis_tracker,
                       const at::Tensor& found_inf, double growth_factor, double backoff_factor, int64_t growth_interval,
                       int64_t hysteresis, double min_scale, double max_scale) {
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

void adamw_cuda(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, const at::Tensor& step_scalars,
                const std::optional<at::Tensor>& found_inf, double beta1, double beta2, double eps, bool amsgrad,
                bool maximize) {
  constexpr const char* op = "adamw_";
  const size_t n = params.size();
  if (n == 0) return;
  TORCH_CHECK(grads.size() == n, "fastamp::", op, ": expected ", n, " grads, got ", grads.size());
  TORCH_CHECK(exp_avgs.size() == n, "fastamp::", op, ": expected ", n, " exp_avgs, got ", exp_avgs.size());
  TORCH_CHECK(exp_avg_sqs.size() == n, "fastamp::", op, ": expected ", n, " exp_avg_sqs, got ", exp_avg_sqs.size());
  TORCH_CHECK(masters.empty() || masters.size() == n, "fastamp::", op, ": expected 0 or ", n, " masters, got ",
              masters.size());
  TORCH_CHECK(!amsgrad || max_exp_avg_sqs.size() == n, "fastamp::", op, ": amsgrad needs ", n,
              " max_exp_avg_sqs, got ", max_exp_avg_sqs.size());
  TORCH_CHECK(params[0].defined() && params[0].is_cuda(), "fastamp::", op,
              ": params[0] must be a CUDA tensor, got device ", params[0].device());
  const at::Device device = params[0].device();

  TORCH_CHECK(step_scalars.device() == device, "fastamp::", op, ": step_scalars is on ", step_scalars.device(),
              " but params are on ", device);
  TORCH_CHECK(step_scalars.scalar_type() == at::kFloat, "fastamp::", op, ": step_scalars must be float32, got ",
              step_scalars.scalar_type());
  TORCH_CHECK(step_scalars.numel() == 4 && step_scalars.is_contiguous(), "fastamp::", op,
              ": step_scalars must be a contiguous 4-element tensor, got shape ", step_scalars.sizes());
  const float* found_inf_ptr = nullptr;
  if (found_inf.has_value() && found_inf->defined()) {
    check_cuda_scalar(op, "found_inf", *found_inf, at::kFloat, device);
    found_inf_ptr = found_inf->data_ptr<float>();
  }

  std::vector<AdamWTensorRef> refs;
  refs.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    const auto i = static_cast<int64_t>(k);
    const at::Tensor& p = params[k];
    check_list_tensor(op, "params", i, p, device, -1);
    const int64_t numel = p.numel();
    const DType pdt = kernel_dtype(op, "params", i, p);
    check_list_tensor(op, "grads", i, grads[k], device, numel);
    const DType gdt = kernel_dtype(op, "grads", i, grads[k]);
    auto check_fp32 = [&](const char* what, const at::Tensor& t) {
      check_list_tensor(op, what, i, t, device, numel);
      TORCH_CHECK(t.scalar_type() == at::kFloat, "fastamp::", op, ": ", what, "[", i, "] must be float32, got ",
                  t.scalar_type());
      return numel > 0 ? t.data_ptr<float>() : nullptr;
    };
    AdamWTensorRef r{};
    r.param = numel > 0 ? p.data_ptr() : nullptr;
    r.grad = numel > 0 ? grads[k].data_ptr() : nullptr;
    r.master = masters.empty() ? nullptr : check_fp32("masters", masters[k]);
    r.exp_avg = check_fp32("exp_avgs", exp_avgs[k]);
    r.exp_avg_sq = check_fp32("exp_avg_sqs", exp_avg_sqs[k]);
    r.max_exp_avg_sq = amsgrad ? check_fp32("max_exp_avg_sqs", max_exp_avg_sqs[k]) : nullptr;
    r.numel = numel;
    r.param_dtype = pdt;
    r.grad_dtype = gdt;
    refs.push_back(r);
  }

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  check_launch(op, adamw(refs.data(), static_cast<int64_t>(refs.size()), step_scalars.data_ptr<float>(),
                         found_inf_ptr, beta1, beta2, eps, amsgrad, maximize, stream));
}

}  // namespace
}  // namespace cuda
}  // namespace fastamp

TORCH_LIBRARY_IMPL(fastamp, CUDA, m) {
  m.impl("unscale_check_", &fastamp::cuda::unscale_check_cuda);
  m.impl("update_scale_", &fastamp::cuda::update_scale_cuda);
  m.impl("adamw_", &fastamp::cuda::adamw_cuda);
}
