// SPDX-License-Identifier: Apache-2.0
// JobOptimizer around its steps: ranks that die or leave, posts out of turn, SetSteps and
// SetGroups, checkpoints.
#include <unistd.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cpu/numeric.h"
#include "gtest/gtest.h"
#include "optimizer/job_optimizer_test_fixture.h"

namespace trainstream::daemon::job_optimizer_test {
namespace {

// Rank 1 dies after rank 0 posted part of the iteration: the job fails (rank 0 is told), and
// once both are back it starts that iteration over from the state before it.
TEST_F(JobOptimizerTest, ARankDyingMidIterationResetsProgressAndLosesNothing) {
  auto opt = Make(Settings(), 2);
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("a", 50), Param("b", 20)};
  std::unique_ptr<Rank> r0 = Join(*opt, 0, params, 2);
  std::unique_ptr<Rank> r1 = Join(*opt, 1, params, 2);
  ASSERT_NE(r0, nullptr);
  ASSERT_NE(r1, nullptr);
  std::vector<std::vector<float>> initial = Initialize(*r0, params);
  Post(*opt, *r0, 0, RandomFloats(50, 1), 1);
  Post(*opt, *r0, 1, RandomFloats(20, 2), 1);
  End(*opt, *r1, /*clean=*/false);
  std::vector<DoorbellMessage> m = Receive(*r0, 1);
  ASSERT_EQ(m.size(), 1u);
  EXPECT_EQ(m[0].kind, static_cast<uint32_t>(DoorbellKind::kError));
  EXPECT_EQ(m[0].value, kFailedPreconditionCode);
  EXPECT_TRUE(absl::StrContains(opt->Report().state, "rank 1 died at iteration 1"))
      << opt->Report().state;
  End(*opt, *r0, /*clean=*/true);
  EXPECT_FALSE(Pending(*r0));  // one failure, one message
  EXPECT_FALSE(opt->has_sessions());
  for (uint32_t i = 0; i < 2; ++i) EXPECT_EQ(Master(*r0, i), initial[i]) << i;

  r0 = Join(*opt, 0, params, 2, "-again");
  r1 = Join(*opt, 1, params, 2, "-again");
  ASSERT_NE(r0, nullptr);
  ASSERT_NE(r1, nullptr);
  EXPECT_FALSE(r0->registration.initialize);
  EXPECT_EQ(r0->registration.iteration, 0u);
  EXPECT_EQ(opt->Report().state, "ready");
  EXPECT_TRUE(HasEvent(*events_, "optimizer.recovered"));
  std::vector<ReferenceAdamW> refs = {{Hyper(), initial[0]}, {Hyper(), initial[1]}};
  for (uint32_t i = 0; i < 2; ++i) {
    std::vector<float> g0 = RandomFloats(params[i].numel, 40 + i);
    std::vector<float> g1 = RandomFloats(params[i].numel, 45 + i);
    Post(*opt, *r0, i, g0, 1);  // the same iteration again: its earlier posts are forgotten
    Post(*opt, *r1, i, g1, 1);
    refs[i].Step(Sum({g0, g1}, 0.5));
  }
  UpdatesDone(*r0, 2, 1);
  UpdatesDone(*r1, 2, 1);
  for (uint32_t i = 0; i < 2; ++i) ExpectMatches(*r0, i, refs[i]);
  EXPECT_EQ(opt->Report().param_steps, (std::vector<uint64_t>{1, 1}));
  EXPECT_EQ(opt->Report().iteration, 1u);
}

// A rank that closes its session between steps fails the job only when another steps on
// without it: the ranks of a job that ends close one after another.
TEST_F(JobOptimizerTest, ARankLeavingCleanlyBetweenStepsFailsTheOthersWhenTheyStep) {
  auto opt = Make(Settings(), 2);
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("a", 8)};
  std::unique_ptr<Rank> r0 = Join(*opt, 0, params, 2);
  std::unique_ptr<Rank> r1 = Join(*opt, 1, params, 2);
  ASSERT_NE(r0, nullptr);
  ASSERT_NE(r1, nullptr);
  End(*opt, *r1, /*clean=*/true);
  EXPECT_FALSE(Pending(*r0));
  EXPECT_EQ(opt->Report().state, "ready");
  Post(*opt, *r0, 0, RandomFloats(8, 1), 1);
  std::vector<DoorbellMessage> m = Receive(*r0, 1);
  ASSERT_EQ(m.size(), 1u);
  EXPECT_EQ(m[0].kind, static_cast<uint32_t>(DoorbellKind::kError));
  EXPECT_TRUE(absl::StrContains(opt->Report().state, "rank 1 left the job"))
      << opt->Report().state;
}

// Every rank closes its session after the last step (torchrun's ranks at the end of a run):
// the job is finished, not failed, and a restart's ranks step it on from where it was.
TEST_F(JobOptimizerTest, AJobWhoseRanksAllLeaveCleanlyIsFinished) {
  auto opt = Make(Settings(), 2);
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("a", 8)};
  std::unique_ptr<Rank> r0 = Join(*opt, 0, params, 2);
  std::unique_ptr<Rank> r1 = Join(*opt, 1, params, 2);
  ASSERT_NE(r0, nullptr);
  ASSERT_NE(r1, nullptr);
  Post(*opt, *r0, 0, RandomFloats(8, 1), 1);
  Post(*opt, *r1, 0, RandomFloats(8, 2), 1);
  UpdatesDone(*r0, 1, 1);
  UpdatesDone(*r1, 1, 1);
  End(*opt, *r0, /*clean=*/true);
  End(*opt, *r1, /*clean=*/true);
  EXPECT_FALSE(Pending(*r1));
  EXPECT_EQ(opt->Report().state, "finished");
  EXPECT_FALSE(HasEvent(*events_, "optimizer.failed"));

  r1 = Join(*opt, 1, params, 2, "-again");  // any rank may come back first
  r0 = Join(*opt, 0, params, 2, "-again");
  ASSERT_NE(r0, nullptr);
  ASSERT_NE(r1, nullptr);
  EXPECT_EQ(r0->registration.iteration, 1u);
  EXPECT_EQ(opt->Report().state, "ready");
  Post(*opt, *r0, 0, RandomFloats(8, 3), 2);
  Post(*opt, *r1, 0, RandomFloats(8, 4), 2);
  UpdatesDone(*r0, 1, 2);
  UpdatesDone(*r1, 1, 2);
  EXPECT_EQ(opt->Report().iteration, 2u);
}

// The last rank's process dying is not a clean end: the job is kept for a restart ("ready"), not
// "finished".
TEST_F(JobOptimizerTest, AJobWhoseLastRankDiesIsNotFinished) {
  auto opt = Make(Settings(), 2);
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("a", 8)};
  std::unique_ptr<Rank> r0 = Join(*opt, 0, params, 2);
  std::unique_ptr<Rank> r1 = Join(*opt, 1, params, 2);
  ASSERT_NE(r0, nullptr);
  ASSERT_NE(r1, nullptr);
  End(*opt, *r0, /*clean=*/true);
  End(*opt, *r1, /*clean=*/false);
  EXPECT_EQ(opt->Report().state, "ready");
}

// A second session for a rank that is attached is refused before anything changes, even when its
// list would extend the job's.
TEST_F(JobOptimizerTest, ARefusedDuplicateRegistrationAddsNoParameters) {
  auto opt = Make(Settings());
  ASSERT_NE(opt, nullptr);
  std::unique_ptr<Rank> r = Join(*opt, 0, {Param("a", 8)});
  ASSERT_NE(r, nullptr);
  const OptimizerReport before = opt->Report();
  std::unique_ptr<Rank> dup = Attach(0, "s-duplicate");
  ASSERT_NE(dup, nullptr);
  absl::StatusOr<RegistrationResult> refused =
      opt->Register(dup->session_id, 0, {Param("a", 8), Param("b", 1000)});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "rank 0 of job 'job' is already "
                                                              "attached"))
      << refused.status();
  const OptimizerReport after = opt->Report();
  EXPECT_EQ(after.tensors, 1u);
  EXPECT_EQ(after.elements, 8u);
  EXPECT_EQ(after.state_bytes, before.state_bytes);
  EXPECT_FALSE(HasEvent(*events_, "optimizer.extended"));
}

// A rank whose gradient slots don't fit is not attached, and the slots it got are given back.
TEST_F(JobOptimizerTest, ARegistrationThatRunsOutOfMemoryLeavesTheRankDetached) {
  auto opt = Make(Settings(), 2);
  ASSERT_NE(opt, nullptr);
  // Rank 0's state and slot fit the fixture's 256 MiB arena (4 x 56 MiB, plus a small
  // segment); rank 1's slot of 'big' (56 MiB more) does not, after its slot of 'a' did.
  const std::vector<ParameterDescription> params = {Param("a", 64), Param("big", 14u << 20)};
  std::unique_ptr<Rank> r0 = Join(*opt, 0, params, 2);
  ASSERT_NE(r0, nullptr);
  const OptimizerReport before = opt->Report();
  std::unique_ptr<Rank> r1 = Attach(1, "s-rank1", 2);
  ASSERT_NE(r1, nullptr);
  absl::StatusOr<RegistrationResult> refused = opt->Register(r1->session_id, 1, params);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  const OptimizerReport after = opt->Report();
  EXPECT_EQ(after.ranks_attached, 1u);
  EXPECT_EQ(after.state_bytes, before.state_bytes);  // its slot of 'a' was given back
  // Not a rank of the job: its gradient is answered with an error and fails nothing.
  opt->OnGradientReady(r1->session_id,
                       {static_cast<uint32_t>(DoorbellKind::kGradientReady), 0, 0, 1, 0});
  std::vector<DoorbellMessage> m = Receive(*r1, 1);
  ASSERT_EQ(m.size(), 1u);
  EXPECT_EQ(m[0].kind, static_cast<uint32_t>(DoorbellKind::kError));
  EXPECT_EQ(opt->Report().state, "ready");
}

TEST_F(JobOptimizerTest, PostsOutOfTurnFailTheJob) {
  struct Case {
    const char* name;
    uint64_t id, step, micro;
    const char* message;
  };
  const Case cases[] = {
      {"unknown parameter", 5, 1, 0, "posted a gradient for parameter 5"},
      {"wrong iteration", 0, 2, 0, "for iteration 2, but the job is at iteration 1"},
      {"wrong micro-step", 0, 1, 1, "posted micro-step 1 of 'a'"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto opt = Make(Settings(), 1, absl::StrCat("job-", c.id, c.step, c.micro));
    ASSERT_NE(opt, nullptr);
    std::unique_ptr<Rank> r =
        Attach(0, absl::StrCat("s-", c.id, c.step, c.micro));
    ASSERT_NE(r, nullptr);
    ASSERT_TRUE(opt->Register(r->session_id, 0, {Param("a", 8)}).ok());
    opt->OnGradientReady(r->session_id, {static_cast<uint32_t>(DoorbellKind::kGradientReady), 0,
                                         c.id, c.step, c.micro});
    std::vector<DoorbellMessage> m = Receive(*r, 1);
    ASSERT_EQ(m.size(), 1u);
    EXPECT_EQ(m[0].kind, static_cast<uint32_t>(DoorbellKind::kError));
    EXPECT_TRUE(absl::StrContains(opt->Report().state, c.message)) << opt->Report().state;
    doorbells_->Remove(r->session_id);
  }
  // A session that is not a rank of the job gets an error back and changes nothing.
  auto opt = Make(Settings(), 1, "job-stranger");
  ASSERT_NE(opt, nullptr);
  std::unique_ptr<Rank> stranger = Attach(0, "s-stranger");
  ASSERT_NE(stranger, nullptr);
  opt->OnGradientReady(stranger->session_id,
                       {static_cast<uint32_t>(DoorbellKind::kGradientReady), 0, 0, 1, 0});
  std::vector<DoorbellMessage> m = Receive(*stranger, 1);
  ASSERT_EQ(m.size(), 1u);
  EXPECT_EQ(m[0].kind, static_cast<uint32_t>(DoorbellKind::kError));
  EXPECT_EQ(opt->Report().state, "ready");
}

TEST_F(JobOptimizerTest, SetStepsValidatesAndSetsTheBiasCorrection) {
  auto opt = Make(Settings(), 2);
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("a", 40), Param("b", 40)};
  std::unique_ptr<Rank> r0 = Join(*opt, 0, params, 2);
  std::unique_ptr<Rank> r1 = Join(*opt, 1, params, 2);
  ASSERT_NE(r0, nullptr);
  ASSERT_NE(r1, nullptr);
  std::vector<std::vector<float>> initial = Initialize(*r0, params);
  EXPECT_EQ(opt->SetSteps(3, {1, 2, 3}).code(), absl::StatusCode::kInvalidArgument);
  // Mid-step (rank 0 posted, rank 1 not yet).
  std::vector<float> g0 = RandomFloats(40, 1);
  Post(*opt, *r0, 0, g0, 1);
  EXPECT_EQ(opt->SetSteps(3, {}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(opt->Report().iteration, 0u);
  std::vector<float> g1 = RandomFloats(40, 2);
  Post(*opt, *r1, 0, g1, 1);
  PostNone(*opt, *r0, 1, 1);
  PostNone(*opt, *r1, 1, 1);
  UpdatesDone(*r0, 2, 1);
  UpdatesDone(*r1, 2, 1);
  ReferenceAdamW a(Hyper(), initial[0]);
  a.Step(Sum({g0, g1}, 0.5));
  ExpectMatches(*r0, 0, a);

  ASSERT_TRUE(opt->SetSteps(7, {4, 9}).ok());
  OptimizerReport report = opt->Report();
  EXPECT_EQ(report.iteration, 7u);
  EXPECT_EQ(report.param_steps, (std::vector<uint64_t>{4, 9}));
  // The next post is for iteration 8, and each tensor's update uses its own step count.
  ReferenceAdamW b(Hyper(), initial[1]);
  b.t = 9;
  a.t = 4;
  for (uint32_t i = 0; i < 2; ++i) {
    std::vector<float> h0 = RandomFloats(40, 10 + i), h1 = RandomFloats(40, 20 + i);
    Post(*opt, *r0, i, h0, 8);
    Post(*opt, *r1, i, h1, 8);
    (i == 0 ? a : b).Step(Sum({h0, h1}, 0.5));
  }
  UpdatesDone(*r0, 2, 8);
  UpdatesDone(*r1, 2, 8);
  ExpectMatches(*r0, 0, a);
  ExpectMatches(*r0, 1, b);
  EXPECT_EQ(opt->Report().param_steps, (std::vector<uint64_t>{5, 10}));
  // No list: every parameter takes the iteration.
  ASSERT_TRUE(opt->SetSteps(2, {}).ok());
  EXPECT_EQ(opt->Report().param_steps, (std::vector<uint64_t>{2, 2}));
}

TEST_F(JobOptimizerTest, SetGroupsValidatesAndRetunesTheNextStep) {
  OptimizerSettings settings = Settings();
  settings.groups = {Hyper(), Hyper(3e-3, 0.0)};
  auto opt = Make(settings);
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("a", 30, 0), Param("b", 30, 1)};
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  std::vector<std::vector<float>> initial = Initialize(*r, params);
  GroupHyperParameters negative_lr = Hyper(-1.0);
  EXPECT_EQ(opt->SetGroups({Hyper(), negative_lr}, 0).code(),
            absl::StatusCode::kInvalidArgument);
  // Parameter 'b' is in group 1: the groups cannot shrink to one.
  EXPECT_EQ(opt->SetGroups({Hyper()}, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(opt->SetGroups({Hyper(), Hyper()}, -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(opt->SetGroups({Hyper(), Hyper()}, std::nan("")).code(),
            absl::StatusCode::kInvalidArgument);
  // Clipping was off at creation: it cannot be switched on.
  EXPECT_EQ(opt->SetGroups({Hyper(), Hyper()}, 1.0).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(opt->Report().settings.groups, settings.groups);  // refused calls changed nothing

  const std::vector<GroupHyperParameters> retuned = {Hyper(5e-2, 0.2), Hyper(1e-3, 0.0)};
  ASSERT_TRUE(opt->SetGroups(retuned, 0).ok());
  EXPECT_EQ(opt->Report().settings.groups, retuned);
  std::vector<ReferenceAdamW> refs = {{retuned[0], initial[0]}, {retuned[1], initial[1]}};
  for (uint32_t i = 0; i < 2; ++i) {
    std::vector<float> grad = RandomFloats(30, 5 + i);
    Post(*opt, *r, i, grad, 1);
    refs[i].Step(Sum({grad}, 1.0));
  }
  UpdatesDone(*r, 2, 1);
  for (uint32_t i = 0; i < 2; ++i) ExpectMatches(*r, i, refs[i]);
}

// New hyper-parameters that arrive after some tensors of an iteration have stepped apply from the
// next iteration: one iteration's tensors all step with the same values.
TEST_F(JobOptimizerTest, SetGroupsMidIterationAppliesFromTheNextIteration) {
  auto opt = Make(Settings());
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("a", 30), Param("b", 30)};
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  std::vector<std::vector<float>> initial = Initialize(*r, params);
  std::vector<ReferenceAdamW> refs = {{Hyper(), initial[0]}, {Hyper(), initial[1]}};
  std::vector<float> grad = RandomFloats(30, 1);
  Post(*opt, *r, 0, grad, 1);
  refs[0].Step(Sum({grad}, 1.0));
  UpdatesDone(*r, 1, 1);  // 'a' stepped with the old values
  const std::vector<GroupHyperParameters> retuned = {Hyper(5e-2, 0.2)};
  EXPECT_EQ(opt->SetGroups({Hyper(-1.0)}, 0).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(opt->SetGroups(retuned, 0).ok());
  EXPECT_EQ(opt->Report().settings.groups, Settings().groups);
  EXPECT_TRUE(HasEvent(*events_, "optimizer.groups_deferred"));
  grad = RandomFloats(30, 2);
  Post(*opt, *r, 1, grad, 1);
  refs[1].Step(Sum({grad}, 1.0));  // and so does 'b'
  UpdatesDone(*r, 1, 1);
  for (uint32_t i = 0; i < 2; ++i) ExpectMatches(*r, i, refs[i]);
  EXPECT_EQ(opt->Report().settings.groups, retuned);
  for (uint32_t i = 0; i < 2; ++i) {
    refs[i].g = retuned[0];
    grad = RandomFloats(30, 3 + i);
    Post(*opt, *r, i, grad, 2);
    refs[i].Step(Sum({grad}, 1.0));
  }
  UpdatesDone(*r, 2, 2);
  for (uint32_t i = 0; i < 2; ++i) ExpectMatches(*r, i, refs[i]);
}

TEST_F(JobOptimizerTest, SaveAndLoadRoundTripAndContinueBitIdentically) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/job_optimizer_test_",
                                        ::getpid(), ".safetensors");
  auto opt = Make(Settings());
  ASSERT_NE(opt, nullptr);
  EXPECT_EQ(opt->Save(path).status().code(), absl::StatusCode::kFailedPrecondition);
  ParameterDescription bf16 = Param("half", 48);
  bf16.param_type = kernels::ScalarType::kBFloat16;
  const std::vector<ParameterDescription> params = {Param("a", 1000), bf16};
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  ASSERT_TRUE(r->registration.params[1].param.has_value());  // a model-dtype copy
  Initialize(*r, params);
  auto step = [&](uint64_t iteration) {
    for (uint32_t i = 0; i < params.size(); ++i) {
      Post(*opt, *r, i, RandomFloats(params[i].numel, 500 + 10 * iteration + i), iteration);
    }
    UpdatesDone(*r, params.size(), iteration);
  };
  step(1);
  step(2);
  absl::StatusOr<uint64_t> written = opt->Save(path);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_GT(*written, (1000 + 48) * 3 * sizeof(float));
  std::vector<std::vector<float>> saved_master, saved_m, saved_v;
  for (uint32_t i = 0; i < params.size(); ++i) {
    saved_master.push_back(Master(*r, i));
    saved_m.push_back(ExpAvg(*r, i));
    saved_v.push_back(ExpAvgSq(*r, i));
  }
  step(3);
  std::vector<std::vector<float>> third;
  for (uint32_t i = 0; i < params.size(); ++i) third.push_back(Master(*r, i));
  EXPECT_NE(third[0], saved_master[0]);

  ASSERT_TRUE(opt->Load(path).ok());
  OptimizerReport report = opt->Report();
  EXPECT_EQ(report.iteration, 2u);
  EXPECT_EQ(report.param_steps, (std::vector<uint64_t>{2, 2}));
  for (uint32_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(Master(*r, i), saved_master[i]) << i;
    EXPECT_EQ(ExpAvg(*r, i), saved_m[i]) << i;
    EXPECT_EQ(ExpAvgSq(*r, i), saved_v[i]) << i;
  }
  // The bf16 copy the model reads follows the restored master.
  const auto* half =
      reinterpret_cast<const uint16_t*>(Bytes(*r->registration.params[1].param));
  ASSERT_NE(half, nullptr);
  for (size_t k = 0; k < 48; ++k) {
    EXPECT_EQ(half[k], kernels::FloatToBFloat16(saved_master[1][k])) << k;
  }
  step(3);  // the same gradients as the first time round
  for (uint32_t i = 0; i < params.size(); ++i) EXPECT_EQ(Master(*r, i), third[i]) << i;

  // Mid-step, both are refused.
  Post(*opt, *r, 0, RandomFloats(1000, 1), 4);
  EXPECT_EQ(opt->Save(path).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(opt->Load(path).code(), absl::StatusCode::kFailedPrecondition);
  Post(*opt, *r, 1, RandomFloats(48, 2), 4);
  UpdatesDone(*r, 2, 4);

  // Another job's parameter list is refused before anything is overwritten.
  auto other = Make(Settings(), 1, "other");
  ASSERT_NE(other, nullptr);
  std::unique_ptr<Rank> o = Attach(0, "s-other");
  ASSERT_NE(o, nullptr);
  absl::StatusOr<RegistrationResult> reg =
      other->Register(o->session_id, 0, {Param("a", 999), bf16});
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_EQ(other->Load(path).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(other->Report().iteration, 0u);
  ::unlink(path.c_str());
}

}  // namespace
}  // namespace trainstream::daemon::job_optimizer_test
