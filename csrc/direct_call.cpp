// Direct calls of the list ops from Python, for fastamp.functional's native fast path:
// fastamp._C.<op>(same positional arguments as torch.ops.fastamp.<op>).
//
// Why: through torch.ops, every tensor of every list is converted to an IValue, copied into a
// std::vector by the boxed-to-unboxed wrapper, and passed through the autograd fallback; in
// torch 2.13 each such copy and release of a Python-owned tensor also touches its PyObject
// (with the GIL), so at 20,000 tensors the call costs more than the kernel. Here the tensors
// are borrowed from the Python lists (no reference counts moved, the list items are held by
// a Py_INCREF while the GIL is released), checked once for what the shortcut assumes, and the
// op is redispatched straight to its CPU or CUDA kernel, which runs every check of its own.
//
// The shortcut declines (returns NotImplemented, having done nothing) whenever the dispatcher
// could do something other than call that kernel: a tensor subclass or a tensor with any
// dispatch key beyond dense CPU/CUDA + autograd (sparse, conjugate, functionalised, batched,
// Python), a dispatch or torch-function mode, TLS-included keys, grad mode with a tensor that
// requires grad, a list item that is not a tensor, an argument of another type; and when the
// kernel refuses the input (its checks run before it writes anything). The caller then takes
// the torch.ops path, which gives the dispatcher's behaviour and the kernel's error.
#include <Python.h>
#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>

#include <optional>
#include <string>
#include <vector>

#include "cpu/optim_table.h"
#include "host_prefetch.h"
#include "op_signatures.h"
#include "plain_keys.h"

namespace fastamp {
namespace {

const c10::DispatchKeySet kBackendKeys = c10::DispatchKeySet({c10::DispatchKey::CPU, c10::DispatchKey::CUDA});

// Tensors borrowed from Python objects for one call: at::Tensor handles made without moving
// the TensorImpl's reference count (released, not destroyed, at the end), each object held by
// a Py_INCREF so that a list changed by another thread while the GIL is released cannot free
// a tensor the kernel is using.
class Borrowed {
 public:
  Borrowed() = default;
  Borrowed(const Borrowed&) = delete;
  Borrowed& operator=(const Borrowed&) = delete;
  ~Borrowed() {
    for (at::Tensor& t : tensors_) t.unsafeReleaseTensorImpl();
    for (PyObject* o : held_) Py_DECREF(o);
  }

  // Appends the tensor of `obj`; false (nothing appended) when the shortcut must decline it.
  bool add(PyObject* obj) {
    if (!THPVariable_CheckExact(obj)) return false;  // torch.Tensor or nn.Parameter, no subclass
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined()) return false;
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (!has_plain_keys(impl)) return false;
    const c10::DispatchKeySet keys = impl->key_set();
    // requires_grad() is out of line; a tensor without autograd meta never requires grad
    if (grad_mode_ && impl->autograd_meta() != nullptr && impl->requires_grad()) return false;
    keys_ = keys_ | keys;
    Py_INCREF(obj);
    held_.push_back(obj);
    tensors_.push_back(at::Tensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim(impl)));
    return true;
  }

  // A Python list or tuple of tensors: the index range of its tensors in this call, or false.
  bool add_list(PyObject* seq, std::pair<size_t, size_t>* range) {
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) return false;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    const size_t first = tensors_.size();
    constexpr Py_ssize_t d = kHostPrefetchDistance;
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (i + 2 * d < n) prefetch_read(items[i + 2 * d]);
      if (i + d < n && THPVariable_CheckExact(items[i + d])) {
        prefetch_tensor_impl(THPVariable_Unpack(items[i + d]).unsafeGetTensorImpl());
      }
      if (!add(items[i])) return false;
    }
    *range = {first, tensors_.size()};
    return true;
  }

  // One tensor, or None for an optional one: its index (-1 for None), or false.
  bool add_one(PyObject* obj, bool optional, std::ptrdiff_t* index) {
    if (obj == Py_None && optional) {
      *index = -1;
      return true;
    }
    *index = static_cast<std::ptrdiff_t>(tensors_.size());
    return add(obj);
  }

  void reserve(size_t n) {
    tensors_.reserve(n);
    held_.reserve(n);
  }
  at::TensorList list(std::pair<size_t, size_t> r) const {
    return at::TensorList(tensors_.data() + r.first, r.second - r.first);
  }
  const at::Tensor& one(std::ptrdiff_t i) const { return tensors_[static_cast<size_t>(i)]; }
  std::optional<at::Tensor> optional(std::ptrdiff_t i) const {
    if (i < 0) return std::nullopt;
    return tensors_[static_cast<size_t>(i)];
  }
  // The backend the dispatcher would pick (the highest of the tensors' backends).
  c10::DispatchKeySet dispatch_keys() const { return keys_ & kBackendKeys; }

 private:
  std::vector<at::Tensor> tensors_;
  std::vector<PyObject*> held_;
  c10::DispatchKeySet keys_;
  bool grad_mode_ = c10::GradMode::is_enabled();
};

size_t list_size(PyObject* seq) {
  return (PyList_Check(seq) || PyTuple_Check(seq)) ? static_cast<size_t>(PySequence_Fast_GET_SIZE(seq)) : 0;
}

bool modes_active() {
  return c10::impl::TorchDispatchModeTLS::any_modes_set() || at::impl::torch_function_mode_enabled() ||
         (c10::impl::tls_local_dispatch_key_set().included_.raw_repr() & ~c10::default_included_set.raw_repr()) != 0;
}

bool as_double(PyObject* o, double* out) {
  if (!PyFloat_Check(o) && !PyLong_Check(o)) return false;
  *out = PyFloat_AsDouble(o);
  if (*out == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

bool as_bool(PyObject* o, bool* out) {
  if (!PyBool_Check(o)) return false;
  *out = o == Py_True;
  return true;
}

bool as_int(PyObject* o, int64_t* out) {
  if (!PyLong_Check(o) || PyBool_Check(o)) return false;
  int overflow = 0;
  *out = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow != 0 || (*out == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  return true;
}

PyObject* declined() { Py_RETURN_NOTIMPLEMENTED; }

template <class Sig>
c10::TypedOperatorHandle<Sig> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").template typed<Sig>();
}

enum class Ran { kYes, kDeclined, kError };

// Runs `call()` without the GIL. A c10::Error (a kernel check: raised before anything is
// written) declines; anything else is set as a Python RuntimeError (kError).
template <class R, class F>
Ran run_kernel(F&& call, R* result) {
  std::string other;
  Ran ran = Ran::kYes;
  Py_BEGIN_ALLOW_THREADS;
  try {
    *result = call();
  } catch (const c10::Error&) {
    ran = Ran::kDeclined;
  } catch (const std::exception& e) {
    other = e.what();
    ran = Ran::kError;
  }
  Py_END_ALLOW_THREADS;
  if (ran == Ran::kError) PyErr_SetString(PyExc_RuntimeError, other.c_str());
  return ran;
}

// The result of a call that did not run: the error set, or NotImplemented.
PyObject* finish(Ran ran, PyObject* result) {
  if (ran == Ran::kError) return nullptr;
  if (ran == Ran::kDeclined) return declined();
  return result;
}

struct Void {};

// Before the GIL is released nothing can throw but the dispatcher's lookup of the op (its
// schema missing when fastamp.ops.registry could not register it): the torch.ops path says why.
#define FASTAMP_DIRECT_BEGIN \
  try {                      \
    if (modes_active()) return declined();
#define FASTAMP_DIRECT_END \
  }                        \
  catch (...) {            \
    return declined();     \
  }

// unscale_check_(grads, found_inf, inv_scale, write_back, compute_sumsq) and
// unscale_check_stats_(..., counts, absmax).
PyObject* unscale_common(PyObject* const* args, Py_ssize_t nargs, bool stats) {
  FASTAMP_DIRECT_BEGIN
  if (nargs != (stats ? 7 : 5)) return declined();
  Borrowed b;
  b.reserve(list_size(args[0]) + 4);
  std::pair<size_t, size_t> grads;
  std::ptrdiff_t found_inf = 0, inv_scale = 0, counts = 0, absmax = 0;
  bool write_back = false, compute_sumsq = false;
  if (!b.add_list(args[0], &grads) || !b.add_one(args[1], false, &found_inf) ||
      !b.add_one(args[2], false, &inv_scale) || !as_bool(args[3], &write_back) || !as_bool(args[4], &compute_sumsq)) {
    return declined();
  }
  if (stats && (!b.add_one(args[5], false, &counts) || !b.add_one(args[6], false, &absmax))) return declined();
  const c10::DispatchKeySet ks = b.dispatch_keys();
  at::Tensor out;
  Ran ran = Ran::kDeclined;
  if (stats) {
    static auto op = handle<signature::unscale_check_stats_>("fastamp::unscale_check_stats_");
    ran = run_kernel(
        [&] {
          return op.redispatch(ks, b.list(grads), b.one(found_inf), b.one(inv_scale), write_back, compute_sumsq,
                               b.one(counts), b.one(absmax));
        },
        &out);
  } else {
    static auto op = handle<signature::unscale_check_>("fastamp::unscale_check_");
    ran = run_kernel(
        [&] { return op.redispatch(ks, b.list(grads), b.one(found_inf), b.one(inv_scale), write_back, compute_sumsq); },
        &out);
  }
  if (ran != Ran::kYes) return finish(ran, nullptr);
  return THPVariable_Wrap(std::move(out));
  FASTAMP_DIRECT_END
}

PyObject* unscale_check_(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return unscale_common(args, nargs, false);
}

PyObject* unscale_check_stats_(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return unscale_common(args, nargs, true);
}

bool as_str(PyObject* o, c10::string_view* out) {
  if (!PyUnicode_Check(o)) return false;
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(o, &size);
  if (data == nullptr) {
    PyErr_Clear();
    return false;
  }
  *out = c10::string_view(data, static_cast<size_t>(size));
  return true;
}

// A list or tuple of Python floats (or ints, which the schema's float[] takes too).
bool as_doubles(PyObject* seq, std::vector<double>* out) {
  if (!PyList_Check(seq) && !PyTuple_Check(seq)) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  out->resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (PyBool_Check(items[i]) || !as_double(items[i], &(*out)[static_cast<size_t>(i)])) return false;
  }
  return true;
}

// optim_(params, grads, masters, states, step_scalars, found_inf, rng, rng_base, rule, hyper, flags).
PyObject* optim_(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  FASTAMP_DIRECT_BEGIN
  if (nargs != 11) return declined();
  Borrowed b;
  b.reserve(list_size(args[0]) * 3 + list_size(args[3]) + 3);
  std::pair<size_t, size_t> lists[4];
  for (int k = 0; k < 4; ++k) {
    if (!b.add_list(args[k], &lists[k])) return declined();
  }
  std::ptrdiff_t step_scalars = 0, found_inf = -1, rng = -1;
  int64_t rng_base = 0, flags = 0;
  c10::string_view rule;
  std::vector<double> hyper;
  if (!b.add_one(args[4], false, &step_scalars) || !b.add_one(args[5], true, &found_inf) ||
      !b.add_one(args[6], true, &rng) || !as_int(args[7], &rng_base) || !as_str(args[8], &rule) ||
      !as_doubles(args[9], &hyper) || !as_int(args[10], &flags)) {
    return declined();
  }
  const c10::DispatchKeySet ks = b.dispatch_keys();
  static auto op = handle<signature::optim_>("fastamp::optim_");
  Void done;
  const Ran ran = run_kernel(
      [&] {
        op.redispatch(ks, b.list(lists[0]), b.list(lists[1]), b.list(lists[2]), b.list(lists[3]), b.one(step_scalars),
                      b.optional(found_inf), b.optional(rng), rng_base, rule, hyper, flags);
        return Void{};
      },
      &done);
  if (ran != Ran::kYes) return finish(ran, nullptr);
  Py_RETURN_NONE;
  FASTAMP_DIRECT_END
}

// optim_table(params, masters, states, rule, flags) -> capsule | NotImplemented: a persistent table
// of optim_'s tensors (csrc/cpu/optim_table.h) for an optimizer's launch plan; NotImplemented where
// the shortcut declines a tensor or the op refuses one.
constexpr const char* kOptimTableName = "fastamp.optim_table";

void free_optim_table(PyObject* capsule) {
  cpu::OptimTableDeleter()(static_cast<cpu::OptimTable*>(PyCapsule_GetPointer(capsule, kOptimTableName)));
}

PyObject* optim_table(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  FASTAMP_DIRECT_BEGIN
  if (nargs != 5) return declined();
  Borrowed b;
  b.reserve(list_size(args[0]) * 2 + list_size(args[2]));
  std::pair<size_t, size_t> lists[3];
  for (int k = 0; k < 3; ++k) {
    if (!b.add_list(args[k], &lists[k])) return declined();
  }
  c10::string_view rule;
  int64_t flags = 0;
  if (!as_str(args[3], &rule) || !as_int(args[4], &flags)) return declined();
  if (b.dispatch_keys() != c10::DispatchKeySet(c10::DispatchKey::CPU)) return declined();
  cpu::OptimTablePtr table;
  try {
    table = cpu::optim_table_new(b.list(lists[0]), b.list(lists[1]), b.list(lists[2]), rule, flags);
  } catch (const c10::Error&) {
    return declined();
  }
  PyObject* capsule = PyCapsule_New(table.get(), kOptimTableName, &free_optim_table);
  if (capsule != nullptr) table.release();
  return capsule;
  FASTAMP_DIRECT_END
}

// optim_table_run(table, grads, step_scalars, found_inf, rng, rng_base, rule, hyper, flags)
// -> None | NotImplemented: optim_(the table's tensors, grads, ...) when everything fits it.
PyObject* optim_table_run(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  FASTAMP_DIRECT_BEGIN
  if (nargs != 9 || !PyCapsule_IsValid(args[0], kOptimTableName)) return declined();
  auto* table = static_cast<cpu::OptimTable*>(PyCapsule_GetPointer(args[0], kOptimTableName));
  Borrowed b;
  b.reserve(static_cast<size_t>(cpu::optim_table_size(*table)) + 3);
  std::pair<size_t, size_t> grads;
  std::ptrdiff_t step_scalars = 0, found_inf = -1, rng = -1;
  int64_t rng_base = 0, flags = 0;
  c10::string_view rule;
  std::vector<double> hyper;
  if (!b.add_list(args[1], &grads) || !b.add_one(args[2], false, &step_scalars) ||
      !b.add_one(args[3], true, &found_inf) || !b.add_one(args[4], true, &rng) || !as_int(args[5], &rng_base) ||
      !as_str(args[6], &rule) || !as_doubles(args[7], &hyper) || !as_int(args[8], &flags)) {
    return declined();
  }
  if (b.dispatch_keys() != c10::DispatchKeySet(c10::DispatchKey::CPU)) return declined();
  bool ran = false;
  const Ran status = run_kernel(
      [&] {
        return cpu::optim_table_run(*table, b.list(grads), b.one(step_scalars), b.optional(found_inf), b.optional(rng),
                                    rng_base, rule, hyper, flags);
      },
      &ran);
  if (status != Ran::kYes) return finish(status, nullptr);
  if (!ran) return declined();
  Py_RETURN_NONE;
  FASTAMP_DIRECT_END
}

}  // namespace
}  // namespace fastamp

// Registered on the module by csrc/ops.cpp.
PyMethodDef fastamp_direct_methods[] = {
    {"unscale_check_", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fastamp::unscale_check_)),
     METH_FASTCALL, "torch.ops.fastamp.unscale_check_ without the dispatcher's per-tensor work, or NotImplemented"},
    {"unscale_check_stats_",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fastamp::unscale_check_stats_)), METH_FASTCALL,
     "torch.ops.fastamp.unscale_check_stats_ without the dispatcher's per-tensor work, or NotImplemented"},
    {"optim_", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fastamp::optim_)), METH_FASTCALL,
     "torch.ops.fastamp.optim_ without the dispatcher's per-tensor work, or NotImplemented"},
    {"optim_table", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fastamp::optim_table)), METH_FASTCALL,
     "a persistent table of optim_'s params, masters and states for an optimizer's launch plan, or NotImplemented"},
    {"optim_table_run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fastamp::optim_table_run)),
     METH_FASTCALL, "optim_ on a table's tensors and new grads when they fit it, or NotImplemented"},
    {nullptr, nullptr, 0, nullptr}};
