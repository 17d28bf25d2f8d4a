// CPU kernel of fastamp::optim_, the one optimizer op (semantics: fastamp.reference.optim_; flags:
// csrc/optim_flags.h), and its persistent tables (cpu/optim_table.h): the host side.
//
// One pass over all tensors of the call, cut into the fixed chunks of cpu/multi_tensor.h (multiples
// of 32 elements, so no q8 block crosses a chunk seam), handed to the threads in order: each chunk
// runs the kernel of its tensor's dtypes and the call's rule and formats (cpu/optim.h; the kernels
// are cpu/optim_kernels.inc, compiled for every rule per instruction set in cpu/optim_kernels_<isa>.cpp).
// Every tensor is checked before any is written; a non-zero (or NaN) found_inf writes nothing.
// step_scalars is [k] (shared) or [n, k] (row i for tensor i, picked per chunk). The random bits of
// tensor i use streams 4 * (rng_base + i) (the param) and + 1 + j (state j), the element index its
// flat index in the tensor. The kernels run in the default float mode (cpu/q8_host.h: subnormals
// kept, round to nearest even), whatever the calling thread's (torch.set_flush_denormal), so the
// bits depend neither on it nor on the thread count. Bit-exact with the reference for every
// instruction set (AVX-512, AVX2, scalar).
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <vector>

#include "cpu/isa.h"
#include "cpu/multi_tensor.h"
#include "cpu/optim.h"
#include "cpu/optim_checks.h"
#include "cpu/optim_scalar.h"
#include "cpu/optim_table.h"
#include "cpu/q8_host.h"
#include "fastamp_math.h"
#include "host_prefetch.h"
#include "op_signatures.h"
#include "optim_flags.h"
#include "q8_math.h"

namespace fastamp {
namespace cpu {
namespace optim {
namespace {

constexpr const char* kOp = "optim_";

static_assert(kChunkElems % math::kQ8Block == 0, "chunks must hold whole q8 blocks");
static_assert((uint64_t{1} << 32) % static_cast<uint64_t>(kChunkElems) == 0, "chunks must not cross 2^32");
static_assert((1 << 16) % kChunkElems == 0 && kChunkElems % (1 << 14) == 0,
              "the q8 kernel's vector RNG needs chunks of 2^14..2^16 elements (vq8_random16)");

// ---- the rules, as the host sees them (their table: csrc/optim_rules.h) ----

// A rule's row (csrc/optim_rules.h) and what the CPU adds to it.
struct RuleInfo {
  const RuleDef* def;
  // The names its refusals give each state's list, those of its per-rule op (which runs as optim_:
  // the schemas of fastamp/ops/registry.py), so a message names what the caller passed: the key + "s"
  // (exp_avgs), and for q8 the key + "_codes" and "_scales".
  const char* lists[kMaxStates];
  const char* codes[kMaxStates];
  const char* scales[kMaxStates];
  void (*set_hyper)(const double*, int64_t flags, Args&);  // set_hyper<rules::Name> (cpu/optim.h)
};

struct RuleTable {
  RuleInfo rules[kNumRules];
  std::string names[kNumRules][3][kMaxStates];  // what lists, codes and scales point at
  RuleTable() {
    void (*const hypers[])(const double*, int64_t, Args&) = {
#define FASTAMP_CPU_HYPER_(Name, name) &set_hyper<rules::Name>,
        FASTAMP_OPTIM_RULES(FASTAMP_CPU_HYPER_)
#undef FASTAMP_CPU_HYPER_
    };
    for (int i = 0; i < kNumRules; ++i) {
      const RuleDef& d = kRuleDefs[i];
      RuleInfo& r = rules[i];
      r = RuleInfo{&d, {}, {}, {}, hypers[i]};
      for (int j = 0; j < kMaxStates; ++j) {
        if (d.keys[j] == nullptr) continue;
        const char* suffix[3] = {"s", "_codes", "_scales"};
        const char** out[3] = {r.lists, r.codes, r.scales};
        for (int q = 0; q < 3; ++q) {
          names[i][q][j] = std::string(d.keys[j]) + suffix[q];
          out[q][j] = names[i][q][j].c_str();
        }
      }
    }
  }
};

const RuleTable& rule_table() {
  static const RuleTable table;
  return table;
}

const RuleInfo& find_rule(c10::string_view name) {
  const RuleDef* def = find_rule_def(name.data(), name.size());
  TORCH_CHECK(def != nullptr, "fastamp::optim_: unknown rule '", std::string(name.data(), name.size()),
              "'; expected one of ", rule_name_list());
  return rule_table().rules[static_cast<int>(def->id)];
}

// flags: a combination of the rule's.
void check_flags(const RuleInfo& r, int64_t flags) {
  const int64_t allowed = optim_flags::kMaximize | optim_flags::kSrParam | optim_flags::kSrState | r.def->flags;
  TORCH_CHECK((flags & ~allowed) == 0, "fastamp::optim_: flags ", flags, " are not a combination of rule '",
              r.def->name, "''s (MAXIMIZE 1, SR_PARAM 8, SR_STATE 16",
              r.def->flags == optim_flags::kAmsgrad    ? ", AMSGRAD 2"
              : r.def->flags == optim_flags::kNesterov ? ", NESTEROV 4"
                                                       : "",
              ")");
}

// A call's settings from its hyperparameters and flags (fp32 as the reference's _f32 rounds them:
// 1 - beta in fp64, rounded once).
Args args_of(const RuleInfo& r, at::ArrayRef<double> hyper, int64_t flags) {
  TORCH_CHECK(hyper.size() == static_cast<size_t>(r.def->hyper), "fastamp::optim_: rule '", r.def->name, "' takes ",
              r.def->hyper, " hyperparameters, got ", hyper.size());
  Args a{};
  r.set_hyper(hyper.data(), flags, a);
  a.states = states_kept(*r.def, flags, !hyper.empty() && hyper[0] != 0.0);
  a.srp = (flags & optim_flags::kSrParam) != 0;
  a.srs = (flags & optim_flags::kSrState) != 0;
  return a;
}

// ---- formats ----

// The call's formats and the lists' shape: everything the tensors' own checks rely on.
struct Layout {
  const RuleInfo* rule = nullptr;
  int states = 0;  // kept per param
  Master master = Master::kNone;
  at::ScalarType master_dtype = at::kFloat;
  Fmt fmt = Fmt::kFp32;
  at::ScalarType state_dtype = at::kFloat;
  int per = 1;  // lists per state: 2 for q8 (codes, scales)
  const char* masters_name = "masters";
};

// `hyper`: the call's (empty for a table, whose states decide whether SGD keeps a momentum buffer).
Layout layout_of(const RuleInfo& r, int states, size_t n, at::TensorList grads, at::TensorList masters,
                 at::TensorList state_list, at::ArrayRef<double> hyper) {
  Layout l;
  l.rule = &r;
  l.states = states;
  TORCH_CHECK(grads.size() == n, "fastamp::optim_: got ", n, " params but ", grads.size(), " grads");
  if (!masters.empty() && masters[0].defined() && masters[0].scalar_type() == at::kShort) {
    l.masters_name = r.def->int16_masters;
  }
  TORCH_CHECK(masters.empty() || masters.size() == n, "fastamp::optim_: ", l.masters_name,
              " must be empty or have one tensor per param, got ", masters.size(), " ", l.masters_name, " for ", n,
              " params");
  if (!masters.empty()) {
    TORCH_CHECK(masters[0].defined(), "fastamp::optim_: masters[0] is undefined");
    l.master_dtype = masters[0].scalar_type();
    switch (l.master_dtype) {
      case at::kFloat:
        l.master = Master::kFp32;
        break;
      case at::kShort:
        l.master = Master::kRemainder;
        break;
      case at::kChar:
        l.master = Master::kUlp8;
        break;
      default:
        TORCH_CHECK(false,
                    "fastamp::optim_: masters must be float32 (fp32 master weights), int8 (ulp8 corrections of "
                    "bfloat16 / float16 params) or int16 (remainders of bfloat16 params), got ",
                    l.master_dtype);
    }
  }
  if (states > 0 && !state_list.empty()) {
    TORCH_CHECK(state_list[0].defined(), "fastamp::optim_: states[0] is undefined");
    l.state_dtype = state_list[0].scalar_type();
    switch (l.state_dtype) {
      case at::kFloat:
        l.fmt = Fmt::kFp32;
        break;
      case at::kBFloat16:
        l.fmt = Fmt::kBf16;
        break;
      case at::kByte:
        l.fmt = Fmt::kQ8;
        l.per = 2;
        break;
      default:
        TORCH_CHECK(false, "fastamp::optim_: ", r.def->states_name,
                    " must be float32 or bfloat16, or uint8 q8 codes and scales (one state format per call), got ",
                    r.lists[0], "[0] of ", l.state_dtype);
    }
  }
  const size_t want = n * static_cast<size_t>(l.per * states);
  if (state_list.size() != want) {
    // the last state short, as the per-rule ops said it: AMSGRAD's max_exp_avg_sqs, SGD's momentum buffers
    const size_t before = n * static_cast<size_t>(l.per * (states - 1));
    const size_t got = state_list.size() >= before ? (state_list.size() - before) / static_cast<size_t>(l.per) : 0;
    TORCH_CHECK(!(r.def->id == Rule::kAdamW && states == 3 && state_list.size() >= before && state_list.size() < want),
                "fastamp::optim_: ", "amsgrad needs one max_exp_avg_sqs tensor per param, got ", got,
                " (after the exp_avgs and exp_avg_sqs of ", n, " params)");
    TORCH_CHECK(!(r.def->id == Rule::kSgd && states == 1 && !hyper.empty() && state_list.size() < want),
                "fastamp::optim_: momentum=", hyper.empty() ? 0.0 : hyper[0],
                " needs one momentum_buffers tensor per param, got ", got, " for ", n, " params");
    std::string lists;
    for (int j = 0; j < states; ++j) lists += std::string(j ? ", " : "") + r.lists[j];
    TORCH_CHECK(false, "fastamp::optim_: rule '", r.def->name, "' with these settings keeps ", states, " state(s) (",
                lists, "), ", l.per, " list(s) of ", n, " tensors each: ", want, " state tensors, got ",
                state_list.size());
  }
  return l;
}

// The checks of tensor i of every list (grads when `grads` is not empty); its element count.
int64_t check_tensor(const Layout& l, size_t i, size_t n, at::TensorList params, at::TensorList grads,
                     at::TensorList masters, at::TensorList states) {
  const at::Tensor& p = params[i];
  check_list_tensor(kOp, "params", i, p, p, std::nullopt);
  // params[0] says it for the call (as a per-rule op, of one param dtype, did)
  if (i == 0) {
    TORCH_CHECK(is_kernel_float(p.scalar_type()),
                "fastamp::optim_: params must be float32, float16 or bfloat16, got params[0] of ", p.scalar_type());
  }
  TORCH_CHECK(is_kernel_float(p.scalar_type()), "fastamp::optim_: params[", i,
              "] must be float32, float16 or bfloat16, got ", p.scalar_type());
  if (!grads.empty()) {
    check_list_tensor(kOp, "grads", i, grads[i], p, std::nullopt);
    TORCH_CHECK(is_kernel_float(grads[i].scalar_type()), "fastamp::optim_: grads[", i,
                "] must be float32, float16 or bfloat16, got ", grads[i].scalar_type());
  }
  if (l.master != Master::kNone) {
    check_list_tensor(kOp, l.masters_name, i, masters[i], p, l.master_dtype);
    TORCH_CHECK(l.master != Master::kRemainder || p.scalar_type() == at::kBFloat16, "fastamp::optim_: int16 ",
                l.masters_name == std::string("remainders") ? "remainders" : "remainder masters",
                " need bfloat16 params, but params[", i, "] is ", p.scalar_type());
    TORCH_CHECK(l.master != Master::kUlp8 || p.scalar_type() == at::kBFloat16 || p.scalar_type() == at::kHalf,
                "fastamp::optim_: int8 (ulp8) masters need bfloat16 or float16 params, but params[", i, "] is ",
                p.scalar_type());
  }
  for (int j = 0; j < l.states; ++j) {
    if (l.fmt == Fmt::kQ8) {
      check_list_tensor(kOp, l.rule->codes[j], i, states[(2 * j) * n + i], p, at::kByte);
      check_q8_scales(kOp, l.rule->scales[j], i, states[(2 * j + 1) * n + i], p);
    } else {
      check_list_tensor(kOp, l.rule->lists[j], i, states[j * n + i], p, l.state_dtype);
    }
  }
  return p.numel();
}

int64_t master_size(Master m) { return m == Master::kFp32 ? 4 : m == Master::kRemainder ? 2 : 1; }
int64_t state_size(Fmt f) { return f == Fmt::kFp32 ? 4 : f == Fmt::kBf16 ? 2 : 1; }

// ---- the run ----

// One tensor of a call: its pointers at its first element, its kernel, its dtypes' sizes.
struct Entry {
  Span base;
  ChunkFn fn;
  at::ScalarType param_dtype;
  at::ScalarType grad_dtype;
  int8_t param_size;
  int8_t grad_size;
};

// Tensor i's pointers, but for its grad (the lists' tensors at their first element).
Span base_of(const Layout& l, size_t i, size_t n, at::TensorList params, at::TensorList masters,
             at::TensorList states) {
  Span s{};
  s.param = params[i].data_ptr();
  s.master = l.master != Master::kNone ? masters[i].data_ptr() : nullptr;
  for (int j = 0; j < l.states; ++j) {
    if (l.fmt == Fmt::kQ8) {
      s.state[j] = states[(2 * j) * n + i].data_ptr();
      s.scales[j] = static_cast<uint8_t*>(states[(2 * j + 1) * n + i].data_ptr());
    } else {
      s.state[j] = states[j * n + i].data_ptr();
    }
  }
  return s;
}

// The kernels of the entries for their dtypes (one lookup per run of equal dtypes).
void pick_kernels(const Layout& l, std::vector<Entry>& entries, Isa isa) {
  ChunkFn fn = nullptr;
  at::ScalarType p = at::kDouble, g = at::kDouble;
  for (Entry& e : entries) {
    if (e.param_dtype != p || e.grad_dtype != g || fn == nullptr) {
      p = e.param_dtype;
      g = e.grad_dtype;
      fn = pick_kernel(l.rule->def->id, isa, p, g, l.master, l.fmt);
      TORCH_CHECK(fn != nullptr, "fastamp::optim_: no kernel for params of ", p, " and grads of ", g);
    }
    e.fn = fn;
  }
}

// The random bits' stream keys of every entry (math::sr_stream_key of 4 * (rng_base + i) + k is
// mix32(base ^ stream), base from [seed, counter]); zeros where the call rounds nothing stochastically.
void set_keys(const Args& a, std::vector<Entry>& entries, const std::optional<at::Tensor>& rng, int64_t rng_base) {
  if (!(a.srp || a.srs)) {
    for (Entry& e : entries) std::fill(e.base.key, e.base.key + 1 + kMaxStates, 0u);
    return;
  }
  const int64_t* r = rng->data_ptr<int64_t>();
  const uint32_t base =
      math::mix32(math::mix32(static_cast<uint32_t>(r[0]) ^ 0x9E3779B9u) ^ static_cast<uint32_t>(r[1]));
  for (size_t i = 0; i < entries.size(); ++i) {
    const uint32_t stream = static_cast<uint32_t>((static_cast<uint64_t>(rng_base) + static_cast<uint64_t>(i)) * 4u);
    uint32_t* key = entries[i].base.key;
    key[0] = a.srp ? math::mix32(base ^ stream) : 0u;
    for (int j = 0; j < kMaxStates; ++j)
      key[1 + j] = a.srs && j < a.states ? math::mix32(base ^ (stream + 1u + j)) : 0u;
  }
}

// The chunks of the entries, over the threads in order (results do not depend on which thread
// runs a chunk: cpu/multi_tensor.h), in the default float mode.
void run_chunks(const Layout& l, const Args& args, const std::vector<Entry>& entries, const std::vector<Chunk>& chunks,
                const float* sc, int64_t stride) {
  const int64_t msize = master_size(l.master);
  const int64_t ssize = state_size(l.fmt);
  const int64_t k = l.rule->def->scalars;
  const int ns = l.states;
  const bool q8 = l.fmt == Fmt::kQ8;
  parallel_over_chunks_dynamic(chunks, [&](int64_t cb, int64_t ce) {
    const DefaultFloatMode float_mode;
    Args a = args;
    int32_t row_of = -1;
    for (int64_t c = cb; c < ce; ++c) {
      const Chunk& ch = chunks[static_cast<size_t>(c)];
      const Entry& e = entries[static_cast<size_t>(ch.tensor)];
      const int64_t o = ch.begin;  // a multiple of kChunkElems, so of 32
      Span s = e.base;
      s.param = static_cast<char*>(s.param) + o * e.param_size;
      s.grad = static_cast<const char*>(s.grad) + o * e.grad_size;
      if (s.master != nullptr) s.master = static_cast<char*>(s.master) + o * msize;
      for (int j = 0; j < ns; ++j) {
        s.state[j] = static_cast<char*>(s.state[j]) + o * ssize;
        if (q8) s.scales[j] += o / math::kQ8Block;
      }
      s.index0 = static_cast<uint64_t>(o);
      if (ch.tensor != row_of) {
        // the shared [k] (stride 0) or this tensor's row of [n, k]: once per chunk of a new tensor
        const float* row = sc + static_cast<int64_t>(ch.tensor) * stride;
        std::copy(row, row + k, a.s);
        row_of = ch.tensor;
      }
      e.fn(s, ch.len, a);
    }
  });
}

// What a call checks before its tensors: the rule, flags, lists, step scalars, found_inf, rng.
struct CallChecks {
  const RuleInfo* rule;
  Args args;
  int64_t stride;  // of the step-scalar rows: 0 (shared) or k
};

CallChecks check_call(size_t n, const at::Tensor& step_scalars, const std::optional<at::Tensor>& found_inf,
                      const std::optional<at::Tensor>& rng, c10::string_view rule, at::ArrayRef<double> hyper,
                      int64_t flags) {
  const RuleInfo& r = find_rule(rule);
  check_flags(r, flags);
  CallChecks c{&r, args_of(r, hyper, flags), 0};
  c.stride = check_step_scalars(kOp, step_scalars, n, r.def->scalars, r.def->layout);
  check_found_inf(kOp, found_inf);
  check_rng(kOp, rng);
  TORCH_CHECK(rng.has_value() || !(c.args.srp || c.args.srs),
              "fastamp::optim_: SR_PARAM / SR_STATE need rng ([seed, counter], int64), got None");
  return c;
}

void optim_cpu(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList states,
               const at::Tensor& step_scalars, const std::optional<at::Tensor>& found_inf,
               const std::optional<at::Tensor>& rng, int64_t rng_base, c10::string_view rule,
               at::ArrayRef<double> hyper, int64_t flags) {
  const size_t n = params.size();
  const CallChecks call = check_call(n, step_scalars, found_inf, rng, rule, hyper, flags);
  const Layout l = layout_of(*call.rule, call.args.states, n, grads, masters, states, hyper);
  if (n == 0) return;
  // One pass checks every tensor and takes its pointers (nothing is written before it ends). At
  // thousands of small params its time is mostly cache misses on the tensors' TensorImpl and
  // StorageImpl objects: they are prefetched a few params ahead.
  std::vector<Entry> entries(n);
  std::vector<int64_t> numels(n);
  const size_t lists = static_cast<size_t>(l.per * l.states);
  for (size_t i = 0; i < n; ++i) {
    prefetch_tensors_ahead<4>(params, i);
    prefetch_tensors_ahead<4>(grads, i);
    if (!masters.empty()) prefetch_tensors_ahead<4>(masters, i);
    for (size_t q = 0; q < lists; ++q) prefetch_tensors_ahead<4>(states.slice(q * n, n), i);
    numels[i] = check_tensor(l, i, n, params, grads, masters, states);
    Entry& e = entries[i];
    e.param_dtype = params[i].scalar_type();
    e.grad_dtype = grads[i].scalar_type();
    e.param_size = static_cast<int8_t>(c10::elementSize(e.param_dtype));
    e.grad_size = static_cast<int8_t>(c10::elementSize(e.grad_dtype));
    if (numels[i] == 0) continue;
    // untyped data_ptr(): the dtypes were checked above; grads are only read (const: a
    // copy-on-write grad is not copied)
    e.base = base_of(l, i, n, params, masters, states);
    e.base.grad = grads[i].const_data_ptr();
  }
  if (skip_step(found_inf)) return;
  pick_kernels(l, entries, active_isa());
  set_keys(call.args, entries, rng, rng_base);
  run_chunks(l, call.args, entries, split_into_chunks(numels), step_scalars.data_ptr<float>(), call.stride);
}

}  // namespace
}  // namespace optim

// ---- the persistent tables (cpu/optim_table.h) ----

struct OptimTable {
  optim::Layout layout;
  int64_t flags = 0;  // the structural ones it was made with: AMSGRAD
  int64_t n = 0;
  size_t lists = 0;                 // tensors per entry: param, its master, its states' tensors
  std::vector<at::Tensor> tensors;  // entry i's at [i * lists, (i + 1) * lists)
  std::vector<const void*> ptrs;    // their data pointers when the table was made
  std::vector<int64_t> numels;      // their element counts
  std::vector<caffe2::TypeMeta> dtypes;
  std::vector<optim::Entry> entries;  // the grads' pointers and the kernels are written by each run
  std::vector<Chunk> chunks;
  std::atomic<bool> busy{false};  // one run at a time (a run writes `entries`)
};

void OptimTableDeleter::operator()(OptimTable* t) const { delete t; }

int64_t optim_table_size(const OptimTable& table) { return table.n; }

OptimTablePtr optim_table_new(at::TensorList params, at::TensorList masters, at::TensorList states,
                              c10::string_view rule, int64_t flags) {
  using namespace optim;
  const size_t n = params.size();
  TORCH_CHECK(n > 0, "fastamp::optim_: a table needs at least one param");
  const RuleInfo& r = find_rule(rule);
  check_flags(r, flags);
  OptimTablePtr t(new OptimTable);
  // SGD keeps a momentum buffer where it has states
  const int ns = states_kept(*r.def, flags, !states.empty());
  t->layout = layout_of(r, ns, n, params, masters, states, {});
  const Layout& l = t->layout;
  t->flags = flags & optim_flags::kAmsgrad;
  t->n = static_cast<int64_t>(n);
  t->lists = 1 + (l.master != Master::kNone ? 1 : 0) + static_cast<size_t>(l.per * l.states);
  t->tensors.reserve(n * t->lists);
  t->entries.resize(n);
  std::vector<int64_t> numels(n);
  for (size_t i = 0; i < n; ++i) {
    numels[i] = check_tensor(l, i, n, params, {}, masters, states);
    t->tensors.push_back(params[i]);
    if (l.master != Master::kNone) t->tensors.push_back(masters[i]);
    for (size_t q = 0; q < static_cast<size_t>(l.per * l.states); ++q) t->tensors.push_back(states[q * n + i]);
    Entry& e = t->entries[i];
    e.param_dtype = params[i].scalar_type();
    e.param_size = static_cast<int8_t>(params[i].element_size());
    e.base = base_of(l, i, n, params, masters, states);
  }
  t->ptrs.reserve(t->tensors.size());
  t->numels.reserve(t->tensors.size());
  t->dtypes.reserve(t->tensors.size());
  for (at::Tensor& x : t->tensors) {
    t->ptrs.push_back(x.data_ptr());
    t->numels.push_back(x.numel());
    t->dtypes.push_back(x.dtype());
  }
  t->chunks = split_into_chunks(numels);
  return t;
}

bool optim_table_run(OptimTable& t, at::TensorList grads, const at::Tensor& step_scalars,
                     const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& rng, int64_t rng_base,
                     c10::string_view rule, at::ArrayRef<double> hyper, int64_t flags) {
  using namespace optim;
  const size_t n = static_cast<size_t>(t.n);
  const Layout& l = t.layout;
  const CallChecks call = check_call(n, step_scalars, found_inf, rng, rule, hyper, flags);
  if (call.rule != l.rule || grads.size() != n || (flags & optim_flags::kAmsgrad) != t.flags ||
      call.args.states != l.states) {
    return false;
  }
  if (t.busy.exchange(true)) return false;
  struct Release {
    std::atomic<bool>* flag;
    ~Release() { flag->store(false); }
  } release{&t.busy};
  // One pass over the entries: the new grads, and whether the table's tensors are still where, and
  // what, the table says (a `.data` rebind, a resize or a view as another dtype changes one of these).
  const size_t lists = t.lists;
  for (size_t i = 0; i < n; ++i) {
    prefetch_tensors_ahead(grads, i);
    {
      // the table's tensors of the entries d and 2d ahead (counted in entries: each is `lists` tensors,
      // so counting flat tensors, as this loop once did, asked for them barely one entry ahead)
      constexpr size_t d = static_cast<size_t>(kHostPrefetchDistance);
      if (i + 2 * d < n) {
        for (size_t q = 0; q < lists; ++q)
          prefetch_tensor_impl(t.tensors[(i + 2 * d) * lists + q].unsafeGetTensorImpl());
      }
      if (i + d < n) {
        for (size_t q = 0; q < lists; ++q) prefetch_storage_of(t.tensors[(i + d) * lists + q].unsafeGetTensorImpl());
      }
    }
    const c10::TensorImpl* g = grads[i].unsafeGetTensorImpl();
    const at::ScalarType gdt = c10::typeMetaToScalarType(g->dtype());
    if (!g->device().is_cpu() || g->layout() != at::kStrided || !is_kernel_float(gdt) || !g->is_contiguous() ||
        g->numel() != t.numels[i * lists]) {
      return false;
    }
    for (size_t q = 0; q < lists; ++q) {
      const size_t j = i * lists + q;
      const c10::TensorImpl* x = t.tensors[j].unsafeGetTensorImpl();
      if (x->numel() != t.numels[j] || x->dtype() != t.dtypes[j] || !x->is_contiguous() ||
          t.tensors[j].data_ptr() != t.ptrs[j]) {
        return false;
      }
    }
    // scratch until the run: every run writes every entry before its kernel
    Entry& e = t.entries[i];
    e.grad_dtype = gdt;
    e.grad_size = static_cast<int8_t>(c10::elementSize(gdt));
    e.base.grad = grads[i].const_data_ptr();
  }
  if (skip_step(found_inf)) return true;
  pick_kernels(l, t.entries, active_isa());
  set_keys(call.args, t.entries, rng, rng_base);
  run_chunks(l, call.args, t.entries, t.chunks, step_scalars.data_ptr<float>(), call.stride);
  return true;
}

}  // namespace cpu
}  // namespace fastamp

TORCH_LIBRARY_IMPL(fastamp, CPU, m) { FASTAMP_IMPL(m, optim_, fastamp::cpu::optim::optim_cpu); }
