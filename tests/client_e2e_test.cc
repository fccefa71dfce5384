// SPDX-License-Identifier: Apache-2.0
// The C++ client library against the real daemon.
#include <sys/wait.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "daemon_process.h"
#include "gtest/gtest.h"
#include "trainstream/client.h"
#include "trainstream/cuda_transfer.h"

#ifdef TRAINSTREAM_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace trainstream {
namespace {

using client::Session;
using client::SessionOptions;

std::unique_ptr<Session> Open(const testing::DaemonProcess& daemon, const std::string& job) {
  SessionOptions options;
  options.socket_path = daemon.socket_path();
  options.job_id = job;
  auto session = Session::Create(options);
  EXPECT_TRUE(session.ok()) << session.status();
  return session.ok() ? std::move(*session) : nullptr;
}

TEST(ClientE2eTest, BuffersAreSharedWithinAJob) {
  testing::DaemonProcess daemon;
  auto a = Open(daemon, "job");
  auto b = Open(daemon, "job");
  auto buffer = a->Allocate("x", 1 << 20, {"grad", 0, false});
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  std::memcpy((*buffer)->data(), "through the daemon", 18);
  auto seen = b->Lookup("x");
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_EQ(std::memcmp((*seen)->data(), "through the daemon", 18), 0);
  EXPECT_EQ((*seen)->info().owner_session_id, a->id());
  EXPECT_EQ(b->Free(**seen).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(a->Free(**buffer).ok());
}

TEST(ClientE2eTest, DoorbellRoundTripsAndHeartbeats) {
  testing::DaemonProcess daemon;
  auto session = Open(daemon, "job");
  for (int i = 0; i < 1000; ++i) {
    auto rtt = session->Ping();
    ASSERT_TRUE(rtt.ok()) << rtt.status();
  }
  EXPECT_TRUE(session->Heartbeat().ok());
}

TEST(ClientE2eTest, DaemonStopIsReportedNotAHang) {
  testing::DaemonProcess daemon;
  auto session = Open(daemon, "job");
  int status = daemon.Stop(SIGKILL);
  EXPECT_TRUE(WIFSIGNALED(status));
  auto buffer = session->Allocate("late", 64);
  EXPECT_EQ(buffer.status().code(), absl::StatusCode::kUnavailable) << buffer.status();
  EXPECT_NE(buffer.status().message().find(daemon.socket_path()), std::string::npos);
}

TEST(ClientE2eTest, SigtermDrainsAndExitsZero) {
  testing::DaemonProcess daemon;
  { auto session = Open(daemon, "job"); }  // closed on destruction
  int status = daemon.Stop(SIGTERM);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(ClientE2eGpuTest, CopiesThroughRegisteredSegments) {
  std::string why;
  if (!client::CudaAvailable(&why)) GTEST_SKIP() << "no GPU: " << why;
#ifdef TRAINSTREAM_HAVE_CUDA
  testing::DaemonProcess daemon;
  auto session = Open(daemon, "gpu");
  const uint64_t bytes = uint64_t{1} << 30;
  auto up = session->Allocate("up", bytes);
  auto down = session->Allocate("down", bytes);
  ASSERT_TRUE(up.ok() && down.ok());
  ASSERT_TRUE((*up)->cuda_registered());
  auto* words = reinterpret_cast<uint32_t*>((*up)->data());
  for (uint64_t i = 0; i < bytes / 4; ++i) words[i] = static_cast<uint32_t>(i * 2654435761u);
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, bytes), cudaSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ASSERT_TRUE(client::CopyToDevice(**up, 0, device, bytes, stream).ok());
  ASSERT_TRUE(client::CopyToHost(**down, 0, device, bytes, stream).ok());
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(std::memcmp((*up)->data(), (*down)->data(), bytes), 0);
  cudaStreamDestroy(stream);
  cudaFree(device);
#endif
}

}  // namespace
}  // namespace trainstream
