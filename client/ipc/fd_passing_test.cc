// SPDX-License-Identifier: Apache-2.0
#include "ipc/fd_passing.h"

#include <sys/eventfd.h>
#include <sys/socket.h>

#include "gtest/gtest.h"

namespace trainstream::ipc {
namespace {

struct SocketPair {
  SocketPair() {
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds), 0);
    a.Reset(fds[0]);
    b.Reset(fds[1]);
  }
  UniqueFd a, b;
};

TEST(FdPassingTest, DescriptorArrivesAndRefersToTheSameObject) {
  SocketPair pair;
  UniqueFd counter(::eventfd(5, EFD_CLOEXEC));
  int fds[] = {counter.get()};
  ASSERT_TRUE(SendMessage(pair.a.get(), "hello", fds).ok());
  absl::StatusOr<ReceivedMessage> got = ReceiveMessage(pair.b.get(), 1, 1000);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->payload, "hello");
  ASSERT_EQ(got->fds.size(), 1u);
  uint64_t value = 0;
  ASSERT_EQ(::read(got->fds[0].get(), &value, sizeof(value)), 8);
  EXPECT_EQ(value, 5u);
}

TEST(FdPassingTest, UnexpectedDescriptorsAreRefused) {
  SocketPair pair;
  UniqueFd counter(::eventfd(0, EFD_CLOEXEC));
  int fds[] = {counter.get()};
  ASSERT_TRUE(SendMessage(pair.a.get(), "x", fds).ok());
  EXPECT_EQ(ReceiveMessage(pair.b.get(), 0, 1000).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(FdPassingTest, ClosedPeerAndTimeoutAreDistinct) {
  SocketPair pair;
  EXPECT_EQ(ReceiveMessage(pair.b.get(), 0, 10).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  pair.a.Reset();
  EXPECT_EQ(ReceiveMessage(pair.b.get(), 0, 1000).status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace trainstream::ipc
