// SPDX-License-Identifier: Apache-2.0
#include "ipc/doorbell_ring.h"

#include <sys/eventfd.h>
#include <sys/mman.h>

#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "ipc/unique_fd.h"

namespace trainstream::ipc {
namespace {

class DoorbellRingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    bytes_ = DoorbellSegmentBytes();
    segment_ = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(segment_, MAP_FAILED);
    InitializeDoorbellSegment(segment_);
    to_daemon_.Reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    to_client_.Reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  }
  void TearDown() override { ::munmap(segment_, bytes_); }

  DoorbellEndpoint Daemon() {
    return *DoorbellEndpoint::Attach(segment_, bytes_, DoorbellSide::kDaemon, to_client_.get(),
                                     to_daemon_.get());
  }
  DoorbellEndpoint Client() {
    return *DoorbellEndpoint::Attach(segment_, bytes_, DoorbellSide::kClient, to_daemon_.get(),
                                     to_client_.get());
  }

  void* segment_ = nullptr;
  size_t bytes_ = 0;
  UniqueFd to_daemon_, to_client_;
};

TEST_F(DoorbellRingTest, MessagesArriveInOrderBothWays) {
  DoorbellEndpoint daemon = Daemon();
  DoorbellEndpoint client = Client();
  for (uint64_t i = 0; i < 3000; ++i) {  // wraps the ring several times
    ASSERT_TRUE(client.Send({1, 0, i, i * 2, i * 3}).ok());
    DoorbellMessage m;
    ASSERT_TRUE(*daemon.TryReceive(&m));
    EXPECT_EQ(m.id, i);
    EXPECT_EQ(m.value, i * 3);
    ASSERT_TRUE(daemon.Send({2, 0, i, 0, 7}).ok());
    ASSERT_TRUE(client.Receive(&m, 1000).ok());
    EXPECT_EQ(m.id, i);
  }
  DoorbellMessage m;
  EXPECT_FALSE(*daemon.TryReceive(&m));
}

TEST_F(DoorbellRingTest, FullRingIsReportedNotOverwritten) {
  DoorbellEndpoint client = Client();
  for (uint32_t i = 0; i < kDoorbellCapacity; ++i) ASSERT_TRUE(client.Send({1, 0, i}).ok());
  absl::Status full = client.Send({1, 0, 99});
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  DoorbellEndpoint daemon = Daemon();
  DoorbellMessage m;
  ASSERT_TRUE(*daemon.TryReceive(&m));
  EXPECT_EQ(m.id, 0u);
}

TEST_F(DoorbellRingTest, CorruptPeerIndexIsDataLossNotAnOutOfBoundsRead) {
  DoorbellEndpoint daemon = Daemon();
  // A hostile client publishes a head far past anything it wrote.
  auto* control = reinterpret_cast<RingControl*>(static_cast<uint8_t*>(segment_) + 64);
  control->head.store(uint64_t{1} << 40);
  DoorbellMessage m;
  absl::StatusOr<bool> got = daemon.TryReceive(&m);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss);
}

TEST_F(DoorbellRingTest, SleepingReaderIsWokenAcrossThreads) {
  DoorbellEndpoint daemon = Daemon();
  DoorbellEndpoint client = Client();
  std::thread reader([&] {
    for (uint64_t i = 0; i < 200; ++i) {
      DoorbellMessage m;
      ASSERT_TRUE(client.Receive(&m, 5000, /*spin_ns=*/0).ok());
      ASSERT_EQ(m.id, i);
    }
  });
  for (uint64_t i = 0; i < 200; ++i) {
    while (!daemon.Send({2, 0, i}).ok()) std::this_thread::yield();
    if (i % 16 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  reader.join();
}

TEST_F(DoorbellRingTest, ReceiveTimesOut) {
  DoorbellEndpoint client = Client();
  DoorbellMessage m;
  EXPECT_EQ(client.Receive(&m, 20).code(), absl::StatusCode::kDeadlineExceeded);
}

TEST_F(DoorbellRingTest, RejectsForeignLayout) {
  static_cast<DoorbellSegmentHeader*>(segment_)->version = 99;
  auto endpoint = DoorbellEndpoint::Attach(segment_, bytes_, DoorbellSide::kClient,
                                           to_daemon_.get(), to_client_.get());
  EXPECT_EQ(endpoint.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(DoorbellEndpoint::Attach(segment_, 64, DoorbellSide::kClient, 0, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace trainstream::ipc
