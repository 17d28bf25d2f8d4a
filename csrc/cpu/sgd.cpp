// CPU kernel of fastamp::sgd_ (semantics: fastamp/reference/; per-element maths:
// math::sgd_element in csrc/fastamp_math.h).
//
// torch.optim.SGD's update (weight decay, momentum with dampening, Nesterov, maximize) in
// one pass over all tensors of the call, cut into fixed-size chunks spread over threads
// (csrc/cpu/multi_tensor.h). The value optimised is an fp32 master (params of any float
// dtype), the exact master rebuilt from a bf16 param and an int16 remainder
// (math::join_master / split_master), or the param itself (bf16 rounded stochastically
// when an rng tensor is given, with the counter hash in integer vector lanes). Bit-exact
// with the reference for every instruction set (AVX-512, AVX2, scalar). A non-zero (or
// NaN) found_inf writes nothing; is_first (step_scalars[..., 2]) != 0 marks the first applied
// step (the momentum buffer takes the gradient). step_scalars is [3] (shared) or [n, 3] (row i
// for tensor i, picked per chunk).
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <optional>
#include <type_traits>
#include <vector>

#include "cpu/isa.h"
#include "cpu/multi_tensor.h"
#include "cpu/optim_checks.h"
#include "cpu/scalar_ops.h"
#include "fastamp_math.h"
#include "op_signatures.h"

namespace fastamp {
namespace cpu {
namespace {

constexpr int kMasterNone = 0;       // params updated directly
constexpr int kMasterFp32 = 1;       // fp32 master weights
constexpr int kMasterRemainder = 2;  // int16 remainders of bf16 params

struct SgdArgs {
  math::SgdStepScalars s;
  math::SgdHyper h;
};

// Pointers of one chunk, already offset to its first element.
struct SgdChunk {
  void* param;
  const void* grad;
  void* master;            // float* (fp32 masters), int16_t* (remainders) or nullptr
  float* momentum_buffer;  // nullptr without momentum
  uint64_t index0;         // flat index of the chunk's first element in its tensor (RNG counter)
  uint32_t key;            // math::sr_stream_key of stream 4 * tensor_id
};

static_assert((uint64_t{1} << 32) % static_cast<uint64_t>(kChunkElems) == 0, "chunks must not cross 2^32");

namespace scalar {

template <class P, class G, int KIND, bool MOM, bool RNG>
void sgd_range(const SgdChunk& c, int64_t begin, int64_t end, const SgdArgs& a) {
  P* param = static_cast<P*>(c.param);
  const G* grad = static_cast<const G*>(c.grad);
  for (int64_t i = begin; i < end; ++i) {
    float p;
    if constexpr (KIND == kMasterFp32) {
      p = static_cast<float*>(c.master)[i];
    } else if constexpr (KIND == kMasterRemainder) {
      p = math::join_master(param[i].x, static_cast<int16_t*>(c.master)[i]);
    } else {
      p = load_float(param + i);
    }
    float buf = MOM ? c.momentum_buffer[i] : 0.0f;
    math::sgd_element(&p, &buf, load_float(grad + i), a.s, a.h);
    if constexpr (MOM) c.momentum_buffer[i] = buf;
    if constexpr (KIND == kMasterFp32) {
      static_cast<float*>(c.master)[i] = p;
      store_float(param + i, p);
    } else if constexpr (KIND == kMasterRemainder) {
      math::split_master(p, &param[i].x, &static_cast<int16_t*>(c.master)[i]);
    } else if constexpr (RNG) {
      param[i].x = math::float_to_bf16_bits_sr(p, math::sr_random16(c.key, c.index0 + static_cast<uint64_t>(i)));
    } else {
      store_float(param + i, p);
    }
  }
}

template <class P, class G, int KIND, bool MOM, bool RNG>
void sgd_chunk(const SgdChunk& c, int64_t n, const SgdArgs& a) {
  sgd_range<P, G, KIND, MOM, RNG>(c, 0, n, a);
}

}  // namespace scalar

#define FASTAMP_ISA_KERNELS "cpu/sgd_kernels.inc"
#include "cpu/per_isa.inc"  // namespaces avx512 and avx2: the loops of sgd_kernels.inc per ISA

using SgdChunkFn = void (*)(const SgdChunk&, int64_t, const SgdArgs&);

template <class P, class G, int KIND, bool MOM, bool RNG>
SgdChunkFn pick_isa(Isa isa) {
#if FASTAMP_X86_SIMD
  if (isa == Isa::Avx512) return &avx512::sgd_chunk<P, G, KIND, MOM, RNG>;
  if (isa == Isa::Avx2) return &avx2::sgd_chunk<P, G, KIND, MOM, RNG>;
#endif
  (void)isa;
  return &scalar::sgd_chunk<P, G, KIND, MOM, RNG>;
}

template <class P, class G, int KIND, bool RNG>
SgdChunkFn pick_momentum(Isa isa, bool momentum) {
  return momentum ? pick_isa<P, G, KIND, true, RNG>(isa) : pick_isa<P, G, KIND, false, RNG>(isa);
}

// Only the combinations the checks allow are instantiated: remainders and stochastic
// rounding exist for bf16 params only.
template <class P, class G>
SgdChunkFn pick_mode(Isa isa, int kind, bool momentum, bool rng) {
  if (kind == kMasterFp32) return pick_momentum<P, G, kMasterFp32, false>(isa, momentum);
  if constexpr (std::is_same_v<P, c10::BFloat16>) {
    if (kind == kMasterRemainder) return pick_momentum<P, G, kMasterRemainder, false>(isa, momentum);
    if (rng) return pick_momentum<P, G, kMasterNone, true>(isa, momentum);
  }
  return pick_momentum<P, G, kMasterNone, false>(isa, momentum);
}

template <class P>
SgdChunkFn pick_grad(at::ScalarType grad_dtype, Isa isa, int kind, bool momentum, bool rng) {
  switch (grad_dtype) {
    case at::kHalf:
      return pick_mode<P, c10::Half>(isa, kind, momentum, rng);
    case at::kBFloat16:
      return pick_mode<P, c10::BFloat16>(isa, kind, momentum, rng);
    default:
      return pick_mode<P, float>(isa, kind, momentum, rng);
  }
}

SgdChunkFn pick_kernel(at::ScalarType param_dtype, at::ScalarType grad_dtype, Isa isa, int kind, bool momentum,
                       bool rng) {
  switch (param_dtype) {
    case at::kHalf:
      return pick_grad<c10::Half>(grad_dtype, isa, kind, momentum, rng);
    case at::kBFloat16:
      return pick_grad<c10::BFloat16>(grad_dtype, isa, kind, momentum, rng);
    default:
      return pick_grad<float>(grad_dtype, isa, kind, momentum, rng);
  }
}

void sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList momentum_buffers,
             const at::Tensor& step_scalars, const std::optional<at::Tensor>& found_inf,
             const std::optional<at::Tensor>& rng, int64_t rng_base, double momentum, double dampening,
             double weight_decay, bool nesterov, bool maximize) {
  constexpr const char* op = "sgd_";
  const size_t n = params.size();
  const bool has_momentum = momentum != 0.0;
  TORCH_CHECK(grads.size() == n, "fastamp::sgd_: got ", n, " params but ", grads.size(), " grads");
  TORCH_CHECK(masters.empty() || masters.size() == n,
              "fastamp::sgd_: masters must be empty or have one tensor per "
              "param, got ",
              masters.size(), " masters for ", n, " params");
  TORCH_CHECK(!has_momentum || momentum_buffers.size() == n, "fastamp::sgd_: momentum=", momentum,
              " needs one momentum_buffers tensor per param, got ", momentum_buffers.size(), " for ", n, " params");
  const int64_t scalar_stride = check_step_scalars(op, step_scalars, n, 3, "[lr, grad_mul, is_first]");
  check_found_inf(op, found_inf);
  check_rng(op, rng);
  if (n == 0) return;
  int kind = kMasterNone;
  at::ScalarType master_dtype = at::kFloat;
  if (!masters.empty()) {
    TORCH_CHECK(masters[0].defined(), "fastamp::sgd_: masters[0] is undefined");
    master_dtype = masters[0].scalar_type();
    TORCH_CHECK(master_dtype == at::kFloat || master_dtype == at::kShort,
                "fastamp::sgd_: masters must be float32 "
                "(fp32 master weights) or int16 (remainders of bfloat16 params), got ",
                master_dtype);
    kind = master_dtype == at::kFloat ? kMasterFp32 : kMasterRemainder;
  }
  std::vector<int64_t> numels(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    check_list_tensor(op, "params", i, p, p, std::nullopt);
    TORCH_CHECK(is_kernel_float(p.scalar_type()), "fastamp::sgd_: params[", i,
                "] must be float32, float16 or bfloat16, got ", p.scalar_type());
    check_list_tensor(op, "grads", i, grads[i], p, std::nullopt);
    TORCH_CHECK(is_kernel_float(grads[i].scalar_type()), "fastamp::sgd_: grads[", i,
                "] must be float32, float16 or bfloat16, got ", grads[i].scalar_type());
    if (kind != kMasterNone) {
      check_list_tensor(op, "masters", i, masters[i], p, master_dtype);
      TORCH_CHECK(kind != kMasterRemainder || p.scalar_type() == at::kBFloat16,
                  "fastamp::sgd_: int16 remainder "
                  "masters need bfloat16 params, but params[",
                  i, "] is ", p.scalar_type());
    }
    if (has_momentum) check_list_tensor(op, "momentum_buffers", i, momentum_buffers[i], p, at::kFloat);
    numels[i] = p.numel();
  }
  if (skip_step(found_inf)) return;

  const float* sc = step_scalars.data_ptr<float>();
  SgdArgs args;
  args.h = math::SgdHyper{static_cast<float>(momentum),
                          static_cast<float>(1.0 - dampening),
                          static_cast<float>(weight_decay),
                          has_momentum,
                          weight_decay != 0.0,
                          nesterov,
                          maximize};

  const Isa isa = active_isa();
  std::vector<SgdChunk> bases(n);
  std::vector<SgdChunkFn> fns(n);
  std::vector<int8_t> elem_sizes(n * 2);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    // random bits only where the reference draws them: bf16 params without a master
    const bool use_rng = rng.has_value() && kind == kMasterNone && p.scalar_type() == at::kBFloat16;
    fns[i] = pick_kernel(p.scalar_type(), grads[i].scalar_type(), isa, kind, has_momentum, use_rng);
    elem_sizes[2 * i] = static_cast<int8_t>(p.element_size());
    elem_sizes[2 * i + 1] = static_cast<int8_t>(grads[i].element_size());
    if (numels[i] == 0) continue;
    bases[i] = SgdChunk{p.data_ptr(),
                        grads[i].const_data_ptr(),
                        kind != kMasterNone ? masters[i].data_ptr() : nullptr,
                        has_momentum ? static_cast<float*>(momentum_buffers[i].data_ptr()) : nullptr,
                        0,
                        use_rng ? rng_key(*rng, rng_base, i, 0) : 0u};
  }
  const int64_t master_size = kind == kMasterFp32 ? 4 : 2;
  const std::vector<Chunk> chunks = split_into_chunks(numels);
  parallel_over_chunks(chunks, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      const Chunk& ch = chunks[static_cast<size_t>(c)];
      const size_t t = static_cast<size_t>(ch.tensor);
      const SgdChunk& b = bases[t];
      const int64_t o = ch.begin;
      const SgdChunk ptrs{static_cast<char*>(b.param) + o * elem_sizes[2 * t],
                          static_cast<const char*>(b.grad) + o * elem_sizes[2 * t + 1],
                          b.master ? static_cast<char*>(b.master) + o * master_size : nullptr,
                          b.momentum_buffer ? b.momentum_buffer + o : nullptr,
                          static_cast<uint64_t>(o),
                          b.key};
      SgdArgs a = args;
      // the shared [3] (stride 0) or this tensor's row of [n, 3]: once per chunk
      const float* row = sc + static_cast<int64_t>(t) * scalar_stride;
      a.s = math::SgdStepScalars{row[0], row[1], row[2]};
      fns[t](ptrs, ch.len, a);
    }
  });
}

}  // namespace
}  // namespace cpu
}  // namespace fastamp

TORCH_LIBRARY_IMPL(fastamp, CPU, m) { FASTAMP_IMPL(m, sgd_, fastamp::cpu::sgd_cpu); }
