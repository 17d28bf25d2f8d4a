// Software prefetch for the host side's per-tensor loops: the checks of a cached launch plan
// (csrc/plan_check.cpp), the direct calls' reading of tensor lists (csrc/direct_call.cpp) and
// the persistent kernel tables (csrc/cpu/adamw.cpp).
//
// Why: at thousands of small tensors these loops are bound by memory latency, not by work.
// Each tensor is a chain of heap objects far apart (the Python object, its TensorImpl, the
// StorageImpl with the data pointer, the autograd meta holding `.grad`, the grad's TensorImpl),
// and a loop that follows the chain one tensor at a time waits for each miss in turn: ~0.4 us
// per param at 20,000 params of 256 elements, on a 2-core EPYC (issue 21). Asking for the
// objects a few iterations ahead overlaps those misses. A prefetch never faults and never
// changes a result: these helpers only read what the loop itself reads later.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>

namespace fastamp {

// How many iterations ahead each level of an object chain is asked for: of a chain of L
// levels (the Python object, its TensorImpl, its StorageImpl, ...), level k (0 first) at
// (L - k) x this, so that each level's pointer is in cache when the next level is asked for.
constexpr std::ptrdiff_t kHostPrefetchDistance = 6;

// A read hint for the cache line holding p (never faults; a null p is ignored by the CPU).
inline void prefetch_read(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 3);
#else
  (void)p;
#endif
}

// The lines of a TensorImpl that the checks read (sizes, strides, dtype, key set, flags,
// storage and autograd meta pointers sit in its first 256 bytes).
inline void prefetch_tensor_impl(const c10::TensorImpl* impl) {
  const char* p = reinterpret_cast<const char*>(impl);
  for (int line = 0; line < 4; ++line) prefetch_read(p + 64 * line);
}

// The StorageImpl of a TensorImpl (holds the data pointer); reads the TensorImpl, which the
// caller prefetched earlier. A tensor without storage gives nullptr.
inline void prefetch_storage_of(const c10::TensorImpl* impl) {
  prefetch_read(impl->unsafe_storage().unsafeGetStorageImpl());
}

// At iteration i of a loop over tensors held in C++ (at::TensorList, std::vector<at::Tensor>):
// asks for the TensorImpl two distances ahead and the StorageImpl one distance ahead. A loop
// that prefetches several lists per iteration (adamw_q8_'s 7) runs a shorter distance.
template <std::ptrdiff_t Distance = kHostPrefetchDistance, class List>
inline void prefetch_tensors_ahead(const List& list, size_t i) {
  constexpr size_t d = static_cast<size_t>(Distance);
  if (i + 2 * d < list.size()) prefetch_tensor_impl(list[i + 2 * d].unsafeGetTensorImpl());
  if (i + d < list.size()) prefetch_storage_of(list[i + d].unsafeGetTensorImpl());
}

}  // namespace fastamp
