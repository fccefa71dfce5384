// SPDX-License-Identifier: Apache-2.0
// Bases placed in GPU pools, over a real arena and checkpoint and fake VRAM: one pool per base
// and GPU holding the base's exact bytes, joined by later sessions, gone with its last
// importer; refusals for sessions not attached and for bases still loading.
#include "bases/base_gpu_pools.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gpu/fake_vram.h"
#include "gtest/gtest.h"
#include "safetensors/test_checkpoints.h"

namespace trainstream::daemon {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;
using test_checkpoints::Bytes;
using test_checkpoints::Normal;
using test_checkpoints::WriteFile;

constexpr char kGpu[] = "GPU-00000000-1111-2222-3333-444444444444";

Session MakeSession(const std::string& id, uid_t uid) {
  Session s;
  s.id = id;
  s.owner.uid = uid;
  s.owner.pid = 1;
  s.job = JobKey{uid, "job-" + id};
  return s;
}

class BaseGpuPoolsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           absl::StrCat("ts-base-pools-", ::getpid(), "-",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
    WriteFile((dir_ / "model.safetensors").string(),
              {{"model.layers.0.mlp.weight", "F32", {128, 64}, Bytes(Normal(128 * 64, 3))},
               {"model.layers.0.norm.weight", "F32", {64}, Bytes(Normal(64, 4))}});
    arena_ = *Arena::Create(Arena::Options{uint64_t{256} << 20, 0, uint64_t{64} << 20,
                                           uint64_t{2} << 20});
    events_ = std::make_unique<EventLog>(256);
    BaseStore::Options options;
    options.load_threads = 2;
    store_ = std::make_unique<BaseStore>(options, arena_.get(), events_.get());
    pools_ = std::make_unique<GpuPools>(vram_, *events_);
    placer_ = std::make_unique<BaseGpuPools>(
        *store_, *pools_, *events_, [this](const Session& s) { return !ended_.count(s.id); });
  }
  void TearDown() override {
    placer_.reset();
    pools_.reset();
    store_.reset();
    fs::remove_all(dir_);
  }
  // Attaches `session` to the nf4 base of the checkpoint and waits until it is ready.
  uint64_t Attach(const Session& session) {
    BaseLoadRequest request;
    request.path = (dir_ / "model.safetensors").string();
    request.format = "nf4";
    absl::StatusOr<BaseSnapshot> base = store_->Load(session, request);
    EXPECT_TRUE(base.ok()) << base.status();
    for (int i = 0; i < 1000; ++i) {
      if (store_->Get(session.owner.uid, false, base->id)->state != BaseState::kLoading) break;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return base->id;
  }
  std::vector<std::string> EventKinds() const {
    std::vector<std::string> kinds;
    for (const Event& e : events_->Since(0, [](const Event&) { return true; })) {
      if (absl::StartsWith(e.kind, "pool.")) kinds.push_back(e.kind);
    }
    return kinds;
  }

  // What the daemon does when a session ends, as far as bases and pools go.
  void End(const Session& session) {
    ended_.insert(session.id);
    store_->OnSessionEnded(session);
    pools_->SessionEnded(session.id);
  }

  fs::path dir_;
  std::set<std::string> ended_;
  FakeVram vram_;
  std::unique_ptr<Arena> arena_;
  std::unique_ptr<EventLog> events_;
  std::unique_ptr<BaseStore> store_;
  std::unique_ptr<GpuPools> pools_;
  std::unique_ptr<BaseGpuPools> placer_;
};

TEST_F(BaseGpuPoolsTest, APoolHoldsTheBasesBytesAndIsSharedByItsUsersOnThatGpu) {
  const Session a = MakeSession("s-a", 1000), b = MakeSession("s-b", 1000);
  const uint64_t base_id = Attach(a);
  ASSERT_EQ(Attach(b), base_id);
  absl::StatusOr<PoolSummary> first = placer_->Place(a, base_id, kGpu);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<PoolSummary> second = placer_->Place(b, base_id, kGpu);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(first->id, second->id);  // one copy in VRAM
  EXPECT_EQ(vram_.live, 1);
  EXPECT_EQ(vram_.writes, 1);  // filled once
  EXPECT_EQ(second->base_id, base_id);
  EXPECT_THAT(second->importers, UnorderedElementsAre("s-a", "s-b"));

  // Every buffer of the base is in the pool at its offset, byte for byte.
  absl::StatusOr<std::unique_ptr<BaseStore::HostPin>> pin = store_->HostBytes(a, base_id);
  ASSERT_TRUE(pin.ok());
  const std::vector<std::span<const uint8_t>>* host = &(*pin)->bytes();
  ASSERT_EQ(second->buffer_offsets.size(), host->size());
  absl::StatusOr<PoolImport> handle = pools_->Handle(first->id, "s-a");
  ASSERT_TRUE(handle.ok()) << handle.status();
  for (size_t i = 0; i < host->size(); ++i) {
    EXPECT_EQ(second->buffer_offsets[i] % kPoolBufferAlignment, 0u);
    std::vector<uint8_t> in_pool((*host)[i].size());
    ASSERT_EQ(::pread(handle->fd.get(), in_pool.data(), in_pool.size(),
                      static_cast<off_t>(second->buffer_offsets[i])),
              static_cast<ssize_t>(in_pool.size()));
    EXPECT_EQ(std::memcmp(in_pool.data(), (*host)[i].data(), in_pool.size()), 0) << "buffer " << i;
  }
  EXPECT_THAT(EventKinds(),
              ElementsAre("pool.created", "pool.filling", "pool.filled", "pool.joined"));

  // The pool stays while either uses it and goes with the last.
  pools_->SessionEnded("s-a");
  EXPECT_EQ(vram_.live, 1);
  EXPECT_TRUE(pools_->Handle(first->id, "s-b").ok());
  pools_->SessionEnded("s-b");
  EXPECT_EQ(vram_.live, 0);
  EXPECT_TRUE(pools_->List().empty());

  // Asked again afterwards: a new pool, filled again.
  const Session c = MakeSession("s-c", 1000);
  ASSERT_EQ(Attach(c), base_id);
  absl::StatusOr<PoolSummary> again = placer_->Place(c, base_id, kGpu);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(again->id, first->id);
  EXPECT_EQ(vram_.writes, 2);
}

TEST_F(BaseGpuPoolsTest, LegacyPoolsAreFilledToo) {
  vram_.fd_handles = false;
  const Session a = MakeSession("s-a", 1000);
  const uint64_t base_id = Attach(a);
  absl::StatusOr<PoolSummary> pool = placer_->Place(a, base_id, kGpu);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ(pool->kind, PoolKind::kLegacyIpc);
  absl::StatusOr<std::unique_ptr<BaseStore::HostPin>> pin = store_->HostBytes(a, base_id);
  ASSERT_TRUE(pin.ok());
  const std::span<const uint8_t> last = (*pin)->bytes().back();
  EXPECT_EQ(vram_.legacy_bytes.compare(pool->buffer_offsets.back(), last.size(),
                                       reinterpret_cast<const char*>(last.data()), last.size()),
            0);
  EXPECT_THAT(EventKinds(),
              ElementsAre("pool.fallback", "pool.created", "pool.filling", "pool.filled"));
}

TEST_F(BaseGpuPoolsTest, OnlySessionsAttachedToTheBaseMayPlaceIt) {
  const Session a = MakeSession("s-a", 1000);
  const uint64_t base_id = Attach(a);
  ASSERT_TRUE(placer_->Place(a, base_id, kGpu).ok());
  // Another session of the same user that did not load it, and another user's.
  for (const Session& other : {MakeSession("s-b", 1000), MakeSession("s-x", 2000)}) {
    absl::StatusOr<PoolSummary> refused = placer_->Place(other, base_id, kGpu);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound) << other.id;
    EXPECT_THAT(refused.status().message(), HasSubstr("load_base first"));
    EXPECT_FALSE(pools_->Handle(1, other.id).ok());
  }
  EXPECT_EQ(placer_->Place(a, base_id + 7, kGpu).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(vram_.live, 1);
}

TEST_F(BaseGpuPoolsTest, AFailedFillLeavesNoPool) {
  vram_.fail_writes = true;
  const Session a = MakeSession("s-a", 1000);
  const uint64_t base_id = Attach(a);
  absl::StatusOr<PoolSummary> refused = placer_->Place(a, base_id, kGpu);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(refused.status().message(), HasSubstr("cuMemcpyHtoD"));
  EXPECT_EQ(vram_.live, 0);
  EXPECT_TRUE(pools_->List().empty());
  EXPECT_THAT(EventKinds(),
              ElementsAre("pool.created", "pool.filling", "pool.freed", "pool.refused"));
  vram_.fail_writes = false;  // a later attempt starts over
  EXPECT_TRUE(placer_->Place(a, base_id, kGpu).ok());
}

TEST_F(BaseGpuPoolsTest, ASessionEndingDuringTheFillLeavesNeitherPoolNorDanglingBytes) {
  const Session a = MakeSession("s-a", 1000);
  const uint64_t base_id = Attach(a);
  bool base_kept = false;
  vram_.during_write = [&] {
    End(a);  // Ctrl-C while the base is copied to the GPU
    // The base is idle now, yet its bytes are being read: it must outlive the copy.
    store_->ExpireIdle(absl::Now() + absl::Hours(1));
    base_kept = store_->Get(1000, false, base_id).ok();
    EXPECT_EQ(vram_.live, 1);  // and the pool being written stays too
  };
  absl::StatusOr<PoolSummary> placed = placer_->Place(a, base_id, kGpu);
  EXPECT_TRUE(base_kept);
  EXPECT_EQ(placed.status().code(), absl::StatusCode::kNotFound) << placed.status();
  EXPECT_EQ(vram_.live, 0);  // freed as soon as the copy was done
  EXPECT_TRUE(pools_->List().empty());
  store_->ExpireIdle(absl::Now() + absl::Hours(1));
  EXPECT_FALSE(store_->Get(1000, false, base_id).ok());  // and the base after it
}

TEST_F(BaseGpuPoolsTest, AnImportForASessionThatEndedMeanwhileIsUndone) {
  const Session a = MakeSession("s-a", 1000), b = MakeSession("s-b", 1000);
  const uint64_t base_id = Attach(a);
  ASSERT_EQ(Attach(b), base_id);
  ASSERT_TRUE(placer_->Place(a, base_id, kGpu).ok());
  ended_.insert(b.id);  // ended, its end handled before it joins
  absl::StatusOr<PoolSummary> joined = placer_->Place(b, base_id, kGpu);
  EXPECT_EQ(joined.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(pools_->List()[0].importers, ElementsAre("s-a"));
  End(a);
  EXPECT_EQ(vram_.live, 0);
}

}  // namespace
}  // namespace trainstream::daemon
