// The Python module fastamp._C and build_info(). Kernels register per device in csrc/cpu/*.cpp
// and csrc/cuda/*.cpp with TORCH_LIBRARY_IMPL (through FASTAMP_IMPL, op_signatures.h); every
// op's schema and fake (meta) kernel live in the op table of fastamp/ops/registry.py. The semantics of
// each op are defined by fastamp/reference/.
#include <Python.h>
#include <torch/library.h>

#include <string>

// The direct calls of csrc/direct_call.cpp and the plan checks of csrc/plan_check.cpp.
extern PyMethodDef fastamp_direct_methods[];
extern PyMethodDef fastamp_plan_methods[];

extern "C" {
// `import fastamp._C` loads this library so the registrations below run; the module's functions
// are the direct calls of the list ops (fastamp.functional's native fast path) and the
// optimizers' plan checks (fastamp/optim/engine/plan.py).
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, fastamp_direct_methods};
  PyObject* module = PyModule_Create(&module_def);
  if (module != nullptr && PyModule_AddFunctions(module, fastamp_plan_methods) < 0) Py_CLEAR(module);
  return module;
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

// No op schema is defined here: fastamp/ops/registry.py defines them from its op table right after this
// library loads, and the dispatcher then checks every kernel that cpu/ and cuda/ registered
// against them, raising in Python on a difference (a failed check here, in a static
// initialiser, would abort the process). C++ defines only build_info() and cpu_isa().
TORCH_LIBRARY(fastamp, m) { m.def("build_info() -> str", &build_info); }
