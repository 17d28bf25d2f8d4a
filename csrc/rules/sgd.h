// SGD with momentum (fastamp.optim.SGD; its definition: reference/optim.py's RULES["sgd"]): one rule
// of fastamp::optim_, whole, for both C++ backends. The parts are those of rules/lion.h (its head
// comment); csrc/optim_rules.h lists it.
#ifndef FASTAMP_RULES_SGD_H_
#define FASTAMP_RULES_SGD_H_

namespace fastamp {
namespace rules {

struct Sgd {
  static constexpr RuleId kId = RuleId::kSgd;
  static constexpr RuleDef kDef = {
      kId,
      "sgd",
      3,
      "[momentum, dampening, weight_decay]",
      3,
      "[lr, grad_mul, is_first]",
      optim_flags::kNesterov,
      "MAXIMIZE, NESTEROV, SR_PARAM, SR_STATE",
      1,
      0,
      true,
      {"momentum_buffer", nullptr, nullptr},
      "masters",
      "momentum_buffers",
  };
  static constexpr int kMinStates = 0, kMaxStates = 1;  // momentum_buffer, kept only with a momentum
  // without momentum it keeps no state and runs the fp32 instance
  static constexpr unsigned kCudaStates = kStatesFp32 | kStatesQ8;

  struct Hyper {
    float momentum, one_minus_dampening, weight_decay;
    bool has_momentum, has_weight_decay, nesterov, maximize;
  };
  struct Scalars {
    float lr;        // learning rate (fp32)
    float grad_mul;  // 1/scale * clip_coef, or 1
    float first;     // 1.0 on the first applied step (momentum buffer := grad), else 0.0
  };

  static inline Hyper make_hyper(const double* hyper, int64_t flags) {
    Hyper h;
    h.momentum = static_cast<float>(hyper[0]);
    h.one_minus_dampening = static_cast<float>(1.0 - hyper[1]);
    h.weight_decay = static_cast<float>(hyper[2]);
    // decided on the doubles, as the reference's `momentum != 0` and `weight_decay != 0`
    h.has_momentum = hyper[0] != 0.0;
    h.has_weight_decay = hyper[2] != 0.0;
    h.nesterov = (flags & optim_flags::kNesterov) != 0;
    h.maximize = (flags & optim_flags::kMaximize) != 0;
    return h;
  }
  FASTAMP_HD static Scalars scalars(const float* row) { return Scalars{row[0], row[1], row[2]}; }
  FASTAMP_HD static int num_states(const Hyper& h) { return h.has_momentum ? 1 : 0; }
  FASTAMP_HD static constexpr bool root_coded(int) { return false; }

  // p: fp32 master (or param); s[0]: fp32 momentum buffer (untouched without momentum).
  FASTAMP_HD static void element(float* p, float* s, float g, const Scalars& sc, const Hyper& h) {
    g = g * sc.grad_mul;
    if (h.maximize) g = -g;
    if (h.has_weight_decay) g = g + h.weight_decay * *p;
    if (h.has_momentum) {
      const float nb = (sc.first != 0.0f) ? g : (s[0] * h.momentum + h.one_minus_dampening * g);
      s[0] = nb;
      g = h.nesterov ? (g + h.momentum * nb) : nb;
    }
    *p = *p - sc.lr * g;
  }
};

}  // namespace rules
}  // namespace fastamp

#endif  // FASTAMP_RULES_SGD_H_

#ifdef FASTAMP_RULE_VECTOR_STEPS
template <bool NEG_BY_MUL>
struct RuleVec<rules::Sgd, NEG_BY_MUL> {
  GradScale<NEG_BY_MUL> scale;
  vf lr, momentum, one_minus_dampening, wd;
  bool first, has_momentum, has_wd, nesterov;
  RuleVec(const rules::Sgd::Scalars& sc, const rules::Sgd::Hyper& h)
      : scale(sc.grad_mul, h.maximize),
        lr(vset1(sc.lr)),
        momentum(vset1(h.momentum)),
        one_minus_dampening(vset1(h.one_minus_dampening)),
        wd(vset1(h.weight_decay)),
        first(sc.first != 0.0f),
        has_momentum(h.has_momentum),
        has_wd(h.has_weight_decay),
        nesterov(h.nesterov) {}
  int root_state() const { return -1; }
  FASTAMP_OPTIM_INLINE vf step(vf p, vf grad, vf* s, vf*) const {
    vf g = scale(grad);
    if (has_wd) g = vadd(g, vmul(wd, p));
    if (has_momentum) {
      const vf nb = first ? g : vadd(vmul(s[0], momentum), vmul(one_minus_dampening, g));
      s[0] = nb;
      g = nesterov ? vadd(g, vmul(momentum, nb)) : nb;
    }
    return vsub(p, vmul(lr, g));
  }
};
#endif  // FASTAMP_RULE_VECTOR_STEPS
