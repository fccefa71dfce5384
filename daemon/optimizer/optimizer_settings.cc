// SPDX-License-Identifier: Apache-2.0
#include "optimizer/optimizer_settings.h"

#include <cmath>

#include "absl/strings/str_format.h"

namespace trainstream::daemon {

absl::Status ValidateGroups(const std::vector<GroupHyperParameters>& groups) {
  if (groups.empty()) return absl::InvalidArgumentError("an optimizer needs at least one group");
  for (size_t i = 0; i < groups.size(); ++i) {
    const GroupHyperParameters& g = groups[i];
    auto bad = [&](const char* what, double value, const char* range) {
      return absl::InvalidArgumentError(
          absl::StrFormat("group %d: %s %g is not %s", i, what, value, range));
    };
    if (!std::isfinite(g.lr) || g.lr < 0) return bad("lr", g.lr, "a finite value >= 0");
    if (!(g.beta1 >= 0 && g.beta1 < 1)) return bad("beta1", g.beta1, "in [0, 1)");
    if (!(g.beta2 >= 0 && g.beta2 < 1)) return bad("beta2", g.beta2, "in [0, 1)");
    if (!(g.eps >= 0) || !std::isfinite(g.eps)) return bad("eps", g.eps, "a finite value >= 0");
    if (!(g.weight_decay >= 0) || !std::isfinite(g.weight_decay)) {
      return bad("weight_decay", g.weight_decay, "a finite value >= 0");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateSettings(const OptimizerSettings& s) {
  if (s.moment_type == kernels::ScalarType::kFloat16) {
    return absl::InvalidArgumentError("moment_dtype must be float32 or bfloat16");
  }
  if (!(s.max_grad_norm >= 0) || !std::isfinite(s.max_grad_norm)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("max_grad_norm %g is not a finite value >= 0", s.max_grad_norm));
  }
  if (s.accumulation_steps == 0 || s.accumulation_steps > 65536) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "accumulation_steps %d is not between 1 and 65536", s.accumulation_steps));
  }
  if (s.machines == 0 || s.machines > 65536) {
    return absl::InvalidArgumentError(
        absl::StrFormat("machines %d is not between 1 and 65536", s.machines));
  }
  return ValidateGroups(s.groups);
}

}  // namespace trainstream::daemon
