// SPDX-License-Identifier: Apache-2.0
#include <cpuid.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_format.h"
#include "adamw.h"

namespace trainstream::kernels {

size_t ElementSize(ScalarType type) { return type == ScalarType::kFloat32 ? 4 : 2; }

const char* ScalarTypeName(ScalarType type) {
  switch (type) {
    case ScalarType::kFloat32: return "float32";
    case ScalarType::kBFloat16: return "bfloat16";
    case ScalarType::kFloat16: return "float16";
  }
  return "unknown";
}

namespace {

// CPUID leaf 1, ECX bit 29 (clang's __builtin_cpu_supports has no "f16c").
bool HasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
}

}  // namespace

bool IsaSupported(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             HasF16c() && __builtin_cpu_supports("popcnt");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("popcnt");
  }
  return false;
}

Isa BestIsa() {
  static const Isa best = IsaSupported(Isa::kAvx512) ? Isa::kAvx512
                          : IsaSupported(Isa::kAvx2) ? Isa::kAvx2
                                                     : Isa::kScalar;
  return best;
}

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "unknown";
}

void SetStepNumber(AdamWStep* step, uint64_t t) {
  // torch computes these in Python floats (double) and passes them on as such.
  const double t_d = static_cast<double>(t);
  step->bias_correction1 = 1.0 - std::pow(step->beta1, t_d);
  step->bias_correction2_sqrt = std::sqrt(1.0 - std::pow(step->beta2, t_d));
}

namespace {

uint64_t Mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

}  // namespace

uint64_t RoundingSeed(uint64_t index, uint64_t t) {
  return Mix64(Mix64(index + 0x9e3779b97f4a7c15ull) ^ t);
}

AdamWConstants Constants(const AdamWStep& s) {
  AdamWConstants c;
  c.decay = s.decoupled_weight_decay ? static_cast<float>(1.0 - s.lr * s.weight_decay) : 1.0f;
  c.l2 = s.decoupled_weight_decay ? 0.0f : static_cast<float>(s.weight_decay);
  c.step_size = static_cast<float>(-(s.lr / s.bias_correction1));
  c.one_minus_beta1 = static_cast<float>(1.0 - s.beta1);
  c.beta2 = static_cast<float>(s.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - s.beta2);
  // A multiplication by the reciprocal instead of torch's division: it differs from the
  // quotient by at most one rounding and spares a division per element.
  c.inv_bc2 = static_cast<float>(1.0 / s.bias_correction2_sqrt);
  c.eps = static_cast<float>(s.eps);
  c.grad_scale = s.grad_scale;
  // splitmix64's finaliser: consecutive seeds (step numbers) give unrelated 32-bit seeds.
  uint64_t z = s.rounding_seed + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  c.seed = static_cast<uint32_t>(z ^ (z >> 31));
  return c;
}

absl::Status AdamWUpdate(const AdamWTensor& t, size_t begin, size_t end, const AdamWStep& step,
                         Isa isa, uint64_t* nonfinite) {
  if (begin > end || end > t.numel) {
    return absl::InvalidArgumentError(
        absl::StrFormat("range [%d, %d) is outside a tensor of %d elements", begin, end, t.numel));
  }
  if (t.master == nullptr || t.exp_avg == nullptr || t.exp_avg_sq == nullptr ||
      t.grads == nullptr || t.num_grads < 1) {
    return absl::InvalidArgumentError("AdamW needs master weights, both moments and a gradient");
  }
  if (t.moment_type == ScalarType::kFloat16) {
    return absl::InvalidArgumentError("moments are float32 or bfloat16, not float16");
  }
  if (!IsaSupported(isa)) {
    return absl::FailedPreconditionError(
        absl::StrFormat("this CPU lacks the %s instructions", IsaName(isa)));
  }
  // The stochastic-rounding hash takes a 32-bit index: split where the upper bits change and
  // fold them into the seed.
  uint64_t bad = 0;
  while (begin < end) {
    const size_t block_end = std::min(end, ((begin >> 32) + 1) << 32);
    AdamWStep s = step;
    s.rounding_seed ^= (static_cast<uint64_t>(begin >> 32) * 0x9e3779b97f4a7c15ull);
    switch (isa) {
      case Isa::kScalar: bad += internal::AdamWScalar(t, begin, block_end, s); break;
      case Isa::kAvx2: bad += internal::AdamWAvx2(t, begin, block_end, s); break;
      case Isa::kAvx512: bad += internal::AdamWAvx512(t, begin, block_end, s); break;
    }
    begin = block_end;
  }
  if (nonfinite != nullptr) *nonfinite += bad;
  return absl::OkStatus();
}

GradientStats ComputeGradientStats(const void* const* grads, int num_grads, ScalarType type,
                                   size_t begin, size_t end, Isa isa) {
  if (!IsaSupported(isa)) isa = Isa::kScalar;
  switch (isa) {
    case Isa::kAvx2: return internal::StatsAvx2(grads, num_grads, type, begin, end);
    case Isa::kAvx512: return internal::StatsAvx512(grads, num_grads, type, begin, end);
    default: return internal::StatsScalar(grads, num_grads, type, begin, end);
  }
}

}  // namespace trainstream::kernels
