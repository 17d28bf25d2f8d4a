// The update rules of fastamp::optim_, the one optimizer op, as every backend's host side sees them:
// their ids, names, hyperparameter and step-scalar counts, flags, state keys and the names their
// messages give the lists. Their Python twin, which defines what each rule computes, is RULES in
// fastamp/reference/optim.py; their maths is math::<rule>_element (csrc/fastamp_math.h).
//
// The one table both the CPU kernel's host side (cpu/optim.cpp, cpu/optim.h) and the CUDA binding
// and launchers (cuda/bindings.cpp, cuda/launch_plan.h, cuda/launchers.h, cuda/optim.cu) read, so a
// new rule is a row here, not a row and a case in each of them (docs/extending.md). No torch header
// and nothing but constants: the CUDA kernels and the host-compiled launch-plan tests include it.
#pragma once

#include <cstdint>
#include <string_view>

#include "optim_flags.h"

// X(Name, name, max_states): the rules, in id order. `Name` makes the ids (RuleId::kAdamW) and the
// rule structs of each backend (cpu/optim_scalar.h's AdamWRule, cuda/optim_rules.cuh's AdamWRule);
// `name` is the string optim_ takes and the suffix of each backend's per-rule unit (pick_adamw in
// cpu/optim_adamw.cpp, detail::optim_adamw in cuda/optim_adamw.cu); `max_states` the most state
// tensors per param it keeps (a table's depth on CUDA).
#define FASTAMP_OPTIM_RULES(X) \
  X(AdamW, adamw, 3)           \
  X(Sgd, sgd, 1)               \
  X(Lion, lion, 1)

#if defined(__CUDACC__)
#define FASTAMP_RULES_HD __host__ __device__
#else
#define FASTAMP_RULES_HD
#endif

namespace fastamp {

#define FASTAMP_RULE_ID_(Name, name, max_states) k##Name,
enum class RuleId : int32_t { FASTAMP_OPTIM_RULES(FASTAMP_RULE_ID_) };
#undef FASTAMP_RULE_ID_

// The most states a rule keeps per param.
FASTAMP_RULES_HD constexpr int rule_max_states(RuleId rule) {
#define FASTAMP_RULE_MAX_STATES_(Name, name, max_states) \
  if (rule == RuleId::k##Name) return max_states;
  FASTAMP_OPTIM_RULES(FASTAMP_RULE_MAX_STATES_)
#undef FASTAMP_RULE_MAX_STATES_
  return 0;
}

// "adamw, sgd, lion": the rules' names for messages (past the first two characters).
#define FASTAMP_RULE_NAME_(Name, name, max_states) ", " #name
constexpr const char kRuleNameList[] = "" FASTAMP_OPTIM_RULES(FASTAMP_RULE_NAME_);
#undef FASTAMP_RULE_NAME_
constexpr const char* rule_name_list() { return kRuleNameList + 2; }

struct RuleDef {
  RuleId id;
  const char* name;
  int hyper;                // values in optim_'s `hyper`
  const char* hyper_names;  // their names, for messages
  int scalars;              // k: the floats of a step-scalar row
  const char* layout;       // their names
  int64_t flags;            // its own flags, besides MAXIMIZE, SR_PARAM and SR_STATE
  const char* flag_names;   // every flag it takes, for messages
  // The states it keeps: `states`, one more under `extra_state_flag` (AdamW's AMSGRAD), none when
  // `hyper[0]` is 0 and `none_without_hyper0` (SGD without momentum).
  int states;
  int64_t extra_state_flag;
  bool none_without_hyper0;
  const char* keys[3];  // the states' keys, in the order of optim_'s states list (the lists: key + "s")
  // The names the messages give int16 masters (the remainders of bf16 params: AdamW's per-rule op
  // called them so, the others "masters") and the states as a whole.
  const char* int16_masters;
  const char* states_name;
};

constexpr RuleDef kRuleDefs[] = {
    {RuleId::kAdamW,
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
     "moments"},
    {RuleId::kSgd,
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
     "momentum_buffers"},
    {RuleId::kLion,
     "lion",
     2,
     "[beta1, beta2]",
     3,
     "[lr, decay, grad_mul]",
     0,
     "MAXIMIZE, SR_PARAM, SR_STATE",
     1,
     0,
     false,
     {"exp_avg", nullptr, nullptr},
     "masters",
     "exp_avgs"},
};

constexpr int kNumRules = static_cast<int>(sizeof(kRuleDefs) / sizeof(kRuleDefs[0]));

// The row of a rule (the table is in id order).
constexpr const RuleDef& rule_def(RuleId rule) { return kRuleDefs[static_cast<int>(rule)]; }

// The row named `name` (a pointer and a length: std::string_view, c10::string_view), or nullptr.
inline const RuleDef* find_rule_def(const char* name, size_t length) {
  for (const RuleDef& r : kRuleDefs) {
    if (std::string_view(r.name) == std::string_view(name, length)) return &r;
  }
  return nullptr;
}

// The states a call keeps with these flags, and `hyper0_nonzero` (hyper[0] != 0; a table says it by
// having states).
constexpr int states_kept(const RuleDef& r, int64_t flags, bool hyper0_nonzero) {
  return r.none_without_hyper0 && !hyper0_nonzero ? 0 : r.states + ((flags & r.extra_state_flag) != 0 ? 1 : 0);
}

#define FASTAMP_RULE_CHECK_(Name, name, max_states)                                                               \
  static_assert(rule_def(RuleId::k##Name).id == RuleId::k##Name, "kRuleDefs: rows in id order");                  \
  static_assert(                                                                                                  \
      rule_def(RuleId::k##Name).states + (rule_def(RuleId::k##Name).extra_state_flag != 0 ? 1 : 0) == max_states, \
      "kRuleDefs: states disagree with max_states");
FASTAMP_OPTIM_RULES(FASTAMP_RULE_CHECK_)
#undef FASTAMP_RULE_CHECK_
#define FASTAMP_RULE_COUNT_(Name, name, max_states) +1
static_assert(kNumRules == 0 FASTAMP_OPTIM_RULES(FASTAMP_RULE_COUNT_), "kRuleDefs: one row per rule");
#undef FASTAMP_RULE_COUNT_

}  // namespace fastamp
