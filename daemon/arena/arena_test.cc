// SPDX-License-Identifier: Apache-2.0
#include "arena/arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "ipc/shared_mapping.h"

namespace trainstream::daemon {
namespace {

constexpr uint64_t kMiB = 1 << 20;

std::unique_ptr<Arena> MakeArena(uint64_t budget = 64 * kMiB, uint64_t quota = 0) {
  Arena::Options options;
  options.budget_bytes = budget;
  options.uid_quota_bytes = quota;
  options.segment_bytes = 4 * kMiB;
  auto arena = Arena::Create(options);
  EXPECT_TRUE(arena.ok()) << arena.status();
  return std::move(*arena);
}

AllocationRequest Request(std::string name, uint64_t bytes, uid_t uid = 1000,
                          std::string session = "s1") {
  AllocationRequest r;
  r.job = {uid, "job"};
  r.session_id = std::move(session);
  r.name = std::move(name);
  r.bytes = bytes;
  return r;
}

TEST(ArenaTest, OffsetsHonourAlignment) {
  auto arena = MakeArena();
  for (uint64_t alignment : {1u, 64u, 4096u, 65536u}) {
    // (StrCat: GCC 12 at -O3 warns -Wrestrict, wrongly, on "a" + std::to_string(...).)
    AllocationRequest r = Request(absl::StrCat("a", alignment), 100);
    r.alignment = alignment;
    auto record = arena->Allocate(r);
    ASSERT_TRUE(record.ok()) << record.status();
    EXPECT_EQ(record->offset % alignment, 0u) << alignment;
  }
  AllocationRequest odd = Request("odd", 100);
  odd.alignment = 48;
  EXPECT_EQ(arena->Allocate(odd).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ArenaTest, SmallBuffersShareASegmentAndFreedRangesAreReused) {
  auto arena = MakeArena();
  auto a = *arena->Allocate(Request("a", 8192));
  auto b = *arena->Allocate(Request("b", 8192));
  EXPECT_EQ(a.segment_id, b.segment_id);
  EXPECT_NE(a.offset, b.offset);
  ASSERT_TRUE(arena->Free({1000, "job"}, "s1", a.buffer_id).ok());
  auto c = *arena->Allocate(Request("c", 8192));
  EXPECT_EQ(c.segment_id, a.segment_id);
  EXPECT_EQ(c.offset, a.offset);
  EXPECT_EQ(arena->Usage().segments, 1u);
}

// The estimate a job plans with is what allocating the same buffers reserves: small ones
// packed into shared segments (with alignment gaps), large ones each in a segment rounded to
// the granularity.
TEST(ArenaTest, AReservationEstimateMatchesTheAllocations) {
  for (uint64_t granularity : {uint64_t{4096}, 2 * kMiB}) {
    Arena::Options options;
    options.budget_bytes = 256 * kMiB;
    options.segment_bytes = 4 * kMiB;
    options.segment_granularity = granularity;
    std::unique_ptr<Arena> arena = *Arena::Create(options);
    std::vector<Arena::PlannedBuffer> plan;
    const uint64_t sizes[] = {100,     3 * kMiB, 1500 * 1024, 1500 * 1024, 7,
                              2 * kMiB, 1 * kMiB, 5 * kMiB + 1, 640 * 1024,  1};
    for (size_t i = 0; i < std::size(sizes); ++i) {
      plan.push_back({sizes[i], i % 2 == 0 ? uint64_t{64} : uint64_t{4096}});
    }
    const uint64_t estimate = arena->ReservationFor(plan);
    for (size_t i = 0; i < plan.size(); ++i) {
      AllocationRequest r = Request(absl::StrCat("b", i), plan[i].bytes);
      r.alignment = plan[i].alignment;
      ASSERT_TRUE(arena->Allocate(r).ok()) << i;
    }
    EXPECT_EQ(estimate, arena->reserved_bytes()) << "granularity " << granularity;
    // Nothing was held for the estimate itself.
    EXPECT_EQ(arena->ReservationFor({}), 0u);
  }
  // A coarser granularity rounds the large buffers up further.
  Arena::Options coarse;
  coarse.segment_bytes = 64 * kMiB;
  coarse.segment_granularity = 64 * kMiB;
  EXPECT_EQ((*Arena::Create(coarse))->ReservationFor({{40 * kMiB, 64}}), 64 * kMiB);
  coarse.segment_granularity = 2 * kMiB;
  EXPECT_EQ((*Arena::Create(coarse))->ReservationFor({{40 * kMiB, 64}}), 40 * kMiB);
  coarse.segment_granularity = 1000;
  EXPECT_EQ(Arena::Create(coarse).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ArenaTest, EmptySegmentsAreReturned) {
  auto arena = MakeArena();
  auto big = *arena->Allocate(Request("big", 3 * kMiB));  // dedicated: over half a segment
  EXPECT_EQ(arena->reserved_bytes(), 4 * kMiB);
  ASSERT_TRUE(arena->Free({1000, "job"}, "s1", big.buffer_id).ok());
  EXPECT_EQ(arena->reserved_bytes(), 0u);
}

TEST(ArenaTest, RacingRequestsForOneNameGetOneBufferAndNoStrayMemory) {
  // Segments are made with the lock released: requests racing for one name must still end with
  // one buffer, and the losers' segments must not stay reserved.
  auto arena = MakeArena(/*budget=*/64 * kMiB);
  std::vector<absl::StatusCode> codes(8);
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < codes.size(); ++i) {
      threads.emplace_back(
          [&, i] { codes[i] = arena->Allocate(Request("x", 3 * kMiB)).status().code(); });
    }
    for (auto& t : threads) t.join();
  }
  EXPECT_EQ(std::count(codes.begin(), codes.end(), absl::StatusCode::kOk), 1);
  EXPECT_EQ(std::count(codes.begin(), codes.end(), absl::StatusCode::kAlreadyExists), 7);
  EXPECT_EQ(arena->reserved_bytes(), 4 * kMiB);
  EXPECT_EQ(arena->Usage().segments, 1u);
  EXPECT_EQ(arena->Usage().committed_bytes, 4 * kMiB);
}

TEST(ArenaTest, ASessionReleasedWhileItsSegmentIsMadeKeepsNothing) {
  // A large segment is filled with the lock released; a session released meanwhile (its
  // client gone) must not come back to a buffer nobody will free.
  auto arena = MakeArena(/*budget=*/4096 * kMiB);
  absl::StatusOr<BufferRecord> record;
  const absl::Time start = absl::Now();
  absl::Time finished;
  std::thread allocating([&] {
    record = arena->Allocate(Request("big", 1024 * kMiB));
    finished = absl::Now();
  });
  absl::SleepFor(absl::Milliseconds(20));
  const absl::Time release_started = absl::Now();
  arena->ReleaseSession({1000, "job"}, "s1");
  const absl::Time release_ended = absl::Now();
  allocating.join();
  if (finished > release_ended && release_started - start > absl::Milliseconds(5)) {
    // The release ran while the segment was being made (filling 1 GiB takes far longer than
    // the few microseconds before the lock is released).
    EXPECT_EQ(record.status().code(), absl::StatusCode::kFailedPrecondition) << record.status();
    EXPECT_EQ(arena->reserved_bytes(), 0u);
    EXPECT_EQ(arena->Usage().segments, 0u);
  } else {
    GTEST_SKIP() << "the 1 GiB segment was made within 20 ms: the race did not happen";
  }
}

TEST(ArenaTest, BudgetIsEnforcedWithTheNumbers) {
  auto arena = MakeArena(/*budget=*/8 * kMiB);
  ASSERT_TRUE(arena->Allocate(Request("a", 6 * kMiB)).ok());
  absl::Status refused = arena->Allocate(Request("b", 4 * kMiB)).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("budget"), std::string::npos) << refused;
  EXPECT_NE(refused.message().find("'b'"), std::string::npos) << refused;
  EXPECT_EQ(arena->Allocate(Request("huge", 1ull << 50)).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(ArenaTest, QuotaIsPerUid) {
  auto arena = MakeArena(/*budget=*/64 * kMiB, /*quota=*/8 * kMiB);
  ASSERT_TRUE(arena->Allocate(Request("a", 6 * kMiB, 1000)).ok());
  absl::Status refused = arena->Allocate(Request("b", 4 * kMiB, 1000)).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("quota"), std::string::npos) << refused;
  EXPECT_TRUE(arena->Allocate(Request("b", 4 * kMiB, 1001)).ok());
}

TEST(ArenaTest, NamesAreUniquePerJobAndJobsAreIsolated) {
  auto arena = MakeArena();
  auto mine = *arena->Allocate(Request("x", 100, 1000));
  EXPECT_EQ(arena->Allocate(Request("x", 100, 1000)).status().code(),
            absl::StatusCode::kAlreadyExists);
  auto theirs = *arena->Allocate(Request("x", 100, 1001));
  EXPECT_NE(mine.segment_id, theirs.segment_id);  // never two jobs in one segment
  EXPECT_EQ(arena->Lookup({1001, "job"}, "nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(arena->GrantSegment({1001, "job"}, mine.segment_id).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(arena->Free({1001, "job"}, "s1", mine.buffer_id).code(), absl::StatusCode::kNotFound);
}

TEST(ArenaTest, OnlyTheOwningSessionFrees) {
  auto arena = MakeArena();
  auto record = *arena->Allocate(Request("x", 100));
  EXPECT_EQ(arena->Free({1000, "job"}, "s2", record.buffer_id).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(arena->ReleaseSession({1000, "job"}, "s1"), 100u);
  EXPECT_EQ(arena->Lookup({1000, "job"}, "x").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(arena->reserved_bytes(), 0u);
}

TEST(ArenaTest, GrantedSegmentSharesBytesWithTheDaemon) {
  auto arena = MakeArena();
  auto record = *arena->Allocate(Request("x", 4096));
  auto grant = arena->GrantSegment({1000, "job"}, record.segment_id);
  ASSERT_TRUE(grant.ok()) << grant.status();
  auto mapping = ipc::SharedMapping::Map(grant->fd.get(), grant->bytes, true);
  ASSERT_TRUE(mapping.ok());
  std::memcpy(mapping->data() + record.offset, "shared", 6);
  uint8_t* daemon_view = *arena->BufferData({1000, "job"}, record.buffer_id);
  EXPECT_EQ(std::memcmp(daemon_view, "shared", 6), 0);
  // The size is sealed: a client cannot shrink the segment under the daemon's mapping.
  EXPECT_NE(::ftruncate(grant->fd.get(), 0), 0);
}

TEST(ArenaTest, SealedSegmentsRefuseWrites) {
  auto arena = MakeArena();
  AllocationRequest r = Request("base", 4096);
  r.sealable = true;
  auto record = *arena->Allocate(r);
  {
    auto grant = *arena->GrantSegment({1000, "job"}, record.segment_id);
    auto writable = *ipc::SharedMapping::Map(grant.fd.get(), grant.bytes, true);
    std::memcpy(writable.data(), "frozen", 6);
    // Sealing must wait until nobody can write any more.
    EXPECT_EQ(arena->Seal({1000, "job"}, "s1", record.buffer_id).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  auto sealed = arena->Seal({1000, "job"}, "s1", record.buffer_id);
  ASSERT_TRUE(sealed.ok()) << sealed.status();
  EXPECT_TRUE(sealed->read_only);
  auto grant = *arena->GrantSegment({1000, "job"}, record.segment_id);
  EXPECT_TRUE(grant.read_only);
  EXPECT_EQ(ipc::SharedMapping::Map(grant.fd.get(), grant.bytes, true).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_LT(::pwrite(grant.fd.get(), "x", 1, 0), 0);
  auto readable = *ipc::SharedMapping::Map(grant.fd.get(), grant.bytes, false);
  EXPECT_EQ(std::memcmp(readable.data(), "frozen", 6), 0);
  auto unsealable = *arena->Allocate(Request("plain", 64));
  EXPECT_EQ(arena->Seal({1000, "job"}, "s1", unsealable.buffer_id).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(ArenaTest, UsageIsAccountedBySessionTagAndUid) {
  auto arena = MakeArena();
  AllocationRequest a = Request("a", 1000, 1000, "s1");
  a.tag = "grad";
  AllocationRequest b = Request("b", 3000, 1000, "s2");
  b.tag = "grad";
  AllocationRequest c = Request("c", 500, 1001, "s3");
  ASSERT_TRUE(arena->Allocate(a).ok());
  ASSERT_TRUE(arena->Allocate(b).ok());
  ASSERT_TRUE(arena->Allocate(c).ok());
  ArenaUsage usage = arena->Usage();
  ASSERT_EQ(usage.by_tag.size(), 2u);
  EXPECT_EQ(usage.by_tag[0].key, "grad");
  EXPECT_EQ(usage.by_tag[0].bytes, 4000u);
  EXPECT_EQ(usage.by_tag[1].key, "untagged");
  ASSERT_EQ(usage.by_session.size(), 3u);
  EXPECT_EQ(usage.by_session[1].bytes, 3000u);
  ASSERT_EQ(usage.by_uid.size(), 2u);
  EXPECT_EQ(usage.by_uid[0].bytes, 4 * kMiB);
  EXPECT_EQ(usage.reserved_bytes, 8 * kMiB);
  // The totals alone (GetStatus's): the same numbers, none of the rows.
  ArenaUsage totals = arena->Totals();
  EXPECT_EQ(totals.budget_bytes, usage.budget_bytes);
  EXPECT_EQ(totals.reserved_bytes, usage.reserved_bytes);
  EXPECT_EQ(totals.committed_bytes, usage.committed_bytes);
  EXPECT_EQ(totals.segments, usage.segments);
  EXPECT_TRUE(totals.by_tag.empty() && totals.by_session.empty() && totals.by_uid.empty());
}

TEST(ArenaTest, UsageRowsFollowBuffersFreedAndSessionsReleased) {
  // The rows are kept as buffers come and go (not counted per report): a freed buffer and a
  // released session leave no row behind, and what stays is counted once.
  auto arena = MakeArena();
  AllocationRequest a = Request("a", 1000, 1000, "s1");
  a.tag = "grad";
  AllocationRequest b = Request("b", 3000, 1000, "s1");
  b.tag = "grad";
  AllocationRequest c = Request("c", 500, 1000, "s2");
  BufferRecord first = *arena->Allocate(a);
  ASSERT_TRUE(arena->Allocate(b).ok());
  ASSERT_TRUE(arena->Allocate(c).ok());
  ASSERT_TRUE(arena->Free({1000, "job"}, "s1", first.buffer_id).ok());
  ArenaUsage usage = arena->Usage();
  ASSERT_EQ(usage.by_session.size(), 2u);
  EXPECT_EQ(usage.by_session[0].key, "s1");
  EXPECT_EQ(usage.by_session[0].bytes, 3000u);
  EXPECT_EQ(usage.by_session[0].buffers, 1u);
  ASSERT_EQ(usage.by_tag.size(), 2u);
  EXPECT_EQ(usage.by_tag[0].bytes, 3000u);
  ASSERT_EQ(usage.by_uid.size(), 1u);
  EXPECT_EQ(usage.by_uid[0].buffers, 2u);
  arena->ReleaseSession({1000, "job"}, "s1");
  usage = arena->Usage();
  ASSERT_EQ(usage.by_session.size(), 1u);
  EXPECT_EQ(usage.by_session[0].key, "s2");
  ASSERT_EQ(usage.by_tag.size(), 1u);
  EXPECT_EQ(usage.by_tag[0].key, "untagged");
  EXPECT_EQ(usage.by_uid[0].buffers, 1u);
  arena->ReleaseSession({1000, "job"}, "s2");
  usage = arena->Usage();
  EXPECT_TRUE(usage.by_session.empty() && usage.by_tag.empty());
  for (const UsageRow& row : usage.by_uid) EXPECT_EQ(row.buffers, 0u);
}

}  // namespace
}  // namespace trainstream::daemon

namespace trainstream::daemon {
namespace {

AllocationRequest ForJob(const JobKey& job, std::string name, uint64_t bytes) {
  AllocationRequest r;
  r.job = job;
  r.session_id = job.job_id + "-session";
  r.name = std::move(name);
  r.bytes = bytes;
  return r;
}

TEST(ArenaPlanTest, APlanThatDoesNotFitIsRefusedNamingWhoHoldsTheMemory) {
  auto arena = MakeArena(/*budget=*/64 * kMiB);
  const JobKey a{1000, "a"}, b{1001, "b"}, mine{1001, "mine"};
  ASSERT_TRUE(arena->Plan(a, 32 * kMiB, absl::ZeroDuration()).ok());
  ASSERT_TRUE(arena->Plan(mine, 8 * kMiB, absl::ZeroDuration()).ok());
  absl::Status refused = arena->Plan(b, 32 * kMiB, absl::ZeroDuration()).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  // The caller's own jobs are named; another user's only counted.
  for (const char* words : {"job 'b' plans 0.03 GiB", "a job of another user: 0.03 GiB",
                            "your job 'mine': 0.01 GiB planned", "leaving 0.02 GiB"}) {
    EXPECT_NE(refused.message().find(words), std::string::npos) << refused;
  }
  EXPECT_EQ(refused.message().find("'a'"), std::string::npos) << refused;
  EXPECT_TRUE(arena->Plan(b, 24 * kMiB, absl::ZeroDuration()).ok());
  EXPECT_EQ(arena->Usage().committed_bytes, 64 * kMiB);
}

TEST(ArenaPlanTest, APlanOverTheUidsQuotaIsRefusedAtAdmission) {
  // The budget has room, the user's quota does not: refused when planned, not midway.
  auto arena = MakeArena(/*budget=*/64 * kMiB, /*quota=*/32 * kMiB);
  const JobKey first{1000, "first"}, second{1000, "second"}, other{1001, "other"};
  ASSERT_TRUE(arena->Plan(first, 16 * kMiB, absl::ZeroDuration()).ok());
  ASSERT_TRUE(arena->Allocate(ForJob(first, "w", 8 * kMiB)).ok());
  absl::Status refused = arena->Plan(second, 24 * kMiB, absl::ZeroDuration()).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  for (const char* words : {"job 'second' plans 0.02 GiB", "uid 1000", "is 0.04 GiB",
                            "0.03 GiB quota", "--uid_quota"}) {
    EXPECT_NE(refused.message().find(words), std::string::npos) << refused;
  }
  EXPECT_TRUE(arena->Plan(second, 16 * kMiB, absl::ZeroDuration()).ok());
  // Another user's quota is its own.
  EXPECT_TRUE(arena->Plan(other, 32 * kMiB, absl::ZeroDuration()).ok());
}

TEST(ArenaPlanTest, PlannedMemoryIsKeptForItsJob) {
  auto arena = MakeArena(/*budget=*/64 * kMiB);
  const JobKey a{1000, "a"}, c{1002, "c"};
  ASSERT_TRUE(arena->Plan(a, 48 * kMiB, absl::ZeroDuration()).ok());
  // Another job, with no plan, cannot take what job a planned...
  absl::Status refused = arena->Allocate(ForJob(c, "x", 20 * kMiB)).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("planned by other jobs"), std::string::npos) << refused;
  EXPECT_TRUE(arena->Allocate(ForJob(c, "x", 12 * kMiB)).ok());
  // ...while job a's own allocations inside its plan go through.
  EXPECT_TRUE(arena->Allocate(ForJob(a, "w", 44 * kMiB)).ok());
  ArenaUsage usage = arena->Usage();
  ASSERT_EQ(usage.plans.size(), 1u);
  EXPECT_EQ(usage.plans[0].planned_bytes, 48 * kMiB);
  EXPECT_EQ(usage.plans[0].used_bytes, 44 * kMiB);
}

TEST(ArenaPlanTest, AWaitingPlanIsAdmittedWhenTheOtherJobEnds) {
  auto arena = MakeArena(/*budget=*/64 * kMiB);
  const JobKey a{1000, "a"}, b{1001, "b"};
  ASSERT_TRUE(arena->Plan(a, 48 * kMiB, absl::ZeroDuration()).ok());
  ASSERT_TRUE(arena->Allocate(ForJob(a, "w", 40 * kMiB)).ok());
  std::thread finisher([&] {
    absl::SleepFor(absl::Milliseconds(200));
    arena->ReleaseSession(a, "a-session");  // job a ends: its buffers and its plan go
  });
  const absl::Time start = absl::Now();
  absl::StatusOr<PlanOutcome> admitted = arena->Plan(b, 40 * kMiB, absl::Seconds(10));
  finisher.join();
  ASSERT_TRUE(admitted.ok()) << admitted.status();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(150));
  EXPECT_TRUE(arena->Usage().plans.size() == 1 && arena->Usage().plans[0].job == b);
  // A wait that runs out still says why.
  absl::Status late = arena->Plan(a, 40 * kMiB, absl::Milliseconds(50)).status();
  EXPECT_EQ(late.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(late.message().find("after waiting"), std::string::npos) << late;
}

}  // namespace
}  // namespace trainstream::daemon
