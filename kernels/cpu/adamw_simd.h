// SPDX-License-Identifier: Apache-2.0
// The vector body shared by the AVX2 and AVX-512 paths: `Lanes` supplies loads, stores and
// arithmetic for its register width. Included only by adamw_avx2.cc and adamw_avx512.cc, each
// compiled for its instruction set with -ffp-contract=off, so every lane rounds exactly as the
// scalar path does (no fused multiply-adds): the paths agree bit for bit.
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

// kParam: the parameter copy's type, or -1 for none. Every type is fixed at compile time, so
// the loop body holds no branches.
template <typename L, ScalarType kGrad, ScalarType kMoment, int kParam>
uint64_t AdamWTyped(const AdamWTensor& t, size_t begin, size_t end, const AdamWStep& s) {
  using F = typename L::F;
  const AdamWConstants c = Constants(s);
  const F decay = L::Set(c.decay);
  const float l2_scalar = c.l2;
  const F l2 = L::Set(l2_scalar);
  const F step_size = L::Set(c.step_size);
  const F one_minus_beta1 = L::Set(c.one_minus_beta1);
  const F one_minus_beta2 = L::Set(c.one_minus_beta2);
  const F beta2 = L::Set(c.beta2);
  const F inv_bc2 = L::Set(c.inv_bc2);
  const F eps = L::Set(c.eps);
  const F scale = L::Set(c.grad_scale);
  const uint32_t seed = c.seed;
  typename L::I bad = L::ZeroI();
  size_t i = begin;
  for (; i + L::kWidth <= end; i += L::kWidth) {
    F g = LoadTyped<L, kGrad>(t.grads[0], i);
    for (int r = 1; r < t.num_grads; ++r) g = L::Add(g, LoadTyped<L, kGrad>(t.grads[r], i));
    bad = L::CountNonFinite(bad, L::FiniteMask(g));
    g = L::Mul(g, scale);
    F p = L::LoadF32(t.master + i);
    if (l2_scalar != 0.0f) g = L::Add(g, L::Mul(l2, p));
    p = L::Mul(p, decay);
    F m = LoadTyped<L, kMoment>(t.exp_avg, i);
    F v = LoadTyped<L, kMoment>(t.exp_avg_sq, i);
    m = L::Add(m, L::Mul(one_minus_beta1, L::Sub(g, m)));
    v = L::Add(L::Mul(v, beta2), L::Mul(one_minus_beta2, L::Mul(g, g)));
    const F denom = L::Add(L::Mul(L::Sqrt(v), inv_bc2), eps);
    p = L::Add(p, L::Mul(step_size, L::Div(m, denom)));
    L::StoreF32(t.master + i, p);
    if constexpr (kMoment == ScalarType::kFloat32) {
      L::StoreF32(static_cast<float*>(t.exp_avg) + i, m);
      L::StoreF32(static_cast<float*>(t.exp_avg_sq) + i, v);
    } else {
      const auto random = L::Random(seed, static_cast<uint32_t>(i));
      L::StoreBF16Stochastic(static_cast<uint16_t*>(t.exp_avg) + i, m, random);
      L::StoreBF16Stochastic(static_cast<uint16_t*>(t.exp_avg_sq) + i, v, L::High16(random));
    }
    if constexpr (kParam >= 0) {
      StoreNearestTyped<L, static_cast<ScalarType>(kParam)>(t.param_out, i, p);
    }
  }
  uint64_t nonfinite = L::HorizontalCount(bad);
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
