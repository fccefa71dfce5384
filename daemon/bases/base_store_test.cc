// SPDX-License-Identifier: Apache-2.0
// The base store over a real arena and small checkpoints: one copy per user and content,
// loaded once, shared while in use, kept warm, then freed; refusals with their reasons.
#include "bases/base_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "bases/caller_access.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "safetensors/test_checkpoints.h"

namespace trainstream::daemon {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using test_checkpoints::Bytes;
using test_checkpoints::FloatEntry;
using test_checkpoints::Normal;
using test_checkpoints::WriteFile;

BaseLoadRequest Request(const std::string& path, const std::string& format, int block = 0) {
  BaseLoadRequest r;
  r.path = path;
  r.format = format;
  r.block = block;
  return r;
}

Session MakeSession(const std::string& id, uid_t uid, const std::string& job) {
  Session s;
  s.id = id;
  s.owner.uid = uid;
  s.owner.pid = 1;
  s.job = JobKey{uid, job};
  return s;
}

class BaseStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           absl::StrCat("ts-bases-", ::getpid(), "-",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
    std::vector<float> exact;
    weights_ = Normal(4096, 9);
    WriteFile(Path("model.safetensors"),
              {FloatEntry("model.embed_tokens.weight", "BF16", Normal(512, 8), &exact),
               {"model.layers.0.mlp.weight", "F32", {64, 64}, Bytes(weights_)},
               FloatEntry("model.layers.0.norm.weight", "F32", Normal(64, 10), &exact),
               {"position_ids", "I64", {4}, Bytes(std::vector<int64_t>{0, 1, 2, 3})}});
    arena_ = *Arena::Create(Arena::Options{uint64_t{256} << 20, 0, uint64_t{64} << 20,
                                           uint64_t{2} << 20});
    events_ = std::make_unique<EventLog>(256);
  }
  void TearDown() override {
    store_.reset();
    fs::remove_all(dir_);
  }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }
  BaseStore& Store(absl::Duration keep_warm = absl::Minutes(5)) {
    BaseStore::Options options;
    options.keep_warm = keep_warm;
    options.progress_every = absl::ZeroDuration();  // every window: small loads show progress
    options.load_threads = 4;  // tensors loaded concurrently, whatever this machine has
    options.window_bytes = 1000;  // many windows even for these small tensors
    store_ = std::make_unique<BaseStore>(options, arena_.get(), events_.get());
    return *store_;
  }
  BaseSnapshot WaitLoaded(uint64_t id, uid_t uid = 1000) {
    for (int i = 0; i < 1000; ++i) {
      BaseSnapshot s = *store_->Get(uid, false, id);
      if (s.state != BaseState::kLoading) return s;
      absl::SleepFor(absl::Milliseconds(5));
    }
    ADD_FAILURE() << "base " << id << " still loading";
    return {};
  }
  uint64_t BaseBytesInArena() const {
    for (const UsageRow& row : arena_->Usage().by_tag) {
      if (row.key == "base") return row.bytes;
    }
    return 0;
  }
  std::vector<std::string> EventKinds() const {
    std::vector<std::string> kinds;
    for (const Event& e : events_->Since(0, [](const Event&) { return true; })) {
      kinds.push_back(e.kind);
    }
    return kinds;
  }

  fs::path dir_;
  std::vector<float> weights_;
  std::unique_ptr<Arena> arena_;
  std::unique_ptr<EventLog> events_;
  std::unique_ptr<BaseStore> store_;
};

TEST_F(BaseStoreTest, TwoSessionsOfAUserShareOneCopy) {
  BaseStore& store = Store();
  const Session a = MakeSession("s-a", 1000, "job-a");
  const Session b = MakeSession("s-b", 1000, "job-b");
  BaseLoadRequest request = Request(Path("model.safetensors"), "int8");
  absl::StatusOr<BaseSnapshot> first = store.Load(a, request);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<BaseSnapshot> second = store.Load(b, request);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(first->id, second->id);
  const BaseSnapshot ready = WaitLoaded(first->id);
  ASSERT_EQ(ready.state, BaseState::kReady) << ready.error;
  EXPECT_EQ(ready.users.size(), 2u);
  EXPECT_EQ(BaseBytesInArena(), ready.stored_bytes);  // one copy, whoever attached
  EXPECT_EQ(ready.read_bytes, ready.read_total);
  // The 2-D block weight is quantized; the embedding, the norm and the ids are not.
  ASSERT_EQ(ready.tensors.size(), 4u);
  for (const BaseTensor& t : ready.tensors) {
    const bool quantized = t.name == "model.layers.0.mlp.weight";
    EXPECT_EQ(t.stored == StoredAs::kQuantized, quantized) << t.name;
  }
  EXPECT_EQ(ready.tensors[3].stored, StoredAs::kAsIs);
  // What the daemon wrote is the reference quantization of the file's values.
  const BaseTensor& w = ready.tensors[1];
  const kernels::QuantLayout layout = *kernels::LayoutFor(kernels::QuantFormat::kInt8, 4096);
  std::vector<uint8_t> data(layout.data_bytes), scales(layout.scale_bytes);
  ASSERT_TRUE(kernels::Quantize(layout, 0, weights_.data(), 4096, 1.0f, data.data(),
                                scales.data())
                  .ok());
  const uint8_t* held = *arena_->BufferData(JobKey{1000, absl::StrCat("base#", ready.id)},
                                            ready.buffers[w.buffer].buffer_id);
  EXPECT_EQ(std::memcmp(held + w.data_offset, data.data(), data.size()), 0);
  EXPECT_EQ(std::memcmp(held + w.scale_offset, scales.data(), scales.size()), 0);
  // Sealed: every session attached gets its segments read-only; an unattached one gets none.
  absl::StatusOr<SegmentGrant> grant = store.GrantSegment(a, ready.buffers[0].segment_id);
  ASSERT_TRUE(grant.ok()) << grant.status();
  EXPECT_TRUE(grant->read_only);
  EXPECT_EQ(store.GrantSegment(MakeSession("s-c", 1000, "job-c"), ready.buffers[0].segment_id)
                .status()
                .code(),
            absl::StatusCode::kNotFound);
  const std::vector<std::string> kinds = EventKinds();
  EXPECT_NE(std::find(kinds.begin(), kinds.end(), "base.loading"), kinds.end());
  EXPECT_NE(std::find(kinds.begin(), kinds.end(), "base.attached"), kinds.end());
  EXPECT_NE(std::find(kinds.begin(), kinds.end(), "base.ready"), kinds.end());
  // A load says how far it is as it goes: read bytes that only grow, up to the whole.
  std::vector<double> read;
  for (const Event& e : events_->Since(0, [](const Event&) { return true; })) {
    if (e.kind != "base.progress") continue;
    for (const auto& [name, value] : e.numbers) {
      if (name == "read_bytes") read.push_back(value);
    }
  }
  ASSERT_GT(read.size(), 3u);
  EXPECT_TRUE(std::is_sorted(read.begin(), read.end()));
  EXPECT_EQ(read.back(), static_cast<double>(ready.read_total));
}

TEST_F(BaseStoreTest, AnotherUserGetsNeitherTheBaseNorItsSegments) {
  BaseStore& store = Store();
  const Session mine = MakeSession("s-a", 1000, "job");
  const Session theirs = MakeSession("s-z", ::geteuid(), "job");  // may read the file
  const BaseSnapshot base = WaitLoaded(store.Load(mine, Request(Path("model.safetensors"), "bf16"))->id);
  ASSERT_EQ(base.state, BaseState::kReady);
  ASSERT_FALSE(base.buffers.empty());
  EXPECT_EQ(store.Get(::geteuid(), false, base.id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store.Get(::geteuid(), /*admin=*/true, base.id).ok());
  EXPECT_EQ(store.List(::geteuid(), false).size(), 0u);
  EXPECT_EQ(store.GrantSegment(theirs, base.buffers[0].segment_id).status().code(),
            absl::StatusCode::kNotFound);
  const BaseSnapshot own = *store.Load(theirs, Request(Path("model.safetensors"), "bf16"));
  EXPECT_NE(own.id, base.id);  // a copy of its own
}

TEST_F(BaseStoreTest, APlanOnlyRequestSizesTheBaseAsTheLoadStoresIt) {
  BaseStore& store = Store();
  const Session a = MakeSession("s-a", 1000, "job-a");
  for (const char* format : {"bf16", "int8", "nf4"}) {
    BaseLoadRequest plan = Request(Path("model.safetensors"), format);
    plan.plan_only = true;
    absl::StatusOr<BaseSnapshot> planned = store.Load(a, plan);
    ASSERT_TRUE(planned.ok()) << planned.status();
    EXPECT_EQ(planned->state, BaseState::kPlanned);
    EXPECT_EQ(planned->id, 0u);
    EXPECT_TRUE(planned->users.empty());
    EXPECT_EQ(BaseBytesInArena(), 0u) << format;  // nothing taken
    EXPECT_TRUE(store.List(1000, false).empty()) << format;
    const BaseSnapshot loaded =
        WaitLoaded(store.Load(a, Request(Path("model.safetensors"), format))->id);
    ASSERT_EQ(loaded.state, BaseState::kReady) << loaded.error;
    EXPECT_EQ(planned->stored_bytes, loaded.stored_bytes) << format;
    // Asked again once it is held: the base as it is, with no user added.
    const BaseSnapshot held = *store.Load(a, plan);
    EXPECT_EQ(held.id, loaded.id);
    EXPECT_EQ(held.state, BaseState::kReady);
    EXPECT_EQ(held.users.size(), 1u);
    store.OnSessionEnded(a);
    store.ExpireIdle(absl::Now() + absl::Hours(1));
  }
}

TEST_F(BaseStoreTest, ABaseIsKeptWarmAfterItsLastUserThenFreed) {
  BaseStore& store = Store(absl::Seconds(60));
  const Session a = MakeSession("s-a", 1000, "job-a");
  const BaseSnapshot base = *store.Load(a, Request(Path("model.safetensors"), "nf4"));
  ASSERT_EQ(WaitLoaded(base.id).state, BaseState::kReady);
  store.OnSessionEnded(a);
  const BaseSnapshot idle = *store.Get(1000, false, base.id);
  ASSERT_TRUE(idle.idle_since.has_value());
  EXPECT_TRUE(idle.users.empty());
  store.ExpireIdle(absl::Now() + absl::Seconds(30));  // still warm
  const Session again = MakeSession("s-b", 1000, "job-b");
  const BaseSnapshot reused = *store.Load(again, Request(Path("model.safetensors"), "nf4"));
  EXPECT_EQ(reused.id, base.id);
  EXPECT_EQ(reused.state, BaseState::kReady);  // no second load
  store.OnSessionEnded(again);
  store.ExpireIdle(absl::Now() + absl::Seconds(61));
  EXPECT_EQ(store.Get(1000, false, base.id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(BaseBytesInArena(), 0u);
  EXPECT_EQ(arena_->Usage().committed_bytes, 0u);  // its plan went with it
  const std::vector<std::string> kinds = EventKinds();
  EXPECT_NE(std::find(kinds.begin(), kinds.end(), "base.freed"), kinds.end());
}

TEST_F(BaseStoreTest, ALoadEveryAskerLeftIsStoppedAndItsMemoryFreed) {
  // 256 tensors of 64K floats, quantized one at a time: long enough that the asker's session
  // ends while most of it is unread.
  std::vector<test_checkpoints::Entry> entries;
  for (int i = 0; i < 256; ++i) {
    entries.push_back({absl::StrCat("model.layers.", i, ".weight"), "F32", {256, 256},
                       Bytes(Normal(65536, 100 + i))});
  }
  WriteFile(Path("large.safetensors"), entries);
  BaseStore::Options options;
  options.load_threads = 1;
  store_ = std::make_unique<BaseStore>(options, arena_.get(), events_.get());
  const Session a = MakeSession("s-a", 1000, "job-a");
  const BaseSnapshot base = *store_->Load(a, Request(Path("large.safetensors"), "nf4"));
  store_->OnSessionEnded(a);  // the client was killed, or gave up
  const BaseSnapshot stopped = WaitLoaded(base.id);
  EXPECT_EQ(stopped.state, BaseState::kFailed);
  EXPECT_THAT(stopped.error, HasSubstr("ended or detached while it loaded"));
  EXPECT_LT(stopped.read_bytes, stopped.read_total / 2) << "the load ran on";
  EXPECT_EQ(BaseBytesInArena(), 0u);
  // Asked again, it loads afresh (and stops again when that asker detaches).
  const Session b = MakeSession("s-b", 1000, "job-b");
  const BaseSnapshot again = *store_->Load(b, Request(Path("large.safetensors"), "nf4"));
  EXPECT_NE(again.id, base.id);
  EXPECT_EQ(again.state, BaseState::kLoading);
  ASSERT_TRUE(store_->Detach(b, again.id).ok());
  EXPECT_EQ(WaitLoaded(again.id).state, BaseState::kFailed);
  EXPECT_EQ(BaseBytesInArena(), 0u);
}

TEST_F(BaseStoreTest, AMappedBaseStaysUntilItsMappersEndEvenDetached) {
  BaseStore& store = Store(absl::ZeroDuration());
  const Session a = MakeSession("s-a", 1000, "job-a");
  const BaseSnapshot base =
      WaitLoaded(store.Load(a, Request(Path("model.safetensors"), "int8"))->id);
  ASSERT_TRUE(store.GrantSegment(a, base.buffers[0].segment_id).ok());  // now it maps it
  ASSERT_TRUE(store.Detach(a, base.id).ok());
  store.ExpireIdle(absl::Now() + absl::Hours(1));
  EXPECT_TRUE(store.Get(1000, false, base.id).ok());  // its pages are still in that process
  store.OnSessionEnded(a);
  store.ExpireIdle(absl::Now());
  EXPECT_EQ(store.Get(1000, false, base.id).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(BaseStoreTest, TheSameContentAskedDifferentlyIsOneBase) {
  BaseStore& store = Store();
  const Session a = MakeSession("s-a", 1000, "job-a");
  BaseLoadRequest first = Request(Path("model.safetensors"), "nf4");  // default block: 64
  first.quantize = {"model.layers.0.mlp.weight", "model.embed_tokens.weight"};
  BaseLoadRequest second = Request(dir_.string() + "/./model.safetensors", "nf4", 64);
  second.quantize = {"model.embed_tokens.weight", "model.layers.0.mlp.weight",
                     "model.embed_tokens.weight"};
  EXPECT_EQ(store.Load(a, first)->id, store.Load(a, second)->id);
}

TEST_F(BaseStoreTest, ASessionThatEndedMidRequestAttachesToNothing) {
  BaseStore::Options options;
  options.session_alive = [](const Session&) { return false; };
  BaseStore store(options, arena_.get(), events_.get());
  EXPECT_EQ(store.Load(MakeSession("s-a", 1000, "job"), Request(Path("model.safetensors"), "bf16"))
                .status()
                .code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(store.List(1000, false).empty());
}

TEST_F(BaseStoreTest, FilesAreOpenedWithTheCallersRights) {
  if (::geteuid() != 0) GTEST_SKIP() << "taking another user's rights needs root";
  fs::permissions(Path("model.safetensors"), fs::perms::owner_read | fs::perms::owner_write);
  fs::create_directories(Path("open"));
  fs::permissions(Path("open"), fs::perms::all);
  fs::permissions(dir_, fs::perms::owner_all | fs::perms::others_exec);
  // A link the other user could make to a file it may not read.
  fs::create_symlink(Path("model.safetensors"), Path("open/link.safetensors"));
  BaseStore& store = Store();
  const Session other = MakeSession("s-o", 65534, "job");
  const absl::Status denied = store.Load(other, Request(Path("open/link.safetensors"), "bf16"))
                                  .status();
  EXPECT_EQ(denied.code(), absl::StatusCode::kPermissionDenied) << denied;
  // The thread has its own rights back: root reads the file.
  const Session root = MakeSession("s-r", 0, "job");
  EXPECT_TRUE(store.Load(root, Request(Path("open/link.safetensors"), "bf16")).ok());
}

TEST(CallerFilesTest, OpensAsTheCallerThenAsTheDaemonAgain) {
  if (::geteuid() != 0) GTEST_SKIP() << "taking another user's rights needs root";
  const std::string path = (fs::temp_directory_path() /
                            absl::StrCat("ts-caller-", ::getpid())).string();
  std::ofstream(path) << "private";
  fs::permissions(path, fs::perms::owner_read | fs::perms::owner_write);
  PeerCredentials nobody;
  nobody.uid = 65534;
  nobody.gid = 65534;
  {
    std::unique_ptr<CallerFiles> as_caller = *CallerFiles::Enter(nobody);
    EXPECT_TRUE(as_caller->switched());
    errno = 0;
    EXPECT_LT(::open(path.c_str(), O_RDONLY), 0);  // the kernel checked as uid 65534
    EXPECT_EQ(errno, EACCES);
  }
  const int fd = ::open(path.c_str(), O_RDONLY);  // root's own rights are back
  EXPECT_GE(fd, 0);
  if (fd >= 0) ::close(fd);
  // The daemon's own user needs no switch.
  PeerCredentials self;
  self.uid = ::geteuid();
  EXPECT_FALSE((*CallerFiles::Enter(self))->switched());
  fs::remove(path);
}

TEST_F(BaseStoreTest, RequestsAreCheckedAndFailuresSayWhy) {
  arena_ = *Arena::Create(Arena::Options{uint64_t{32} << 20, 0, uint64_t{8} << 20,
                                         uint64_t{2} << 20});
  BaseStore& store = Store();
  const Session a = MakeSession("s-a", 1000, "job");
  EXPECT_EQ(store.Load(a, Request("relative/model.safetensors", "bf16")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(store.Load(a, Request(Path("model.safetensors"), "fp4")).status().message()),
              HasSubstr("one of bf16, int8, nf4, fp8, nvfp4"));
  EXPECT_EQ(store.Load(a, Request(Path("model.safetensors"), "nf4", 3)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Load(a, Request(Path("absent.safetensors"), "bf16")).status().code(),
            absl::StatusCode::kNotFound);
  BaseLoadRequest unknown = Request(Path("model.safetensors"), "int8");
  unknown.quantize = {"model.layers.9.mlp.weight"};
  EXPECT_THAT(std::string(store.Load(a, unknown).status().message()),
              HasSubstr("'model.layers.9.mlp.weight' named for quantization is not in"));
  // Too big for the budget: refused with the numbers before anything is allocated.
  std::vector<float> exact;
  WriteFile(Path("big.safetensors"),
            {FloatEntry("w", "F32", std::vector<float>(uint64_t{20} << 20, 0.5f), &exact)});
  const absl::Status big = store.Load(a, Request(Path("big.safetensors"), "bf16")).status();
  EXPECT_EQ(big.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(big.message()), HasSubstr("needs 0.04 GB of host memory"));
  EXPECT_EQ(arena_->Usage().committed_bytes, 0u);
  // A weight that can't be quantized fails the load, names the tensor, and frees the memory.
  std::vector<float> bad = Normal(4096, 3);
  bad[100] = std::nanf("");
  WriteFile(Path("nan.safetensors"), {{"layers.0.w", "F32", {64, 64}, Bytes(bad)}});
  const BaseSnapshot failing = *store.Load(a, Request(Path("nan.safetensors"), "int8"));
  const BaseSnapshot failed = WaitLoaded(failing.id);
  EXPECT_EQ(failed.state, BaseState::kFailed);
  EXPECT_THAT(failed.error, HasSubstr("tensor 'layers.0.w'"));
  EXPECT_EQ(BaseBytesInArena(), 0u);
}

}  // namespace
}  // namespace trainstream::daemon
