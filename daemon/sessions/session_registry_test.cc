// SPDX-License-Identifier: Apache-2.0
#include "sessions/session_registry.h"

#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"

namespace trainstream::daemon {
namespace {

struct Ended {
  std::string id;
  SessionEnd reason;
};

class SessionRegistryTest : public ::testing::Test {
 protected:
  SessionRegistryTest()
      : registry_({absl::Milliseconds(200), 3},
                  [this](const Session& s, SessionEnd r) { ended_.push_back({s.id, r}); }) {}

  PeerCredentials alice_{100, 1000, 1000, false};
  PeerCredentials bob_{200, 1001, 1001, false};
  PeerCredentials root_{300, 0, 0, true};
  std::vector<Ended> ended_;
  SessionRegistry registry_;
};

TEST_F(SessionRegistryTest, OpenAttachCloseRunsTheEndCallbackOnce) {
  auto session = registry_.Open(alice_, {"job", 0, 1, 100});
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ((*session)->id.substr(0, 2), "s-");
  EXPECT_EQ((*session)->job.uid, 1000u);
  ASSERT_TRUE(registry_.Attach(alice_, (*session)->id, (*session)->attach_token).ok());
  EXPECT_EQ(registry_.Attach(alice_, (*session)->id, (*session)->attach_token).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(registry_.Close(alice_, (*session)->id).ok());
  ASSERT_EQ(ended_.size(), 1u);
  EXPECT_EQ(ended_[0].reason, SessionEnd::kClosed);
  EXPECT_EQ(registry_.Close(alice_, (*session)->id).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ended_.size(), 1u);
}

TEST_F(SessionRegistryTest, TheKernelsPidIsTheOwnersWhateverTheClientSays) {
  // A client in its own PID namespace says 1; the kernel's pid is who it is.
  auto contained = registry_.Open(alice_, {"job", 0, 1, 1});
  ASSERT_TRUE(contained.ok()) << contained.status();
  EXPECT_EQ((*contained)->owner.pid, alice_.pid);
  EXPECT_EQ((*contained)->pid_in_namespace, 1);
  auto plain = *registry_.Open(alice_, {"job", 0, 1, alice_.pid});
  EXPECT_EQ(plain->pid_in_namespace, 0);
}

TEST_F(SessionRegistryTest, EventsNameTheOwnerAsTheKernelAndTheClientSawIt) {
  // SO_PEERCRED's pid is 0 for a process outside the daemon's PID namespace (the daemon in a
  // container of its own): served, with the pid the client gave kept to be said.
  PeerCredentials unseen = alice_;
  unseen.pid = 0;
  auto outside = registry_.Open(unseen, {"job", 0, 1, 4242});
  ASSERT_TRUE(outside.ok()) << outside.status();
  EXPECT_EQ((*outside)->owner.pid, 0);
  EXPECT_EQ((*outside)->pid_in_namespace, 4242);
  EXPECT_EQ(OwnerName(**outside),
            "a process outside the daemon's PID namespace (pid 4242 in its own)");
  Session session;
  session.owner = unseen;
  EXPECT_EQ(OwnerName(session), "a process outside the daemon's PID namespace");
  session.owner = alice_;
  EXPECT_EQ(OwnerName(session), absl::StrFormat("pid %d", alice_.pid));
  session.pid_in_namespace = 1;
  EXPECT_EQ(OwnerName(session),
            absl::StrFormat("pid %d (pid 1 in its own PID namespace)", alice_.pid));
}

TEST_F(SessionRegistryTest, AnotherUidCanNeitherTouchNorSee) {
  auto session = *registry_.Open(alice_, {"job", 0, 1, 0});
  EXPECT_EQ(registry_.Get(bob_, session->id).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(registry_.Heartbeat(bob_, session->id).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(registry_.Close(bob_, session->id).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(registry_.Attach(bob_, session->id, session->attach_token).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(registry_.List(bob_).empty());
  EXPECT_EQ(registry_.List(alice_).size(), 1u);
  EXPECT_EQ(registry_.List(root_).size(), 1u);
  EXPECT_TRUE(ended_.empty());
}

TEST_F(SessionRegistryTest, WrongTokenIsRefused) {
  auto session = *registry_.Open(alice_, {"job", 0, 1, 0});
  std::string forged = session->attach_token;
  forged[0] ^= 1;
  EXPECT_EQ(registry_.Attach(alice_, session->id, forged).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(registry_.Attach(alice_, session->id, "short").status().code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(SessionRegistryTest, LeasesExpireUnlessRenewed) {
  auto kept = *registry_.Open(alice_, {"job", 0, 1, 0});
  auto lost = *registry_.Open(alice_, {"job", 1, 2, 0});
  absl::SleepFor(absl::Milliseconds(120));
  ASSERT_TRUE(registry_.Heartbeat(alice_, kept->id).ok());
  absl::SleepFor(absl::Milliseconds(120));
  EXPECT_EQ(registry_.ExpireLeases(absl::Now()), 1);
  ASSERT_EQ(ended_.size(), 1u);
  EXPECT_EQ(ended_[0].id, lost->id);
  EXPECT_EQ(ended_[0].reason, SessionEnd::kLeaseExpired);
  EXPECT_TRUE(registry_.Get(alice_, kept->id).ok());
}

TEST_F(SessionRegistryTest, AnEndedSessionSaysWhyToItsOwnerAlone) {
  auto lost = *registry_.Open(alice_, {"job", 0, 1, 0});
  absl::SleepFor(absl::Milliseconds(250));
  ASSERT_EQ(registry_.ExpireLeases(absl::Now()), 1);
  const absl::Status gone = registry_.Heartbeat(alice_, lost->id).status();
  EXPECT_EQ(gone.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(gone.message().find("ended"), std::string::npos) << gone;
  EXPECT_NE(gone.message().find("(lease expired)"), std::string::npos) << gone;
  // Another user learns nothing of it: the same answer as for an id that never existed.
  const absl::Status theirs = registry_.Get(bob_, lost->id).status();
  EXPECT_EQ(theirs.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(theirs.message().find("never existed"), std::string::npos) << theirs;
  EXPECT_EQ(theirs.message().find("lease"), std::string::npos) << theirs;
  // Kept for the last 1,024 ends, not for ever.
  for (int i = 0; i < 1024; ++i) {
    auto s = *registry_.Open(root_, {"churn", 0, 1, 0});
    ASSERT_TRUE(registry_.Close(root_, s->id).ok());
  }
  EXPECT_NE(registry_.Get(alice_, lost->id).status().message().find("never existed"),
            std::string::npos);
}

TEST_F(SessionRegistryTest, PerUidLimitAndDraining) {
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(registry_.Open(alice_, {"job", 0, 1, 0}).ok());
  EXPECT_EQ(registry_.Open(alice_, {"job", 0, 1, 0}).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(registry_.Open(bob_, {"job", 0, 1, 0}).ok());
  registry_.StartDraining();
  EXPECT_EQ(registry_.Open(bob_, {"job", 0, 1, 0}).status().code(),
            absl::StatusCode::kUnavailable);
  registry_.EndAll(SessionEnd::kShutdown);
  EXPECT_EQ(registry_.size(), 0u);
  EXPECT_EQ(ended_.size(), 4u);
}

}  // namespace
}  // namespace trainstream::daemon
