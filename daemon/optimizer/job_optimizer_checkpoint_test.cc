// SPDX-License-Identifier: Apache-2.0
// A job's checkpoint, written or read, holds up no other job: the doorbell thread serves every
// session while one job's state is on its way to or from a file, even when that job's own rank
// posts a gradient meanwhile (issue 50, item 2). The checkpoint's I/O is held open by the test,
// so the window is as long as the test needs, on any machine.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "optimizer/job_optimizer_test_fixture.h"
#include "optimizer/optimizer_registry.h"

namespace trainstream::daemon::job_optimizer_test {
namespace {

constexpr uid_t kOtherUid = 1001;
// Each wait for the doorbell thread's answer gives up after this (a stalled thread then fails
// the test instead of hanging it); a round trip of an idle daemon takes about 0.1 ms.
constexpr int kAnswerTimeoutMs = 2000;
constexpr absl::Duration kPromptAnswer = absl::Milliseconds(100);

// A FileSource whose opens wait until the test lets them go: a checkpoint being read.
class GatedFiles : public FileSource {
 public:
  absl::StatusOr<ipc::UniqueFd> OpenForReading(const std::string& path,
                                               uint64_t* bytes) const override {
    if (!opened.HasBeenNotified()) opened.Notify();
    release.WaitForNotification();
    return Filesystem().OpenForReading(path, bytes);
  }
  bool IsDirectory(const std::string& path) const override {
    return Filesystem().IsDirectory(path);
  }
  bool Exists(const std::string& path) const override { return Filesystem().Exists(path); }
  absl::StatusOr<std::string> RealPath(const std::string& path) const override {
    return Filesystem().RealPath(path);
  }
  mutable absl::Notification opened, release;
};

// Two users' jobs on one daemon's parts, the doorbells routed to the optimizers as
// trainstreamd routes them (daemon.cc).
class CheckpointIsolationTest : public JobOptimizerTest {
 protected:
  void SetUp() override {
    JobOptimizerTest::SetUp();
    OptimizerRegistry::Options options;
    options.threads = 2;
    options.pin_threads = false;
    registry_ = std::make_unique<OptimizerRegistry>(options, arena_.get(), doorbells_.get(),
                                                    events_.get());
    doorbells_->SetHandler(DoorbellKind::kGradientReady,
                           [this](const Session& s, const DoorbellMessage& m, DoorbellChannel&) {
                             registry_->OnGradientReady(s, m);
                           });
  }
  void TearDown() override {
    doorbells_->Stop();  // no message reaches the registry once it is gone
    registry_.reset();
  }

  struct JobRank {
    Session session;
    std::shared_ptr<JobOptimizer> optimizer;
    std::unique_ptr<Rank> rank;
  };
  // Rank 0 of a one-rank job of `uid`, registered with one parameter of `numel` elements,
  // its master set to random values and its gradient to zeros.
  std::unique_ptr<JobRank> Open(uid_t uid, const std::string& job, uint64_t numel) {
    auto j = std::make_unique<JobRank>();
    j->session.id = "s-" + job;
    j->session.job = {uid, job};
    j->session.owner.uid = uid;
    j->rank = Attach(0, j->session.id, 1, j->session.job);
    if (j->rank == nullptr) return nullptr;
    absl::StatusOr<std::shared_ptr<JobOptimizer>> optimizer =
        registry_->CreateOrJoin(j->session, Settings());
    EXPECT_TRUE(optimizer.ok()) << optimizer.status();
    if (!optimizer.ok()) return nullptr;
    j->optimizer = *optimizer;
    absl::StatusOr<RegistrationResult> registered =
        j->optimizer->Register(j->session.id, 0, {Param("w", numel)});
    EXPECT_TRUE(registered.ok()) << registered.status();
    if (!registered.ok()) return nullptr;
    j->rank->registration = *registered;
    const std::vector<float> initial = RandomFloats(numel, 7);
    std::memcpy(Data(*j, registered->params[0].master), initial.data(), numel * sizeof(float));
    std::memset(Data(*j, registered->params[0].grad), 0, numel * sizeof(float));
    return j;
  }
  uint8_t* Data(const JobRank& j, const BufferRecord& record) {
    absl::StatusOr<uint8_t*> data = arena_->BufferData(j.session.job, record.buffer_id);
    EXPECT_TRUE(data.ok()) << data.status();
    return data.ok() ? *data : nullptr;
  }
  std::vector<float> Master(const JobRank& j) {
    const BufferRecord& master = j.rank->registration.params[0].master;
    const float* data = reinterpret_cast<const float*>(Data(j, master));
    return std::vector<float>(data, data + master.bytes / sizeof(float));
  }

  static void PostGradient(JobRank& j, uint64_t step) {
    ASSERT_TRUE(j.rank->doorbell
                    ->Send({static_cast<uint32_t>(DoorbellKind::kGradientReady), 0, 0, step, 0})
                    .ok());
  }
  // How long the doorbell thread takes to answer `j`'s message of `kind` (for parameter 0,
  // micro-step 0) with one of `answer` (a failure, and the timeout, when it does not).
  static absl::Duration RoundTrip(JobRank& j, DoorbellKind kind, uint64_t step,
                                  DoorbellKind answer) {
    const absl::Time start = absl::Now();
    EXPECT_TRUE(j.rank->doorbell->Send({static_cast<uint32_t>(kind), 0, 0, step, 0}).ok());
    DoorbellMessage m;
    absl::Status received = j.rank->doorbell->Receive(&m, kAnswerTimeoutMs);
    const absl::Duration took = absl::Now() - start;
    EXPECT_TRUE(received.ok()) << "no answer to job '" << j.session.job.job_id << "' in "
                               << kAnswerTimeoutMs << " ms: " << received;
    if (received.ok()) {
      EXPECT_EQ(m.kind, static_cast<uint32_t>(answer));
    }
    return took;
  }

  // While `a`'s checkpoint I/O is held open, and after `a`'s rank posted its gradient: `b`'s
  // round trips and step are answered promptly, and so is a listing of the optimizers (tsctl
  // optimizers).
  void ExpectOtherJobServed(JobRank& a, JobRank& b) {
    PostGradient(a, 1);
    absl::SleepFor(absl::Milliseconds(50));  // the doorbell thread has taken a's post by now
    absl::Duration worst;
    for (int i = 0; i < 5; ++i) {
      worst = std::max(worst, RoundTrip(b, DoorbellKind::kPing, 0, DoorbellKind::kPong));
    }
    const absl::Duration step =
        RoundTrip(b, DoorbellKind::kGradientReady, 1, DoorbellKind::kUpdateDone);
    EXPECT_LT(worst, kPromptAnswer) << "job b's doorbell round trip during job a's checkpoint";
    EXPECT_LT(step, kPromptAnswer) << "job b's step during job a's checkpoint";

    // The lister may outlive this call (it waits for a's I/O when the listing stalls).
    auto listed = std::make_shared<absl::Notification>();
    lister_ = std::thread([this, listed] {
      PeerCredentials admin;
      admin.admin = true;
      EXPECT_EQ(registry_->List(admin).size(), 2u);
      listed->Notify();
    });
    EXPECT_TRUE(listed->WaitForNotificationWithTimeout(absl::Milliseconds(kAnswerTimeoutMs)))
        << "listing the optimizers waited for job a's checkpoint";
  }
  void JoinLister() {
    if (lister_.joinable()) lister_.join();
  }

  std::unique_ptr<OptimizerRegistry> registry_;
  std::thread lister_;
};

TEST_F(CheckpointIsolationTest, AJobSavingWhileItsRankPostsStallsNoOtherJob) {
  std::unique_ptr<JobRank> a = Open(kUid, "a", kLargeNumel);
  std::unique_ptr<JobRank> b = Open(kOtherUid, "b", 1000);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const std::vector<float> before = Master(*a);

  absl::Notification writing, release;
  std::vector<float> written;
  absl::StatusOr<uint64_t> saved = absl::UnknownError("not saved");
  std::thread saver([&] {
    saved = a->optimizer->SaveWith([&](const CheckpointContents& c) -> absl::StatusOr<uint64_t> {
      writing.Notify();
      release.WaitForNotification();
      const float* master = static_cast<const float*>(c.arrays.at(0).data);
      written.assign(master, master + c.arrays.at(0).numel);
      return c.arrays.at(0).numel * sizeof(float);
    });
  });
  writing.WaitForNotification();
  ExpectOtherJobServed(*a, *b);
  release.Notify();
  saver.join();
  JoinLister();
  ASSERT_TRUE(saved.ok()) << saved.status();

  // a's gradient was not lost: it stepped once the save was over, and not before (the file
  // holds the state from before it).
  std::vector<DoorbellMessage> done = Receive(*a->rank, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].kind, static_cast<uint32_t>(DoorbellKind::kUpdateDone));
  EXPECT_EQ(done[0].step, 1u);
  EXPECT_EQ(written, before);
  EXPECT_NE(Master(*a), before);
  EXPECT_EQ(a->optimizer->Report().iteration, 1u);
}

TEST_F(CheckpointIsolationTest, AJobLoadingWhileItsRankPostsStallsNoOtherJob) {
  std::unique_ptr<JobRank> a = Open(kUid, "a", kLargeNumel);
  std::unique_ptr<JobRank> b = Open(kOtherUid, "b", 1000);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  char directory[] = "/tmp/ts-checkpoint-test-XXXXXX";
  ASSERT_NE(::mkdtemp(directory), nullptr);
  const std::string path = std::string(directory) + "/a.safetensors";
  ASSERT_TRUE(a->optimizer->Save(path).ok());
  const std::vector<float> saved = Master(*a);

  GatedFiles files;
  absl::Status loaded = absl::UnknownError("not loaded");
  std::thread loader([&] { loaded = a->optimizer->Load(path, files); });
  files.opened.WaitForNotification();
  ExpectOtherJobServed(*a, *b);
  files.release.Notify();
  loader.join();
  JoinLister();
  EXPECT_TRUE(loaded.ok()) << loaded;

  // a's post waited for the restored state, then stepped it.
  std::vector<DoorbellMessage> done = Receive(*a->rank, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].kind, static_cast<uint32_t>(DoorbellKind::kUpdateDone));
  EXPECT_EQ(a->optimizer->Report().iteration, 1u);
  EXPECT_NE(Master(*a), saved);
  ::unlink(path.c_str());
  ::rmdir(directory);
}

}  // namespace
}  // namespace trainstream::daemon::job_optimizer_test
