// SPDX-License-Identifier: Apache-2.0
// The vector body shared by the AVX2 and AVX-512 paths: `Lanes` supplies loads, stores and
// arithmetic for its register width. Included only by adamw_avx2.cc and adamw_avx512.cc, each
// compiled for its instruction set with -ffp-contract=off, so every lane rounds exactly as the
// scalar path does (fused multiply-adds only where the scalar path calls std::fma): the paths
// agree bit for bit.
#ifndef TRAINSTREAM_KERNELS_CPU_ADAMW_SIMD_H_
#define TRAINSTREAM_KERNELS_CPU_ADAMW_SIMD_H_

#include "adamw.h"

namespace trainstream::kernels::internal {

template <typename L>
inline typename L::F LoadAs(const void* base, ScalarType type, size_t i) {
  switch (type) {
    case ScalarType::kFloat32: return L::LoadF32(static_cast<const float*>(base) + i);
    case ScalarType::kBFloat16: return L::LoadBF16(static_cast<const uint16_t*>(base) + i);
    case ScalarType::kFloat16: return L::LoadF16(static_cast<const uint16_t*>(base) + i);
  }
  return L::Zero();
}

template <typename L, ScalarType kType>
inline typename L::F LoadTyped(const void* base, size_t i) {
  if constexpr (kType == ScalarType::kFloat32) {
    return L::LoadF32(static_cast<const float*>(base) + i);
  } else if constexpr (kType == ScalarType::kBFloat16) {
    return L::LoadBF16(static_cast<const uint16_t*>(base) + i);
  } else {
    return L::LoadF16(static_cast<const uint16_t*>(base) + i);
  }
}

template <typename L, ScalarType kType>
inline void StoreNearestTyped(void* base, size_t i, typename L::F v) {
  if constexpr (kType == ScalarType::kFloat32) {
    L::StoreF32(static_cast<float*>(base) + i, v);
  } else if constexpr (kType == ScalarType::kBFloat16) {
    L::StoreBF16(static_cast<uint16_t*>(base) + i, v);
  } else {
    L::StoreF16(static_cast<uint16_t*>(base) + i, v);
  }
}

// One vector's update: reads the gradient(s), master and moments, writes the fp32 arrays, and
// returns what still has to be narrowed to 16 bits (the caller stores those two vectors at a
// time, which packs them with one instruction instead of two).
template <typename L, ScalarType kGrad, ScalarType kMoment>
struct VectorUpdate {
  using F = typename L::F;
  struct Result {
    F param, exp_avg, exp_avg_sq;
  };

  explicit VectorUpdate(const AdamWStep& s) : c(Constants(s)) {}

  Result operator()(const AdamWTensor& t, size_t i, uint64_t* nonfinite) const {
    F g = LoadTyped<L, kGrad>(t.grads[0], i);
    for (int r = 1; r < t.num_grads; ++r) g = L::Add(g, LoadTyped<L, kGrad>(t.grads[r], i));
    // Counted in a scalar register: the mask's population count runs on the integer ports,
    // leaving the vector ports to the arithmetic.
    *nonfinite += L::NonFiniteLanes(g);
    g = L::Mul(g, grad_scale);
    F p = L::LoadF32(t.master + i);
    if (c.l2 != 0.0f) g = L::MulAdd(l2, p, g);
    p = L::Mul(p, decay);
    F m = LoadTyped<L, kMoment>(t.exp_avg, i);
    F v = LoadTyped<L, kMoment>(t.exp_avg_sq, i);
    m = L::MulAdd(one_minus_beta1, L::Sub(g, m), m);
    v = L::MulAdd(one_minus_beta2, L::Mul(g, g), L::Mul(v, beta2));
    const F denom = L::MulAdd(L::Sqrt(v), inv_bc2, eps);
    p = L::MulAdd(step_size, L::Div(m, denom), p);
    L::StoreF32(t.master + i, p);
    if constexpr (kMoment == ScalarType::kFloat32) {
      L::StoreF32(static_cast<float*>(t.exp_avg) + i, m);
      L::StoreF32(static_cast<float*>(t.exp_avg_sq) + i, v);
    }
    return {p, m, v};
  }

  const AdamWConstants c;
  const F decay = L::Set(c.decay), l2 = L::Set(c.l2), step_size = L::Set(c.step_size);
  const F one_minus_beta1 = L::Set(c.one_minus_beta1), one_minus_beta2 = L::Set(c.one_minus_beta2);
  const F beta2 = L::Set(c.beta2), inv_bc2 = L::Set(c.inv_bc2), eps = L::Set(c.eps);
  const F grad_scale = L::Set(c.grad_scale);
};

// kParam: the parameter copy's type, or -1 for none. Every type is fixed at compile time, so
// the loop body holds no branches.
template <typename L, ScalarType kGrad, ScalarType kMoment, int kParam>
uint64_t AdamWTyped(const AdamWTensor& t, size_t begin, size_t end, const AdamWStep& s) {
  constexpr size_t W = L::kWidth;
  const VectorUpdate<L, kGrad, kMoment> update(s);
  const uint32_t seed = update.c.seed;
  auto* exp_avg16 = static_cast<uint16_t*>(t.exp_avg);
  auto* exp_avg_sq16 = static_cast<uint16_t*>(t.exp_avg_sq);
  uint64_t nonfinite = 0;
  size_t i = begin;
  for (; i + 2 * W <= end; i += 2 * W) {
    const auto a = update(t, i, &nonfinite);
    const auto b = update(t, i + W, &nonfinite);
    if constexpr (kMoment == ScalarType::kBFloat16) {
      // One 32-bit draw per element: the low half rounds the first moment, the high the second.
      const auto random_a = L::Random(seed, static_cast<uint32_t>(i));
      const auto random_b = L::Random(seed, static_cast<uint32_t>(i + W));
      L::StoreBF16StochasticPair(exp_avg16 + i, a.exp_avg, b.exp_avg, random_a, random_b);
      L::StoreBF16StochasticPair(exp_avg_sq16 + i, a.exp_avg_sq, b.exp_avg_sq,
                                 L::High16(random_a), L::High16(random_b));
    }
    if constexpr (kParam == static_cast<int>(ScalarType::kBFloat16)) {
      L::StoreBF16Pair(static_cast<uint16_t*>(t.param_out) + i, a.param, b.param);
    } else if constexpr (kParam >= 0) {
      StoreNearestTyped<L, static_cast<ScalarType>(kParam)>(t.param_out, i, a.param);
      StoreNearestTyped<L, static_cast<ScalarType>(kParam)>(t.param_out, i + W, b.param);
    }
  }
  for (; i + W <= end; i += W) {
    const auto a = update(t, i, &nonfinite);
    if constexpr (kMoment == ScalarType::kBFloat16) {
      const auto random = L::Random(seed, static_cast<uint32_t>(i));
      L::StoreBF16Stochastic(exp_avg16 + i, a.exp_avg, random);
      L::StoreBF16Stochastic(exp_avg_sq16 + i, a.exp_avg_sq, L::High16(random));
    }
    if constexpr (kParam >= 0) {
      StoreNearestTyped<L, static_cast<ScalarType>(kParam)>(t.param_out, i, a.param);
    }
  }
  if (i < end) nonfinite += AdamWScalar(t, i, end, s);
  return nonfinite;
}

template <typename L, ScalarType kGrad, ScalarType kMoment>
uint64_t AdamWForParam(const AdamWTensor& t, size_t b, size_t e, const AdamWStep& s) {
  if (t.param_out == nullptr) return AdamWTyped<L, kGrad, kMoment, -1>(t, b, e, s);
  switch (t.param_type) {
    case ScalarType::kFloat32: return AdamWTyped<L, kGrad, kMoment, 0>(t, b, e, s);
    case ScalarType::kBFloat16: return AdamWTyped<L, kGrad, kMoment, 1>(t, b, e, s);
    case ScalarType::kFloat16: return AdamWTyped<L, kGrad, kMoment, 2>(t, b, e, s);
  }
  return 0;
}

template <typename L, ScalarType kGrad>
uint64_t AdamWForMoment(const AdamWTensor& t, size_t b, size_t e, const AdamWStep& s) {
  if (t.moment_type == ScalarType::kFloat32) {
    return AdamWForParam<L, kGrad, ScalarType::kFloat32>(t, b, e, s);
  }
  return AdamWForParam<L, kGrad, ScalarType::kBFloat16>(t, b, e, s);
}

template <typename L>
uint64_t AdamWVector(const AdamWTensor& t, size_t begin, size_t end, const AdamWStep& s) {
  switch (t.grad_type) {
    case ScalarType::kFloat32: return AdamWForMoment<L, ScalarType::kFloat32>(t, begin, end, s);
    case ScalarType::kBFloat16: return AdamWForMoment<L, ScalarType::kBFloat16>(t, begin, end, s);
    case ScalarType::kFloat16: return AdamWForMoment<L, ScalarType::kFloat16>(t, begin, end, s);
  }
  return 0;
}

template <typename L>
GradientStats StatsVector(const void* const* grads, int n, ScalarType type, size_t begin,
                          size_t end) {
  GradientStats stats;
  typename L::D sum = L::ZeroD();
  typename L::I bad = L::ZeroI();
  size_t i = begin;
  for (; i + L::kWidth <= end; i += L::kWidth) {
    typename L::F g = LoadAs<L>(grads[0], type, i);
    for (int r = 1; r < n; ++r) g = L::Add(g, LoadAs<L>(grads[r], type, i));
    const auto finite = L::FiniteMask(g);
    bad = L::CountNonFinite(bad, finite);
    sum = L::AddSquares(sum, L::KeepFinite(g, finite));
  }
  stats.sum_squares = L::HorizontalSum(sum);
  stats.nonfinite = L::HorizontalCount(bad);
  if (i < end) {
    GradientStats tail = StatsScalar(grads, n, type, i, end);
    stats.sum_squares += tail.sum_squares;
    stats.nonfinite += tail.nonfinite;
  }
  return stats;
}

}  // namespace trainstream::kernels::internal

#endif  // TRAINSTREAM_KERNELS_CPU_ADAMW_SIMD_H_
