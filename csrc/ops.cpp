// Schemas of fastamp's native ops (the TORCH_LIBRARY pattern of pytorch/extension-cpp).
// Kernels register per device in csrc/cpu/*.cpp and csrc/cuda/*.cpp with
// TORCH_LIBRARY_IMPL; fake (meta) impls live in fastamp/_ops.py. The semantics of each op
// are defined by fastamp/reference.py.
#include <Python.h>
#include <torch/library.h>

#include <string>

extern "C" {
// `import fastamp._C` only needs to load this library so the registrations below run.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace {
std::string build_info() {
  std::string s = "cpu";
#if defined(FASTAMP_WITH_CUDA)
  s += "+cuda";
#endif
#if defined(__AVX512F__)
  s += " compiled-baseline=avx512";
#elif defined(__AVX2__)
  s += " compiled-baseline=avx2";
#endif
  return s;
}
}  // namespace

TORCH_LIBRARY(fastamp, m) {
  m.def(
      "unscale_check_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale, bool write_back, "
      "bool compute_sumsq) -> Tensor");
  m.def(
      "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, "
      "Tensor found_inf, float growth_factor, float backoff_factor, int growth_interval, int hysteresis, "
      "float min_scale, float max_scale) -> ()");
  m.def(
      "adamw_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] masters, Tensor(c!)[] exp_avgs, "
      "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor step_scalars, Tensor? found_inf, "
      "float beta1, float beta2, float eps, bool amsgrad, bool maximize) -> ()");
  m.def(
      "adamw_bf16_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] remainders, Tensor(c!)[] exp_avgs, "
      "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor step_scalars, Tensor? found_inf, Tensor? rng, "
      "int rng_base, float beta1, float beta2, float eps, bool amsgrad, bool maximize) -> ()");
  m.def(
      "sgd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] masters, Tensor(c!)[] momentum_buffers, "
      "Tensor step_scalars, Tensor? found_inf, Tensor? rng, int rng_base, float momentum, float dampening, "
      "float weight_decay, bool nesterov, bool maximize) -> ()");
  m.def(
      "unscale_check_stats_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale, bool write_back, "
      "bool compute_sumsq, Tensor(c!) counts, Tensor(d!) absmax) -> Tensor");
  m.def("build_info() -> str", &build_info);
}
