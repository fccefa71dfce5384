// SPDX-License-Identifier: Apache-2.0
// The plain path: one element at a time, in the order torch.optim.AdamW (single-tensor) applies
// its operations, with a fused multiply-add wherever an addition follows a multiplication. It is
// also the reference the vector paths are tested against.
#include <cmath>

#include "adamw.h"
#include "numeric.h"

namespace trainstream::kernels {

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    if (mantissa == 0) return BitsToFloat(sign);
    // Subnormal: normalise.
    float value = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -value : value;
  }
  if (exponent == 31) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsToFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t FloatToHalf(float f) {
  // Round to nearest even, as F16C's _mm_cvtps_ph(_MM_FROUND_TO_NEAREST_INT).
  const uint32_t bits = FloatToBits(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs >= 0x7f800000u) return sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u);
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and up round to infinity
  if (abs >= 0x38800000u) {                        // a normal half
    const uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
    return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
  }
  const uint32_t exponent = abs >> 23;
  if (exponent < 102) return sign;  // below 2^-25: rounds to zero
  // A subnormal half counts units of 2^-24; the float is mantissa * 2^(exponent - 150).
  const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126 - exponent;  // 14..24
  uint32_t half = mantissa >> shift;
  const uint32_t remainder = mantissa & ((1u << shift) - 1);
  const uint32_t halfway = 1u << (shift - 1);
  if (remainder > halfway || (remainder == halfway && (half & 1u))) ++half;
  return sign | static_cast<uint16_t>(half);
}

namespace {

inline float Load(const void* base, ScalarType type, size_t i) {
  switch (type) {
    case ScalarType::kFloat32: return static_cast<const float*>(base)[i];
    case ScalarType::kBFloat16: return BFloat16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case ScalarType::kFloat16: return HalfToFloat(static_cast<const uint16_t*>(base)[i]);
  }
  return 0;
}

inline void StoreNearest(void* base, ScalarType type, size_t i, float value) {
  switch (type) {
    case ScalarType::kFloat32: static_cast<float*>(base)[i] = value; break;
    case ScalarType::kBFloat16: static_cast<uint16_t*>(base)[i] = FloatToBFloat16(value); break;
    case ScalarType::kFloat16: static_cast<uint16_t*>(base)[i] = FloatToHalf(value); break;
  }
}

inline void StoreMoment(void* base, ScalarType type, size_t i, float value, uint32_t random) {
  if (type == ScalarType::kFloat32) {
    static_cast<float*>(base)[i] = value;
  } else {
    static_cast<uint16_t*>(base)[i] = FloatToBFloat16Stochastic(value, random);
  }
}

}  // namespace

void AccumulateGradients(float* accum, bool overwrite, const void* const* grads, int num_grads,
                         ScalarType grad_type, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    float g = overwrite ? 0.0f : accum[i];
    for (int r = 0; r < num_grads; ++r) g += Load(grads[r], grad_type, i);
    accum[i] = g;
  }
}

void ConvertFromFloat(const float* src, void* dst, ScalarType type, size_t numel) {
  for (size_t i = 0; i < numel; ++i) StoreNearest(dst, type, i, src[i]);
}

namespace internal {

uint64_t AdamWScalar(const AdamWTensor& t, size_t begin, size_t end, const AdamWStep& s) {
  uint64_t nonfinite = 0;
  const AdamWConstants c = Constants(s);
  const float decay = c.decay, l2 = c.l2, step_size = c.step_size;
  const float one_minus_beta1 = c.one_minus_beta1, one_minus_beta2 = c.one_minus_beta2;
  const float inv_bc2 = c.inv_bc2, beta2 = c.beta2, eps = c.eps;
  const uint32_t seed = c.seed;
  const bool stochastic = t.moment_type == ScalarType::kBFloat16;
  for (size_t i = begin; i < end; ++i) {
    float g = 0;
    for (int r = 0; r < t.num_grads; ++r) g += Load(t.grads[r], t.grad_type, i);
    nonfinite += !std::isfinite(g);
    g *= c.grad_scale;
    float p = t.master[i];
    if (l2 != 0.0f) g = std::fma(l2, p, g);
    p *= decay;
    float m = Load(t.exp_avg, t.moment_type, i);
    float v = Load(t.exp_avg_sq, t.moment_type, i);
    // Fused multiply-adds where the vector paths use them (std::fma rounds once, as they do).
    m = std::fma(one_minus_beta1, g - m, m);
    v = std::fma(one_minus_beta2, g * g, v * beta2);
    const float denom = std::fma(std::sqrt(v), inv_bc2, eps);
    p = std::fma(step_size, m / denom, p);
    t.master[i] = p;
    // One 32-bit draw per element: the low half rounds the first moment, the high the second.
    const uint32_t random = stochastic ? MixBits(seed, static_cast<uint32_t>(i)) : 0;
    StoreMoment(t.exp_avg, t.moment_type, i, m, random & 0xffffu);
    StoreMoment(t.exp_avg_sq, t.moment_type, i, v, random >> 16);
    if (t.param_out != nullptr) StoreNearest(t.param_out, t.param_type, i, p);
  }
  return nonfinite;
}

GradientStats StatsScalar(const void* const* grads, int n, ScalarType type, size_t b, size_t e) {
  GradientStats stats;
  for (size_t i = b; i < e; ++i) {
    float g = 0;
    for (int r = 0; r < n; ++r) g += Load(grads[r], type, i);
    if (!std::isfinite(g)) {
      ++stats.nonfinite;
      continue;
    }
    stats.sum_squares += static_cast<double>(g) * g;
  }
  return stats;
}

}  // namespace internal
}  // namespace trainstream::kernels
