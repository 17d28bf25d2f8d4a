// Launch planning of fastamp's multi-tensor CUDA kernels: which launches an op call makes,
// how its tensors are packed into the launch table and how a block finds its chunks.
//
// Host-only C++ plus a few functions shared with the kernels; no CUDA or torch header, so a
// plain C++ compiler can count launches and walk chunks without a GPU or a toolkit
// (tests/tools/test_cuda_launch_plan.py). The launchers (amp.cu, optim.cuh) run exactly the
// plan these functions return.
//
// Packing: every non-empty tensor of an op call gets one entry (its pointers, numel and the
// ordinal of its first chunk within its launch) in a single table in device memory, uploaded
// once per call (one copy from pinned memory; under stream capture, fill kernels carrying the
// table as kernel arguments, so the graph owns it). There is one launch per dtype
// combination whatever the number of tensors, and each launch covers any number of chunks:
// its blocks take balanced contiguous ranges of the launch's chunks, find the first one's
// tensor by binary search and walk forward from there.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../optim_rules.h"

#if defined(__CUDACC__)
#define FASTAMP_PLAN_HD __host__ __device__ __forceinline__
#else
#define FASTAMP_PLAN_HD inline
#endif

namespace fastamp {
namespace cuda {

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline int32_t dtype_index(DType d) { return static_cast<int32_t>(d); }

// Elements handled by one block at a time. A multiple of every vector width, so each
// chunk of an aligned tensor starts aligned. sum-of-squares partials are per chunk.
constexpr int64_t kChunkSize = 65536;

// Threads per block of every multi-tensor kernel.
constexpr int kBlockSize = 256;

// Resident threads per SM the grid is sized for (blocks beyond it would only queue).
constexpr int kThreadsPerSm = 2048;

FASTAMP_PLAN_HD int64_t num_chunks(int64_t numel) { return (numel + kChunkSize - 1) / kChunkSize; }

// Table rows (pointers per tensor) of each op's kernels.
constexpr int kUnscaleDepth = 1;       // grad
constexpr int kUnscaleStatsDepth = 3;  // grad, counts row, absmax
constexpr int kUnscaleSlotsDepth = 2;  // grad, the grad's own partial slots (unscale_check_partials_)
// optim_ (the one optimizer kernel, optim.cuh): one table layout per (update rule, state format).
// Rows: param, grad, master (or null), the rule's state tensors (one per state, two for q8:
// codes then scales; null past the states a call keeps), and the tensor's list index, from
// which the kernel finds its step-scalar row and its random streams (so neither takes a row).
using OptimRule = ::fastamp::RuleId;  // the rules of csrc/optim_rules.h
enum class StateFormat : int32_t { kFloat32 = 0, kBFloat16 = 1, kQ8 = 2 };

// The most states a rule keeps (csrc/optim_rules.h): AdamW exp_avg, exp_avg_sq and (amsgrad)
// max_exp_avg_sq; SGD its momentum buffer (none without momentum); Lion exp_avg.
FASTAMP_PLAN_HD constexpr int optim_max_states(OptimRule rule) { return rule_max_states(rule); }
// Tensors per state: q8 keeps codes and block scales.
FASTAMP_PLAN_HD constexpr int state_streams(StateFormat format) { return format == StateFormat::kQ8 ? 2 : 1; }
constexpr int kOptimFixedRows = 4;  // param, grad, master, list index
FASTAMP_PLAN_HD constexpr int optim_depth(OptimRule rule, StateFormat format) {
  return kOptimFixedRows + optim_max_states(rule) * state_streams(format);
}
constexpr int kOptimFirstStateRow = 3;

// Table payload per fill kernel under stream capture: the kernel-argument space minus the
// fill kernel's other arguments. CUDA 12.1+ accepts 32,764 bytes of kernel arguments on
// Volta and newer (every arch fastamp builds for); older toolkits 4,096.
#if defined(CUDART_VERSION) && CUDART_VERSION < 12010
constexpr size_t kFillPayloadBytes = 4096 - 32;
#else
constexpr size_t kFillPayloadBytes = 32768 - 64;
#endif
static_assert(kFillPayloadBytes % 16 == 0, "fill payload must be whole 16-byte words");

// ---- the table ----

template <int DEPTH>
struct TableEntry {
  void* ptrs[DEPTH];
  int64_t numel;        // > 0
  int64_t chunk_start;  // ordinal of the tensor's first chunk within its launch
};

// What a kernel receives: its launch's entries (device memory) and their chunk count.
template <int DEPTH>
struct TableView {
  static constexpr int kDepth = DEPTH;
  const TableEntry<DEPTH>* entries;
  int64_t num_tensors;
  int64_t num_chunks;
};

struct ChunkLocation {
  int64_t tensor;  // entry index within the launch
  int64_t offset;  // element offset of the chunk within its tensor (a multiple of kChunkSize)
  int64_t n;       // elements in this chunk (1..kChunkSize)
};

// Block `block` of `grid` takes chunks [*begin, *end): contiguous, balanced to one chunk,
// never empty when grid <= num_chunks. Any assignment gives the same results (per-chunk
// work and partials do not depend on which block runs a chunk).
FASTAMP_PLAN_HD void block_chunk_range(int64_t num_chunks_total, int64_t grid, int64_t block, int64_t* begin,
                                       int64_t* end) {
  *begin = block * num_chunks_total / grid;
  *end = (block + 1) * num_chunks_total / grid;
}

// Walks a block's chunks in increasing order: one binary search for the first chunk, then
// forward steps (entries are never empty, so chunk_start strictly increases).
template <int DEPTH>
struct ChunkWalker {
  const TableEntry<DEPTH>* entries;
  int64_t num_tensors;
  int64_t tensor;

  FASTAMP_PLAN_HD ChunkWalker(const TableView<DEPTH>& view, int64_t first_chunk)
      : entries(view.entries), num_tensors(view.num_tensors), tensor(0) {
    int64_t lo = 0;
    int64_t hi = num_tensors - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) >> 1;
      if (entries[mid].chunk_start <= first_chunk) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    tensor = lo;
  }

  // `chunk` must not be below the previous call's (or the first chunk).
  FASTAMP_PLAN_HD ChunkLocation locate(int64_t chunk) {
    while (tensor + 1 < num_tensors && entries[tensor + 1].chunk_start <= chunk) ++tensor;
    ChunkLocation loc;
    loc.tensor = tensor;
    loc.offset = (chunk - entries[tensor].chunk_start) * kChunkSize;
    const int64_t left = entries[tensor].numel - loc.offset;
    loc.n = left < kChunkSize ? left : kChunkSize;
    return loc;
  }
};

// ---- the table's upload ----

// Device (and staging) buffer size of a table: whole 16-byte words (fill kernels store uint4).
inline size_t table_buffer_bytes(size_t table_bytes) { return (table_bytes + 15) / 16 * 16; }

// One fill kernel's share of the table buffer under stream capture.
struct FillSegment {
  size_t offset;  // bytes into the buffer, a multiple of 16
  size_t bytes;   // a multiple of 16, at most kFillPayloadBytes
};

inline std::vector<FillSegment> fill_segments(size_t table_bytes) {
  std::vector<FillSegment> segments;
  const size_t total = table_buffer_bytes(table_bytes);
  for (size_t offset = 0; offset < total; offset += kFillPayloadBytes) {
    segments.push_back({offset, total - offset < kFillPayloadBytes ? total - offset : kFillPayloadBytes});
  }
  return segments;
}

// ---- the plan ----

struct PlannedLaunch {
  int32_t group = 0;        // dtype combination: a dtype index, or 3 * param + grad (plan_param_grad)
  int64_t first_entry = 0;  // index of the launch's first entry in the op's table
  int64_t num_tensors = 0;  // entries of this launch
  int64_t num_chunks = 0;   // chunks of this launch
  int64_t first_chunk = 0;  // ordinal of its first chunk among all the op call's chunks
  int64_t grid = 0;         // blocks
};

struct LaunchPlan {
  std::vector<int64_t> entry_tensor;  // list index of each table entry, in table order
  std::vector<PlannedLaunch> launches;
  size_t entry_bytes = 0;
  size_t table_bytes = 0;
  int64_t total_chunks = 0;
  int64_t table_copies = 0;    // host-to-device copies of the table (1, or 0 under capture)
  int64_t table_fills = 0;     // fill kernels writing the table (under stream capture only)
  int64_t other_launches = 0;  // the op's own extra work (memsets, the sum-of-squares finalize)

  int64_t total_launches() const {
    return table_copies + table_fills + static_cast<int64_t>(launches.size()) + other_launches;
  }
};

// Tensor i (numel[i] elements) belongs to group[i] in [0, num_groups), or to none when
// group[i] < 0; empty tensors get no entry. One launch per non-empty group, groups in
// increasing order, tensors in list order within a group: the sum-of-squares partials
// (chunk ordinals) follow that order, so they are fixed for a given list.
inline LaunchPlan plan_launches(const int32_t* group, const int64_t* numel, int64_t n, int32_t num_groups,
                                size_t entry_bytes, bool capturing, int64_t sm_count) {
  LaunchPlan plan;
  plan.entry_bytes = entry_bytes;
  const int64_t grid_cap = (sm_count > 0 ? sm_count : 1) * (kThreadsPerSm / kBlockSize);
  std::vector<PlannedLaunch> by_group(static_cast<size_t>(num_groups > 0 ? num_groups : 0));
  for (int64_t i = 0; i < n; ++i) {
    if (group[i] < 0 || group[i] >= num_groups || numel[i] <= 0) continue;
    PlannedLaunch& l = by_group[static_cast<size_t>(group[i])];
    l.num_tensors += 1;
    l.num_chunks += num_chunks(numel[i]);
  }
  int64_t entries = 0;
  for (int32_t g = 0; g < num_groups; ++g) {
    PlannedLaunch& l = by_group[static_cast<size_t>(g)];
    l.group = g;
    l.first_entry = entries;
    l.first_chunk = plan.total_chunks;
    l.grid = l.num_chunks < grid_cap ? l.num_chunks : grid_cap;
    entries += l.num_tensors;
    plan.total_chunks += l.num_chunks;
    if (l.num_tensors > 0) plan.launches.push_back(l);
  }
  plan.entry_tensor.resize(static_cast<size_t>(entries));
  std::vector<int64_t> cursor(by_group.size());
  for (size_t g = 0; g < by_group.size(); ++g) cursor[g] = by_group[g].first_entry;
  for (int64_t i = 0; i < n; ++i) {
    if (group[i] < 0 || group[i] >= num_groups || numel[i] <= 0) continue;
    plan.entry_tensor[static_cast<size_t>(cursor[static_cast<size_t>(group[i])]++)] = i;
  }
  plan.table_bytes = static_cast<size_t>(entries) * entry_bytes;
  if (plan.table_bytes > 0) {
    if (capturing) {
      plan.table_fills = static_cast<int64_t>(fill_segments(plan.table_bytes).size());
    } else {
      plan.table_copies = 1;
    }
  }
  return plan;
}

// Writes the plan's table into `out` (plan.table_bytes bytes). ptrs_of(i, void** row) fills
// the DEPTH pointers of list tensor i.
template <int DEPTH, typename PtrsOf>
void pack_table(const LaunchPlan& plan, const int64_t* numel, PtrsOf ptrs_of, void* out) {
  auto* entries = static_cast<TableEntry<DEPTH>*>(out);
  for (const PlannedLaunch& launch : plan.launches) {
    int64_t chunk = 0;
    for (int64_t k = 0; k < launch.num_tensors; ++k) {
      const int64_t e = launch.first_entry + k;
      const int64_t i = plan.entry_tensor[static_cast<size_t>(e)];
      TableEntry<DEPTH> entry;
      ptrs_of(i, entry.ptrs);
      entry.numel = numel[i];
      entry.chunk_start = chunk;
      chunk += num_chunks(numel[i]);
      std::memcpy(entries + e, &entry, sizeof(entry));
    }
  }
}

// ---- the plans of the ops (what amp.cu and optim.cuh launch) ----

// unscale_check_ / unscale_check_stats_: one launch per grad dtype (fp32, fp16, bf16); then
// the sum-of-squares finalize (or the memset of the zero result) and, with statistics, the
// two memsets zeroing counts and absmax.
inline LaunchPlan plan_unscale_check(const DType* grad, const int64_t* numel, int64_t n, bool stats, bool capturing,
                                     int64_t sm_count) {
  std::vector<int32_t> group(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) group[static_cast<size_t>(i)] = dtype_index(grad[i]);
  const size_t entry = stats ? sizeof(TableEntry<kUnscaleStatsDepth>) : sizeof(TableEntry<kUnscaleDepth>);
  LaunchPlan plan = plan_launches(group.data(), numel, n, 3, entry, capturing, sm_count);
  plan.other_launches = 1 + (stats && n > 0 ? 2 : 0);
  return plan;
}

// unscale_check_partials_: the launches of unscale_check_ (one per grad dtype, the same chunks),
// with each grad's chunk partials written to its own slots; no finalize, no memset.
inline LaunchPlan plan_unscale_check_partials(const DType* grad, const int64_t* numel, int64_t n, bool capturing,
                                              int64_t sm_count) {
  std::vector<int32_t> group(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) group[static_cast<size_t>(i)] = dtype_index(grad[i]);
  return plan_launches(group.data(), numel, n, 3, sizeof(TableEntry<kUnscaleSlotsDepth>), capturing, sm_count);
}

// optim_: one launch per (param dtype, grad dtype), group 3 * param + grad.
inline LaunchPlan plan_param_grad(const DType* param, const DType* grad, const int64_t* numel, int64_t n,
                                  size_t entry_bytes, bool capturing, int64_t sm_count) {
  std::vector<int32_t> group(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) group[i] = 3 * dtype_index(param[i]) + dtype_index(grad[i]);
  return plan_launches(group.data(), numel, n, 9, entry_bytes, capturing, sm_count);
}

// Bytes of one optim_ table entry: optim_depth pointers, numel and the first chunk.
constexpr size_t optim_entry_bytes(OptimRule rule, StateFormat format) {
  return static_cast<size_t>(optim_depth(rule, format)) * sizeof(void*) + 2 * sizeof(int64_t);
}

// Every rule and state format plans alike: only the entry size (the table's rows) differs.
inline LaunchPlan plan_optim(OptimRule rule, StateFormat format, const DType* param, const DType* grad,
                             const int64_t* numel, int64_t n, bool capturing, int64_t sm_count) {
  return plan_param_grad(param, grad, numel, n, optim_entry_bytes(rule, format), capturing, sm_count);
}

}  // namespace cuda
}  // namespace fastamp
