// The steady-state check of the optimizers' cached launch plan (fastamp/optim/engine/plan.py), as
// one C loop per param group instead of one Python-level pass per property.
//
// Why: a step that reuses its plan must still look at every param and grad (the grads are
// new tensors each step; a param may be rebound through `.data`; a state tensor may be
// replaced by assignment). In Python each property is a pass of C calls over the list (a grad
// read, a dtype, a contiguity test, a data_ptr, a state identity: ~50-120 ns each per tensor,
// ~0.6 us per tensor in all); here it is one loop that reads each object once.
//
// Each function answers exactly what its Python twin in _plan.py answers, or returns
// NotImplemented (having changed nothing) where it cannot tell without Python: an item that
// is not a plain tensor (a subclass may override `.grad`, `.dtype` or `data_ptr`), a state that
// is not a dict, a list of another type. The caller then takes the Python path.
#include <Python.h>
#include <ATen/ATen.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "host_prefetch.h"
#include "plain_keys.h"

namespace fastamp {
namespace {

// At iteration i of a loop over a list of params, asks for what iteration i + d.. reads, one
// level of the chain per distance: the param object (4d ahead), its TensorImpl (3d), its
// storage and autograd meta (2d), its grad's TensorImpl (d). Reads only objects an earlier
// call prefetched, and only of plain tensors (torch.Tensor or nn.Parameter).
void prefetch_param_chain(PyObject* list, Py_ssize_t n, Py_ssize_t i) {
  constexpr Py_ssize_t d = kHostPrefetchDistance;
  auto impl_at = [&](Py_ssize_t j) -> const c10::TensorImpl* {
    if (j >= n) return nullptr;
    PyObject* obj = PyList_GET_ITEM(list, j);
    return THPVariable_CheckExact(obj) ? THPVariable_Unpack(obj).unsafeGetTensorImpl() : nullptr;
  };
  if (i + 4 * d < n) prefetch_read(PyList_GET_ITEM(list, i + 4 * d));
  if (const c10::TensorImpl* impl = impl_at(i + 3 * d)) prefetch_tensor_impl(impl);
  if (const c10::TensorImpl* impl = impl_at(i + 2 * d)) {
    prefetch_storage_of(impl);
    // the AutogradMeta's vtable pointer (grad() is virtual) and its grad_, declared after a name
    // string: its first 48 bytes
    const char* meta = reinterpret_cast<const char*>(impl->autograd_meta());
    if (meta != nullptr) {
      prefetch_read(meta);
      prefetch_read(meta + 47);
    }
  }
  if (const c10::TensorImpl* impl = impl_at(i + d)) {
    auto* meta = static_cast<const torch::autograd::AutogradMeta*>(impl->autograd_meta());
    if (meta != nullptr && meta->grad_.defined()) prefetch_tensor_impl(meta->grad_.unsafeGetTensorImpl());
  }
}

// A tensor's `.grad`, read where torch keeps it (its AutogradMeta's grad_) rather than through
// Tensor::grad(): that goes through torch's variable hooks (a virtual call, the leaf test, the hooks'
// lookup) for every tensor, ~8% of the Triton launcher's host time at 20,000 tensors (perf, 2026-12-07).
// A leaf (every param; no grad_fn) answers the same either way; a tensor with a grad_fn asks torch, as
// before (Tensor.grad may warn there).
const at::Tensor& grad_of(const at::Tensor& t) {
  static const at::Tensor undefined;
  const auto* meta = static_cast<const torch::autograd::AutogradMeta*>(t.unsafeGetTensorImpl()->autograd_meta());
  if (meta == nullptr) return undefined;
  if (meta->grad_fn_ != nullptr) return t.grad();
  return meta->grad_;
}

// An int64 buffer argument (array('q'), or bytes of int64 values), read without converting Python
// ints; `size()` -1 where `obj` offers no buffer of whole int64s.
class Int64Buffer {
 public:
  // obj: an object with the buffer protocol, or nullptr for none (size() is then -1, as for a non-buffer)
  explicit Int64Buffer(PyObject* obj) {
    ok_ = obj != nullptr && PyObject_GetBuffer(obj, &view_, PyBUF_SIMPLE) == 0;
    if (!ok_ && obj != nullptr) PyErr_Clear();
  }
  ~Int64Buffer() {
    if (ok_) PyBuffer_Release(&view_);
  }
  Int64Buffer(const Int64Buffer&) = delete;
  Int64Buffer& operator=(const Int64Buffer&) = delete;
  Py_ssize_t size() const { return ok_ && view_.len % 8 == 0 ? view_.len / 8 : -1; }
  int64_t operator[](Py_ssize_t i) const {
    int64_t v;
    std::memcpy(&v, static_cast<const char*>(view_.buf) + 8 * i, sizeof(v));
    return v;
  }

 private:
  Py_buffer view_{};
  bool ok_ = false;
};

// plan_lists(lists, ptrs, numels, dtypes) -> True | False | NotImplemented
//
// The Triton launch plans' check of a call's persistent lists (kernels/_common.py, _Plan.grad_ptrs:
// the params, masters and states, the same tensors step after step), every list in one prefetched C
// loop, read as one sequence without joining them: tensor k must sit at the planned address
// (const_data_ptr() == ptrs[k], which does not materialise a copy-on-write tensor), have the planned
// dtype (dtypes[k], the torch.dtype object) and element count (numels[k]), and be contiguous.
// `ptrs` and `numels` are int64 buffers (array('q')). True: every tensor fits; False: one differs
// (or the count does); NotImplemented: an item is not a plain torch.Tensor / nn.Parameter, a list
// is not a list, or a tensor cannot answer (no storage): the Python passes then decide. It reads
// no `.grad` (plan_grads does, for the optimizers' plan), so a param costs the lines of its object,
// its TensorImpl and its StorageImpl only.
PyObject* plan_lists(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "plan_lists takes 4 arguments");
    return nullptr;
  }
  PyObject *lists = args[0], *dtypes = args[3];
  if (!PyList_CheckExact(lists) || !PyList_CheckExact(dtypes)) Py_RETURN_NOTIMPLEMENTED;
  const Int64Buffer ptrs(args[1]), numels(args[2]);
  const Py_ssize_t n = PyList_GET_SIZE(dtypes);
  if (ptrs.size() != n || numels.size() != n) {
    PyErr_SetString(PyExc_ValueError, "plan_lists: ptrs and numels must be int64 buffers as long as dtypes");
    return nullptr;
  }
  std::vector<PyObject*> items;
  items.reserve(static_cast<size_t>(n));
  const Py_ssize_t nl = PyList_GET_SIZE(lists);
  for (Py_ssize_t l = 0; l < nl; ++l) {
    PyObject* list = PyList_GET_ITEM(lists, l);
    if (!PyList_CheckExact(list)) Py_RETURN_NOTIMPLEMENTED;
    const Py_ssize_t m = PyList_GET_SIZE(list);
    if (static_cast<Py_ssize_t>(items.size()) + m > n) Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < m; ++i) items.push_back(PyList_GET_ITEM(list, i));
  }
  if (static_cast<Py_ssize_t>(items.size()) != n) Py_RETURN_FALSE;
  auto impl_at = [&](Py_ssize_t j) -> const c10::TensorImpl* {
    if (j >= n) return nullptr;
    PyObject* obj = items[static_cast<size_t>(j)];
    return THPVariable_CheckExact(obj) ? THPVariable_Unpack(obj).unsafeGetTensorImpl() : nullptr;
  };
  constexpr Py_ssize_t d = kHostPrefetchDistance;
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      // one level of each tensor's chain per distance: its object, its TensorImpl, its StorageImpl
      if (i + 3 * d < n) prefetch_read(items[static_cast<size_t>(i + 3 * d)]);
      if (const c10::TensorImpl* impl = impl_at(i + 2 * d)) prefetch_tensor_impl(impl);
      if (const c10::TensorImpl* impl = impl_at(i + d)) prefetch_storage_of(impl);
      PyObject* obj = items[static_cast<size_t>(i)];
      if (!THPVariable_CheckExact(obj)) Py_RETURN_NOTIMPLEMENTED;
      const at::Tensor& t = THPVariable_Unpack(obj);
      if (reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type())) != PyList_GET_ITEM(dtypes, i) ||
          reinterpret_cast<int64_t>(t.const_data_ptr()) != ptrs[i] || t.numel() != numels[i] || !t.is_contiguous())
        Py_RETURN_FALSE;
    }
  } catch (const std::exception&) {
    // a tensor without storage and the like: the Python passes answer
    Py_RETURN_NOTIMPLEMENTED;
  }
  Py_RETURN_TRUE;
}

// plan_grads(params, planned, ptrs, param_dtypes, grad_dtypes, strided[, numels])
//   -> list | True | False | NotImplemented
//
// The grads of a group's params when the group still fits its plan, else False:
// `params` holds the planned objects (`planned`, identity), each param's data_ptr() and dtype
// are the planned ones (`ptrs`, `param_dtypes`), the params with a grad are those with a
// planned grad dtype (`grad_dtypes[i]`, None: no grad), each grad is dense, of that dtype,
// and contiguous unless planned strided (`strided[i]` != 0: copied contiguous by the caller).
// With `numels` (a list of ints; the Triton launch plans, kernels/_common.py) each param must
// also have that many elements and be contiguous, and a fit answers True: the caller wants the
// answer only, and no grad object is created.
PyObject* plan_grads(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6 && nargs != 7) {
    PyErr_SetString(PyExc_TypeError, "plan_grads takes 6 or 7 arguments");
    return nullptr;
  }
  PyObject *params = args[0], *planned = args[1], *ptrs = args[2], *param_dtypes = args[3], *grad_dtypes = args[4],
           *strided = args[5];
  PyObject* numels = nargs == 7 ? args[6] : nullptr;
  if (!PyList_CheckExact(params) || !PyList_CheckExact(planned) || !PyList_CheckExact(ptrs) ||
      !PyList_CheckExact(param_dtypes) || !PyList_CheckExact(grad_dtypes) || !PyBytes_CheckExact(strided) ||
      (numels != nullptr && !PyList_CheckExact(numels)))
    Py_RETURN_NOTIMPLEMENTED;
  const Py_ssize_t n = PyList_GET_SIZE(planned);
  if (PyList_GET_SIZE(ptrs) != n || PyList_GET_SIZE(param_dtypes) != n || PyList_GET_SIZE(grad_dtypes) != n ||
      PyBytes_GET_SIZE(strided) != n || (numels != nullptr && PyList_GET_SIZE(numels) != n)) {
    PyErr_SetString(PyExc_ValueError, "plan_grads: the planned lists differ in length");
    return nullptr;
  }
  if (PyList_GET_SIZE(params) != n) Py_RETURN_FALSE;
  const char* strided_flags = PyBytes_AS_STRING(strided);
  // the answer is decided before any grad object is created: a first pass of plain reads
  PyObject* answer = Py_True;
  std::vector<const at::Tensor*> found(static_cast<size_t>(n), nullptr);
  try {
    for (Py_ssize_t i = 0; i < n && answer == Py_True; ++i) {
      prefetch_param_chain(params, n, i);
      PyObject* p = PyList_GET_ITEM(params, i);
      if (p != PyList_GET_ITEM(planned, i)) {
        answer = Py_False;
        break;
      }
      if (!THPVariable_CheckExact(p)) {  // torch.Tensor or nn.Parameter, no subclass
        answer = Py_NotImplemented;
        break;
      }
      const at::Tensor& t = THPVariable_Unpack(p);
      if (reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type())) != PyList_GET_ITEM(param_dtypes, i) ||
          PyLong_AsVoidPtr(PyList_GET_ITEM(ptrs, i)) != t.const_data_ptr()) {
        if (PyErr_Occurred()) return nullptr;
        answer = Py_False;
        break;
      }
      if (numels != nullptr) {
        const long long want_numel = PyLong_AsLongLong(PyList_GET_ITEM(numels, i));
        if (want_numel == -1 && PyErr_Occurred()) return nullptr;
        if (t.numel() != want_numel || !t.is_contiguous()) {
          answer = Py_False;
          break;
        }
      }
      const at::Tensor& g = grad_of(t);
      PyObject* want = PyList_GET_ITEM(grad_dtypes, i);
      if (!g.defined()) {
        if (want != Py_None) answer = Py_False;
        continue;
      }
      if (want == Py_None) {
        answer = Py_False;
        break;
      }
      if (g.is_sparse() || g.layout() != at::kStrided ||
          reinterpret_cast<PyObject*>(torch::getTHPDtype(g.scalar_type())) != want) {
        answer = Py_False;
        break;
      }
      if (!strided_flags[i] && !g.is_contiguous()) answer = Py_False;
      found[static_cast<size_t>(i)] = &g;
    }
  } catch (const std::exception&) {
    // a param without storage or the like: the Python path answers (and the full checks name it)
    answer = Py_NotImplemented;
  }
  if (answer != Py_True || numels != nullptr) {
    Py_INCREF(answer);
    return answer;
  }
  PyObject* out = PyList_New(n);
  if (out == nullptr) return nullptr;
  constexpr Py_ssize_t d = kHostPrefetchDistance;
  for (Py_ssize_t i = 0; i < n; ++i) {
    // `found` points into the params' autograd meta, alive while the GIL is held
    if (i + d < n && found[static_cast<size_t>(i + d)] != nullptr) {
      prefetch_tensor_impl(found[static_cast<size_t>(i + d)]->unsafeGetTensorImpl());
    }
    const at::Tensor* g = found[static_cast<size_t>(i)];
    PyObject* obj = g != nullptr ? THPVariable_Wrap(*g) : (Py_INCREF(Py_None), Py_None);
    if (obj == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, i, obj);
  }
  return out;
}

// param_grads(params) -> (grads, plain, any_fp16) | NotImplemented
//
// What the scaler's grad check reads first (fastamp/scaler/grad_check.py, _plain_grads):
// `[p.grad for p in params]` (None where a param has none), whether every grad there is is
// exactly a torch.Tensor (`type(g) is Tensor`), and whether one of them is float16, in one
// prefetched C loop. NotImplemented (nothing created) for a list that is not a list, or an
// item that is not a plain tensor (a subclass may override `.grad`): the caller then reads
// the grads in Python.
PyObject* param_grads(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1) {
    PyErr_SetString(PyExc_TypeError, "param_grads takes 1 argument");
    return nullptr;
  }
  PyObject* params = args[0];
  if (!PyList_CheckExact(params)) Py_RETURN_NOTIMPLEMENTED;
  const Py_ssize_t n = PyList_GET_SIZE(params);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (i + kHostPrefetchDistance < n) prefetch_read(PyList_GET_ITEM(params, i + kHostPrefetchDistance));
    if (!THPVariable_CheckExact(PyList_GET_ITEM(params, i))) Py_RETURN_NOTIMPLEMENTED;
  }
  PyObject* grads = PyList_New(n);
  if (grads == nullptr) return nullptr;
  bool plain = true, fp16 = false;
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      prefetch_param_chain(params, n, i);
      const at::Tensor& g = grad_of(THPVariable_Unpack(PyList_GET_ITEM(params, i)));
      PyObject* obj = Py_None;
      if (g.defined()) {
        obj = THPVariable_Wrap(g);
        if (obj == nullptr) {
          Py_DECREF(grads);
          return nullptr;
        }
        plain = plain && Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(THPVariableClass);
        fp16 = fp16 || g.scalar_type() == at::kHalf;
      } else {
        Py_INCREF(obj);
      }
      PyList_SET_ITEM(grads, i, obj);
    }
  } catch (const std::exception&) {
    // the Python path reads the grads again (and raises what `.grad` raises)
    Py_DECREF(grads);
    Py_RETURN_NOTIMPLEMENTED;
  }
  return Py_BuildValue("(NOO)", grads, plain ? Py_True : Py_False, fp16 ? Py_True : Py_False);
}

// dense_ptrs(grads, numels, dtypes, device) -> list | bytes | None | NotImplemented
//
// The Triton launcher's read of a call's grads (kernels/_common.py, _Plan.grad_ptrs): their
// data_ptr() values when each grads[i] is a dense contiguous tensor on `device` of dtype
// dtypes[i] with numels[i] elements (numels may run on past the grads), not a lazily negated
// view, at a 16-byte aligned address; else None. `numels`: a list of ints, or an int64 buffer
// (array('q'), read without converting Python ints), and then the addresses come back as the
// int64 values of a bytes object (array('q').frombytes), not as a list of Python ints. In one
// prefetched C loop instead of a pass per property. NotImplemented (nothing decided) for anything but
// a list of plain torch.Tensor / nn.Parameter objects with plain dispatch keys: the Python passes
// answer those.
PyObject* dense_ptrs(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "dense_ptrs takes 4 arguments");
    return nullptr;
  }
  PyObject *grads = args[0], *numels = args[1], *dtypes = args[2], *device = args[3];
  if (!PyList_CheckExact(grads) || !PyList_CheckExact(dtypes) || !THPDevice_Check(device)) Py_RETURN_NOTIMPLEMENTED;
  const bool numel_list = PyList_CheckExact(numels);
  const Int64Buffer numel_buf(numel_list ? nullptr : numels);
  const Py_ssize_t n = PyList_GET_SIZE(grads);
  if ((numel_list ? PyList_GET_SIZE(numels) : numel_buf.size()) < n || PyList_GET_SIZE(dtypes) < n)
    Py_RETURN_NOTIMPLEMENTED;
  const c10::Device dev = reinterpret_cast<THPDevice*>(device)->device;
  std::vector<void*> ptrs(static_cast<size_t>(n));
  bool fits = true;
  constexpr Py_ssize_t d = kHostPrefetchDistance;
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (i + 3 * d < n) prefetch_read(PyList_GET_ITEM(grads, i + 3 * d));
      if (i + 2 * d < n && THPVariable_CheckExact(PyList_GET_ITEM(grads, i + 2 * d))) {
        prefetch_tensor_impl(THPVariable_Unpack(PyList_GET_ITEM(grads, i + 2 * d)).unsafeGetTensorImpl());
      }
      if (i + d < n && THPVariable_CheckExact(PyList_GET_ITEM(grads, i + d))) {
        prefetch_storage_of(THPVariable_Unpack(PyList_GET_ITEM(grads, i + d)).unsafeGetTensorImpl());
      }
      PyObject* obj = PyList_GET_ITEM(grads, i);
      if (!THPVariable_CheckExact(obj)) Py_RETURN_NOTIMPLEMENTED;
      const at::Tensor& g = THPVariable_Unpack(obj);
      if (!g.defined() || !has_plain_keys(g.unsafeGetTensorImpl())) Py_RETURN_NOTIMPLEMENTED;
      if (!fits) continue;  // keep reading: a later item may still need the Python passes
      const long long want = numel_list ? PyLong_AsLongLong(PyList_GET_ITEM(numels, i)) : numel_buf[i];
      if (want == -1 && PyErr_Occurred()) return nullptr;
      if (g.layout() != at::kStrided || g.device() != dev || g.numel() != want ||
          reinterpret_cast<PyObject*>(torch::getTHPDtype(g.scalar_type())) != PyList_GET_ITEM(dtypes, i) ||
          !g.is_contiguous() || g.is_neg()) {
        fits = false;
        continue;
      }
      void* p = g.data_ptr();
      if (reinterpret_cast<uintptr_t>(p) & 15) {
        fits = false;
        continue;
      }
      ptrs[static_cast<size_t>(i)] = p;
    }
  } catch (const std::exception&) {
    // a grad without storage and the like: the Python passes answer (None)
    Py_RETURN_NOTIMPLEMENTED;
  }
  if (!fits) Py_RETURN_NONE;
  if (!numel_list) {
    static_assert(sizeof(void*) == sizeof(int64_t), "addresses as int64");
    return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(ptrs.data()),
                                     static_cast<Py_ssize_t>(ptrs.size() * sizeof(void*)));
  }
  PyObject* out = PyList_New(n);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* v = PyLong_FromVoidPtr(ptrs[static_cast<size_t>(i)]);
    if (v == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, i, v);
  }
  return out;
}

// same_items(dicts, keys, values) -> bool | NotImplemented: whether dicts[i][keys[k]] is values[k][i]
// for every i and k (a missing key: False); each dict is visited once, for all keys.
PyObject* same_items(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "same_items takes 3 arguments");
    return nullptr;
  }
  PyObject *dicts = args[0], *keys = args[1], *values = args[2];
  if (!PyList_CheckExact(dicts) || !PyTuple_CheckExact(keys) || !PyTuple_CheckExact(values) ||
      PyTuple_GET_SIZE(keys) != PyTuple_GET_SIZE(values))
    Py_RETURN_NOTIMPLEMENTED;
  const Py_ssize_t n = PyList_GET_SIZE(dicts), nk = PyTuple_GET_SIZE(keys);
  for (Py_ssize_t k = 0; k < nk; ++k) {
    PyObject* v = PyTuple_GET_ITEM(values, k);
    if (!PyList_CheckExact(v) || PyList_GET_SIZE(v) != n) Py_RETURN_NOTIMPLEMENTED;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyDict_CheckExact(PyList_GET_ITEM(dicts, i))) Py_RETURN_NOTIMPLEMENTED;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* d = PyList_GET_ITEM(dicts, i);
    for (Py_ssize_t k = 0; k < nk; ++k) {
      PyObject* v = PyDict_GetItemWithError(d, PyTuple_GET_ITEM(keys, k));
      if (v == nullptr && PyErr_Occurred()) return nullptr;
      if (v != PyList_GET_ITEM(PyTuple_GET_ITEM(values, k), i)) Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
}

}  // namespace
}  // namespace fastamp

// Added to the module by csrc/ops.cpp.
PyMethodDef fastamp_plan_methods[] = {
    {"plan_grads", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fastamp::plan_grads)), METH_FASTCALL,
     "the grads of a param group that still fits its cached launch plan (True with numels), False, or "
     "NotImplemented"},
    {"param_grads", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fastamp::param_grads)), METH_FASTCALL,
     "(the params' grads, whether each grad is exactly a torch.Tensor, whether one is float16), or NotImplemented"},
    {"plan_lists", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fastamp::plan_lists)), METH_FASTCALL,
     "whether the Triton launch plan's persistent lists still hold the planned addresses, dtypes and element "
     "counts (True / False), or NotImplemented"},
    {"dense_ptrs", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fastamp::dense_ptrs)), METH_FASTCALL,
     "the data pointers of dense contiguous grads of the planned numels and dtypes on a device, None, or "
     "NotImplemented"},
    {"same_items", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fastamp::same_items)), METH_FASTCALL,
     "whether dicts[i][keys[k]] is values[k][i] for every i and k, or NotImplemented"},
    {nullptr, nullptr, 0, nullptr}};
