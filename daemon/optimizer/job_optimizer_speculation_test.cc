// SPDX-License-Identifier: Apache-2.0
// JobOptimizer's speculative updates: whatever the steps' norms and non-finite values, the state
// is bit for bit the one of updating after the step's last gradient (defer_updates), and a
// speculated update is never seen by a rank, nor kept by a failed job, before its decision.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "optimizer/job_optimizer_internal.h"
#include "optimizer/job_optimizer_test_fixture.h"

namespace trainstream::daemon::job_optimizer_test {
namespace {

// Uniform gradients in (-1, 1) over these tensors have a norm of about 317: a scale of 1 is
// clipped by max_grad_norm 1, one of 1e-3 is not.
constexpr double kClipped = 1.0;
constexpr double kUnclipped = 1e-3;

std::vector<ParameterDescription> Params() {
  ParameterDescription big = Param("big", kLargeNumel);
  big.param_type = kernels::ScalarType::kBFloat16;  // has a parameter slot, copied aside too
  return {Param("a", 1000), big, Param("c", 7)};
}

struct Scenario {
  std::vector<double> scales;  // one per step
  uint64_t nan_step = 0;       // > 0: a NaN in `nan_tensor`'s gradient at this step
  uint32_t nan_tensor = 0;
};

struct Outcome {
  std::vector<std::vector<uint8_t>> state;          // per buffer
  std::vector<std::map<uint64_t, uint32_t>> flags;  // kUpdateDone flags, per step
  std::vector<double> norms;                        // per step
  OptimizerReport report;
};

class SpeculationTest : public JobOptimizerTest {
 protected:
  std::shared_ptr<JobOptimizer> MakeWith(const OptimizerSettings& settings,
                                         uint64_t speculation_bytes, uint32_t world_size = 1) {
    JobOptimizer::Deps deps = Deps();
    deps.speculation_bytes = speculation_bytes;
    auto created = JobOptimizer::Create({kUid, "job"}, settings, world_size, deps);
    EXPECT_TRUE(created.ok()) << created.status();
    return created.ok() ? *created : nullptr;
  }

  std::vector<float> Gradient(const ParameterDescription& d, uint32_t index, uint64_t step,
                              const Scenario& scenario) {
    std::vector<float> grad = RandomFloats(d.numel, 7000 * step + index);
    for (float& x : grad) x = static_cast<float>(x * scenario.scales[step - 1]);
    if (step == scenario.nan_step && index == scenario.nan_tensor) {
      grad[3] = std::numeric_limits<float>::quiet_NaN();
    }
    return grad;
  }

  std::vector<std::vector<uint8_t>> State(const Rank& r) {
    std::vector<std::vector<uint8_t>> state;
    for (const ParameterSlots& slots : r.registration.params) {
      std::vector<BufferRecord> records = {slots.master, slots.exp_avg, slots.exp_avg_sq};
      if (slots.param) records.push_back(*slots.param);
      for (const BufferRecord& record : records) {
        const uint8_t* data = Bytes(record);
        state.emplace_back(data, data + record.bytes);
      }
    }
    return state;
  }

  // The scenario's steps on a fresh job with these settings; the job is closed after.
  Outcome Run(const OptimizerSettings& settings, const Scenario& scenario,
              uint64_t speculation_bytes = ~uint64_t{0}) {
    Outcome out;
    auto opt = MakeWith(settings, speculation_bytes);
    if (opt == nullptr) return out;
    const std::vector<ParameterDescription> params = Params();
    std::unique_ptr<Rank> r = Join(*opt, 0, params, 1, absl::StrCat("-", ++runs_));
    if (r == nullptr) return out;
    Initialize(*r, params);
    for (uint64_t step = 1; step <= scenario.scales.size(); ++step) {
      for (uint32_t i = 0; i < params.size(); ++i) {
        Post(*opt, *r, i, Gradient(params[i], i, step, scenario), step);
      }
      out.flags.push_back(UpdatesDone(*r, params.size(), step));
      out.norms.push_back(opt->Report().last_step.grad_norm);
    }
    out.state = State(*r);
    out.report = opt->Report();
    End(*opt, *r, /*clean=*/true);
    Drain(*pool_);
    return out;
  }

  static OptimizerSettings Clipping(bool eager, bool deferred) {
    OptimizerSettings s = Settings();
    s.max_grad_norm = 1.0;
    s.eager_updates = eager;
    s.defer_updates = deferred;
    return s;
  }

  // The run against the same steps updated after each step's last gradient, bit for bit.
  void ExpectSameAsBarrier(const Outcome& got, OptimizerSettings settings,
                           const Scenario& scenario) {
    settings.eager_updates = false;
    settings.defer_updates = true;
    const Outcome want = Run(settings, scenario);
    ASSERT_EQ(got.state.size(), want.state.size());
    for (size_t k = 0; k < got.state.size(); ++k) {
      EXPECT_TRUE(got.state[k] == want.state[k]) << "buffer " << k << " differs";
    }
    EXPECT_EQ(got.flags, want.flags);
    EXPECT_EQ(got.norms, want.norms);
    EXPECT_EQ(want.report.speculated_steps, 0u);
  }

  int runs_ = 0;
};

TEST_F(SpeculationTest, ClippedOnEveryStepRollsBackEachAndMatchesTheBarrier) {
  const Scenario scenario{{kClipped, kClipped, kClipped, kClipped}};
  const Outcome eager = Run(Clipping(/*eager=*/true, false), scenario);
  EXPECT_EQ(eager.report.speculated_steps, 4u);
  EXPECT_EQ(eager.report.rolled_back_steps, 4u);
  EXPECT_TRUE(eager.report.last_step.rolled_back);
  EXPECT_EQ(eager.report.last_step.speculated_tensors, 3u);
  EXPECT_LT(eager.report.last_step.clip_coef, 0.01);
  EXPECT_TRUE(HasEvent(*events_, "optimizer.rolled_back"));
  ExpectSameAsBarrier(eager, Clipping(true, false), scenario);
}

TEST_F(SpeculationTest, NeverClippedPublishesTheSpeculatedUpdates) {
  const Scenario scenario{{kUnclipped, kUnclipped, kUnclipped}};
  const Outcome eager = Run(Clipping(/*eager=*/true, false), scenario);
  EXPECT_EQ(eager.report.speculated_steps, 3u);
  EXPECT_EQ(eager.report.rolled_back_steps, 0u);
  EXPECT_EQ(eager.report.last_step.clip_coef, 1.0);
  EXPECT_FALSE(HasEvent(*events_, "optimizer.rolled_back"));
  ExpectSameAsBarrier(eager, Clipping(true, false), scenario);
}

TEST_F(SpeculationTest, TheDefaultSpeculatesOnlyAfterAStepThatNeededNoClipping) {
  // 1: speculates, kept. 2: speculates, rolled back. 3: waits (2 clipped). 4: speculates (3 did
  // not clip), rolled back. 5: waits. 6: speculates, rolled back.
  const Scenario scenario{{kUnclipped, kClipped, kUnclipped, kClipped, kUnclipped, kClipped}};
  const Outcome adaptive = Run(Clipping(false, false), scenario);
  EXPECT_EQ(adaptive.report.speculated_steps, 4u);
  EXPECT_EQ(adaptive.report.rolled_back_steps, 3u);
  ExpectSameAsBarrier(adaptive, Clipping(false, false), scenario);
}

TEST_F(SpeculationTest, AlternateClippingWithEagerUpdatesMatchesTheBarrier) {
  const Scenario scenario{{kClipped, kUnclipped, kClipped, kUnclipped, kUnclipped}};
  const Outcome eager = Run(Clipping(true, false), scenario);
  EXPECT_EQ(eager.report.speculated_steps, 5u);
  EXPECT_EQ(eager.report.rolled_back_steps, 2u);
  ExpectSameAsBarrier(eager, Clipping(true, false), scenario);
}

// Two ranks, two micro-steps a step: the speculated passes read the summed buffer.
TEST_F(SpeculationTest, RanksAndMicroStepsMatchTheBarrier) {
  const std::vector<ParameterDescription> params = Params();
  const std::vector<double> scales = {kClipped, kUnclipped, kClipped};
  auto run = [&](bool eager) {
    OptimizerSettings settings = Clipping(eager, /*deferred=*/!eager);
    settings.accumulation_steps = 2;
    auto opt = MakeWith(settings, ~uint64_t{0}, /*world_size=*/2);
    std::vector<std::unique_ptr<Rank>> ranks;
    for (uint32_t k = 0; k < 2; ++k) {
      ranks.push_back(Join(*opt, k, params, 2, absl::StrCat("-ranks", ++runs_)));
    }
    Initialize(*ranks[0], params);
    for (uint64_t step = 1; step <= scales.size(); ++step) {
      for (uint32_t micro = 0; micro < 2; ++micro) {
        for (uint32_t i = 0; i < params.size(); ++i) {
          for (uint32_t k = 0; k < 2; ++k) {
            std::vector<float> grad =
                RandomFloats(params[i].numel, 7000 * step + 100 * k + 10 * micro + i);
            for (float& x : grad) x = static_cast<float>(x * scales[step - 1]);
            Post(*opt, *ranks[k], i, grad, step, micro);
          }
        }
        if (micro == 0) {
          for (auto& r : ranks) EXPECT_EQ(Receive(*r, params.size()).size(), params.size());
        }
      }
      for (auto& r : ranks) EXPECT_EQ(UpdatesDone(*r, params.size(), step).size(), params.size());
    }
    std::pair<std::vector<std::vector<uint8_t>>, OptimizerReport> out = {State(*ranks[0]),
                                                                         opt->Report()};
    for (auto& r : ranks) End(*opt, *r, /*clean=*/true);
    Drain(*pool_);
    return out;
  };
  const auto eager = run(true);
  const auto barrier = run(false);
  EXPECT_EQ(eager.second.speculated_steps, 3u);
  EXPECT_EQ(eager.second.rolled_back_steps, 2u);
  EXPECT_TRUE(eager.first == barrier.first);
  EXPECT_EQ(eager.second.param_steps, barrier.second.param_steps);
}

TEST_F(SpeculationTest, ManySmallChunksGiveTheSameNormAsTheBarrier) {
  // 74 chunks for the large tensor, on three workers: the chunks end in any order, and the norm
  // (so the clip) must not depend on it.
  OptimizerSettings settings = Clipping(true, false);
  settings.chunk_elements = 4096;
  const Scenario scenario{{kClipped, kUnclipped, kClipped, kClipped}};
  const Outcome eager = Run(settings, scenario);
  EXPECT_EQ(eager.report.rolled_back_steps, 3u);
  ExpectSameAsBarrier(eager, settings, scenario);
}

TEST_F(SpeculationTest, ANanUnderSkipRestoresEveryTensorAndTheNextStepRuns) {
  for (uint32_t nan_tensor : {0u, 1u, 2u}) {
    SCOPED_TRACE(absl::StrCat("NaN in tensor ", nan_tensor));
    OptimizerSettings settings = Clipping(true, false);
    settings.max_grad_norm = 0;
    settings.nonfinite = NonFinitePolicy::kSkipStep;
    const Scenario scenario{{kUnclipped, kClipped, kUnclipped}, /*nan_step=*/2, nan_tensor};
    const Outcome eager = Run(settings, scenario);
    ASSERT_EQ(eager.flags.size(), 3u);
    for (const auto& [id, flags] : eager.flags[1]) {
      EXPECT_EQ(flags, ipc::kFlagSkipped) << "tensor " << id << " at the skipped step";
    }
    for (const auto& [id, flags] : eager.flags[2]) EXPECT_EQ(flags, 0u) << "tensor " << id;
    EXPECT_EQ(eager.report.rolled_back_steps, 1u);
    ExpectSameAsBarrier(eager, settings, scenario);
  }
}

TEST_F(SpeculationTest, TensorsWithoutRoomForACopyWaitAndTheResultIsTheSame) {
  // Room for "a" (1000 x 12 bytes) and "c", not for "big" (300000 x 14 bytes).
  const Scenario scenario{{kClipped, kUnclipped, kClipped}};
  const Outcome limited = Run(Clipping(true, false), scenario, /*speculation_bytes=*/20000);
  EXPECT_TRUE(HasEvent(*events_, "optimizer.speculation_limited"));
  EXPECT_EQ(limited.report.last_step.speculated_tensors, 2u);
  ExpectSameAsBarrier(limited, Clipping(true, false), scenario);
}

TEST_F(SpeculationTest, ASpeculatedUpdateIsMadeBeforeTheLastGradientButNotPublished) {
  auto opt = MakeWith(Clipping(true, false), ~uint64_t{0});
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = Params();
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  const std::vector<std::vector<float>> initial = Initialize(*r, params);
  const Scenario scenario{{kClipped}};
  Post(*opt, *r, 0, Gradient(params[0], 0, 1, scenario), 1);
  Drain(*pool_);
  // Updated in place before the norm is known (a barrier would leave it as it was)...
  EXPECT_NE(Master(*r, 0), initial[0]);
  // ...but no rank hears of it until the decision.
  EXPECT_FALSE(Pending(*r));
  for (uint32_t i = 1; i < params.size(); ++i) {
    Post(*opt, *r, i, Gradient(params[i], i, 1, scenario), 1);
  }
  EXPECT_EQ(UpdatesDone(*r, params.size(), 1).size(), params.size());
  EXPECT_TRUE(opt->Report().last_step.rolled_back);
}

TEST_F(SpeculationTest, ARankDyingMidStepLeavesSpeculatedTensorsUntouched) {
  auto opt = MakeWith(Clipping(true, false), ~uint64_t{0});
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = Params();
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  Initialize(*r, params);
  const std::vector<std::vector<uint8_t>> before = State(*r);
  const Scenario scenario{{kUnclipped}};
  Post(*opt, *r, 0, Gradient(params[0], 0, 1, scenario), 1);
  Post(*opt, *r, 1, Gradient(params[1], 1, 1, scenario), 1);
  End(*opt, *r, /*clean=*/false);
  // The speculating tensors' passes end, then their copies go back.
  Drain(*pool_);
  Drain(*pool_);
  Drain(*pool_);
  EXPECT_EQ(State(*r), before);
  EXPECT_TRUE(HasEvent(*events_, "optimizer.failed"));
  EXPECT_EQ(opt->Report().param_steps, std::vector<uint64_t>(params.size(), 0));
}

TEST_F(SpeculationTest, TheErrorPolicyFailsTheJobWithNothingUpdated) {
  OptimizerSettings settings = Clipping(true, false);
  settings.nonfinite = NonFinitePolicy::kError;
  auto opt = MakeWith(settings, ~uint64_t{0});
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = Params();
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  Initialize(*r, params);
  const std::vector<std::vector<uint8_t>> before = State(*r);
  const Scenario scenario{{kUnclipped}, /*nan_step=*/1, /*nan_tensor=*/2};
  for (uint32_t i = 0; i < params.size(); ++i) {
    Post(*opt, *r, i, Gradient(params[i], i, 1, scenario), 1);
  }
  std::vector<DoorbellMessage> m = Receive(*r, 1);
  ASSERT_EQ(m.size(), 1u);
  EXPECT_EQ(m[0].kind, static_cast<uint32_t>(DoorbellKind::kError));
  EXPECT_EQ(State(*r), before);  // restored before the error is sent
  EXPECT_NE(opt->Report().state.find("non-finite"), std::string::npos);
}

TEST_F(SpeculationTest, AReportedNormDoesNotHoldUpdatesBack) {
  OptimizerSettings settings = Settings();
  settings.report_grad_norm = true;
  settings.nonfinite = NonFinitePolicy::kIgnore;
  auto opt = MakeWith(settings, ~uint64_t{0});
  ASSERT_NE(opt, nullptr);
  const std::vector<ParameterDescription> params = Params();
  std::unique_ptr<Rank> r = Join(*opt, 0, params);
  ASSERT_NE(r, nullptr);
  const std::vector<std::vector<float>> initial = Initialize(*r, params);
  const Scenario scenario{{kClipped}};
  double sum_squares = 0;
  ReferenceAdamW ref(Hyper(), initial[0]);
  std::vector<float> grad0 = Gradient(params[0], 0, 1, scenario);
  ref.Step(Sum({grad0}, 1.0));
  Post(*opt, *r, 0, grad0, 1);
  // Published before the step's other gradients are posted.
  std::vector<DoorbellMessage> first = Receive(*r, 1);
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0].kind, static_cast<uint32_t>(DoorbellKind::kUpdateDone));
  EXPECT_EQ(first[0].id, 0u);
  ExpectMatches(*r, 0, ref);
  for (float x : grad0) sum_squares += double{x} * x;
  for (uint32_t i = 1; i < params.size(); ++i) {
    std::vector<float> grad = Gradient(params[i], i, 1, scenario);
    for (float x : grad) sum_squares += double{x} * x;
    Post(*opt, *r, i, grad, 1);
  }
  EXPECT_EQ(UpdatesDone(*r, params.size() - 1, 1).size(), params.size() - 1);
  const OptimizerReport report = opt->Report();
  EXPECT_NEAR(report.last_step.grad_norm, std::sqrt(sum_squares), 1e-6 * std::sqrt(sum_squares));
  EXPECT_EQ(report.last_step.clip_coef, 1.0);
  EXPECT_EQ(report.param_steps, std::vector<uint64_t>(params.size(), 1));
}

// A directory standing for / (proc and sys files written into it).
class FakeRoot {
 public:
  FakeRoot() {
    char pattern[] = "/tmp/ts-root-XXXXXX";
    root_ = mkdtemp(pattern);
  }
  ~FakeRoot() { std::filesystem::remove_all(root_); }
  void Write(const std::string& path, const std::string& text) {
    const std::filesystem::path file = root_ + path;
    std::filesystem::create_directories(file.parent_path());
    std::ofstream(file) << text;
  }
  const std::string& root() const { return root_; }

 private:
  std::string root_;
};

TEST(HostMemoryTest, TheMachinesMemoryWithoutACgroupLimit) {
  FakeRoot fake;
  fake.Write("/proc/meminfo", "MemTotal: 1048576 kB\nMemFree: 1000 kB\nMemAvailable: 524288 kB\n");
  fake.Write("/proc/self/cgroup", "0::/system.slice/trainstreamd.service\n");
  fake.Write("/sys/fs/cgroup/system.slice/trainstreamd.service/memory.max", "max\n");
  const job_optimizer_internal::HostMemory memory =
      job_optimizer_internal::ReadHostMemory(fake.root());
  EXPECT_EQ(memory.total, uint64_t{1} << 30);
  EXPECT_EQ(memory.available, uint64_t{512} << 20);
}

TEST(HostMemoryTest, ACgroupLimitBelowTheMachinesBoundsWhatIsLeft) {
  FakeRoot fake;
  fake.Write("/proc/meminfo", "MemTotal: 1048576 kB\nMemAvailable: 524288 kB\n");
  fake.Write("/proc/self/cgroup", "0::/kubepods/pod1\n");
  fake.Write("/sys/fs/cgroup/kubepods/pod1/memory.max", std::to_string(256 << 20) + "\n");
  fake.Write("/sys/fs/cgroup/kubepods/pod1/memory.current", std::to_string(200 << 20) + "\n");
  const job_optimizer_internal::HostMemory memory =
      job_optimizer_internal::ReadHostMemory(fake.root());
  EXPECT_EQ(memory.total, uint64_t{256} << 20);
  EXPECT_EQ(memory.available, uint64_t{56} << 20);  // the limit less what the cgroup uses
}

TEST(HostMemoryTest, ALimitAboveTheProcesssCgroupCounts) {
  // A systemd slice's MemoryMax (or a pod's) sits above the service's own cgroup.
  FakeRoot fake;
  fake.Write("/proc/meminfo", "MemTotal: 1048576 kB\nMemAvailable: 1048576 kB\n");
  fake.Write("/proc/self/cgroup", "0::/ts.slice/trainstreamd.service\n");
  fake.Write("/sys/fs/cgroup/ts.slice/trainstreamd.service/memory.max", "max\n");
  fake.Write("/sys/fs/cgroup/ts.slice/trainstreamd.service/memory.current",
             std::to_string(100 << 20) + "\n");
  fake.Write("/sys/fs/cgroup/ts.slice/memory.max", std::to_string(512 << 20) + "\n");
  fake.Write("/sys/fs/cgroup/ts.slice/memory.current", std::to_string(400 << 20) + "\n");
  const job_optimizer_internal::HostMemory memory =
      job_optimizer_internal::ReadHostMemory(fake.root());
  EXPECT_EQ(memory.total, uint64_t{512} << 20);
  EXPECT_EQ(memory.available, uint64_t{112} << 20);
}

TEST(HostMemoryTest, ACgroupV1MemoryLimitCounts) {
  FakeRoot fake;
  fake.Write("/proc/meminfo", "MemTotal: 1048576 kB\nMemAvailable: 1048576 kB\n");
  fake.Write("/proc/self/cgroup", "4:memory:/docker/abc\n1:cpu:/docker/abc\n0::/\n");
  fake.Write("/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes",
             std::to_string(300 << 20) + "\n");
  fake.Write("/sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes",
             std::to_string(100 << 20) + "\n");
  // v1's "no limit" at the top: a huge number, not a limit.
  fake.Write("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  const job_optimizer_internal::HostMemory memory =
      job_optimizer_internal::ReadHostMemory(fake.root());
  EXPECT_EQ(memory.total, uint64_t{300} << 20);
  EXPECT_EQ(memory.available, uint64_t{200} << 20);
}

TEST(SpeculationSettingsTest, EagerAndDeferredTogetherAreRefused) {
  OptimizerSettings s = Settings();
  s.eager_updates = true;
  s.defer_updates = true;
  absl::Status status = ValidateSettings(s);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("choose one"), std::string::npos) << status;
}

}  // namespace
}  // namespace trainstream::daemon::job_optimizer_test
