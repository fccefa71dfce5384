// SPDX-License-Identifier: Apache-2.0
// JobOptimizer after a failure: what the failed iteration's tasks still on the pool may do, and
// what its tensors hold once the ranks are back or a checkpoint is restored.
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
    PostOutOfTurn(*opt, *r);
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
  const std::string path = absl::StrCat(::testing::TempDir(), "/job_optimizer_recovery_",
                                        ::getpid(), ".safetensors");
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

}  // namespace
}  // namespace trainstream::daemon::job_optimizer_test
