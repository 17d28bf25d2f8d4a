// CPU kernels of fastamp::unscale_check_ and fastamp::update_scale_ (semantics:
// fastamp/reference/; per-element maths: csrc/fastamp_math.h).
//
// unscale_check_: one pass over all grads of the call (fp32/fp16/bf16 mixed), cut into
// fixed-size chunks (csrc/cpu/multi_tensor.h) and spread over threads; each chunk runs
// the widest vector kernel the CPU supports (AVX-512, AVX2, or the scalar twin of the
// reference). found_inf and the written grads are bit-exact with the reference for every
// instruction set. The sum of squares adds exact fp64 squares in 16 fixed lanes per
// chunk, then the chunk sums in chunk order in fp64: it does not depend on the number of
// threads or on the instruction set, and differs from the reference's fp64 sum only by
// fp64 reassociation.
//
// unscale_check_stats_ is the same pass with a compile-time STATS switch (so the plain
// op's kernels are unchanged): per chunk, integer counts of non-finite / zero / fp16
// underflow values and the absolute max of finite values, combined per tensor after the
// parallel region; integer sums and a max are exact whatever the order.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu/isa.h"
#include "cpu/multi_tensor.h"
#include "cpu/scalar_ops.h"
#include "fastamp_math.h"
#include "host_prefetch.h"
#include "op_signatures.h"

namespace fastamp {
namespace cpu {
namespace {

// Gradient health of one chunk (unscale_check_stats_), added into by the chunk kernels.
// No member initializers: the array of them for multi-chunk tensors is left uninitialised;
// each chunk's kernel adds into a zeroed local one that is then stored.
struct ChunkStats {
  int64_t nonfinite;  // elements that raise found_inf
  int64_t zeros;      // y == 0 (x is then finite: inf * 0 and nan * s are nan)
  int64_t underflow;  // 0 < |y| < 2^-14
  float absmax;       // max |y| over finite y
};

// The statistics of a 16-bit grad as thresholds on its magnitude bits u = bits & 0x7fff.
// y = x * inv_scale rounds monotonically in |x|, and the order of u is the order of |x|
// (inf after every finite value, NaN after inf), so with a finite inv_scale each statistic
// of unscale_check_stats_ is a comparison of u with a threshold found once per call
// (bounds16): non-finite u >= bad, zero u < nonzero, |y| < 2^-14 u < big, finite y u < finite.
// The AVX-512 kernel counts with these on 32 raw 16-bit lanes at a time, a few integer
// ops per 32 elements, instead of float tests per element; valid is false when inv_scale
// is not finite (the float tests run then).
struct Bounds16 {
  bool valid = false;
  uint16_t bad = 0, nonzero = 0, big = 0, finite = 0;
};

namespace scalar {

// Reference per-element rule; element i adds to lanes[i % 16]. STATS: also counts into *stats.
template <class T, bool WRITE, bool SUMSQ, bool STATS>
bool unscale_range(T* x, int64_t begin, int64_t end, float inv_scale, double* lanes, ChunkStats* stats) {
  bool bad = false;
  for (int64_t i = begin; i < end; ++i) {
    const float xv = load_float(x + i);
    bool elem_bad = false;
    const float y = math::unscale_element(xv, inv_scale, &elem_bad);
    if constexpr (WRITE) {
      store_float(x + i, y);
      if (!stored_is_finite(x + i)) elem_bad = true;
    }
    bad |= elem_bad;
    if constexpr (SUMSQ) {
      const double d = static_cast<double>(y);
      lanes[i & 15] += d * d;
    }
    if constexpr (STATS) {
      const float ay = std::fabs(y);
      stats->nonfinite += elem_bad ? 1 : 0;
      stats->zeros += (math::is_finite(xv) && y == 0.0f) ? 1 : 0;
      stats->underflow += (ay > 0.0f && ay < math::kFp16MinNormal) ? 1 : 0;
      if (math::is_finite(y) && ay > stats->absmax) stats->absmax = ay;
    }
  }
  return bad;
}

// How many of x[0, n) raise found_inf, counted again after a vector STATS loop saw one
// (rare: overflow steps). Written back, that is a stored value that is not finite (|y|
// reached the limit of T, or y was inf/nan); checked only, it is !(|x * inv_scale| < limit).
template <class T, bool WRITE>
int64_t count_flagged(const T* x, int64_t n, float inv_scale, float limit) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (WRITE) {
      count += stored_is_finite(x + i) ? 0 : 1;
    } else {
      count += (std::fabs(load_float(x + i) * inv_scale) < limit) ? 0 : 1;
    }
  }
  return count;
}

// Largest |y| over the finite y of x[0, n), for a vector STATS chunk that met a non-finite
// one. Written back (fp32 only: fp16/bf16 write-back keeps its own max) x already holds y.
template <class T, bool WRITE>
float finite_absmax(const T* x, int64_t n, float inv_scale) {
  float best = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float y = WRITE ? load_float(x + i) : load_float(x + i) * inv_scale;
    const float a = std::fabs(y);
    if (math::is_finite(y) && a > best) best = a;
  }
  return best;
}

template <class T, bool WRITE, bool SUMSQ, bool STATS>
bool unscale_chunk(void* data, int64_t n, float inv_scale, float /*limit*/, const Bounds16* /*bounds*/, double* lanes,
                   ChunkStats* stats) {
  return unscale_range<T, WRITE, SUMSQ, STATS>(static_cast<T*>(data), 0, n, inv_scale, lanes, stats);
}

}  // namespace scalar

#define FASTAMP_ISA_KERNELS "cpu/amp_kernels.inc"
#include "cpu/per_isa.inc"  // namespaces avx512 and avx2: the loops of amp_kernels.inc per ISA

using UnscaleChunkFn = bool (*)(void*, int64_t, float, float, const Bounds16*, double*, ChunkStats*);

template <class T, bool WRITE, bool SUMSQ, bool STATS>
UnscaleChunkFn pick_unscale(Isa isa) {
#if FASTAMP_X86_SIMD
  if (isa == Isa::Avx512) return &avx512::unscale_chunk<T, WRITE, SUMSQ, STATS>;
  if (isa == Isa::Avx2) return &avx2::unscale_chunk<T, WRITE, SUMSQ, STATS>;
#endif
  (void)isa;
  return &scalar::unscale_chunk<T, WRITE, SUMSQ, STATS>;
}

template <class T, bool STATS>
UnscaleChunkFn pick_unscale(Isa isa, bool write_back, bool compute_sumsq) {
  if (write_back) {
    return compute_sumsq ? pick_unscale<T, true, true, STATS>(isa) : pick_unscale<T, true, false, STATS>(isa);
  }
  return compute_sumsq ? pick_unscale<T, false, true, STATS>(isa) : pick_unscale<T, false, false, STATS>(isa);
}

template <class T>
UnscaleChunkFn pick_unscale(Isa isa, bool write_back, bool compute_sumsq, bool stats) {
  return stats ? pick_unscale<T, true>(isa, write_back, compute_sumsq)
               : pick_unscale<T, false>(isa, write_back, compute_sumsq);
}

int dtype_slot(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return 0;
    case at::kHalf:
      return 1;
    case at::kBFloat16:
      return 2;
    default:
      return -1;
  }
}

void check_flag_tensor(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), "fastamp::", op, ": ", name, " must be a CPU tensor for the CPU kernel, got device ",
              t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "fastamp::", op, ": ", name, " must have dtype ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.numel() == 1, "fastamp::", op, ": ", name, " must have exactly one element, got shape ", t.sizes());
}

// The smallest u in [0, inf_bits] whose |x| (T with bits u) satisfies pred, for a pred that
// is false up to some u and true from there on; u = inf_bits (x = inf) counts as true.
template <class T, class Pred>
uint16_t first_bits(uint16_t inf_bits, Pred pred) {
  uint32_t lo = 0, hi = inf_bits;
  while (lo < hi) {
    const uint32_t mid = (lo + hi) / 2;
    T x;
    x.x = static_cast<uint16_t>(mid);
    if (pred(load_float(&x))) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return static_cast<uint16_t>(lo);
}

// Bounds16 of T for one call: y = |x| * |inv_scale| in fp32, as the kernels compute |y|.
template <class T>
Bounds16 bounds16(float inv_scale, float limit) {
  Bounds16 b;
  if (!math::is_finite(inv_scale)) return b;
  const uint16_t inf_bits = std::is_same_v<T, c10::Half> ? 0x7c00 : 0x7f80;
  const float inv = std::fabs(inv_scale);
  b.bad = first_bits<T>(inf_bits, [&](float a) { return !(a * inv < limit); });
  b.nonzero = first_bits<T>(inf_bits, [&](float a) { return a * inv != 0.0f; });
  b.big = first_bits<T>(inf_bits, [&](float a) { return a * inv >= math::kFp16MinNormal; });
  b.finite = first_bits<T>(inf_bits, [&](float a) { return !math::is_finite(a * inv); });
  b.valid = true;
  return b;
}

// unscale_check_, and with counts/absmax unscale_check_stats_ (same pass, STATS kernels).
// slot_out (unscale_check_partials_, check only with the sum of squares): chunk k of grad t
// writes its fp64 partial into slot_out[offsets[t] + k] instead of the call's own partials,
// and the call folds nothing (sumsq_fold_ does, later, in the ordinary order).
at::Tensor unscale_check_impl(const char* op, at::TensorList grads, const at::Tensor& found_inf,
                              const at::Tensor& inv_scale, bool write_back, bool compute_sumsq,
                              const at::Tensor* counts, const at::Tensor* absmax, double* slot_out = nullptr,
                              const int64_t* offsets = nullptr) {
  check_flag_tensor(op, "found_inf", found_inf, at::kFloat);
  check_flag_tensor(op, "inv_scale", inv_scale, at::kFloat);
  const size_t ntensors = grads.size();
  std::vector<int64_t> numels(ntensors);
  std::vector<void*> ptrs(ntensors);
  std::vector<int8_t> slots(ntensors);
  for (size_t i = 0; i < ntensors; ++i) {
    prefetch_tensors_ahead(grads, i);
    const at::Tensor& g = grads[i];
    TORCH_CHECK(g.defined(), "fastamp::", op, ": grads[", i, "] is undefined");
    TORCH_CHECK(g.device().is_cpu(), "fastamp::", op, ": grads[", i, "] must be a CPU tensor, got device ", g.device());
    TORCH_CHECK(g.layout() == at::kStrided, "fastamp::", op, ": grads[", i,
                "] must be a dense (strided) tensor, got layout ", g.layout());
    const int slot = dtype_slot(g.scalar_type());
    TORCH_CHECK(slot >= 0, "fastamp::", op, ": grads[", i, "] must be float32, float16 or bfloat16, got ",
                g.scalar_type());
    TORCH_CHECK(g.is_contiguous(), "fastamp::", op, ": grads[", i,
                "] must be contiguous (fastamp.functional.unscale_check_ copies strided grads), got strides ",
                g.strides());
    numels[i] = g.numel();
    ptrs[i] = numels[i] > 0 ? g.data_ptr() : nullptr;
    slots[i] = static_cast<int8_t>(slot);
  }
  const bool stats = counts != nullptr;
  const auto ngrads = static_cast<int64_t>(ntensors);
  if (stats) {
    TORCH_CHECK(counts->device().is_cpu(), "fastamp::", op, ": counts must be a CPU tensor, got device ",
                counts->device());
    TORCH_CHECK(counts->scalar_type() == at::kLong, "fastamp::", op, ": counts must have dtype Long (int64), got ",
                counts->scalar_type());
    TORCH_CHECK(counts->dim() == 2 && counts->size(0) == ngrads && counts->size(1) == 3, "fastamp::", op,
                ": counts must have shape [", ngrads, ", 3] (one row per grad), got ", counts->sizes());
    TORCH_CHECK(counts->is_contiguous(), "fastamp::", op, ": counts must be contiguous, got strides ",
                counts->strides());
    TORCH_CHECK(absmax->device().is_cpu(), "fastamp::", op, ": absmax must be a CPU tensor, got device ",
                absmax->device());
    TORCH_CHECK(absmax->scalar_type() == at::kFloat, "fastamp::", op, ": absmax must have dtype Float, got ",
                absmax->scalar_type());
    TORCH_CHECK(absmax->dim() == 1 && absmax->size(0) == ngrads, "fastamp::", op, ": absmax must have shape [", ngrads,
                "] (one entry per grad), got ", absmax->sizes());
    TORCH_CHECK(absmax->is_contiguous(), "fastamp::", op, ": absmax must be contiguous, got strides ",
                absmax->strides());
  }

  const Isa isa = active_isa();
  const UnscaleChunkFn fns[3] = {
      pick_unscale<float>(isa, write_back, compute_sumsq, stats),
      pick_unscale<c10::Half>(isa, write_back, compute_sumsq, stats),
      pick_unscale<c10::BFloat16>(isa, write_back, compute_sumsq, stats),
  };
  const float inf = std::numeric_limits<float>::infinity();
  const float limits[3] = {
      inf,
      write_back ? 65520.0f : inf,
      write_back ? math::bits_float(0x7f7f8000u) : inf,
  };
  const float inv = *inv_scale.data_ptr<float>();
  Bounds16 bounds[3];
  if (stats) {
    bounds[1] = bounds16<c10::Half>(inv, limits[1]);
    bounds[2] = bounds16<c10::BFloat16>(inv, limits[2]);
  }

  const std::vector<Chunk> chunks = split_into_chunks(numels);
  std::vector<double> partial(compute_sumsq && slot_out == nullptr ? chunks.size() : 0);
  // Statistics rows: a tensor of one chunk (every small tensor) gets its row written by the
  // chunk's thread; the chunks of larger tensors leave theirs here (entries of one-chunk
  // tensors are never touched) and are combined after the parallel region.
  int64_t* cnt = stats ? counts->data_ptr<int64_t>() : nullptr;
  float* amax = stats ? absmax->data_ptr<float>() : nullptr;
  std::unique_ptr<ChunkStats[]> chunk_stats(stats ? new ChunkStats[chunks.size()] : nullptr);
  auto whole_tensor = [&](const Chunk& ch) {
    return ch.begin == 0 && ch.len == numels[static_cast<size_t>(ch.tensor)];
  };
  std::atomic<bool> any_bad{false};
  parallel_over_chunks(chunks, [&](int64_t cb, int64_t ce) {
    bool bad = false;
    auto chunk_base = [&](int64_t c, int64_t* bytes) {
      const Chunk& ch = chunks[static_cast<size_t>(c)];
      const int64_t elem = slots[static_cast<size_t>(ch.tensor)] == 0 ? 4 : 2;
      *bytes = ch.len * elem;
      return static_cast<char*>(ptrs[static_cast<size_t>(ch.tensor)]) + ch.begin * elem;
    };
    for (int64_t c = cb; c < ce; ++c) {
      const Chunk& ch = chunks[static_cast<size_t>(c)];
      const int slot = slots[static_cast<size_t>(ch.tensor)];
      int64_t bytes = 0;
      char* base = chunk_base(c, &bytes);
      if (c + 1 < ce) {
        // Small tensors are separate allocations that the in-loop prefetch (which runs a
        // fixed distance ahead in the same tensor) never reaches: fetch the start of the
        // next chunk while this one runs.
        int64_t next_bytes = 0;
        const char* next = chunk_base(c + 1, &next_bytes);
        for (int64_t o = 0; o < std::min<int64_t>(next_bytes, kNextChunkPrefetchBytes); o += 64)
          prefetch_read(next + o);
      }
      double lanes[16] = {};
      ChunkStats st{};
      bad |= fns[slot](base, ch.len, inv, limits[slot], &bounds[slot], lanes, stats ? &st : nullptr);
      if (compute_sumsq) {
        if (slot_out != nullptr) {
          slot_out[offsets[ch.tensor] + ch.begin / kChunkElems] = reduce_lanes16(lanes);
        } else {
          partial[static_cast<size_t>(c)] = reduce_lanes16(lanes);
        }
      }
      if (stats) {
        if (whole_tensor(ch)) {
          const int64_t t = ch.tensor;
          cnt[3 * t] = st.nonfinite;
          cnt[3 * t + 1] = st.zeros;
          cnt[3 * t + 2] = st.underflow;
          amax[t] = st.absmax;
        } else {
          chunk_stats[static_cast<size_t>(c)] = st;
        }
      }
    }
    if (bad) any_bad.store(true, std::memory_order_relaxed);
  });

  if (stats && ngrads > 0) {
    // integer counts and a max: the same whatever the chunk order or thread count.
    // A larger tensor's chunks are consecutive and its first one starts at 0: it sets the
    // row, the others add to it; empty tensors have no chunk and get a zero row.
    for (size_t c = 0; c < chunks.size(); ++c) {
      if (whole_tensor(chunks[c])) continue;
      const int64_t t = chunks[c].tensor;
      const ChunkStats& st = chunk_stats[c];
      if (chunks[c].begin == 0) {
        cnt[3 * t] = st.nonfinite;
        cnt[3 * t + 1] = st.zeros;
        cnt[3 * t + 2] = st.underflow;
        amax[t] = st.absmax;
      } else {
        cnt[3 * t] += st.nonfinite;
        cnt[3 * t + 1] += st.zeros;
        cnt[3 * t + 2] += st.underflow;
        if (st.absmax > amax[t]) amax[t] = st.absmax;
      }
    }
    for (int64_t t = 0; t < ngrads; ++t) {
      if (numels[static_cast<size_t>(t)] == 0) {
        std::fill(cnt + 3 * t, cnt + 3 * t + 3, int64_t{0});
        amax[t] = 0.0f;
      }
    }
  }
  if (any_bad.load()) *found_inf.data_ptr<float>() = 1.0f;
  double total = 0.0;
  for (double p : partial) total += p;
  return at::scalar_tensor(static_cast<float>(total), found_inf.options());
}

at::Tensor unscale_check_cpu(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale,
                             bool write_back, bool compute_sumsq) {
  return unscale_check_impl("unscale_check_", grads, found_inf, inv_scale, write_back, compute_sumsq, nullptr, nullptr);
}

at::Tensor unscale_check_stats_cpu(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale,
                                   bool write_back, bool compute_sumsq, const at::Tensor& counts,
                                   const at::Tensor& absmax) {
  return unscale_check_impl("unscale_check_stats_", grads, found_inf, inv_scale, write_back, compute_sumsq, &counts,
                            &absmax);
}

// Grad t's chunk partials go to partials[offsets[t] ..] (ceil(numel / kChunkElems) of them):
// the per-chunk values unscale_check_ folds in chunk order, so
// gradient release can check its buckets in hook order and fold them in the ordinary order.
void unscale_check_partials_cpu(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale,
                                const at::Tensor& partials, at::IntArrayRef offsets) {
  constexpr const char* op = "unscale_check_partials_";
  TORCH_CHECK(partials.device().is_cpu(), "fastamp::", op, ": partials must be a CPU tensor, got device ",
              partials.device());
  TORCH_CHECK(partials.scalar_type() == at::kDouble, "fastamp::", op, ": partials must have dtype Double, got ",
              partials.scalar_type());
  TORCH_CHECK(partials.dim() == 1 && partials.is_contiguous(), "fastamp::", op,
              ": partials must be a contiguous 1-D tensor, got shape ", partials.sizes());
  TORCH_CHECK(offsets.size() == grads.size(), "fastamp::", op, ": offsets must have one entry per grad (", grads.size(),
              "), got ", offsets.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    const int64_t n = grads[i].defined() ? grads[i].numel() : 0;
    const int64_t k = (n + kChunkElems - 1) / kChunkElems;
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + k <= partials.numel(), "fastamp::", op, ": offsets[", i,
                "] = ", offsets[i], " leaves no room for the ", k, " partials of grads[", i, "] in ", partials.numel(),
                " slots");
  }
  unscale_check_impl(op, grads, found_inf, inv_scale, false, true, nullptr, nullptr, partials.data_ptr<double>(),
                     offsets.data());
}

// unscale_check_'s fold of the partials at index (in that order): fp64 from 0, rounded once to fp32.
at::Tensor sumsq_fold_cpu(const at::Tensor& partials, const at::Tensor& index) {
  constexpr const char* op = "sumsq_fold";
  TORCH_CHECK(partials.device().is_cpu() && partials.scalar_type() == at::kDouble && partials.dim() == 1 &&
                  partials.is_contiguous(),
              "fastamp::", op, ": partials must be a contiguous 1-D CPU Double tensor");
  TORCH_CHECK(index.device().is_cpu() && index.scalar_type() == at::kLong && index.dim() == 1 && index.is_contiguous(),
              "fastamp::", op, ": index must be a contiguous 1-D CPU Long tensor");
  const double* p = partials.data_ptr<double>();
  const int64_t* ix = index.data_ptr<int64_t>();
  const int64_t n = partials.numel();
  for (int64_t k = 0; k < index.numel(); ++k) {
    TORCH_CHECK(ix[k] >= 0 && ix[k] < n, "fastamp::", op, ": index[", k, "] = ", ix[k], " is out of range for ", n,
                " partials");
  }
  double total = 0.0;
  for (int64_t k = 0; k < index.numel(); ++k) total += p[ix[k]];
  return at::scalar_tensor(static_cast<float>(total), partials.options().dtype(at::kFloat));
}

void update_scale_cpu(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& hysteresis_tracker,
                      const at::Tensor& found_inf, double growth_factor, double backoff_factor, int64_t growth_interval,
                      int64_t hysteresis, double min_scale, double max_scale) {
  constexpr const char* op = "update_scale_";
  check_flag_tensor(op, "scale", scale, at::kFloat);
  check_flag_tensor(op, "growth_tracker", growth_tracker, at::kInt);
  check_flag_tensor(op, "hysteresis_tracker", hysteresis_tracker, at::kInt);
  check_flag_tensor(op, "found_inf", found_inf, at::kFloat);
  math::update_scale(scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
                     hysteresis_tracker.data_ptr<int32_t>(), *found_inf.data_ptr<float>(), growth_factor,
                     backoff_factor, growth_interval, hysteresis, min_scale, max_scale);
}

std::string cpu_isa() { return isa_name(active_isa()); }

}  // namespace
}  // namespace cpu
}  // namespace fastamp

TORCH_LIBRARY_FRAGMENT(fastamp, m) {
  // Which instruction set the CPU kernels use now (FASTAMP_CPU_ISA can lower it).
  m.def("cpu_isa() -> str", &fastamp::cpu::cpu_isa);
}

TORCH_LIBRARY_IMPL(fastamp, CPU, m) {
  FASTAMP_IMPL(m, unscale_check_, fastamp::cpu::unscale_check_cpu);
  FASTAMP_IMPL(m, update_scale_, fastamp::cpu::update_scale_cpu);
  FASTAMP_IMPL(m, unscale_check_stats_, fastamp::cpu::unscale_check_stats_cpu);
  FASTAMP_IMPL(m, unscale_check_partials_, fastamp::cpu::unscale_check_partials_cpu);
  FASTAMP_IMPL(m, sumsq_fold, fastamp::cpu::sumsq_fold_cpu);
}
