// CPU kernel of fastamp::adamw_ (semantics: fastamp/reference/; per-element maths:
// math::adamw_element in csrc/fastamp_math.h).
//
// One pass over all tensors of the call, cut into fixed-size chunks spread over threads
// (csrc/cpu/multi_tensor.h): reads grad, master (or param), m, v (and max v) and writes
// them plus the param rounded to its dtype. Bit-exact with the reference for every
// instruction set (AVX-512, AVX2, scalar). A non-zero (or NaN) found_inf writes nothing.
// step_scalars is [4] (shared) or [n, 4] (row i for tensor i, picked per chunk).
//
// fastamp::adamw_bf16_ (bf16 params with int16 master remainders and/or stochastic
// rounding, fp32 or bf16 moments) is the same pass: the exact fp32 master is rebuilt from
// param + remainder in registers (math::join_master) and split again after the update
// (math::split_master); without remainders the result is rounded to bf16 stochastically
// when an rng tensor is given. The counter-based hash (math::sr_random16) runs in 32-bit
// integer vector lanes, so every instruction set draws the reference's bits.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu/adamw_table.h"
#include "cpu/isa.h"
#include "cpu/multi_tensor.h"
#include "cpu/optim_checks.h"
#include "cpu/scalar_ops.h"
#include "fastamp_math.h"
#include "host_prefetch.h"
#include "op_signatures.h"

namespace fastamp {
namespace cpu {
namespace {

struct AdamWArgs {
  math::AdamWStepScalars s;
  math::AdamWHyper h;
  bool maximize;
};

// `a` with the step scalars at `row` (the shared [4], or the chunk's tensor's row of
// [n, 4]): set once per chunk, so per-tensor scalars cost nothing per element.
inline AdamWArgs with_row(AdamWArgs a, const float* row) {
  a.s = math::AdamWStepScalars{row[0], row[1], row[2], row[3]};
  return a;
}

// Pointers of one chunk, already offset to its first element.
struct AdamWChunk {
  void* param;
  const void* grad;
  float* master;  // nullptr without master weights
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // nullptr without amsgrad
};

// One chunk of adamw_bf16_, pointers already offset to its first element.
struct AdamWBf16Chunk {
  c10::BFloat16* param;
  const void* grad;
  int16_t* remainder;  // nullptr without remainders
  void* exp_avg;       // moments: float or c10::BFloat16 (the kernel's M)
  void* exp_avg_sq;
  void* max_exp_avg_sq;  // nullptr without amsgrad
  uint64_t index0;       // flat index of the chunk's first element in its tensor (RNG counter)
  uint32_t key[4];       // math::sr_stream_key of streams 4 * tensor_id + k: param, m, v, vmax
};

// A chunk starts at a multiple of kChunkElems and is at most that long, so the high 32
// bits of the flat index are the same for all its elements (the vector RNG relies on it).
static_assert((uint64_t{1} << 32) % static_cast<uint64_t>(kChunkElems) == 0, "chunks must not cross 2^32");

namespace scalar {

// A moment written back to its dtype: fp32 as is; bf16 stochastically (RNG) or to nearest-even.
template <class M, bool RNG>
inline void store_moment(M* p, float v, uint32_t key, uint64_t index) {
  if constexpr (std::is_same_v<M, c10::BFloat16> && RNG) {
    p->x = math::float_to_bf16_bits_sr(v, math::sr_random16(key, index));
  } else {
    store_float(p, v);
  }
}

template <class G, bool REM, class M, bool AMSGRAD, bool RNG>
void adamw_bf16_range(const AdamWBf16Chunk& c, int64_t begin, int64_t end, const AdamWArgs& a) {
  const G* grad = static_cast<const G*>(c.grad);
  M* exp_avg = static_cast<M*>(c.exp_avg);
  M* exp_avg_sq = static_cast<M*>(c.exp_avg_sq);
  M* max_exp_avg_sq = static_cast<M*>(c.max_exp_avg_sq);
  for (int64_t i = begin; i < end; ++i) {
    const uint64_t index = c.index0 + static_cast<uint64_t>(i);
    float p = REM ? math::join_master(c.param[i].x, c.remainder[i]) : load_float(c.param + i);
    float m = load_float(exp_avg + i);
    float v = load_float(exp_avg_sq + i);
    float vmax = AMSGRAD ? load_float(max_exp_avg_sq + i) : 0.0f;
    math::adamw_element(&p, &m, &v, &vmax, load_float(grad + i), a.s, a.h, AMSGRAD, a.maximize);
    if constexpr (REM) {
      math::split_master(p, &c.param[i].x, &c.remainder[i]);
    } else if constexpr (RNG) {
      c.param[i].x = math::float_to_bf16_bits_sr(p, math::sr_random16(c.key[0], index));
    } else {
      store_float(c.param + i, p);
    }
    store_moment<M, RNG>(exp_avg + i, m, c.key[1], index);
    store_moment<M, RNG>(exp_avg_sq + i, v, c.key[2], index);
    if constexpr (AMSGRAD) store_moment<M, RNG>(max_exp_avg_sq + i, vmax, c.key[3], index);
  }
}

template <class G, bool REM, class M, bool AMSGRAD, bool RNG>
void adamw_bf16_chunk(const AdamWBf16Chunk& c, int64_t n, const AdamWArgs& a) {
  adamw_bf16_range<G, REM, M, AMSGRAD, RNG>(c, 0, n, a);
}

template <class P, class G, bool MASTER, bool AMSGRAD>
void adamw_range(const AdamWChunk& c, int64_t begin, int64_t end, const AdamWArgs& a) {
  P* param = static_cast<P*>(c.param);
  const G* grad = static_cast<const G*>(c.grad);
  for (int64_t i = begin; i < end; ++i) {
    float p = MASTER ? c.master[i] : load_float(param + i);
    float vmax = AMSGRAD ? c.max_exp_avg_sq[i] : 0.0f;
    math::adamw_element(&p, c.exp_avg + i, c.exp_avg_sq + i, &vmax, load_float(grad + i), a.s, a.h, AMSGRAD,
                        a.maximize);
    if constexpr (AMSGRAD) c.max_exp_avg_sq[i] = vmax;
    if constexpr (MASTER) c.master[i] = p;
    store_float(param + i, p);
  }
}

template <class P, class G, bool MASTER, bool AMSGRAD>
void adamw_chunk(const AdamWChunk& c, int64_t n, const AdamWArgs& a) {
  adamw_range<P, G, MASTER, AMSGRAD>(c, 0, n, a);
}

}  // namespace scalar

#define FASTAMP_ISA_KERNELS "cpu/adamw_kernels.inc"
#include "cpu/per_isa.inc"  // namespaces avx512 and avx2: the loops of adamw_kernels.inc per ISA

using AdamWChunkFn = void (*)(const AdamWChunk&, int64_t, const AdamWArgs&);

template <class P, class G, bool MASTER, bool AMSGRAD>
AdamWChunkFn pick_isa(Isa isa) {
#if FASTAMP_X86_SIMD
  if (isa == Isa::Avx512) return &avx512::adamw_chunk<P, G, MASTER, AMSGRAD>;
  if (isa == Isa::Avx2) return &avx2::adamw_chunk<P, G, MASTER, AMSGRAD>;
#endif
  (void)isa;
  return &scalar::adamw_chunk<P, G, MASTER, AMSGRAD>;
}

template <class P, class G>
AdamWChunkFn pick_flags(Isa isa, bool master, bool amsgrad) {
  if (master) return amsgrad ? pick_isa<P, G, true, true>(isa) : pick_isa<P, G, true, false>(isa);
  return amsgrad ? pick_isa<P, G, false, true>(isa) : pick_isa<P, G, false, false>(isa);
}

template <class P>
AdamWChunkFn pick_grad(at::ScalarType grad_dtype, Isa isa, bool master, bool amsgrad) {
  switch (grad_dtype) {
    case at::kHalf:
      return pick_flags<P, c10::Half>(isa, master, amsgrad);
    case at::kBFloat16:
      return pick_flags<P, c10::BFloat16>(isa, master, amsgrad);
    default:
      return pick_flags<P, float>(isa, master, amsgrad);
  }
}

AdamWChunkFn pick_kernel(at::ScalarType param_dtype, at::ScalarType grad_dtype, Isa isa, bool master, bool amsgrad) {
  switch (param_dtype) {
    case at::kHalf:
      return pick_grad<c10::Half>(grad_dtype, isa, master, amsgrad);
    case at::kBFloat16:
      return pick_grad<c10::BFloat16>(grad_dtype, isa, master, amsgrad);
    default:
      return pick_grad<float>(grad_dtype, isa, master, amsgrad);
  }
}

// The pass of adamw_ over `chunks` of the tensors `bases` (pointers at each tensor's first
// element), shared by the op and by its persistent tables (AdamWTable below).
void run_adamw_chunks(AdamWChunkFn fn, const std::vector<AdamWChunk>& bases, const std::vector<Chunk>& chunks,
                      int64_t param_size, int64_t grad_size, const AdamWArgs& args, const float* sc,
                      int64_t scalar_stride) {
  auto at_chunk = [&](const Chunk& ch) {
    const AdamWChunk& b = bases[static_cast<size_t>(ch.tensor)];
    const int64_t o = ch.begin;
    return AdamWChunk{static_cast<char*>(b.param) + o * param_size,
                      static_cast<const char*>(b.grad) + o * grad_size,
                      b.master ? b.master + o : nullptr,
                      b.exp_avg + o,
                      b.exp_avg_sq + o,
                      b.max_exp_avg_sq ? b.max_exp_avg_sq + o : nullptr};
  };
  parallel_over_chunks(chunks, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      const Chunk& ch = chunks[static_cast<size_t>(c)];
      fn(at_chunk(ch), ch.len, with_row(args, sc + ch.tensor * scalar_stride));
    }
  });
}

void adamw_cpu(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList exp_avgs,
               at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, const at::Tensor& step_scalars,
               const std::optional<at::Tensor>& found_inf, double beta1, double beta2, double eps, bool amsgrad,
               bool maximize) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n, "fastamp::adamw_: got ", n, " params but ", grads.size(), " grads");
  TORCH_CHECK(exp_avgs.size() == n, "fastamp::adamw_: got ", n, " params but ", exp_avgs.size(), " exp_avgs");
  TORCH_CHECK(exp_avg_sqs.size() == n, "fastamp::adamw_: got ", n, " params but ", exp_avg_sqs.size(), " exp_avg_sqs");
  TORCH_CHECK(masters.empty() || masters.size() == n,
              "fastamp::adamw_: masters must be empty or have one tensor per "
              "param, got ",
              masters.size(), " masters for ", n, " params");
  TORCH_CHECK(!amsgrad || max_exp_avg_sqs.size() == n,
              "fastamp::adamw_: amsgrad needs one max_exp_avg_sqs tensor per "
              "param, got ",
              max_exp_avg_sqs.size(), " for ", n, " params");
  const int64_t scalar_stride =
      check_step_scalars("adamw_", step_scalars, n, 4, "[step_size, bc2_sqrt, decay, grad_mul]");
  if (found_inf) {
    TORCH_CHECK(found_inf->device().is_cpu(), "fastamp::adamw_: found_inf must be a CPU tensor, got device ",
                found_inf->device());
    TORCH_CHECK(found_inf->scalar_type() == at::kFloat && found_inf->numel() == 1,
                "fastamp::adamw_: found_inf must be a 1-element float32 tensor, got dtype ", found_inf->scalar_type(),
                " and shape ", found_inf->sizes());
  }
  if (n == 0) return;
  const at::ScalarType param_dtype = params[0].scalar_type();
  const at::ScalarType grad_dtype = grads[0].scalar_type();
  TORCH_CHECK(is_kernel_float(param_dtype), "fastamp::adamw_: params must be float32, float16 or bfloat16, got ",
              param_dtype);
  TORCH_CHECK(is_kernel_float(grad_dtype), "fastamp::adamw_: grads must be float32, float16 or bfloat16, got ",
              grad_dtype);
  const bool use_master = !masters.empty();
  std::vector<int64_t> numels(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    check_list_tensor("adamw_", "params", i, p, p, param_dtype);
    check_list_tensor("adamw_", "grads", i, grads[i], p, grad_dtype);
    check_list_tensor("adamw_", "exp_avgs", i, exp_avgs[i], p, at::kFloat);
    check_list_tensor("adamw_", "exp_avg_sqs", i, exp_avg_sqs[i], p, at::kFloat);
    if (use_master) check_list_tensor("adamw_", "masters", i, masters[i], p, at::kFloat);
    if (amsgrad) check_list_tensor("adamw_", "max_exp_avg_sqs", i, max_exp_avg_sqs[i], p, at::kFloat);
    numels[i] = p.numel();
  }

  if (found_inf) {
    // CPU tensor: reading it is no device sync. Non-zero or NaN skips the whole step.
    if (*found_inf->data_ptr<float>() != 0.0f) return;
  }
  const float* sc = step_scalars.data_ptr<float>();
  AdamWArgs args;
  args.h = math::AdamWHyper{static_cast<float>(beta1), static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
                            static_cast<float>(1.0 - beta2), static_cast<float>(eps)};
  args.maximize = maximize;

  const AdamWChunkFn fn = pick_kernel(param_dtype, grad_dtype, active_isa(), use_master, amsgrad);
  const size_t param_size = params[0].element_size();
  const size_t grad_size = grads[0].element_size();
  std::vector<AdamWChunk> bases(n);
  for (size_t i = 0; i < n; ++i) {
    if (numels[i] == 0) continue;
    // untyped data_ptr(): the dtypes were checked above (the typed one checks again, out of
    // line, per tensor); grads are only read (const: a copy-on-write grad is not copied)
    bases[i] = AdamWChunk{params[i].data_ptr(),
                          grads[i].const_data_ptr(),
                          use_master ? static_cast<float*>(masters[i].data_ptr()) : nullptr,
                          static_cast<float*>(exp_avgs[i].data_ptr()),
                          static_cast<float*>(exp_avg_sqs[i].data_ptr()),
                          amsgrad ? static_cast<float*>(max_exp_avg_sqs[i].data_ptr()) : nullptr};
  }
  run_adamw_chunks(fn, bases, split_into_chunks(numels), static_cast<int64_t>(param_size),
                   static_cast<int64_t>(grad_size), args, sc, scalar_stride);
}

}  // namespace

struct AdamWTable {
  int64_t n = 0;
  int lists = 0;  // tensors per entry: param, exp_avg, exp_avg_sq, then master and max_exp_avg_sq if used
  at::ScalarType param_dtype = at::kFloat;
  bool master = false;
  bool amsgrad = false;
  std::vector<at::Tensor> tensors;  // entry i's at [i * lists, (i + 1) * lists)
  std::vector<const void*> ptrs;    // their data pointers when the table was made
  std::vector<int64_t> numels;
  std::vector<AdamWChunk> bases;  // the grads' pointers are written by each run
  std::vector<Chunk> chunks;
  std::atomic<bool> busy{false};  // one run at a time (a run writes `bases`)
};

void AdamWTableDeleter::operator()(AdamWTable* t) const { delete t; }

int64_t adamw_table_size(const AdamWTable& table) { return table.n; }

AdamWTablePtr adamw_table_new(at::TensorList params, at::TensorList masters, at::TensorList exp_avgs,
                              at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, bool amsgrad) {
  const size_t n = params.size();
  TORCH_CHECK(n > 0, "fastamp::adamw_: a table needs at least one param");
  TORCH_CHECK(exp_avgs.size() == n && exp_avg_sqs.size() == n && (masters.empty() || masters.size() == n) &&
                  (!amsgrad || max_exp_avg_sqs.size() == n),
              "fastamp::adamw_: the lists of a table differ in length");
  AdamWTablePtr t(new AdamWTable);
  t->n = static_cast<int64_t>(n);
  t->param_dtype = params[0].scalar_type();
  TORCH_CHECK(is_kernel_float(t->param_dtype), "fastamp::adamw_: params must be float32, float16 or bfloat16, got ",
              t->param_dtype);
  t->master = !masters.empty();
  t->amsgrad = amsgrad;
  t->lists = 3 + (t->master ? 1 : 0) + (amsgrad ? 1 : 0);
  t->tensors.reserve(n * static_cast<size_t>(t->lists));
  t->numels.resize(n);
  t->bases.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    check_list_tensor("adamw_", "params", i, p, p, t->param_dtype);
    check_list_tensor("adamw_", "exp_avgs", i, exp_avgs[i], p, at::kFloat);
    check_list_tensor("adamw_", "exp_avg_sqs", i, exp_avg_sqs[i], p, at::kFloat);
    if (t->master) check_list_tensor("adamw_", "masters", i, masters[i], p, at::kFloat);
    if (amsgrad) check_list_tensor("adamw_", "max_exp_avg_sqs", i, max_exp_avg_sqs[i], p, at::kFloat);
    t->tensors.push_back(p);
    t->tensors.push_back(exp_avgs[i]);
    t->tensors.push_back(exp_avg_sqs[i]);
    if (t->master) t->tensors.push_back(masters[i]);
    if (amsgrad) t->tensors.push_back(max_exp_avg_sqs[i]);
    t->numels[i] = p.numel();
  }
  t->ptrs.reserve(t->tensors.size());
  for (at::Tensor& x : t->tensors) t->ptrs.push_back(x.data_ptr());
  for (size_t i = 0; i < n; ++i) {
    void* const* q = const_cast<void* const*>(t->ptrs.data() + i * static_cast<size_t>(t->lists));
    int k = 3;
    AdamWChunk& b = t->bases[i];
    b.param = q[0];
    b.grad = nullptr;
    b.exp_avg = static_cast<float*>(q[1]);
    b.exp_avg_sq = static_cast<float*>(q[2]);
    b.master = t->master ? static_cast<float*>(q[k++]) : nullptr;
    b.max_exp_avg_sq = amsgrad ? static_cast<float*>(q[k]) : nullptr;
  }
  t->chunks = split_into_chunks(t->numels);
  return t;
}

namespace {

// Whether the table's tensors are still where, and what, the table says: a `.data` rebind,
// a resize or a view as another dtype changes one of these (one pass over the tensors).
bool table_intact(const AdamWTable& t) {
  const size_t total = t.tensors.size();
  const size_t lists = static_cast<size_t>(t.lists);
  for (size_t j = 0; j < total; ++j) {
    prefetch_tensors_ahead(t.tensors, j);
    const at::Tensor& x = t.tensors[j];
    const size_t i = j / lists;
    const at::ScalarType want = j % lists == 0 ? t.param_dtype : at::kFloat;
    if (x.numel() != t.numels[i] || x.scalar_type() != want || !x.is_contiguous() || x.data_ptr() != t.ptrs[j]) {
      return false;
    }
  }
  return true;
}

}  // namespace

bool adamw_table_run(AdamWTable& t, at::TensorList grads, const at::Tensor& step_scalars,
                     const std::optional<at::Tensor>& found_inf, double beta1, double beta2, double eps, bool amsgrad,
                     bool maximize) {
  const size_t n = static_cast<size_t>(t.n);
  if (grads.size() != n || amsgrad != t.amsgrad) return false;
  if (t.busy.exchange(true)) return false;
  struct Release {
    std::atomic<bool>* flag;
    ~Release() { flag->store(false); }
  } release{&t.busy};
  const int64_t scalar_stride =
      check_step_scalars("adamw_", step_scalars, n, 4, "[step_size, bc2_sqrt, decay, grad_mul]");
  check_found_inf("adamw_", found_inf);
  const at::ScalarType grad_dtype = grads[0].scalar_type();
  if (!is_kernel_float(grad_dtype)) return false;
  const caffe2::TypeMeta grad_meta = c10::scalarTypeToTypeMeta(grad_dtype);
  for (size_t i = 0; i < n; ++i) {
    prefetch_tensors_ahead(grads, i);
    const c10::TensorImpl* g = grads[i].unsafeGetTensorImpl();
    if (!g->device().is_cpu() || g->layout() != at::kStrided || g->dtype() != grad_meta || !g->is_contiguous() ||
        g->numel() != t.numels[i]) {
      return false;
    }
    // scratch until the run: every run writes every entry before its kernel
    t.bases[i].grad = grads[i].const_data_ptr();
  }
  if (!table_intact(t)) return false;
  if (skip_step(found_inf)) return true;
  AdamWArgs args;
  args.h = math::AdamWHyper{static_cast<float>(beta1), static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
                            static_cast<float>(1.0 - beta2), static_cast<float>(eps)};
  args.maximize = maximize;
  const AdamWChunkFn fn = pick_kernel(t.param_dtype, grad_dtype, active_isa(), t.master, t.amsgrad);
  run_adamw_chunks(fn, t.bases, t.chunks, static_cast<int64_t>(c10::elementSize(t.param_dtype)),
                   static_cast<int64_t>(c10::elementSize(grad_dtype)), args, step_scalars.data_ptr<float>(),
                   scalar_stride);
  return true;
}

namespace {

using AdamWBf16ChunkFn = void (*)(const AdamWBf16Chunk&, int64_t, const AdamWArgs&);

template <class G, bool REM, class M, bool AMSGRAD, bool RNG>
AdamWBf16ChunkFn pick_bf16_isa(Isa isa) {
#if FASTAMP_X86_SIMD
  if (isa == Isa::Avx512) return &avx512::adamw_bf16_chunk<G, REM, M, AMSGRAD, RNG>;
  if (isa == Isa::Avx2) return &avx2::adamw_bf16_chunk<G, REM, M, AMSGRAD, RNG>;
#endif
  (void)isa;
  return &scalar::adamw_bf16_chunk<G, REM, M, AMSGRAD, RNG>;
}

template <class G, bool REM, class M>
AdamWBf16ChunkFn pick_bf16_flags(Isa isa, bool amsgrad, bool rng) {
  if (amsgrad) return rng ? pick_bf16_isa<G, REM, M, true, true>(isa) : pick_bf16_isa<G, REM, M, true, false>(isa);
  return rng ? pick_bf16_isa<G, REM, M, false, true>(isa) : pick_bf16_isa<G, REM, M, false, false>(isa);
}

template <class G>
AdamWBf16ChunkFn pick_bf16_state(Isa isa, bool rem, bool bf16_moments, bool amsgrad, bool rng) {
  if (rem) {
    return bf16_moments ? pick_bf16_flags<G, true, c10::BFloat16>(isa, amsgrad, rng)
                        : pick_bf16_flags<G, true, float>(isa, amsgrad, rng);
  }
  return bf16_moments ? pick_bf16_flags<G, false, c10::BFloat16>(isa, amsgrad, rng)
                      : pick_bf16_flags<G, false, float>(isa, amsgrad, rng);
}

AdamWBf16ChunkFn pick_bf16_kernel(at::ScalarType grad_dtype, Isa isa, bool rem, bool bf16_moments, bool amsgrad,
                                  bool rng) {
  switch (grad_dtype) {
    case at::kHalf:
      return pick_bf16_state<c10::Half>(isa, rem, bf16_moments, amsgrad, rng);
    case at::kBFloat16:
      return pick_bf16_state<c10::BFloat16>(isa, rem, bf16_moments, amsgrad, rng);
    default:
      return pick_bf16_state<float>(isa, rem, bf16_moments, amsgrad, rng);
  }
}

void adamw_bf16_cpu(at::TensorList params, at::TensorList grads, at::TensorList remainders, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, const at::Tensor& step_scalars,
                    const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& rng, int64_t rng_base,
                    double beta1, double beta2, double eps, bool amsgrad, bool maximize) {
  constexpr const char* op = "adamw_bf16_";
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n, "fastamp::adamw_bf16_: got ", n, " params but ", grads.size(), " grads");
  TORCH_CHECK(exp_avgs.size() == n, "fastamp::adamw_bf16_: got ", n, " params but ", exp_avgs.size(), " exp_avgs");
  TORCH_CHECK(exp_avg_sqs.size() == n, "fastamp::adamw_bf16_: got ", n, " params but ", exp_avg_sqs.size(),
              " exp_avg_sqs");
  TORCH_CHECK(remainders.empty() || remainders.size() == n,
              "fastamp::adamw_bf16_: remainders must be empty or "
              "have one tensor per param, got ",
              remainders.size(), " remainders for ", n, " params");
  TORCH_CHECK(!amsgrad || max_exp_avg_sqs.size() == n,
              "fastamp::adamw_bf16_: amsgrad needs one max_exp_avg_sqs "
              "tensor per param, got ",
              max_exp_avg_sqs.size(), " for ", n, " params");
  const int64_t scalar_stride = check_step_scalars(op, step_scalars, n, 4, "[step_size, bc2_sqrt, decay, grad_mul]");
  check_found_inf(op, found_inf);
  check_rng(op, rng);
  if (n == 0) return;
  TORCH_CHECK(exp_avgs[0].defined(), "fastamp::adamw_bf16_: exp_avgs[0] is undefined");
  const at::ScalarType moment_dtype = exp_avgs[0].scalar_type();
  TORCH_CHECK(moment_dtype == at::kFloat || moment_dtype == at::kBFloat16,
              "fastamp::adamw_bf16_: moments must be float32 or bfloat16 (all of one dtype), got exp_avgs[0] of ",
              moment_dtype);
  const bool use_rem = !remainders.empty();
  std::vector<int64_t> numels(n);
  std::vector<int8_t> grad_slots(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    check_list_tensor(op, "params", i, p, p, at::kBFloat16);
    check_list_tensor(op, "grads", i, grads[i], p, std::nullopt);
    const at::ScalarType gdt = grads[i].scalar_type();
    TORCH_CHECK(is_kernel_float(gdt), "fastamp::adamw_bf16_: grads[", i,
                "] must be float32, float16 or bfloat16, "
                "got ",
                gdt);
    grad_slots[i] = static_cast<int8_t>(gdt == at::kFloat ? 0 : (gdt == at::kHalf ? 1 : 2));
    check_list_tensor(op, "exp_avgs", i, exp_avgs[i], p, moment_dtype);
    check_list_tensor(op, "exp_avg_sqs", i, exp_avg_sqs[i], p, moment_dtype);
    if (amsgrad) check_list_tensor(op, "max_exp_avg_sqs", i, max_exp_avg_sqs[i], p, moment_dtype);
    if (use_rem) check_list_tensor(op, "remainders", i, remainders[i], p, at::kShort);
    numels[i] = p.numel();
  }
  if (skip_step(found_inf)) return;

  const float* sc = step_scalars.data_ptr<float>();
  AdamWArgs args;
  args.h = math::AdamWHyper{static_cast<float>(beta1), static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
                            static_cast<float>(1.0 - beta2), static_cast<float>(eps)};
  args.maximize = maximize;

  const bool bf16_moments = moment_dtype == at::kBFloat16;
  // random bits are drawn only for what is rounded stochastically: the param without
  // remainders, and bf16 moments
  const bool use_rng = rng.has_value() && (!use_rem || bf16_moments);
  const Isa isa = active_isa();
  const AdamWBf16ChunkFn fns[3] = {
      pick_bf16_kernel(at::kFloat, isa, use_rem, bf16_moments, amsgrad, use_rng),
      pick_bf16_kernel(at::kHalf, isa, use_rem, bf16_moments, amsgrad, use_rng),
      pick_bf16_kernel(at::kBFloat16, isa, use_rem, bf16_moments, amsgrad, use_rng),
  };
  const int64_t moment_size = bf16_moments ? 2 : 4;
  std::vector<AdamWBf16Chunk> bases(n);
  for (size_t i = 0; i < n; ++i) {
    if (numels[i] == 0) continue;
    AdamWBf16Chunk& b = bases[i];
    b.param = static_cast<c10::BFloat16*>(params[i].data_ptr());
    b.grad = grads[i].const_data_ptr();
    b.remainder = use_rem ? static_cast<int16_t*>(remainders[i].data_ptr()) : nullptr;
    b.exp_avg = exp_avgs[i].data_ptr();
    b.exp_avg_sq = exp_avg_sqs[i].data_ptr();
    b.max_exp_avg_sq = amsgrad ? max_exp_avg_sqs[i].data_ptr() : nullptr;
    b.index0 = 0;
    for (uint32_t k = 0; k < 4; ++k) b.key[k] = use_rng ? rng_key(*rng, rng_base, i, k) : 0u;
  }
  const std::vector<Chunk> chunks = split_into_chunks(numels);
  parallel_over_chunks(chunks, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      const Chunk& ch = chunks[static_cast<size_t>(c)];
      const size_t t = static_cast<size_t>(ch.tensor);
      const AdamWBf16Chunk& b = bases[t];
      const int64_t o = ch.begin;
      const int64_t grad_size = grad_slots[t] == 0 ? 4 : 2;
      AdamWBf16Chunk ptrs = b;
      ptrs.param = b.param + o;
      ptrs.grad = static_cast<const char*>(b.grad) + o * grad_size;
      ptrs.remainder = b.remainder ? b.remainder + o : nullptr;
      ptrs.exp_avg = static_cast<char*>(b.exp_avg) + o * moment_size;
      ptrs.exp_avg_sq = static_cast<char*>(b.exp_avg_sq) + o * moment_size;
      ptrs.max_exp_avg_sq = b.max_exp_avg_sq ? static_cast<char*>(b.max_exp_avg_sq) + o * moment_size : nullptr;
      ptrs.index0 = static_cast<uint64_t>(o);
      fns[grad_slots[t]](ptrs, ch.len, with_row(args, sc + static_cast<int64_t>(t) * scalar_stride));
    }
  });
}

}  // namespace
}  // namespace cpu
}  // namespace fastamp

TORCH_LIBRARY_IMPL(fastamp, CPU, m) {
  FASTAMP_IMPL(m, adamw_, fastamp::cpu::adamw_cpu);
  FASTAMP_IMPL(m, adamw_bf16_, fastamp::cpu::adamw_bf16_cpu);
}
