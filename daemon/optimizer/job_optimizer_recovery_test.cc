// SPDX-License-Identifier: Apache-2.0
// JobOptimizer after a failure: what the failed iteration's tasks still on the pool may do, and
// what its tensors hold once the ranks are back or a checkpoint is restored.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "optimizer/job_optimizer_test_fixture.h"

namespace trainstream::daemon::job_optimizer_test {
namespace {

// How long the pool stays held after a call that must wait for it: long enough that a call
// that doesn't wait has done its work by then.
constexpr absl::Duration kHold = absl::Milliseconds(200);

// The failed iteration's statistics task runs only after the job is back. Were the progress
// reset under it, it would count its chunk against the redone iteration's tensor, whose update
// would then never be counted done: the iteration would hang.
TEST_F(JobOptimizerTest, RecoveryWaitsForTheFailedIterationsTasks) {
  OptimizerSettings settings = Settings();
  settings.max_grad_norm = 1e6;  // statistics first (and a clip that never bites)
  auto opt = Make(settings);
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("w", 64)};
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  std::vector<std::vector<float>> initial = Initialize(*r, params);
  std::vector<float> grad = RandomFloats(64, 2);
  {
    PoolBlocker blocker(*pool_);
    Post(*opt, *r, 0, RandomFloats(64, 1), 1);  // its statistics wait in the pool's queue
    // The error waits for that speculating pass to be undone, so the rank leaves without it.
    FailOutOfTurn(*opt, *r);
    End(*opt, *r, /*clean=*/true);
    blocker.ReleaseOneAfter(kHold);
    r = Join(*opt, 0, params, 1, "-again");
    ASSERT_NE(r, nullptr);
    EXPECT_EQ(r->registration.iteration, 0u);
    Post(*opt, *r, 0, grad, 1);
    blocker.Join();
  }
  ReferenceAdamW ref(Hyper(), initial[0]);
  ref.Step(Sum({grad}, 1.0));
  EXPECT_EQ(UpdatesDone(*r, 1, 1)[0], 0u);
  ExpectMatches(*r, 0, ref);
  EXPECT_EQ(opt->Report().param_steps, std::vector<uint64_t>{1});
  EXPECT_EQ(opt->Report().iteration, 1u);
}

// Load on a failed job waits for the failed iteration's update still queued, so the restored
// state is what the file holds, not the update written over it afterwards.
TEST_F(JobOptimizerTest, LoadOnAFailedJobIsNotOverwrittenByItsQueuedUpdate) {
  const std::string path =
      absl::StrCat(::testing::TempDir(), "/job_optimizer_recovery_", ::getpid(), ".safetensors");
  auto opt = Make(Settings());
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("w", kLargeNumel)};
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  std::vector<std::vector<float>> initial = Initialize(*r, params);
  ASSERT_TRUE(opt->Save(path).ok());
  {
    PoolBlocker blocker(*pool_);
    Post(*opt, *r, 0, RandomFloats(kLargeNumel, 1), 1);  // its update waits in the queue
    PostOutOfTurn(*opt, *r);
    blocker.ReleaseOneAfter(kHold);
    ASSERT_TRUE(opt->Load(path).ok());
    blocker.Join();
    blocker.ReleaseAll();
    Drain(*pool_);
  }
  EXPECT_EQ(Master(*r, 0), initial[0]);
  EXPECT_EQ(ExpAvg(*r, 0), std::vector<float>(kLargeNumel, 0.0f));
  EXPECT_EQ(opt->Report().param_steps, std::vector<uint64_t>{0});
  EXPECT_EQ(opt->Report().state, "ready");
  // And the job steps on from the restored state.
  ReferenceAdamW ref(Hyper(), initial[0]);
  std::vector<float> grad = RandomFloats(kLargeNumel, 3);
  Post(*opt, *r, 0, grad, 1);
  ref.Step(Sum({grad}, 1.0));
  UpdatesDone(*r, 1, 1);
  ExpectMatches(*r, 0, ref);
  ::unlink(path.c_str());
}

// A tensor whose update was done when a rank died keeps it: the redone iteration doesn't step
// it again, so every tensor's step count stays the iteration count.
TEST_F(JobOptimizerTest, ATensorSteppedBeforeAFailureIsNotSteppedAgainWhenTheIterationIsRedone) {
  auto opt = Make(Settings(), 2);
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("a", 50), Param("b", 20)};
  std::unique_ptr<Rank> r0 = Join(*opt, 0, params, 2);
  std::unique_ptr<Rank> r1 = Join(*opt, 1, params, 2);
  ASSERT_NE(r0, nullptr);
  ASSERT_NE(r1, nullptr);
  std::vector<std::vector<float>> initial = Initialize(*r0, params);
  std::vector<ReferenceAdamW> refs = {{Hyper(), initial[0]}, {Hyper(), initial[1]}};
  std::vector<float> a0 = RandomFloats(50, 1), a1 = RandomFloats(50, 2);
  Post(*opt, *r0, 0, a0, 1);
  Post(*opt, *r1, 0, a1, 1);
  refs[0].Step(Sum({a0, a1}, 0.5));
  UpdatesDone(*r0, 1, 1);
  UpdatesDone(*r1, 1, 1);
  End(*opt, *r1, /*clean=*/false);  // before 'b'
  EXPECT_EQ(Receive(*r0, 1).at(0).kind, static_cast<uint32_t>(DoorbellKind::kError));
  End(*opt, *r0, /*clean=*/true);

  r0 = Join(*opt, 0, params, 2, "-again");
  r1 = Join(*opt, 1, params, 2, "-again");
  ASSERT_NE(r0, nullptr);
  ASSERT_NE(r1, nullptr);
  EXPECT_EQ(r0->registration.iteration, 0u);
  EXPECT_EQ(opt->Report().param_steps, (std::vector<uint64_t>{1, 0}));
  for (uint32_t i = 0; i < 2; ++i) {
    std::vector<float> g0 = RandomFloats(params[i].numel, 10 + i);
    std::vector<float> g1 = RandomFloats(params[i].numel, 20 + i);
    Post(*opt, *r0, i, g0, 1);
    Post(*opt, *r1, i, g1, 1);
    if (i == 1) refs[1].Step(Sum({g0, g1}, 0.5));  // 'a' keeps its step of the first attempt
  }
  for (Rank* r : {r0.get(), r1.get()}) {
    std::map<uint64_t, uint32_t> done = UpdatesDone(*r, 2, 1);
    EXPECT_EQ(done[0], 0u);  // copy 'a' back: its value is this iteration's
    EXPECT_EQ(done[1], 0u);
  }
  for (uint32_t i = 0; i < 2; ++i) ExpectMatches(*r0, i, refs[i]);
  OptimizerReport report = opt->Report();
  EXPECT_EQ(report.param_steps, (std::vector<uint64_t>{1, 1}));
  EXPECT_EQ(report.iteration, 1u);
  // The next iteration steps both.
  for (uint32_t i = 0; i < 2; ++i) {
    std::vector<float> g0 = RandomFloats(params[i].numel, 30 + i);
    std::vector<float> g1 = RandomFloats(params[i].numel, 40 + i);
    Post(*opt, *r0, i, g0, 2);
    Post(*opt, *r1, i, g1, 2);
    refs[i].Step(Sum({g0, g1}, 0.5));
  }
  UpdatesDone(*r0, 2, 2);
  UpdatesDone(*r1, 2, 2);
  for (uint32_t i = 0; i < 2; ++i) ExpectMatches(*r0, i, refs[i]);
  EXPECT_EQ(opt->Report().param_steps, (std::vector<uint64_t>{2, 2}));
}

// A rank dies while a tensor's update (two chunks) waits on the pool: the update still runs to
// its end and counts, so the tensor is stepped once, not half-stepped or stepped uncounted.
TEST_F(JobOptimizerTest, AnUpdateUnderWayWhenTheJobFailsCompletesAndCounts) {
  auto opt = Make(Settings(), 2);
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = {Param("big", kLargeNumel), Param("b", 20)};
  std::unique_ptr<Rank> r0 = Join(*opt, 0, params, 2);
  std::unique_ptr<Rank> r1 = Join(*opt, 1, params, 2);
  ASSERT_NE(r0, nullptr);
  ASSERT_NE(r1, nullptr);
  std::vector<std::vector<float>> initial = Initialize(*r0, params);
  std::vector<ReferenceAdamW> refs = {{Hyper(), initial[0]}, {Hyper(), initial[1]}};
  {
    PoolBlocker blocker(*pool_);
    std::vector<float> g0 = RandomFloats(kLargeNumel, 1), g1 = RandomFloats(kLargeNumel, 2);
    Post(*opt, *r0, 0, g0, 1);
    Post(*opt, *r1, 0, g1, 1);  // its update's two chunks wait in the queue
    refs[0].Step(Sum({g0, g1}, 0.5));
    End(*opt, *r1, /*clean=*/false);
    EXPECT_EQ(Receive(*r0, 1).at(0).kind, static_cast<uint32_t>(DoorbellKind::kError));
    End(*opt, *r0, /*clean=*/true);
    blocker.ReleaseOneAfter(kHold);
    r0 = Join(*opt, 0, params, 2, "-again");
    ASSERT_NE(r0, nullptr);
    blocker.Join();
    r1 = Join(*opt, 1, params, 2, "-again");
    ASSERT_NE(r1, nullptr);
    EXPECT_EQ(opt->Report().param_steps, (std::vector<uint64_t>{1, 0}));
    ExpectMatches(*r0, 0, refs[0]);
    for (uint32_t i = 0; i < 2; ++i) {
      std::vector<float> h0 = RandomFloats(params[i].numel, 10 + i);
      std::vector<float> h1 = RandomFloats(params[i].numel, 20 + i);
      Post(*opt, *r0, i, h0, 1);
      Post(*opt, *r1, i, h1, 1);
      if (i == 1) refs[1].Step(Sum({h0, h1}, 0.5));
    }
  }
  UpdatesDone(*r0, 2, 1);
  UpdatesDone(*r1, 2, 1);
  for (uint32_t i = 0; i < 2; ++i) ExpectMatches(*r0, i, refs[i]);
  EXPECT_EQ(opt->Report().param_steps, (std::vector<uint64_t>{1, 1}));
  EXPECT_EQ(opt->Report().iteration, 1u);
  EXPECT_TRUE(HasEvent(*events_, "optimizer.recovered"));
}

}  // namespace
}  // namespace trainstream::daemon::job_optimizer_test
