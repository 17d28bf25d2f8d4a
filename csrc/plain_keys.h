// The dispatch keys of a plain dense tensor, shared by the host shortcuts (csrc/direct_call.cpp,
// csrc/plan_check.cpp): a tensor with any other key (a Python subclass or mode, a functorch
// wrapper, a lazily negated or conjugated view, a sparse or nested layout) goes to the dispatcher
// or to the Python passes instead.
#pragma once

#include <c10/core/DispatchKeySet.h>
#include <c10/core/TensorImpl.h>

namespace fastamp {

// Dense CPU/CUDA tensors as autograd sees them, nothing else.
inline const c10::DispatchKeySet kPlainKeys = c10::DispatchKeySet(
    {c10::DispatchKey::CPU, c10::DispatchKey::CUDA, c10::DispatchKey::ADInplaceOrView, c10::DispatchKey::AutogradCPU,
     c10::DispatchKey::AutogradCUDA, c10::DispatchKey::AutocastCPU, c10::DispatchKey::AutocastCUDA});

// Whether a tensor's keys are all plain ones (raw bits: DispatchKeySet's operator- keeps the
// backend bits).
inline bool has_plain_keys(const c10::TensorImpl* impl) {
  return (impl->key_set().raw_repr() & ~kPlainKeys.raw_repr()) == 0;
}

}  // namespace fastamp
