// The update rules of fastamp::optim_, the one optimizer op: their list, and what every backend's
// host side reads about them (ids, names, hyperparameter and step-scalar counts, flags, state keys,
// the names messages give the lists). Their Python twin, which defines what each rule computes, is
// RULES in fastamp/reference/optim.py.
//
// A rule's C++ is one header, csrc/rules/<name>.h: its row of the table (kDef), its constants and
// step scalars, its element maths (the CPU scalar path and the CUDA kernel) and its vector step (the
// CPU's per-ISA loops). Adding a rule is a line in FASTAMP_OPTIM_RULES and an #include below
// (docs/extending.md); the CPU kernel (cpu/optim.cpp, cpu/optim_kernels_*.cpp) and the CUDA binding,
// launchers and kernels (cuda/) read them from here. No torch header and nothing but constants and
// inline maths: the CUDA kernels and the host-compiled launch-plan tests include it.
//
// The rule headers are included outside this file's include guard on purpose: the CPU's per-ISA
// kernel file (cpu/optim_kernels.inc) includes this file again with FASTAMP_RULE_VECTOR_STEPS
// defined, inside each instruction set's namespace, for the rules' RuleVec parts.
#ifndef FASTAMP_OPTIM_RULES_H_
#define FASTAMP_OPTIM_RULES_H_

#include <cstdint>
#include <string_view>

#include "fastamp_math.h"
#include "optim_flags.h"

// X(Name, name): the rules, in id order. `Name` makes the ids (RuleId::kAdamW) and names the rule's
// struct (rules::AdamW, in csrc/rules/adamw.h); `name` is the string optim_ takes.
#define FASTAMP_OPTIM_RULES(X) \
  X(AdamW, adamw)              \
  X(Sgd, sgd)                  \
  X(Lion, lion)

#if defined(__CUDACC__)
#define FASTAMP_RULES_HD __host__ __device__
#else
#define FASTAMP_RULES_HD
#endif

namespace fastamp {

#define FASTAMP_RULE_ID_(Name, name) k##Name,
enum class RuleId : int32_t { FASTAMP_OPTIM_RULES(FASTAMP_RULE_ID_) };
#undef FASTAMP_RULE_ID_

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

// The state formats a rule's CUDA kernel is compiled for (its kCudaStates): every rule takes fp32
// (and a rule without states runs as fp32); each other format's instances cost ~15 s of nvcc per
// rule (sm_80 + sm_90), so only the formats its optimizer uses.
constexpr unsigned kStatesFp32 = 1u, kStatesBf16 = 2u, kStatesQ8 = 4u;

}  // namespace fastamp

#endif  // FASTAMP_OPTIM_RULES_H_

// ---- the rules ----
#include "rules/adamw.h"
#include "rules/sgd.h"
#include "rules/lion.h"

#ifndef FASTAMP_OPTIM_RULES_TABLE_H_
#define FASTAMP_OPTIM_RULES_TABLE_H_

namespace fastamp {

// The rules' rows, in id order.
#define FASTAMP_RULE_ROW_(Name, name) rules::Name::kDef,
constexpr RuleDef kRuleDefs[] = {FASTAMP_OPTIM_RULES(FASTAMP_RULE_ROW_)};
#undef FASTAMP_RULE_ROW_

constexpr int kNumRules = static_cast<int>(sizeof(kRuleDefs) / sizeof(kRuleDefs[0]));

// The most states a rule keeps per param.
FASTAMP_RULES_HD constexpr int rule_max_states(RuleId rule) {
#define FASTAMP_RULE_MAX_STATES_(Name, name) \
  if (rule == RuleId::k##Name) return rules::Name::kMaxStates;
  FASTAMP_OPTIM_RULES(FASTAMP_RULE_MAX_STATES_)
#undef FASTAMP_RULE_MAX_STATES_
  return 0;
}

// "adamw, sgd, lion": the rules' names for messages (past the first two characters).
#define FASTAMP_RULE_NAME_(Name, name) ", " #name
constexpr const char kRuleNameList[] = "" FASTAMP_OPTIM_RULES(FASTAMP_RULE_NAME_);
#undef FASTAMP_RULE_NAME_
constexpr const char* rule_name_list() { return kRuleNameList + 2; }

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

#define FASTAMP_RULE_CHECK_(Name, name)                                                                         \
  static_assert(rule_def(RuleId::k##Name).id == RuleId::k##Name, "kRuleDefs: rows in id order");                \
  static_assert(rule_def(RuleId::k##Name).states + (rule_def(RuleId::k##Name).extra_state_flag != 0 ? 1 : 0) == \
                    rules::Name::kMaxStates,                                                                    \
                "kRuleDefs: states disagree with kMaxStates");                                                  \
  static_assert(rules::Name::kMinStates ==                                                                      \
                    (rule_def(RuleId::k##Name).none_without_hyper0 ? 0 : rule_def(RuleId::k##Name).states),     \
                "kRuleDefs: states disagree with kMinStates");                                                  \
  static_assert((rules::Name::kCudaStates & kStatesFp32) != 0, "every rule's CUDA kernel takes fp32 states");
FASTAMP_OPTIM_RULES(FASTAMP_RULE_CHECK_)
#undef FASTAMP_RULE_CHECK_
#define FASTAMP_RULE_COUNT_(Name, name) +1
static_assert(kNumRules == 0 FASTAMP_OPTIM_RULES(FASTAMP_RULE_COUNT_), "kRuleDefs: one row per rule");
#undef FASTAMP_RULE_COUNT_

}  // namespace fastamp

#endif  // FASTAMP_OPTIM_RULES_TABLE_H_
