// SPDX-License-Identifier: Apache-2.0
// Jobs' reported PCIe totals: grown by what each session's report adds, never shrunk by a
// session, seen by their own uid (or an admin), forgotten with the job's last reporting session.
#include "sessions/transfer_totals.h"

#include <cstdint>
#include <limits>
#include <string>

#include "gtest/gtest.h"

namespace trainstream::daemon {
namespace {

Session SessionOf(const std::string& id, uid_t uid, const std::string& job) {
  Session s;
  s.id = id;
  s.owner = PeerCredentials{100, uid, uid, false};
  s.job = JobKey{uid, job};
  return s;
}

PeerCredentials Viewer(uid_t uid, bool admin = false) { return {1, uid, uid, admin}; }

TEST(TransferTotalsTest, AJobSumsWhatEachOfItsSessionsAdds) {
  TransferTotals totals;
  const Session rank0 = SessionOf("s-0", 1000, "ddp"), rank1 = SessionOf("s-1", 1000, "ddp");
  ASSERT_TRUE(totals.Report(rank0, 100, 10).ok());
  ASSERT_TRUE(totals.Report(rank0, 250, 30).ok());  // running totals: adds 150 and 20
  ASSERT_TRUE(totals.Report(rank1, 5, 0).ok());
  auto rows = totals.List(Viewer(1000));
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].job.job_id, "ddp");
  EXPECT_EQ(rows[0].h2d_bytes, 255u);
  EXPECT_EQ(rows[0].d2h_bytes, 30u);
  // One rank ends: what it moved stays in the job's total while the job goes on.
  totals.SessionEnded(rank0);
  ASSERT_TRUE(totals.Report(rank1, 6, 1).ok());
  rows = totals.List(Viewer(1000));
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].h2d_bytes, 256u);
  EXPECT_EQ(rows[0].d2h_bytes, 31u);
  // The last one ends: the job is forgotten.
  totals.SessionEnded(rank1);
  EXPECT_TRUE(totals.List(Viewer(0, true)).empty());
}

TEST(TransferTotalsTest, TotalsThatGoDownAreRefusedAndChangeNothing) {
  TransferTotals totals;
  const Session s = SessionOf("s-0", 1000, "j");
  ASSERT_TRUE(totals.Report(s, 100, 100).ok());
  const absl::Status refused = totals.Report(s, 99, 200);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("went down"), std::string::npos) << refused;
  auto rows = totals.List(Viewer(1000));
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].h2d_bytes, 100u);
  EXPECT_EQ(rows[0].d2h_bytes, 100u);
}

TEST(TransferTotalsTest, ASumPastTwoToTheSixtyFourStopsAtTheTop) {
  TransferTotals totals;
  const uint64_t top = std::numeric_limits<uint64_t>::max();
  ASSERT_TRUE(totals.Report(SessionOf("s-0", 1, "j"), top, 0).ok());
  ASSERT_TRUE(totals.Report(SessionOf("s-1", 1, "j"), top, 0).ok());
  EXPECT_EQ(totals.List(Viewer(1)).at(0).h2d_bytes, top);
}

TEST(TransferTotalsTest, AUserSeesItsOwnJobsAndAnAdminSeesAll) {
  TransferTotals totals;
  ASSERT_TRUE(totals.Report(SessionOf("s-a", 1000, "alice"), 1, 1).ok());
  ASSERT_TRUE(totals.Report(SessionOf("s-b", 1001, "bob"), 2, 2).ok());
  auto alice = totals.List(Viewer(1000));
  ASSERT_EQ(alice.size(), 1u);
  EXPECT_EQ(alice[0].job.job_id, "alice");
  EXPECT_EQ(totals.List(Viewer(1002)).size(), 0u);
  EXPECT_EQ(totals.List(Viewer(1002, true)).size(), 2u);
}

TEST(TransferTotalsTest, TheSameJobNameOfTwoUsersIsTwoJobs) {
  TransferTotals totals;
  ASSERT_TRUE(totals.Report(SessionOf("s-a", 1000, "default"), 1, 0).ok());
  ASSERT_TRUE(totals.Report(SessionOf("s-b", 1001, "default"), 2, 0).ok());
  EXPECT_EQ(totals.List(Viewer(1000)).at(0).h2d_bytes, 1u);
  EXPECT_EQ(totals.List(Viewer(1001)).at(0).h2d_bytes, 2u);
}

}  // namespace
}  // namespace trainstream::daemon
