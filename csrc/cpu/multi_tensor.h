// Flattened multi-tensor work lists for the CPU kernels (private to csrc/cpu/).
//
// All tensors of one op call are cut into chunks of at most kChunkElems elements; the
// cut depends only on the tensor sizes, never on the number of threads, so per-chunk
// partial results (the sum of squares) combined in chunk order are deterministic. The
// chunks are then split into one contiguous run per thread, balanced by element count
// plus a fixed per-chunk cost so thousands of tiny tensors spread evenly too.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "host_prefetch.h"  // prefetch_read

namespace fastamp {
namespace cpu {

constexpr int64_t kChunkElems = 16384;
// Per-chunk bookkeeping counted as this many elements when balancing threads.
constexpr int64_t kChunkCostElems = 64;
// How much of the next chunk a chunk loop prefetches before running the current one.
constexpr int64_t kNextChunkPrefetchBytes = 2048;

// Below this much work (in element units) a single thread is faster than waking others.
constexpr int64_t kMinParallelWork = 1 << 15;

struct Chunk {
  int32_t tensor;  // index into the op's tensor lists
  int64_t begin;   // first element of the chunk within that tensor
  int64_t len;     // number of elements, 1..kChunkElems
};

inline std::vector<Chunk> split_into_chunks(const std::vector<int64_t>& numels) {
  std::vector<Chunk> chunks;
  int64_t count = 0;
  for (int64_t n : numels) count += (n + kChunkElems - 1) / kChunkElems;
  chunks.reserve(static_cast<size_t>(count));
  for (size_t t = 0; t < numels.size(); ++t) {
    for (int64_t b = 0; b < numels[t]; b += kChunkElems) {
      chunks.push_back(Chunk{static_cast<int32_t>(t), b, std::min(kChunkElems, numels[t] - b)});
    }
  }
  return chunks;
}

// Calls fn(first_chunk, end_chunk) on disjoint contiguous runs covering all chunks, in
// parallel with at::parallel_for when there is enough work. fn must not throw.
template <class F>
void parallel_over_chunks(const std::vector<Chunk>& chunks, const F& fn) {
  const int64_t n = static_cast<int64_t>(chunks.size());
  if (n == 0) return;
  int64_t work = 0;
  for (const Chunk& c : chunks) work += c.len + kChunkCostElems;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t tasks = std::min<int64_t>(work < kMinParallelWork ? 1 : threads, n);
  if (tasks <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  // bounds[t] = first chunk whose starting work offset is >= t * work / tasks
  std::vector<int64_t> bounds(static_cast<size_t>(tasks) + 1, n);
  bounds[0] = 0;
  int64_t acc = 0;
  int64_t t = 1;
  for (int64_t c = 0; c < n && t < tasks; ++c) {
    while (t < tasks && acc >= (work / tasks) * t) bounds[static_cast<size_t>(t++)] = c;
    acc += chunks[static_cast<size_t>(c)].len + kChunkCostElems;
  }
  at::parallel_for(0, tasks, 1, [&](int64_t tb, int64_t te) {
    for (int64_t i = tb; i < te; ++i) {
      const int64_t cb = bounds[static_cast<size_t>(i)];
      const int64_t ce = bounds[static_cast<size_t>(i) + 1];
      if (cb < ce) fn(cb, ce);
    }
  });
}

// Like parallel_over_chunks, but the chunks are cut into runs of about kDynamicRunWork
// element units (the cut depends only on the chunk list) that the threads take in order from a
// shared counter as each finishes its last: a thread slowed down (a busy sibling core, another
// process) takes fewer runs instead of making the other wait at the end. fn must not throw, and
// (as for parallel_over_chunks) a chunk's result must not depend on which run holds it.
constexpr int64_t kDynamicRunWork = 4 * kChunkElems;

template <class F>
void parallel_over_chunks_dynamic(const std::vector<Chunk>& chunks, const F& fn) {
  const int64_t n = static_cast<int64_t>(chunks.size());
  if (n == 0) return;
  int64_t work = 0;
  for (const Chunk& c : chunks) work += c.len + kChunkCostElems;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  if (work < kMinParallelWork || threads <= 1 || n == 1) {
    fn(int64_t{0}, n);
    return;
  }
  std::vector<int64_t> bounds{0};
  int64_t acc = 0;
  for (int64_t c = 0; c < n; ++c) {
    acc += chunks[static_cast<size_t>(c)].len + kChunkCostElems;
    if (acc >= kDynamicRunWork && c + 1 < n) {
      bounds.push_back(c + 1);
      acc = 0;
    }
  }
  bounds.push_back(n);
  const int64_t runs = static_cast<int64_t>(bounds.size()) - 1;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, runs), 1, [&](int64_t tb, int64_t te) {
    for (int64_t i = tb; i < te; ++i) {
      for (int64_t r = next.fetch_add(1, std::memory_order_relaxed); r < runs;
           r = next.fetch_add(1, std::memory_order_relaxed)) {
        fn(bounds[static_cast<size_t>(r)], bounds[static_cast<size_t>(r) + 1]);
      }
    }
  });
}

}  // namespace cpu
}  // namespace fastamp
