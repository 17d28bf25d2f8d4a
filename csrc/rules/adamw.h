// AdamW (fastamp.optim.AdamW; its definition: reference/optim.py's RULES["adamw"]): one rule of
// fastamp::optim_, whole, for both C++ backends. The parts are those of rules/lion.h (its head
// comment); csrc/optim_rules.h lists it. The step scalars depend on the step, lr and scale: the
// optimizer computes them on the device (no host sync) and passes them as fp32 `step_scalars`.
#ifndef FASTAMP_RULES_ADAMW_H_
#define FASTAMP_RULES_ADAMW_H_

namespace fastamp {
namespace rules {

struct AdamW {
  static constexpr RuleId kId = RuleId::kAdamW;
  static constexpr RuleDef kDef = {
      kId,
      "adamw",
      3,
      "[beta1, beta2, eps]",
      4,
      "[step_size, bc2_sqrt, decay, grad_mul]",
      optim_flags::kAmsgrad,
      "MAXIMIZE, AMSGRAD, SR_PARAM, SR_STATE",
      2,
      optim_flags::kAmsgrad,
      false,
      {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
      "remainders",
      "moments",
  };
  static constexpr int kMinStates = 2, kMaxStates = 3;  // exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad)
  static constexpr unsigned kCudaStates = kStatesFp32 | kStatesBf16 | kStatesQ8;

  struct Hyper {
    float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
    bool amsgrad, maximize;
  };
  struct Scalars {
    float step_size;  // lr / (1 - beta1^step)          (computed in fp64, rounded once)
    float bc2_sqrt;   // sqrt(1 - beta2^step)            (fp64, rounded once)
    float decay;      // 1 - lr * weight_decay           (fp64, rounded once)
    float grad_mul;   // 1/scale * clip_coef, or 1       (fp32)
  };

  static inline Hyper make_hyper(const double* hyper, int64_t flags) {
    Hyper h;
    h.beta1 = static_cast<float>(hyper[0]);
    h.one_minus_beta1 = static_cast<float>(1.0 - hyper[0]);
    h.beta2 = static_cast<float>(hyper[1]);
    h.one_minus_beta2 = static_cast<float>(1.0 - hyper[1]);
    h.eps = static_cast<float>(hyper[2]);
    h.amsgrad = (flags & optim_flags::kAmsgrad) != 0;
    h.maximize = (flags & optim_flags::kMaximize) != 0;
    return h;
  }
  FASTAMP_HD static Scalars scalars(const float* row) { return Scalars{row[0], row[1], row[2], row[3]}; }
  FASTAMP_HD static int num_states(const Hyper& h) { return h.amsgrad ? 3 : 2; }
  // exp_avg_sq and max_exp_avg_sq are stored by the q8 code of their root (w = sqrt(v))
  FASTAMP_HD static constexpr bool root_coded(int j) { return j > 0; }

  // p: the fp32 master (or the fp32 param); s: exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad); g: the
  // raw grad in fp32. torch's fused CPU AdamW formulas (lerp for m; decoupled decay as a multiply).
  FASTAMP_HD static void element(float* p, float* s, float g, const Scalars& sc, const Hyper& h) {
    g = g * sc.grad_mul;
    if (h.maximize) g = -g;
    float pv = *p * sc.decay;
    const float diff = g - s[0];
    // torch.lerp(m, g, w): w < 0.5 ? m + w*(g-m) : g - (g-m)*(1-w), with w = 1 - beta1
    const float mv = (h.one_minus_beta1 < 0.5f) ? (s[0] + h.one_minus_beta1 * diff) : (g - diff * h.beta1);
    const float vv = s[1] * h.beta2 + (h.one_minus_beta2 * g) * g;
    float dv = vv;
    if (h.amsgrad) {
      const float a = s[2];
      s[2] = (a != a || vv != vv) ? (a + vv) : (a > vv ? a : vv);  // torch.maximum propagates NaN
      dv = s[2];
    }
    const float denom = sqrtf(dv) / sc.bc2_sqrt + h.eps;
    pv = pv - (sc.step_size * mv) / denom;
    *p = pv;
    s[0] = mv;
    s[1] = vv;
  }
};

}  // namespace rules
}  // namespace fastamp

#endif  // FASTAMP_RULES_ADAMW_H_

#ifdef FASTAMP_RULE_VECTOR_STEPS
template <bool NEG_BY_MUL>
struct RuleVec<rules::AdamW, NEG_BY_MUL> {
  GradScale<NEG_BY_MUL> scale;
  vf step_size, bc2_sqrt, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  bool lerp_from_m, amsgrad;
  RuleVec(const rules::AdamW::Scalars& sc, const rules::AdamW::Hyper& h)
      : scale(sc.grad_mul, h.maximize),
        step_size(vset1(sc.step_size)),
        bc2_sqrt(vset1(sc.bc2_sqrt)),
        decay(vset1(sc.decay)),
        beta1(vset1(h.beta1)),
        one_minus_beta1(vset1(h.one_minus_beta1)),
        beta2(vset1(h.beta2)),
        one_minus_beta2(vset1(h.one_minus_beta2)),
        eps(vset1(h.eps)),
        lerp_from_m(h.one_minus_beta1 < 0.5f),  // torch.lerp's two formulas, chosen as element() does
        amsgrad(h.amsgrad) {}
  int root_state() const { return amsgrad ? 2 : 1; }
  FASTAMP_OPTIM_INLINE vf step(vf p, vf grad, vf* s, vf* root) const {
    const vf g = scale(grad);
    p = vmul(p, decay);
    const vf diff = vsub(g, s[0]);
    const vf m = lerp_from_m ? vadd(s[0], vmul(one_minus_beta1, diff)) : vsub(g, vmul(diff, beta1));
    const vf v = vadd(vmul(s[1], beta2), vmul(vmul(one_minus_beta2, g), g));
    vf d = v;
    if (amsgrad) {
      d = vmaximum(s[2], v);
      s[2] = d;
    }
    const vf w = vsqrt(d);
    *root = w;
    s[0] = m;
    s[1] = v;
    return vsub(p, vdiv(vmul(step_size, m), vadd(vdiv(w, bc2_sqrt), eps)));
  }
};
#endif  // FASTAMP_RULE_VECTOR_STEPS
