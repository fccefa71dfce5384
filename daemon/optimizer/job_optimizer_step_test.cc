// SPDX-License-Identifier: Apache-2.0
// JobOptimizer's step machine: updates against a reference AdamW, micro-steps, ranks, non-finite
// gradients and clipping.
#include <bit>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "optimizer/job_optimizer_test_fixture.h"

namespace trainstream::daemon::job_optimizer_test {
namespace {

TEST_F(JobOptimizerTest, IterationsMatchAReferenceAdamW) {
  auto opt = Make(Settings());
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("w", 1000), Param("big", kLargeNumel),
                                                    Param("b", 7)};
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  EXPECT_TRUE(r->registration.initialize);
  EXPECT_EQ(r->registration.iteration, 0u);
  ASSERT_EQ(r->registration.params.size(), 3u);
  std::vector<std::vector<float>> initial = Initialize(*r, params);
  std::vector<ReferenceAdamW> refs;
  for (const auto& w : initial) refs.emplace_back(Hyper(), w);
  for (uint64_t step = 1; step <= 3; ++step) {
    for (uint32_t i = 0; i < params.size(); ++i) {
      std::vector<float> grad = RandomFloats(params[i].numel, 1000 * step + i);
      Post(*opt, *r, i, grad, step);
      refs[i].Step(Sum({grad}, 1.0));
    }
    std::map<uint64_t, uint32_t> done = UpdatesDone(*r, params.size(), step);
    EXPECT_EQ(done.size(), params.size());
    for (const auto& entry : done) EXPECT_EQ(entry.second, 0u) << "flags of " << entry.first;
    OptimizerReport report = opt->Report();
    EXPECT_EQ(report.iteration, step);
    EXPECT_EQ(report.state, "ready");
    EXPECT_EQ(report.param_steps, std::vector<uint64_t>(params.size(), step));
    EXPECT_EQ(report.last_step.iteration, step);
    EXPECT_FALSE(report.last_step.skipped);
  }
  for (uint32_t i = 0; i < params.size(); ++i) ExpectMatches(*r, i, refs[i]);
  EXPECT_EQ(opt->Report().tensors, 3u);
  EXPECT_EQ(opt->Report().elements, 1000u + kLargeNumel + 7u);
}

TEST_F(JobOptimizerTest, AdamFoldsWeightDecayIntoTheGradient) {
  OptimizerSettings settings = Settings();
  settings.decoupled_weight_decay = false;
  auto opt = Make(settings);
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("w", 64)};
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  ReferenceAdamW ref(Hyper(), Initialize(*r, params)[0]);
  ref.decoupled = false;
  for (uint64_t step = 1; step <= 2; ++step) {
    std::vector<float> grad = RandomFloats(64, 7 + step);
    Post(*opt, *r, 0, grad, step);
    ref.Step(Sum({grad}, 1.0));
    UpdatesDone(*r, 1, step);
  }
  ExpectMatches(*r, 0, ref);
}

TEST_F(JobOptimizerTest, MicroStepsAreSummedBeforeTheUpdate) {
  OptimizerSettings settings = Settings();
  settings.accumulation_steps = 3;
  auto opt = Make(settings);
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("w", 500), Param("big", kLargeNumel)};
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  std::vector<std::vector<float>> initial = Initialize(*r, params);
  std::vector<ReferenceAdamW> refs;
  for (const auto& w : initial) refs.emplace_back(Hyper(), w);
  for (uint64_t step = 1; step <= 2; ++step) {
    std::vector<std::vector<std::vector<float>>> micro(params.size());
    for (uint64_t k = 0; k < 3; ++k) {
      for (uint32_t i = 0; i < params.size(); ++i) {
        micro[i].push_back(RandomFloats(params[i].numel, 31 * step + 7 * k + i));
        Post(*opt, *r, i, micro[i].back(), step, k);
      }
      if (k == 2) break;
      // Each slot may be written again only once its micro-step has been summed.
      std::map<uint64_t, uint64_t> consumed;
      for (const DoorbellMessage& m : Receive(*r, params.size())) {
        EXPECT_EQ(m.kind, static_cast<uint32_t>(DoorbellKind::kGradConsumed));
        EXPECT_EQ(m.step, step);
        consumed[m.id] = m.value;
      }
      EXPECT_EQ(consumed, (std::map<uint64_t, uint64_t>{{0, k}, {1, k}}));
      EXPECT_EQ(opt->Report().state, "stepping");
    }
    // torch sums micro-steps into .grad; the mean is over ranks only.
    for (uint32_t i = 0; i < params.size(); ++i) refs[i].Step(Sum(micro[i], 1.0));
    UpdatesDone(*r, params.size(), step);
    EXPECT_EQ(opt->Report().iteration, step);
  }
  for (uint32_t i = 0; i < params.size(); ++i) ExpectMatches(*r, i, refs[i]);
}

TEST_F(JobOptimizerTest, TwoRanksGradientsAreAveraged) {
  auto opt = Make(Settings(), 2);
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("w", 300), Param("big", kLargeNumel)};
  std::unique_ptr<Rank> r0 = Join(*opt, 0, params, 2);
  std::unique_ptr<Rank> r1 = Join(*opt, 1, params, 2);
  ASSERT_NE(r0, nullptr);
  ASSERT_NE(r1, nullptr);
  EXPECT_TRUE(r0->registration.initialize);
  EXPECT_FALSE(r1->registration.initialize);
  // The state is shared; each rank posts into a gradient slot of its own.
  EXPECT_EQ(r0->registration.params[0].master.buffer_id,
            r1->registration.params[0].master.buffer_id);
  EXPECT_NE(r0->registration.params[0].grad.buffer_id, r1->registration.params[0].grad.buffer_id);
  std::vector<std::vector<float>> initial = Initialize(*r0, params);
  std::vector<ReferenceAdamW> refs;
  for (const auto& w : initial) refs.emplace_back(Hyper(), w);
  for (uint64_t step = 1; step <= 2; ++step) {
    for (uint32_t i = 0; i < params.size(); ++i) {
      std::vector<float> g0 = RandomFloats(params[i].numel, 50 * step + i);
      std::vector<float> g1 = RandomFloats(params[i].numel, 70 * step + i, 3.0f);
      Post(*opt, *r0, i, g0, step);
      EXPECT_EQ(opt->Report().state, "stepping");
      Post(*opt, *r1, i, g1, step);
      refs[i].Step(Sum({g0, g1}, 0.5));
    }
    UpdatesDone(*r0, params.size(), step);
    UpdatesDone(*r1, params.size(), step);
    EXPECT_EQ(opt->Report().iteration, step);
  }
  for (uint32_t i = 0; i < params.size(); ++i) ExpectMatches(*r0, i, refs[i]);
}

TEST_F(JobOptimizerTest, TwoRanksWithMicroStepsAverageTheRanksSums) {
  OptimizerSettings settings = Settings();
  settings.accumulation_steps = 2;
  auto opt = Make(settings, 2);
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("w", 256)};
  std::unique_ptr<Rank> r0 = Join(*opt, 0, params, 2);
  std::unique_ptr<Rank> r1 = Join(*opt, 1, params, 2);
  ASSERT_NE(r0, nullptr);
  ASSERT_NE(r1, nullptr);
  ReferenceAdamW ref(Hyper(), Initialize(*r0, params)[0]);
  std::vector<std::vector<float>> grads;
  for (uint64_t k = 0; k < 2; ++k) {
    grads.push_back(RandomFloats(256, 10 + k));
    grads.push_back(RandomFloats(256, 20 + k, 2.0f));
    Post(*opt, *r0, 0, grads[2 * k], 1, k);
    Post(*opt, *r1, 0, grads[2 * k + 1], 1, k);
    if (k == 0) {
      for (Rank* r : {r0.get(), r1.get()}) {
        std::vector<DoorbellMessage> m = Receive(*r, 1);
        ASSERT_EQ(m.size(), 1u);
        EXPECT_EQ(m[0].kind, static_cast<uint32_t>(DoorbellKind::kGradConsumed));
      }
    }
  }
  ref.Step(Sum(grads, 0.5));
  UpdatesDone(*r0, 1, 1);
  UpdatesDone(*r1, 1, 1);
  ExpectMatches(*r0, 0, ref);
}

TEST_F(JobOptimizerTest, AParameterWithoutAGradientKeepsItsStateAndStep) {
  auto opt = Make(Settings());
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("used", 40), Param("unused", 40)};
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  std::vector<std::vector<float>> initial = Initialize(*r, params);
  ReferenceAdamW ref(Hyper(), initial[0]);
  std::vector<float> grad = RandomFloats(40, 3);
  Post(*opt, *r, 0, grad, 1);
  PostNone(*opt, *r, 1, 1);
  ref.Step(Sum({grad}, 1.0));
  std::map<uint64_t, uint32_t> done = UpdatesDone(*r, 2, 1);
  EXPECT_EQ(done[0], 0u);
  EXPECT_EQ(done[1], ipc::kFlagNoGradient);
  ExpectMatches(*r, 0, ref);
  EXPECT_EQ(Master(*r, 1), initial[1]);
  EXPECT_EQ(ExpAvg(*r, 1), std::vector<float>(40, 0.0f));
  EXPECT_EQ(opt->Report().param_steps, (std::vector<uint64_t>{1, 0}));
  EXPECT_EQ(opt->Report().iteration, 1u);
}

TEST_F(JobOptimizerTest, IgnoreAppliesNonFiniteValuesAndCountsThem) {
  auto opt = Make(Settings());  // nonfinite = kIgnore, as torch
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("w", 16)};
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  Initialize(*r, params);
  std::vector<float> grad = RandomFloats(16, 4);
  grad[5] = std::numeric_limits<float>::quiet_NaN();
  Post(*opt, *r, 0, grad, 1);
  EXPECT_EQ(UpdatesDone(*r, 1, 1)[0], 0u);
  OptimizerReport report = opt->Report();
  EXPECT_EQ(report.last_step.nonfinite, 1u);
  EXPECT_FALSE(report.last_step.skipped);
  EXPECT_TRUE(std::isnan(Master(*r, 0)[5]));
  EXPECT_TRUE(std::isfinite(Master(*r, 0)[4]));
  EXPECT_EQ(report.param_steps, std::vector<uint64_t>{1});
  EXPECT_TRUE(HasEvent(*events_, "optimizer.nonfinite"));
}

TEST_F(JobOptimizerTest, SkipStepLeavesEveryTensorUntouchedAndTheNextStepRuns) {
  OptimizerSettings settings = Settings();
  settings.nonfinite = NonFinitePolicy::kSkipStep;
  auto opt = Make(settings);
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("a", 64), Param("b", 8)};
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  std::vector<std::vector<float>> initial = Initialize(*r, params);
  std::vector<float> bad = RandomFloats(8, 5);
  bad[3] = std::numeric_limits<float>::infinity();
  Post(*opt, *r, 0, RandomFloats(64, 6), 1);
  Post(*opt, *r, 1, bad, 1);
  std::map<uint64_t, uint32_t> done = UpdatesDone(*r, 2, 1);
  EXPECT_EQ(done[0], ipc::kFlagSkipped);
  EXPECT_EQ(done[1], ipc::kFlagSkipped);
  for (uint32_t i = 0; i < 2; ++i) {
    EXPECT_EQ(Master(*r, i), initial[i]) << i;
    EXPECT_EQ(ExpAvg(*r, i), std::vector<float>(params[i].numel, 0.0f)) << i;
  }
  OptimizerReport report = opt->Report();
  EXPECT_TRUE(report.last_step.skipped);
  EXPECT_EQ(report.last_step.nonfinite, 1u);
  EXPECT_EQ(report.param_steps, (std::vector<uint64_t>{0, 0}));
  EXPECT_EQ(report.iteration, 1u);  // a skipped step is still a step, as with GradScaler
  EXPECT_TRUE(HasEvent(*events_, "optimizer.step_skipped"));
  // The next step updates with bias corrections of step 1.
  std::vector<ReferenceAdamW> refs = {{Hyper(), initial[0]}, {Hyper(), initial[1]}};
  for (uint32_t i = 0; i < 2; ++i) {
    std::vector<float> grad = RandomFloats(params[i].numel, 60 + i);
    Post(*opt, *r, i, grad, 2);
    refs[i].Step(Sum({grad}, 1.0));
  }
  done = UpdatesDone(*r, 2, 2);
  EXPECT_EQ(done[0], 0u);
  EXPECT_EQ(done[1], 0u);
  for (uint32_t i = 0; i < 2; ++i) ExpectMatches(*r, i, refs[i]);
  EXPECT_EQ(opt->Report().param_steps, (std::vector<uint64_t>{1, 1}));
  EXPECT_FALSE(opt->Report().last_step.skipped);
}

TEST_F(JobOptimizerTest, ErrorPolicyFailsTheJobNamingTheTensorAndTouchesNothing) {
  OptimizerSettings settings = Settings();
  settings.nonfinite = NonFinitePolicy::kError;
  // One worker and small chunks make 'a''s restore slow: the error must still come after it.
  settings.threads = 1;
  settings.chunk_elements = 4096;
  auto opt = Make(settings);
  ASSERT_NE(opt, nullptr);
  constexpr uint64_t kLarge = uint64_t{1} << 20;
  const std::vector<ParameterDescription> params = {Param("a", kLarge), Param("b", 8)};
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  std::vector<std::vector<float>> initial = Initialize(*r, params);
  std::vector<float> bad = RandomFloats(8, 5);
  bad[0] = std::numeric_limits<float>::quiet_NaN();
  Post(*opt, *r, 0, RandomFloats(kLarge, 6), 1);
  Post(*opt, *r, 1, bad, 1);
  // A post once the job has failed, while 'a' is still being restored: answered by the
  // failure's one announcement, after the restore, not by an error of its own before it.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!absl::StartsWith(opt->Report().state, "failed: ") && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  Post(*opt, *r, 1, bad, 2);
  std::vector<DoorbellMessage> m = Receive(*r, 1);
  ASSERT_EQ(m.size(), 1u);
  EXPECT_EQ(m[0].kind, static_cast<uint32_t>(DoorbellKind::kError));
  EXPECT_EQ(m[0].value, kFailedPreconditionCode);
  for (uint32_t i = 0; i < 2; ++i) EXPECT_EQ(Master(*r, i), initial[i]) << i;
  (void)Pending(*r);  // the post's own error, when the restore had ended before it came
  OptimizerReport report = opt->Report();
  EXPECT_TRUE(absl::StartsWith(report.state, "failed: ")) << report.state;
  EXPECT_TRUE(absl::StrContains(report.state, "'b'")) << report.state;
  EXPECT_EQ(report.iteration, 0u);
  for (uint32_t i = 0; i < 2; ++i) EXPECT_EQ(Master(*r, i), initial[i]) << i;
  // A failed job answers every further gradient with an error.
  Post(*opt, *r, 0, RandomFloats(kLarge, 6), 1);
  m = Receive(*r, 1);
  ASSERT_EQ(m.size(), 1u);
  EXPECT_EQ(m[0].kind, static_cast<uint32_t>(DoorbellKind::kError));
}

TEST_F(JobOptimizerTest, GuardStopsUpdatingAtTheFirstNonFiniteTensor) {
  OptimizerSettings settings = Settings();
  settings.nonfinite = NonFinitePolicy::kGuard;
  auto opt = Make(settings);
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("first", 32), Param("poisoned", 32),
                                                    Param("after", 32)};
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  std::vector<std::vector<float>> initial = Initialize(*r, params);
  ReferenceAdamW ref(Hyper(), initial[0]);
  std::vector<float> grad = RandomFloats(32, 8);
  ref.Step(Sum({grad}, 1.0));
  // One at a time, so the order the guard sees them in is fixed.
  Post(*opt, *r, 0, grad, 1);
  EXPECT_EQ(UpdatesDone(*r, 1, 1)[0], 0u);
  std::vector<float> bad = RandomFloats(32, 9);
  bad[1] = bad[2] = std::numeric_limits<float>::quiet_NaN();
  Post(*opt, *r, 1, bad, 1);
  EXPECT_EQ(UpdatesDone(*r, 1, 1)[1], ipc::kFlagSkipped);
  Post(*opt, *r, 2, RandomFloats(32, 10), 1);
  EXPECT_EQ(UpdatesDone(*r, 1, 1)[2], ipc::kFlagSkipped);
  ExpectMatches(*r, 0, ref);
  EXPECT_EQ(Master(*r, 1), initial[1]);
  EXPECT_EQ(Master(*r, 2), initial[2]);
  OptimizerReport report = opt->Report();
  EXPECT_TRUE(report.last_step.skipped);
  EXPECT_EQ(report.last_step.nonfinite, 2u);
  EXPECT_EQ(report.param_steps, (std::vector<uint64_t>{1, 0, 0}));
  EXPECT_EQ(report.iteration, 1u);
  EXPECT_EQ(report.state, "ready");
}

// The step-skipped event counts the tensors updated before the non-finite one; a tensor without
// a gradient was left alone, not updated.
TEST_F(JobOptimizerTest, GuardCountsOnlyTensorsUpdatedBeforeTheNonFiniteOne) {
  OptimizerSettings settings = Settings();
  settings.nonfinite = NonFinitePolicy::kGuard;
  auto opt = Make(settings);
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("unused", 16), Param("first", 16),
                                                    Param("poisoned", 16)};
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  Initialize(*r, params);
  PostNone(*opt, *r, 0, 1);
  EXPECT_EQ(UpdatesDone(*r, 1, 1)[0], ipc::kFlagNoGradient);
  Post(*opt, *r, 1, RandomFloats(16, 1), 1);
  EXPECT_EQ(UpdatesDone(*r, 1, 1)[1], 0u);
  std::vector<float> bad = RandomFloats(16, 2);
  bad[0] = std::numeric_limits<float>::infinity();
  Post(*opt, *r, 2, bad, 1);
  EXPECT_EQ(UpdatesDone(*r, 1, 1)[2], ipc::kFlagSkipped);
  // The event follows the last kUpdateDone under the job's lock, which Report takes.
  EXPECT_EQ(opt->Report().iteration, 1u);
  std::vector<Event> skipped =
      events_->Since(0, [](const Event& e) { return e.kind == "optimizer.step_skipped"; });
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_TRUE(absl::StrContains(skipped[0].message, "(1 of 3 had been before it"))
      << skipped[0].message;
  double before = -1;
  for (const auto& number : skipped[0].numbers) {
    if (number.first == "tensors_updated_before") before = number.second;
  }
  EXPECT_EQ(before, 1.0);
  EXPECT_EQ(opt->Report().param_steps, (std::vector<uint64_t>{0, 1, 0}));
}

TEST_F(JobOptimizerTest, ClippingScalesTheAveragedGradientByTheGlobalNorm) {
  OptimizerSettings settings = Settings();
  settings.max_grad_norm = 0.5;
  auto opt = Make(settings, 2);
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("a", 100), Param("b", 30)};
  std::unique_ptr<Rank> r0 = Join(*opt, 0, params, 2);
  std::unique_ptr<Rank> r1 = Join(*opt, 1, params, 2);
  ASSERT_NE(r0, nullptr);
  ASSERT_NE(r1, nullptr);
  std::vector<std::vector<float>> initial = Initialize(*r0, params);
  std::vector<std::vector<double>> mean;
  double sum_squares = 0;
  for (uint32_t i = 0; i < 2; ++i) {
    std::vector<float> g0 = RandomFloats(params[i].numel, 80 + i);
    std::vector<float> g1 = RandomFloats(params[i].numel, 90 + i);
    Post(*opt, *r0, i, g0, 1);
    Post(*opt, *r1, i, g1, 1);
    mean.push_back(Sum({g0, g1}, 0.5));
    for (double x : mean.back()) sum_squares += x * x;
  }
  UpdatesDone(*r0, 2, 1);
  UpdatesDone(*r1, 2, 1);
  const double norm = std::sqrt(sum_squares);
  ASSERT_GT(norm, 1.0);  // so the clip bites
  const double coef = 0.5 / (norm + 1e-6);
  OptimizerReport report = opt->Report();
  EXPECT_NEAR(report.last_step.grad_norm, norm, 1e-5 * norm);
  EXPECT_NEAR(report.last_step.clip_coef, coef, 1e-6);
  for (uint32_t i = 0; i < 2; ++i) {
    ReferenceAdamW ref(Hyper(), initial[i]);
    for (double& x : mean[i]) x *= coef;
    ref.Step(mean[i]);
    ExpectMatches(*r0, i, ref);
  }
}

// A rank that updates some parameters on its GPU sends their sum of squares before posting
// them without a gradient: the clip covers both, as torch's clip_grad_norm_ over all would.
TEST_F(JobOptimizerTest, ClippingCountsTheSumOfSquaresARankUpdatesOnItsGpu) {
  OptimizerSettings settings = Settings();
  settings.max_grad_norm = 0.5;
  auto opt = Make(settings, 1);
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("host", 50), Param("on_gpu", 20)};
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  std::vector<std::vector<float>> initial = Initialize(*r, params);
  std::vector<float> g = RandomFloats(50, 7);
  double host = 0;
  for (float x : g) host += static_cast<double>(x) * x;
  const double device = 9.0 * host;  // the norm is sqrt(10) times the host's alone
  Post(*opt, *r, 0, g, 1);
  opt->OnNormContribution(r->session_id, {static_cast<uint32_t>(DoorbellKind::kNormContribution), 0,
                                          0, 1, std::bit_cast<uint64_t>(device)});
  PostNone(*opt, *r, 1, 1);
  UpdatesDone(*r, 2, 1);
  const double norm = std::sqrt(host + device);
  ASSERT_GT(norm, 1.0);
  const double coef = 0.5 / (norm + 1e-6);
  OptimizerReport report = opt->Report();
  EXPECT_NEAR(report.last_step.grad_norm, norm, 1e-5 * norm);
  EXPECT_NEAR(report.last_step.clip_coef, coef, 1e-6);
  ReferenceAdamW ref(Hyper(), initial[0]);
  std::vector<double> clipped(g.begin(), g.end());
  for (double& x : clipped) x *= coef;
  ref.Step(clipped);
  ExpectMatches(*r, 0, ref);
  // The next step starts from nothing: without a contribution the norm is the host's.
  Post(*opt, *r, 0, g, 2);
  PostNone(*opt, *r, 1, 2);
  UpdatesDone(*r, 2, 2);
  EXPECT_NEAR(opt->Report().last_step.grad_norm, std::sqrt(host), 1e-5 * std::sqrt(host));
}

// eager=False: no update starts before every gradient of the step is in.
TEST_F(JobOptimizerTest, DeferredUpdatesWaitForEveryGradient) {
  OptimizerSettings settings = Settings();
  settings.defer_updates = true;
  auto opt = Make(settings, 1);
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("a", 40), Param("b", 30)};
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  std::vector<std::vector<float>> initial = Initialize(*r, params);
  std::vector<float> ga = RandomFloats(40, 11), gb = RandomFloats(30, 12);
  Post(*opt, *r, 0, ga, 1);
  EXPECT_FALSE(Pending(*r));  // 'a' waits for 'b'
  Post(*opt, *r, 1, gb, 1);
  UpdatesDone(*r, 2, 1);
  for (uint32_t i = 0; i < 2; ++i) {
    ReferenceAdamW ref(Hyper(), initial[i]);
    const std::vector<float>& g = i == 0 ? ga : gb;
    ref.Step(std::vector<double>(g.begin(), g.end()));
    ExpectMatches(*r, i, ref);
  }
}

// threads=1 and small chunks: a tensor's chunks run one after another on one worker, and the
// update is the same.
TEST_F(JobOptimizerTest, AJobLimitedToOneWorkerInSmallChunksUpdatesTheSame) {
  OptimizerSettings settings = Settings();
  settings.threads = 1;
  settings.chunk_elements = 4096;
  settings.max_grad_norm = 1e6;  // the statistics pass runs in chunks too
  auto opt = Make(settings, 1);
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("big", 20000), Param("small", 100)};
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  std::vector<std::vector<float>> initial = Initialize(*r, params);
  for (uint64_t step = 1; step <= 2; ++step) {
    std::vector<std::vector<float>> grads = {RandomFloats(20000, 20 + step),
                                             RandomFloats(100, 30 + step)};
    Post(*opt, *r, 0, grads[0], step);
    Post(*opt, *r, 1, grads[1], step);
    UpdatesDone(*r, 2, step);
    if (step == 1) {
      for (uint32_t i = 0; i < 2; ++i) {
        ReferenceAdamW ref(Hyper(), initial[i]);
        ref.Step(std::vector<double>(grads[i].begin(), grads[i].end()));
        ExpectMatches(*r, i, ref);
      }
    }
  }
  EXPECT_EQ(opt->Report().iteration, 2u);
}

TEST(OptimizerSettingsTest, ChunkElementsAreMultiplesOf256From4096) {
  OptimizerSettings s;
  s.groups = {GroupHyperParameters{}};
  for (uint64_t bad : {uint64_t{1000}, uint64_t{2048}, uint64_t{4100}, uint64_t{1} << 31}) {
    s.chunk_elements = bad;
    absl::Status status = ValidateSettings(s);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(status.message(), "multiple of 256")) << status;
  }
  for (uint64_t good : {uint64_t{0}, uint64_t{4096}, uint64_t{1} << 20}) {
    s.chunk_elements = good;
    EXPECT_TRUE(ValidateSettings(s).ok()) << good;
  }
}

// A norm contribution out of place fails the job, and its state says why.
class NormContributionTest : public JobOptimizerTest {
 protected:
  std::string StateAfter(double max_grad_norm, uint64_t step, double sum_squares) {
    OptimizerSettings settings = Settings();
    settings.max_grad_norm = max_grad_norm;
    auto opt = Make(settings, 1);
    if (opt == nullptr) return "no optimizer";
    std::unique_ptr<Rank> r = Join(*opt, 0, {Param("a", 8)});
    if (r == nullptr) return "no rank";
    opt->OnNormContribution(r->session_id, {static_cast<uint32_t>(DoorbellKind::kNormContribution),
                                            0, 0, step, std::bit_cast<uint64_t>(sum_squares)});
    return opt->Report().state;
  }
};

TEST_F(NormContributionTest, ToAJobThatNeitherClipsNorReports) {
  const std::string state = StateAfter(0.0, 1, 1.0);
  EXPECT_TRUE(absl::StartsWith(state, "failed: ")) << state;
  EXPECT_TRUE(absl::StrContains(state, "neither clips nor reports")) << state;
}

TEST_F(NormContributionTest, ForAnotherIteration) {
  const std::string state = StateAfter(1.0, 2, 1.0);
  EXPECT_TRUE(absl::StartsWith(state, "failed: ")) << state;
  EXPECT_TRUE(absl::StrContains(state, "for iteration 2; the job is at iteration 1")) << state;
}

TEST_F(NormContributionTest, Negative) {
  const std::string state = StateAfter(1.0, 1, -1.0);
  EXPECT_TRUE(absl::StartsWith(state, "failed: ")) << state;
  EXPECT_TRUE(absl::StrContains(state, "must be a finite sum of squares")) << state;
}

TEST_F(NormContributionTest, Infinite) {
  const std::string state = StateAfter(1.0, 1, std::numeric_limits<double>::infinity());
  EXPECT_TRUE(absl::StartsWith(state, "failed: ")) << state;
  EXPECT_TRUE(absl::StrContains(state, "must be a finite sum of squares")) << state;
}

}  // namespace
}  // namespace trainstream::daemon::job_optimizer_test
