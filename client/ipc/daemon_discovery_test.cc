// SPDX-License-Identifier: Apache-2.0
#include "ipc/daemon_discovery.h"

#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "gtest/gtest.h"
#include "ipc/unix_socket.h"

namespace trainstream::ipc {
namespace {

class DaemonDiscoveryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/ts-discovery-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    directory_ = pattern;
  }
  void TearDown() override { std::filesystem::remove_all(directory_); }
  std::string Path(const std::string& name) const { return directory_ + "/" + name; }

  std::string directory_;
};

TEST(DataSocketSeenFrom, TheDaemonsDataSocketInTheFolderTheClientReachedItThrough) {
  // The same view of the folder: the path the daemon said.
  EXPECT_EQ(DataSocketSeenFrom("/run/trainstream/trainstreamd.sock",
                               "/run/trainstream/trainstreamd.sock.data"),
            "/run/trainstream/trainstreamd.sock.data");
  // The daemon in a container, its socket folder mounted here at another path.
  EXPECT_EQ(DataSocketSeenFrom("/var/run/ts/trainstreamd.sock",
                               "/run/trainstream/trainstreamd.sock.data"),
            "/var/run/ts/trainstreamd.sock.data");
  EXPECT_EQ(DataSocketSeenFrom("d.sock", "/run/trainstream/d.sock.data"),
            "/run/trainstream/d.sock.data");  // a relative control path: nothing to map by
}

TEST_F(DaemonDiscoveryTest, TheFirstSocketWithAListenerIsChosen) {
  absl::StatusOr<UniqueFd> second = ListenUnix(Path("second.sock"), SOCK_STREAM, 0600);
  ASSERT_TRUE(second.ok()) << second.status();
  absl::StatusOr<UniqueFd> third = ListenUnix(Path("third.sock"), SOCK_STREAM, 0600);
  ASSERT_TRUE(third.ok()) << third.status();
  absl::StatusOr<std::string> found =
      FindDaemonSocket({Path("missing.sock"), Path("second.sock"), Path("third.sock")});
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(*found, Path("second.sock"));
}

TEST_F(DaemonDiscoveryTest, NoneListeningSaysWhyForEachCandidate) {
  {
    // A daemon that stopped without removing its socket file.
    absl::StatusOr<UniqueFd> stale = ListenUnix(Path("stale.sock"), SOCK_STREAM, 0600);
    ASSERT_TRUE(stale.ok()) << stale.status();
  }
  absl::StatusOr<std::string> found = FindDaemonSocket({Path("missing.sock"), Path("stale.sock")});
  ASSERT_TRUE(absl::IsUnavailable(found.status())) << found.status();
  const std::string message(found.status().message());
  EXPECT_NE(message.find(Path("missing.sock") + " (No such file or directory)"),
            std::string::npos) << message;
  EXPECT_NE(message.find(Path("stale.sock") + " (Connection refused)"), std::string::npos)
      << message;
}

TEST_F(DaemonDiscoveryTest, TheSystemSocketComesFirstAndCanBeMoved) {
  ::setenv("TRAINSTREAM_SYSTEM_SOCKET", Path("system.sock").c_str(), 1);
  std::vector<std::string> candidates = SocketCandidates();
  ::unsetenv("TRAINSTREAM_SYSTEM_SOCKET");
  ASSERT_FALSE(candidates.empty());
  EXPECT_EQ(candidates.front(), Path("system.sock"));
  // Root uses the system daemon only; anyone else also their own.
  EXPECT_EQ(candidates.size(), ::getuid() == 0 ? 1u : 2u);
  EXPECT_EQ(SocketCandidates().front(), "/run/trainstream/trainstreamd.sock");
}

TEST_F(DaemonDiscoveryTest, ANamedSocketIsTheOnlyCandidate) {
  ::unsetenv("TRAINSTREAM_SOCKET");
  EXPECT_EQ(ClientSocketCandidates(), SocketCandidates());
  ::setenv("TRAINSTREAM_SOCKET", Path("named.sock").c_str(), 1);
  std::vector<std::string> candidates = ClientSocketCandidates();
  ::unsetenv("TRAINSTREAM_SOCKET");
  EXPECT_EQ(candidates, std::vector<std::string>{Path("named.sock")});
}

}  // namespace
}  // namespace trainstream::ipc
