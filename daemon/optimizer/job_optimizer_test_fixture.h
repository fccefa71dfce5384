// SPDX-License-Identifier: Apache-2.0
// The fixture of JobOptimizer's unit tests (job_optimizer_*_test.cc): the step machine through
// its real parts, an arena over memfd segments, the thread pool, and a doorbell dispatcher whose
// rings each test reads from the client's end, as a rank would. The weights and moments are
// checked against an AdamW written here in double precision.
#ifndef TRAINSTREAM_DAEMON_OPTIMIZER_JOB_OPTIMIZER_TEST_FIXTURE_H_
#define TRAINSTREAM_DAEMON_OPTIMIZER_JOB_OPTIMIZER_TEST_FIXTURE_H_

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "ipc/doorbell_ring.h"
#include "ipc/shared_mapping.h"
#include "ipc/unique_fd.h"
#include "optimizer/job_optimizer.h"
#include "sessions/session.h"

namespace trainstream::daemon::job_optimizer_test {

using ipc::DoorbellKind;
using ipc::DoorbellMessage;

inline constexpr uid_t kUid = 1000;
inline constexpr int kReceiveTimeoutMs = 10000;
inline constexpr uint64_t kFailedPreconditionCode = 9;
// More than one pool chunk (job_optimizer_internal.h's kDefaultChunkElements), so a tensor's update
// is finished by whichever chunk ends last.
inline constexpr uint64_t kLargeNumel = 300000;

// torch.optim.AdamW (and Adam with L2 when not decoupled), one tensor, in double precision.
struct ReferenceAdamW {
  GroupHyperParameters g;
  bool decoupled = true;
  std::vector<double> w, m, v;
  uint64_t t = 0;

  ReferenceAdamW(const GroupHyperParameters& hyper, const std::vector<float>& initial)
      : g(hyper), w(initial.begin(), initial.end()), m(initial.size()), v(initial.size()) {}

  void Step(const std::vector<double>& grad) {
    ++t;
    const double bc1 = 1 - std::pow(g.beta1, static_cast<double>(t));
    const double bc2_sqrt = std::sqrt(1 - std::pow(g.beta2, static_cast<double>(t)));
    for (size_t i = 0; i < w.size(); ++i) {
      double gi = grad[i];
      if (decoupled) {
        w[i] *= 1 - g.lr * g.weight_decay;
      } else {
        gi += g.weight_decay * w[i];
      }
      m[i] = g.beta1 * m[i] + (1 - g.beta1) * gi;
      v[i] = g.beta2 * v[i] + (1 - g.beta2) * gi * gi;
      w[i] -= g.lr / bc1 * m[i] / (std::sqrt(v[i]) / bc2_sqrt + g.eps);
    }
  }
};

// The largest |got - want| beyond atol + rtol * |want|, as a multiple of that allowance (<= 1:
// close). Counts a NaN as far.
inline double Excess(const std::vector<float>& got, const std::vector<double>& want, double atol,
                     double rtol = 1e-5) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double allowed = atol + rtol * std::abs(want[i]);
    const double d = std::abs(static_cast<double>(got[i]) - want[i]);
    if (!(d <= allowed * 1e12)) return std::numeric_limits<double>::infinity();
    worst = std::max(worst, d / allowed);
  }
  return worst;
}

inline std::vector<float> RandomFloats(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> out(n);
  for (float& x : out) x = dist(gen);
  return out;
}

inline std::vector<double> Sum(const std::vector<std::vector<float>>& parts, double scale) {
  std::vector<double> out(parts.at(0).size());
  for (const std::vector<float>& part : parts) {
    for (size_t i = 0; i < out.size(); ++i) out[i] += part[i];
  }
  for (double& x : out) x *= scale;
  return out;
}

inline ParameterDescription Param(std::string name, uint64_t numel, uint32_t group = 0) {
  ParameterDescription d;
  d.name = std::move(name);
  d.numel = numel;
  d.group = group;
  return d;
}

inline GroupHyperParameters Hyper(double lr = 1e-2, double weight_decay = 0.1) {
  GroupHyperParameters g;
  g.lr = lr;
  g.weight_decay = weight_decay;
  return g;
}

inline OptimizerSettings Settings() {
  OptimizerSettings s;
  s.groups = {Hyper()};
  return s;
}

// One rank as its client sees the job: its session, its end of the doorbell and its slots.
struct Rank {
  uint32_t rank = 0;
  std::string session_id;
  ipc::UniqueFd to_daemon, to_client;
  ipc::SharedMapping mapping;
  std::unique_ptr<ipc::DoorbellEndpoint> doorbell;
  RegistrationResult registration;
};

// Holds every worker of a pool, so the optimizer's tasks wait in its queue (a test can then fail
// the job while some are still to run). Workers are let go one at a time, from this thread or,
// for a call that waits for the job's tasks, from another one after a delay; the rest go when
// the blocker is destroyed.
class PoolBlocker {
 public:
  explicit PoolBlocker(ThreadPool& pool) {
    for (size_t i = 0; i < pool.size(); ++i) {
      gates_.push_back(std::make_unique<absl::Notification>());
      absl::Notification* gate = gates_.back().get();
      pool.Submit([this, gate] {
        ++holding_;
        gate->WaitForNotification();
        ++left_;
      });
    }
    while (holding_.load() < gates_.size()) absl::SleepFor(absl::Milliseconds(1));
  }
  ~PoolBlocker() {
    if (timer_.joinable()) timer_.join();
    ReleaseAll();
    // The gates outlive the workers' waits on them.
    while (left_.load() < gates_.size()) absl::SleepFor(absl::Milliseconds(1));
  }
  PoolBlocker(const PoolBlocker&) = delete;
  PoolBlocker& operator=(const PoolBlocker&) = delete;

  // Lets one more worker go: the queued tasks then run one at a time, in order.
  void ReleaseOne() {
    if (released_ < gates_.size()) gates_[released_++]->Notify();
  }
  void ReleaseAll() {
    while (released_ < gates_.size()) ReleaseOne();
  }
  // ReleaseOne from another thread after `delay`. Call once, and touch the blocker again only
  // once the delay has passed (or destroy it: that waits).
  void ReleaseOneAfter(absl::Duration delay) {
    timer_ = std::thread([this, delay] {
      absl::SleepFor(delay);
      ReleaseOne();
    });
  }
  void Join() {
    if (timer_.joinable()) timer_.join();
  }

 private:
  std::vector<std::unique_ptr<absl::Notification>> gates_;
  size_t released_ = 0;
  std::atomic<size_t> holding_{0}, left_{0};
  std::thread timer_;
};

// Returns once every task queued on `pool` before the call has finished: each worker must take
// one of these tasks, which wait for each other.
inline void Drain(ThreadPool& pool) {
  std::atomic<size_t> started{0};
  pool.ParallelFor(pool.size(), [&](size_t) {
    ++started;
    while (started.load() < pool.size()) std::this_thread::yield();
  });
}

class JobOptimizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Arena::Options options;
    options.budget_bytes = uint64_t{256} << 20;
    options.segment_bytes = uint64_t{4} << 20;
    absl::StatusOr<std::unique_ptr<Arena>> arena = Arena::Create(options);
    ASSERT_TRUE(arena.ok()) << arena.status();
    arena_ = std::move(*arena);
    events_ = std::make_unique<EventLog>(1024);
    pool_ = std::make_unique<ThreadPool>(3, /*pin=*/false);
    auto doorbells = DoorbellDispatcher::Create([](const std::string&, const std::string&) {});
    ASSERT_TRUE(doorbells.ok()) << doorbells.status();
    doorbells_ = std::move(*doorbells);
  }

  JobOptimizer::Deps Deps() { return {arena_.get(), pool_.get(), doorbells_.get(), events_.get()}; }

  std::shared_ptr<JobOptimizer> Make(const OptimizerSettings& settings, uint32_t world_size = 1,
                                     const std::string& job_id = "job") {
    auto created = JobOptimizer::Create({kUid, job_id}, settings, world_size, Deps());
    EXPECT_TRUE(created.ok()) << created.status();
    return created.ok() ? *created : nullptr;
  }

  // A session of `rank` with a doorbell, attached from the client's side.
  std::unique_ptr<Rank> Attach(uint32_t rank, const std::string& session_id,
                               uint32_t world_size = 1, const JobKey& job = {kUid, "job"}) {
    auto session = std::make_shared<Session>();
    session->id = session_id;
    session->job = job;
    session->rank = rank;
    session->world_size = world_size;
    absl::StatusOr<DoorbellGrant> grant = doorbells_->Add(session);
    EXPECT_TRUE(grant.ok()) << grant.status();
    if (!grant.ok()) return nullptr;
    auto r = std::make_unique<Rank>();
    r->rank = rank;
    r->session_id = session_id;
    r->to_daemon = std::move(grant->to_daemon);
    r->to_client = std::move(grant->to_client);
    auto mapping = ipc::SharedMapping::Map(grant->segment.get(), ipc::DoorbellSegmentBytes(),
                                           /*writable=*/true);
    EXPECT_TRUE(mapping.ok()) << mapping.status();
    if (!mapping.ok()) return nullptr;
    r->mapping = std::move(*mapping);
    auto endpoint = ipc::DoorbellEndpoint::Attach(r->mapping.data(), r->mapping.size(),
                                                  ipc::DoorbellSide::kClient, r->to_daemon.get(),
                                                  r->to_client.get());
    EXPECT_TRUE(endpoint.ok()) << endpoint.status();
    if (!endpoint.ok()) return nullptr;
    r->doorbell = std::make_unique<ipc::DoorbellEndpoint>(std::move(*endpoint));
    return r;
  }

  // Attaches and registers `rank`; the registration is kept in the Rank.
  std::unique_ptr<Rank> Join(JobOptimizer& opt, uint32_t rank,
                             const std::vector<ParameterDescription>& params,
                             uint32_t world_size = 1, const std::string& suffix = "") {
    std::unique_ptr<Rank> r = Attach(rank, absl::StrCat("s-rank", rank, suffix), world_size);
    if (r == nullptr) return nullptr;
    absl::StatusOr<RegistrationResult> registered = opt.Register(r->session_id, rank, params);
    EXPECT_TRUE(registered.ok()) << registered.status();
    if (!registered.ok()) return nullptr;
    r->registration = std::move(*registered);
    return r;
  }

  // As the daemon ends a session: the doorbell goes first, then the optimizer hears of it.
  void End(JobOptimizer& opt, const Rank& r, bool clean) {
    doorbells_->Remove(r.session_id);
    opt.OnSessionEnded(r.session_id, clean);
  }

  uint8_t* Bytes(const BufferRecord& record) {
    absl::StatusOr<uint8_t*> data = arena_->BufferData({kUid, "job"}, record.buffer_id);
    EXPECT_TRUE(data.ok()) << data.status();
    return data.ok() ? *data : nullptr;
  }
  std::vector<float> Floats(const BufferRecord& record, uint64_t numel) {
    const float* data = reinterpret_cast<const float*>(Bytes(record));
    if (data == nullptr) return {};
    return std::vector<float>(data, data + numel);
  }
  void Write(const BufferRecord& record, const std::vector<float>& values) {
    uint8_t* data = Bytes(record);
    ASSERT_NE(data, nullptr);
    ASSERT_GE(record.bytes, values.size() * sizeof(float));
    std::memcpy(data, values.data(), values.size() * sizeof(float));
  }

  // The rank's gradient for parameter `index` of iteration `step`, micro-step `micro`.
  void Post(JobOptimizer& opt, const Rank& r, uint32_t index, const std::vector<float>& grad,
            uint64_t step, uint64_t micro = 0) {
    Write(r.registration.params.at(index).grad, grad);
    opt.OnGradientReady(
        r.session_id, {static_cast<uint32_t>(DoorbellKind::kGradientReady), 0, index, step, micro});
  }
  // A post for a parameter the job doesn't have: fails the job, as a rank out of turn does.
  void FailOutOfTurn(JobOptimizer& opt, const Rank& r) {
    opt.OnGradientReady(r.session_id,
                        {static_cast<uint32_t>(DoorbellKind::kGradientReady), 0, 1000, 1, 0});
  }
  // The same, and the error that tells the rank (once its speculated tensors are restored).
  void PostOutOfTurn(JobOptimizer& opt, Rank& r) {
    FailOutOfTurn(opt, r);
    std::vector<DoorbellMessage> m = Receive(r, 1);
    ASSERT_EQ(m.size(), 1u);
    EXPECT_EQ(m[0].kind, static_cast<uint32_t>(DoorbellKind::kError));
  }
  void PostNone(JobOptimizer& opt, const Rank& r, uint32_t index, uint64_t step,
                uint64_t micro = 0) {
    opt.OnGradientReady(r.session_id, {static_cast<uint32_t>(DoorbellKind::kGradientReady),
                                       ipc::kFlagNoGradient, index, step, micro});
  }

  // The next `count` messages to the rank (fewer, with a failure, if they do not come).
  std::vector<DoorbellMessage> Receive(Rank& r, size_t count) {
    std::vector<DoorbellMessage> out;
    while (out.size() < count) {
      DoorbellMessage m;
      absl::Status received = r.doorbell->Receive(&m, kReceiveTimeoutMs);
      if (!received.ok()) {
        ADD_FAILURE() << "rank " << r.rank << " got " << out.size() << " of " << count
                      << " messages: " << received;
        break;
      }
      out.push_back(m);
    }
    return out;
  }
  // Whether a message is waiting for the rank (after the daemon has had time to send one).
  bool Pending(Rank& r) {
    DoorbellMessage m;
    return r.doorbell->Receive(&m, 100).ok();
  }

  // Waits for every parameter's kUpdateDone of `step`; returns their flags by parameter.
  std::map<uint64_t, uint32_t> UpdatesDone(Rank& r, size_t params, uint64_t step) {
    std::map<uint64_t, uint32_t> flags;
    for (const DoorbellMessage& m : Receive(r, params)) {
      EXPECT_EQ(m.kind, static_cast<uint32_t>(DoorbellKind::kUpdateDone)) << "id " << m.id;
      EXPECT_EQ(m.step, step) << "id " << m.id;
      EXPECT_FALSE(flags.contains(m.id)) << "two kUpdateDone for " << m.id;
      flags[m.id] = m.flags;
    }
    return flags;
  }

  std::vector<float> Master(const Rank& r, uint32_t index) {
    return Floats(r.registration.params.at(index).master, numel_of(r, index));
  }
  std::vector<float> ExpAvg(const Rank& r, uint32_t index) {
    return Floats(r.registration.params.at(index).exp_avg, numel_of(r, index));
  }
  std::vector<float> ExpAvgSq(const Rank& r, uint32_t index) {
    return Floats(r.registration.params.at(index).exp_avg_sq, numel_of(r, index));
  }
  uint64_t numel_of(const Rank& r, uint32_t index) {
    return r.registration.params.at(index).master.bytes / sizeof(float);
  }

  // The weights, exp_avg and exp_avg_sq of `index` against the reference.
  void ExpectMatches(const Rank& r, uint32_t index, const ReferenceAdamW& ref) {
    EXPECT_LE(Excess(Master(r, index), ref.w, 1e-6), 1.0) << "master of " << index;
    EXPECT_LE(Excess(ExpAvg(r, index), ref.m, 1e-7), 1.0) << "exp_avg of " << index;
    EXPECT_LE(Excess(ExpAvgSq(r, index), ref.v, 1e-10), 1.0) << "exp_avg_sq of " << index;
  }

  // Writes initial weights into the masters (the first rank initialises them) and returns them.
  std::vector<std::vector<float>> Initialize(const Rank& r,
                                             const std::vector<ParameterDescription>& params) {
    std::vector<std::vector<float>> initial;
    for (uint32_t i = 0; i < params.size(); ++i) {
      initial.push_back(RandomFloats(params[i].numel, 100 + i));
      Write(r.registration.params.at(i).master, initial.back());
    }
    return initial;
  }

  // Declared first, destroyed last: the pool's last task may hold the optimizer, whose
  // destructor frees into the arena and logs an event.
  std::unique_ptr<Arena> arena_;
  std::unique_ptr<EventLog> events_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<DoorbellDispatcher> doorbells_;
};

inline bool HasEvent(const EventLog& events, const std::string& kind) {
  for (const Event& e : events.Since(0, [](const Event&) { return true; })) {
    if (e.kind == kind) return true;
  }
  return false;
}

}  // namespace trainstream::daemon::job_optimizer_test

#endif  // TRAINSTREAM_DAEMON_OPTIMIZER_JOB_OPTIMIZER_TEST_FIXTURE_H_
