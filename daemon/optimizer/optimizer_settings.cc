// SPDX-License-Identifier: Apache-2.0
#include "optimizer/optimizer_settings.h"

#include <cmath>

#include "absl/strings/str_format.h"

namespace trainstream::daemon {

ParameterBufferBytes BufferBytesFor(const OptimizerSettings& settings,
                                    const ParameterDescription& param) {
  const uint64_t n = param.numel;
  ParameterBufferBytes bytes;
  bytes.master = n * 4;
  bytes.moment = n * kernels::ElementSize(settings.moment_type);
  if (param.param_type != kernels::ScalarType::kFloat32) {
    bytes.param = n * kernels::ElementSize(param.param_type);
  }
  if (settings.reduces_into_buffer()) bytes.accum = n * 4;
  bytes.grad = n * kernels::ElementSize(param.grad_type);
  return bytes;
}

std::vector<uint64_t> JobBufferBytes(const OptimizerSettings& settings,
                                     const std::vector<ParameterDescription>& params,
                                     uint32_t ranks) {
  std::vector<uint64_t> out;
  for (const ParameterDescription& p : params) {
    const ParameterBufferBytes b = BufferBytesFor(settings, p);
    out.insert(out.end(), {b.master, b.moment, b.moment});
    if (b.param > 0) out.push_back(b.param);
    if (b.accum > 0) out.push_back(b.accum);
  }
  for (uint32_t rank = 0; rank < ranks; ++rank) {
    for (const ParameterDescription& p : params) out.push_back(BufferBytesFor(settings, p).grad);
  }
  return out;
}

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
  // Chunk boundaries stay on 256 elements, so the vector kernels' loads keep their alignment.
  if (s.chunk_elements != 0 &&
      (s.chunk_elements < 4096 || s.chunk_elements > (uint64_t{1} << 30) ||
       s.chunk_elements % 256 != 0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "chunk_elements %d is not a multiple of 256 between 4096 and 2^30", s.chunk_elements));
  }
  if (s.defer_updates && s.eager_updates) {
    return absl::InvalidArgumentError(
        "eager updates and deferred updates were both asked for; choose one (eager=True or "
        "eager=False)");
  }
  return ValidateGroups(s.groups);
}

}  // namespace trainstream::daemon
