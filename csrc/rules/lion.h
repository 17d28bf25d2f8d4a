// Lion (fastamp.optim.Lion; its definition: reference/optim.py's RULES["lion"]): one rule of
// fastamp::optim_, whole, for both C++ backends. csrc/optim_rules.h lists it and includes this
// header; docs/extending.md says what each part is for.
//
//   kDef                   its row of the rules table: names, counts, flags, state keys
//   Hyper, make_hyper      the call's constants (rounded from optim_'s fp64 `hyper` once, as the
//                          reference's _f32) and flags
//   Scalars, scalars(row)  a tensor's step scalars, from its row of `step_scalars`
//   element(...)           the fp32 update of one element (CPU scalar path, CUDA)
//   RuleVec<Lion>          the same update on kW lanes, for the CPU's per-ISA loops (below the
//                          include guard: compiled once per instruction set)
#ifndef FASTAMP_RULES_LION_H_
#define FASTAMP_RULES_LION_H_

namespace fastamp {
namespace rules {

struct Lion {
  static constexpr RuleId kId = RuleId::kLion;
  static constexpr RuleDef kDef = {
      kId,       "lion",
      2,         "[beta1, beta2]",
      3,         "[lr, decay, grad_mul]",
      0,         "MAXIMIZE, SR_PARAM, SR_STATE",
      1,         0,
      false,     {"exp_avg", nullptr, nullptr},
      "masters", "exp_avgs",
  };
  static constexpr int kMinStates = 1, kMaxStates = 1;  // exp_avg
  // the state formats the CUDA kernel is compiled for (kStates* of csrc/optim_rules.h)
  static constexpr unsigned kCudaStates = kStatesFp32 | kStatesQ8;

  struct Hyper {
    float beta1, one_minus_beta1, beta2, one_minus_beta2;
    bool maximize;
  };
  struct Scalars {
    float lr;        // learning rate (fp32)
    float decay;     // 1 - lr * weight_decay (fp64, rounded once)
    float grad_mul;  // 1/scale * clip_coef, or 1
  };

  static inline Hyper make_hyper(const double* hyper, int64_t flags) {
    Hyper h;
    h.beta1 = static_cast<float>(hyper[0]);
    h.one_minus_beta1 = static_cast<float>(1.0 - hyper[0]);
    h.beta2 = static_cast<float>(hyper[1]);
    h.one_minus_beta2 = static_cast<float>(1.0 - hyper[1]);
    h.maximize = (flags & optim_flags::kMaximize) != 0;
    return h;
  }
  FASTAMP_HD static Scalars scalars(const float* row) { return Scalars{row[0], row[1], row[2]}; }
  FASTAMP_HD static int num_states(const Hyper&) { return 1; }
  // whether state j is stored by the q8 code of a root (w = sqrt(v)): none here
  FASTAMP_HD static constexpr bool root_coded(int) { return false; }

  // reference.lion_sign: +-1, or c itself for +-0 and NaN (two comparisons, in this order).
  FASTAMP_HD static float sign(float c) { return c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : c); }

  // p: fp32 master (or param); s[0]: fp32 exp_avg. Same operations and order as reference.lion_.
  FASTAMP_HD static void element(float* p, float* s, float g, const Scalars& sc, const Hyper& h) {
    g = g * sc.grad_mul;
    if (h.maximize) g = -g;
    float pv = *p * sc.decay;
    const float c = s[0] * h.beta1 + g * h.one_minus_beta1;
    pv = pv - sc.lr * sign(c);
    s[0] = s[0] * h.beta2 + g * h.one_minus_beta2;
    *p = pv;
  }
};

}  // namespace rules
}  // namespace fastamp

#endif  // FASTAMP_RULES_LION_H_

#ifdef FASTAMP_RULE_VECTOR_STEPS
template <bool NEG_BY_MUL>
struct RuleVec<rules::Lion, NEG_BY_MUL> {
  GradScale<NEG_BY_MUL> scale;
  vf lr, decay, beta1, one_minus_beta1, beta2, one_minus_beta2;
  RuleVec(const rules::Lion::Scalars& sc, const rules::Lion::Hyper& h)
      : scale(sc.grad_mul, h.maximize),
        lr(vset1(sc.lr)),
        decay(vset1(sc.decay)),
        beta1(vset1(h.beta1)),
        one_minus_beta1(vset1(h.one_minus_beta1)),
        beta2(vset1(h.beta2)),
        one_minus_beta2(vset1(h.one_minus_beta2)) {}
  int root_state() const { return -1; }
  // Lion::sign: +-1, or c itself for +-0 and NaN (where both ordered comparisons are false).
  static FASTAMP_OPTIM_INLINE vf sign(vf c) {
    const vf zero = vset1(0.0f);
    const vf neg = vselect(vcmp_lt(c, zero), c, vset1(-1.0f));
    return vselect(vcmp_gt(c, zero), neg, vset1(1.0f));
  }
  FASTAMP_OPTIM_INLINE vf step(vf p, vf grad, vf* s, vf*) const {
    const vf g = scale(grad);
    const vf m = s[0];
    const vf c = vadd(vmul(m, beta1), vmul(g, one_minus_beta1));
    const vf np = vsub(vmul(p, decay), vmul(lr, sign(c)));
    s[0] = vadd(vmul(m, beta2), vmul(g, one_minus_beta2));
    return np;
  }
};
#endif  // FASTAMP_RULE_VECTOR_STEPS
