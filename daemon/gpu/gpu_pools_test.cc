// SPDX-License-Identifier: Apache-2.0
// GPU pools over VRAM APIs that refuse one way or the other (the fallbacks), importers coming
// and going, and other users. The driver's own implementation runs on the GPU machine.
#include "gpu/gpu_pools.h"

#include "gpu/driver_vram_api.h"
#include "gpu/fake_vram.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace trainstream::daemon {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

// A registry over fake VRAM, with its event log.
class GpuPoolsTest : public ::testing::Test {
 protected:
  FakeVram vram;
  EventLog log{64};
  GpuPools pools{vram, log};
};

std::vector<std::string> Kinds(const EventLog& log) {
  std::vector<std::string> kinds;
  for (const Event& e : log.Since(0, [](const Event&) { return true; })) kinds.push_back(e.kind);
  return kinds;
}

TEST_F(GpuPoolsTest, VmmPoolsExportADescriptorOfTheImportersOwn) {
  absl::StatusOr<PoolSummary> made = pools.Create("s1", 1000, "GPU-a", 5 << 20, "base 1");
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(made->kind, PoolKind::kVmm);
  EXPECT_EQ(made->bytes, uint64_t{6} << 20);  // rounded up to the granularity
  absl::StatusOr<PoolImport> imported = pools.Import(made->id, "s2", 1000);
  ASSERT_TRUE(imported.ok()) << imported.status();
  ASSERT_TRUE(imported->fd.valid());
  struct stat a {}, b {};
  ASSERT_EQ(::fstat(imported->fd.get(), &a), 0);
  // The same open file as the pool's, through a descriptor the pool does not own.
  absl::StatusOr<PoolImport> again = pools.Import(made->id, "s3", 1000);
  ASSERT_TRUE(again.ok());
  ASSERT_EQ(::fstat(again->fd.get(), &b), 0);
  EXPECT_EQ(a.st_ino, b.st_ino);
  EXPECT_NE(imported->fd.get(), again->fd.get());
  EXPECT_THAT(pools.List()[0].importers, UnorderedElementsAre("s2", "s3"));
  EXPECT_THAT(Kinds(log), UnorderedElementsAre("pool.created"));
  // Another pool's handle is another file.
  absl::StatusOr<PoolSummary> other = pools.Create("s1", 1000, "GPU-a", 1 << 20, "base 2");
  ASSERT_TRUE(other.ok());
  absl::StatusOr<PoolImport> theirs = pools.Import(other->id, "s2", 1000);
  ASSERT_TRUE(theirs.ok());
  struct stat c {};
  ASSERT_EQ(::fstat(theirs->fd.get(), &c), 0);
  EXPECT_NE(a.st_ino, c.st_ino);
}

TEST_F(GpuPoolsTest, ASessionImportingTwiceHoldsThePoolUntilItReleasesTwice) {
  absl::StatusOr<PoolSummary> made = pools.Create("owner", 1000, "GPU-a", 1 << 20, "base 1");
  ASSERT_TRUE(made.ok());
  ASSERT_TRUE(pools.Import(made->id, "a", 1000).ok());
  ASSERT_TRUE(pools.Import(made->id, "a", 1000).ok());  // two mappings in one process
  ASSERT_TRUE(pools.Free(made->id, "owner").ok());
  ASSERT_TRUE(pools.Release(made->id, "a").ok());
  EXPECT_EQ(vram.live, 1);  // one mapping left
  ASSERT_TRUE(pools.Release(made->id, "a").ok());
  EXPECT_EQ(vram.live, 0);
}

TEST_F(GpuPoolsTest, WithoutFdHandlesItFallsBackToLegacyIpcAndSaysWhy) {
  vram.fd_handles = false;
  absl::StatusOr<PoolSummary> made = pools.Create("s1", 1000, "GPU-a", 5 << 20, "base 1");
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(made->kind, PoolKind::kLegacyIpc);
  absl::StatusOr<PoolImport> imported = pools.Import(made->id, "s2", 1000, ::getpid());
  ASSERT_TRUE(imported.ok());
  EXPECT_FALSE(imported->fd.valid());
  EXPECT_EQ(imported->legacy_handle[0], 0xab);
  std::vector<Event> events = log.Since(0, [](const Event& e) { return e.kind == "pool.fallback"; });
  ASSERT_EQ(events.size(), 1u);
  EXPECT_THAT(events[0].message, HasSubstr("does not support POSIX file-descriptor handles"));
  EXPECT_THAT(events[0].message, HasSubstr("covers the whole allocation"));
}

TEST_F(GpuPoolsTest, WhenBothWaysAreRefusedThePoolIsRefusedWithBothReasons) {
  vram.fd_handles = false;
  vram.legacy = false;
  absl::StatusOr<PoolSummary> made = pools.Create("s1", 1000, "GPU-a", 5 << 20, "base 1");
  EXPECT_EQ(made.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(made.status().message(), HasSubstr("file-descriptor handles"));
  EXPECT_THAT(made.status().message(), HasSubstr("cudaIpcGetMemHandle: not permitted"));
  EXPECT_THAT(Kinds(log), UnorderedElementsAre("pool.refused"));
  EXPECT_EQ(vram.live, 0);
  EXPECT_TRUE(pools.List().empty());
}

TEST_F(GpuPoolsTest, AnotherUsersPoolIsNotThereForThem) {
  absl::StatusOr<PoolSummary> made = pools.Create("s1", 1000, "GPU-a", 1 << 20, "base 1");
  ASSERT_TRUE(made.ok());
  absl::StatusOr<PoolImport> theirs = pools.Import(made->id, "x1", 2000);
  EXPECT_EQ(theirs.status().code(), absl::StatusCode::kNotFound);
  // The same answer as for a pool that does not exist at all.
  EXPECT_EQ(theirs.status().message(), absl::StrFormat("no GPU pool %d", made->id));
  EXPECT_EQ(pools.Import(99, "x1", 2000).status().message(), "no GPU pool 99");
  EXPECT_TRUE(pools.List(2000).empty());
  EXPECT_EQ(pools.List(1000).size(), 1u);
  EXPECT_EQ(pools.Free(made->id, "x1").code(), absl::StatusCode::kNotFound);
}

TEST_F(GpuPoolsTest, ALegacyPoolIsRefusedToAProcessOutsideTheDaemonsPidNamespace) {
  // The kernel gives pid 0 for a client the daemon cannot see (the daemon in a container of
  // its own): the daemon could not keep the pool alive while that process still maps it.
  vram.fd_handles = false;
  absl::StatusOr<PoolSummary> made = pools.Create("owner", 1000, "GPU-a", 1 << 20, "base 1");
  ASSERT_TRUE(made.ok()) << made.status();
  ASSERT_EQ(made->kind, PoolKind::kLegacyIpc);
  absl::StatusOr<PoolImport> unseen = pools.Import(made->id, "outside", 1000, /*pid=*/0);
  EXPECT_EQ(unseen.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(unseen.status().message(), HasSubstr("outside it"));
  EXPECT_THAT(unseen.status().message(), HasSubstr("hostPID"));
  // It counted no import: the owner's free takes the pool at once.
  ASSERT_TRUE(pools.Free(made->id, "owner").ok());
  EXPECT_EQ(vram.live, 0);
  // A pool shared as a descriptor needs no pid: every process may import it.
  vram.fd_handles = true;
  absl::StatusOr<PoolSummary> vmm = pools.Create("owner", 1000, "GPU-a", 1 << 20, "base 2");
  ASSERT_TRUE(vmm.ok()) << vmm.status();
  EXPECT_TRUE(pools.Import(vmm->id, "outside", 1000, /*pid=*/0).ok());
}

TEST_F(GpuPoolsTest, ADaemonSetToLegacyIpcNeverExportsDescriptors) {
  GpuPools legacy_only(vram, log, /*legacy_only=*/true);
  absl::StatusOr<PoolSummary> made = legacy_only.Create("s1", 1000, "GPU-a", 1 << 20, "base 1");
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(made->kind, PoolKind::kLegacyIpc);  // though the fake exports descriptors
  const std::vector<Event> events = log.Since(0, [](const Event& e) { return true; });
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events[0].kind, "pool.fallback");
  EXPECT_THAT(events[0].message, HasSubstr("--gpu_pool_export=legacy_ipc"));
  ASSERT_TRUE(legacy_only.Free(made->id, "s1").ok());
}

TEST_F(GpuPoolsTest, ALegacyPoolWaitsForTheProcessesOfEndedImportersToExit) {
  vram.fd_handles = false;
  absl::StatusOr<PoolSummary> made = pools.Create("owner", 1000, "GPU-a", 1 << 20, "base 1");
  ASSERT_TRUE(made.ok());
  ASSERT_EQ(made->kind, PoolKind::kLegacyIpc);
  const pid_t child = ::fork();
  if (child == 0) {
    ::pause();
    ::_exit(0);
  }
  ASSERT_GT(child, 0);
  ASSERT_TRUE(pools.Import(made->id, "a", 1000, child).ok());
  ASSERT_TRUE(pools.Free(made->id, "owner").ok());
  // Its session ended (closed, or reclaimed) while the process lives: it may still have the
  // handle open, so the memory is not freed under it.
  pools.SessionEnded("a");
  pools.Sweep();
  EXPECT_EQ(vram.live, 1);
  EXPECT_THAT(Kinds(log), testing::Contains("pool.lingering"));
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  pools.Sweep();
  EXPECT_EQ(vram.live, 0);
  EXPECT_TRUE(pools.List().empty());
}

TEST_F(GpuPoolsTest, AFreedPoolStaysWhileImportedAndGoesWithItsLastImporter) {
  absl::StatusOr<PoolSummary> made = pools.Create("owner", 1000, "GPU-a", 1 << 20, "base 1");
  ASSERT_TRUE(made.ok());
  ASSERT_TRUE(pools.Import(made->id, "a", 1000).ok());
  ASSERT_TRUE(pools.Import(made->id, "b", 1000).ok());
  ASSERT_TRUE(pools.Free(made->id, "owner").ok());
  EXPECT_EQ(vram.live, 1);  // still mapped by a and b
  // Let go by its owner, it still takes importers while imported.
  ASSERT_TRUE(pools.Import(made->id, "c", 1000).ok());
  ASSERT_TRUE(pools.Release(made->id, "c").ok());
  EXPECT_EQ(vram.live, 1);
  // A client killed while using it: its session ends, the pool stays for the other.
  pools.SessionEnded("a");
  EXPECT_EQ(vram.live, 1);
  EXPECT_THAT(pools.List()[0].importers, UnorderedElementsAre("b"));
  ASSERT_TRUE(pools.Release(made->id, "b").ok());
  EXPECT_EQ(vram.live, 0);
  EXPECT_EQ(vram.released, 1);
  EXPECT_TRUE(pools.List().empty());
  EXPECT_EQ(Kinds(log).back(), "pool.freed");
  EXPECT_EQ(pools.Release(made->id, "b").code(), absl::StatusCode::kNotFound);
}

TEST_F(GpuPoolsTest, AnOwnerThatEndsFreesItsUnimportedPoolsAtOnce) {
  ASSERT_TRUE(pools.Create("owner", 1000, "GPU-a", 1 << 20, "base 1").ok());
  ASSERT_TRUE(pools.Create("owner", 1000, "GPU-b", 1 << 20, "base 1").ok());
  pools.SessionEnded("owner");
  EXPECT_EQ(vram.live, 0);
  EXPECT_EQ(vram.released, 2);
}

TEST(GpuPools, TheDriversApiRefusesAPoolOnAGpuThatIsNotThereAndSaysWhy) {
  // The real implementation: on a machine without a driver (CI) its absence is the reason; with
  // one, the GPU named does not exist. Either way both ways of sharing are tried and refused.
  std::unique_ptr<VramApi> api = LoadDriverVramApi();
  EventLog log(16);
  GpuPools pools(*api, log);
  absl::StatusOr<PoolSummary> made =
      pools.Create("s", 1000, "GPU-00000000-0000-0000-0000-000000000000", 1 << 20, "base 1");
  EXPECT_EQ(made.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(made.status().message(),
              AnyOf(HasSubstr("no CUDA driver"), HasSubstr("no CUDA support"),
                    HasSubstr("did not initialise"),
                    HasSubstr("no GPU GPU-00000000-0000-0000-0000-000000000000")));
  EXPECT_TRUE(pools.List().empty());
}

TEST_F(GpuPoolsTest, BadRequestsAreRefused) {
  EXPECT_EQ(pools.Create("s", 1000, "GPU-a", 0, "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pools.Create("s", 1000, "", 1, "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(vram.live, 0);
}

}  // namespace
}  // namespace trainstream::daemon
