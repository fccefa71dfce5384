// SPDX-License-Identifier: Apache-2.0
#include "adamw.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "numeric.h"

namespace trainstream::kernels {
namespace {

std::vector<Isa> SupportedIsas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (IsaSupported(isa)) out.push_back(isa);
  }
  return out;
}

// A tensor's worth of state in some dtypes, with random contents.
struct State {
  State(size_t n, ScalarType moment, ScalarType grad, ScalarType param, int ranks, uint32_t seed)
      : n(n), moment(moment), grad(grad), param(param) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    master.resize(n);
    for (float& x : master) x = normal(rng);
    m.resize(n * 4);
    v.resize(n * 4);
    for (size_t i = 0; i < n; ++i) {
      float mi = 0.1f * normal(rng), vi = 0.01f * std::abs(normal(rng));
      Put(m.data(), moment, i, mi);
      Put(v.data(), moment, i, vi);
    }
    grads.resize(ranks);
    for (auto& g : grads) {
      g.resize(n * 4);
      for (size_t i = 0; i < n; ++i) Put(g.data(), grad, i, normal(rng));
    }
    out.assign(n * 4, 0);
  }
  static void Put(uint8_t* base, ScalarType type, size_t i, float value) {
    if (type == ScalarType::kFloat32) {
      std::memcpy(base + 4 * i, &value, 4);
    } else {
      uint16_t h = type == ScalarType::kBFloat16 ? FloatToBFloat16(value) : FloatToHalf(value);
      std::memcpy(base + 2 * i, &h, 2);
    }
  }
  AdamWTensor View() {
    pointers.clear();
    for (auto& g : grads) pointers.push_back(g.data());
    AdamWTensor t;
    t.master = master.data();
    t.exp_avg = m.data();
    t.exp_avg_sq = v.data();
    t.moment_type = moment;
    t.grads = pointers.data();
    t.num_grads = static_cast<int>(grads.size());
    t.grad_type = grad;
    t.param_out = out.data();
    t.param_type = param;
    t.numel = n;
    return t;
  }
  size_t n;
  ScalarType moment, grad, param;
  std::vector<float> master;
  std::vector<uint8_t> m, v, out;
  std::vector<std::vector<uint8_t>> grads;
  std::vector<const void*> pointers;
};

AdamWStep Step(uint64_t t, bool decoupled) {
  AdamWStep s;
  s.lr = 1e-2;
  s.weight_decay = 0.1;
  s.decoupled_weight_decay = decoupled;
  s.grad_scale = 0.5f;
  s.rounding_seed = 0x1234567890abcdefull + t;
  SetStepNumber(&s, t);
  return s;
}

TEST(AdamWKernelTest, VectorPathsMatchScalarBitForBit) {
  const ScalarType types[] = {ScalarType::kFloat32, ScalarType::kBFloat16, ScalarType::kFloat16};
  for (ScalarType moment : {ScalarType::kFloat32, ScalarType::kBFloat16}) {
    for (ScalarType grad : types) {
      for (ScalarType param : types) {
        for (int ranks : {1, 3}) {
          for (bool decoupled : {true, false}) {
            const size_t n = 1000 + 37;  // not a multiple of any width: exercises the tails
            // A NaN and an infinity in the gradient carry non-finite values into the moments
            // and the parameter copy, whose narrowing has its own path for them.
            auto poison = [&](State& state) {
              State::Put(state.grads[0].data(), grad, 5, NAN);
              State::Put(state.grads[0].data(), grad, 600, INFINITY);
            };
            State reference(n, moment, grad, param, ranks, 7);
            poison(reference);
            uint64_t reference_nonfinite = 0;
            for (uint64_t t = 1; t <= 3; ++t) {
              ASSERT_TRUE(AdamWUpdate(reference.View(), 0, n, Step(t, decoupled), Isa::kScalar,
                                      &reference_nonfinite)
                              .ok());
            }
            ASSERT_EQ(reference_nonfinite, 6u);
            for (Isa isa : SupportedIsas()) {
              State s(n, moment, grad, param, ranks, 7);
              poison(s);
              uint64_t nonfinite = 0;
              for (uint64_t t = 1; t <= 3; ++t) {
                // Two ranges, as two threads would split it.
                ASSERT_TRUE(AdamWUpdate(s.View(), 0, 500, Step(t, decoupled), isa, &nonfinite).ok());
                ASSERT_TRUE(AdamWUpdate(s.View(), 500, n, Step(t, decoupled), isa, &nonfinite).ok());
              }
              EXPECT_EQ(nonfinite, reference_nonfinite);
              SCOPED_TRACE(testing::Message()
                           << IsaName(isa) << " moment=" << ScalarTypeName(moment)
                           << " grad=" << ScalarTypeName(grad) << " param=" << ScalarTypeName(param)
                           << " ranks=" << ranks << " decoupled=" << decoupled);
              EXPECT_EQ(std::memcmp(s.master.data(), reference.master.data(), n * 4), 0);
              EXPECT_EQ(s.m, reference.m);
              EXPECT_EQ(s.v, reference.v);
              EXPECT_EQ(s.out, reference.out);
            }
          }
        }
      }
    }
  }
}

TEST(AdamWKernelTest, ScalarPathFollowsTheAdamWFormula) {
  // Against the formula evaluated in double precision.
  State s(257, ScalarType::kFloat32, ScalarType::kFloat32, ScalarType::kFloat32, 2, 3);
  std::vector<double> p(s.master.begin(), s.master.end()), m(257), v(257);
  for (size_t i = 0; i < 257; ++i) {
    float mi, vi;
    std::memcpy(&mi, s.m.data() + 4 * i, 4);
    std::memcpy(&vi, s.v.data() + 4 * i, 4);
    m[i] = mi;
    v[i] = vi;
  }
  for (uint64_t t = 1; t <= 5; ++t) {
    AdamWStep step = Step(t, true);
    ASSERT_TRUE(AdamWUpdate(s.View(), 0, 257, step, Isa::kScalar).ok());
    for (size_t i = 0; i < 257; ++i) {
      float g0, g1;
      std::memcpy(&g0, s.grads[0].data() + 4 * i, 4);
      std::memcpy(&g1, s.grads[1].data() + 4 * i, 4);
      double g = (static_cast<double>(g0) + g1) * 0.5;
      p[i] *= 1.0 - 1e-2 * 0.1;
      m[i] = 0.9 * m[i] + 0.1 * g;
      v[i] = 0.999 * v[i] + 0.001 * g * g;
      double bc1 = 1 - std::pow(0.9, t), bc2 = 1 - std::pow(0.999, t);
      p[i] -= 1e-2 / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + 1e-8);
    }
  }
  for (size_t i = 0; i < 257; ++i) EXPECT_NEAR(s.master[i], p[i], 2e-6) << i;
  float out0;
  std::memcpy(&out0, s.out.data(), 4);
  EXPECT_EQ(out0, s.master[0]);
}

TEST(AdamWKernelTest, StochasticRoundingIsUnbiased) {
  // 1 + 2^-10 lies between two bf16 values (spacing 2^-7): nearest-even always rounds down,
  // stochastic rounding lands above 1/8 of the time.
  const float value = 1.0f + 1.0f / 1024;
  double sum = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    sum += BFloat16ToFloat(FloatToBFloat16Stochastic(value, MixBits(99, i)));
  }
  EXPECT_NEAR(sum / n, value, 2e-5);
  EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(value)), 1.0f);
}

TEST(AdamWKernelTest, HalfConversionRoundsToNearestEven) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(5.960464477539063e-08f), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToHalf(2.98e-08f), 0x0000);                // under half of it
  EXPECT_EQ(FloatToHalf(1.0f + 1.0f / 2048), 0x3c00);        // tie: to even
  EXPECT_EQ(FloatToHalf(1.0f + 3.0f / 2048), 0x3c02);        // tie: to even (up)
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    EXPECT_EQ(FloatToHalf(HalfToFloat(static_cast<uint16_t>(h))), h) << h;
  }
}

TEST(AdamWKernelTest, GradientStatsAgreeAcrossPaths) {
  State s(4099, ScalarType::kFloat32, ScalarType::kBFloat16, ScalarType::kFloat32, 2, 11);
  State::Put(s.grads[0].data(), ScalarType::kBFloat16, 17, INFINITY);
  State::Put(s.grads[1].data(), ScalarType::kBFloat16, 4000, NAN);
  AdamWTensor t = s.View();
  GradientStats reference = ComputeGradientStats(t.grads, 2, t.grad_type, 0, 4099, Isa::kScalar);
  EXPECT_EQ(reference.nonfinite, 2u);
  double expected = 0;
  for (size_t i = 0; i < 4099; ++i) {
    if (i == 17 || i == 4000) continue;
    uint16_t a, b;
    std::memcpy(&a, s.grads[0].data() + 2 * i, 2);
    std::memcpy(&b, s.grads[1].data() + 2 * i, 2);
    double g = BFloat16ToFloat(a) + BFloat16ToFloat(b);
    expected += g * g;
  }
  EXPECT_NEAR(reference.sum_squares, expected, expected * 1e-6);
  for (Isa isa : SupportedIsas()) {
    GradientStats stats = ComputeGradientStats(t.grads, 2, t.grad_type, 0, 4099, isa);
    EXPECT_EQ(stats.nonfinite, 2u) << IsaName(isa);
    EXPECT_NEAR(stats.sum_squares, reference.sum_squares, reference.sum_squares * 1e-12);
  }
}

TEST(AdamWKernelTest, BadArgumentsAreErrors) {
  State s(16, ScalarType::kFloat32, ScalarType::kFloat32, ScalarType::kFloat32, 1, 1);
  EXPECT_EQ(AdamWUpdate(s.View(), 0, 17, Step(1, true), Isa::kScalar).code(),
            absl::StatusCode::kInvalidArgument);
  AdamWTensor t = s.View();
  t.moment_type = ScalarType::kFloat16;
  EXPECT_EQ(AdamWUpdate(t, 0, 16, Step(1, true), Isa::kScalar).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace trainstream::kernels
