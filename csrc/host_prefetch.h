// Software prefetch for the host side's per-tensor loops: the checks of a cached launch plan
// (csrc/plan_check.cpp), the direct calls' reading of tensor lists (csrc/direct_call.cpp) and
// the persistent kernel tables (csrc/cpu/optim.cpp).
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

namespace detail {
#if defined(__GNUC__) || defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"
// Where the TensorImpl fields the checks read sit, from torch's own header (so a torch that moves
// them moves the prefetches with them): storage_ near the start (autograd_meta_, private, is
// declared right after it: the same 16 bytes); storage_offset_, numel_, data_type_, device_opt_,
// the flag bits (is_contiguous_, sizes_strides_policy_, storage_access_should_throw_, ...) and
// key_set_ together further on. Between them sit the sizes and strides, which a check of a
// contiguous tensor's cached numel and flag bits does not read. Never instantiated: the offsets only.
struct TensorImplFields : c10::TensorImpl {
  static constexpr size_t storage_at() { return offsetof(TensorImplFields, storage_); }
  static constexpr size_t offset_at() { return offsetof(TensorImplFields, storage_offset_); }
  static constexpr size_t key_set_end() { return offsetof(TensorImplFields, key_set_) + sizeof(c10::DispatchKeySet); }
};
#pragma GCC diagnostic pop
#endif
}  // namespace detail

// The lines of a TensorImpl that the checks read. With GCC or Clang only those holding the fields
// above (2-3 lines: the sizes and strides between them are skipped); elsewhere its first 256 bytes.
// Each miss that is not asked for is one fewer in flight for the lines that are: at thousands of
// tensors these loops are bound by how many misses the core keeps in flight.
inline void prefetch_tensor_impl(const c10::TensorImpl* impl) {
  const char* p = reinterpret_cast<const char*>(impl);
#if defined(__GNUC__) || defined(__clang__)
  using F = detail::TensorImplFields;
  static_assert(F::storage_at() < F::offset_at() && F::key_set_end() <= sizeof(c10::TensorImpl),
                "TensorImpl's fields moved: revisit prefetch_tensor_impl");
  prefetch_read(p + F::storage_at());
  prefetch_read(p + F::storage_at() + 15);
  for (size_t off = F::offset_at(); off < F::key_set_end(); off += 64) prefetch_read(p + off);
  prefetch_read(p + F::key_set_end() - 1);
#else
  for (int line = 0; line < 4; ++line) prefetch_read(p + 64 * line);
#endif
}

// The StorageImpl of a TensorImpl (holds the data pointer); reads the TensorImpl, which the
// caller prefetched earlier. A tensor without storage gives nullptr. The data pointer and the
// flags a data_ptr() read checks sit in bytes 16..63 of the object (after its vtable pointer and
// reference counts), which may straddle two lines.
inline void prefetch_storage_of(const c10::TensorImpl* impl) {
  const char* s = reinterpret_cast<const char*>(impl->unsafe_storage().unsafeGetStorageImpl());
  if (s == nullptr) return;
  prefetch_read(s + 16);
  prefetch_read(s + 63);
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
