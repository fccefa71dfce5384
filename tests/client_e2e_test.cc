// SPDX-License-Identifier: Apache-2.0
// The C++ client library against the real daemon.
#include "trainstream/client.h"

#include <sys/wait.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "daemon_process.h"
#include "gtest/gtest.h"
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

// Inspection comes back as typed structs: 64-bit counts past 2^32 as numbers, lists as vectors.
TEST(ClientE2eTest, InspectionRepliesAreTyped) {
  testing::DaemonProcess daemon({"--memory_budget=6G"});
  auto session = Open(daemon, "typed");
  ASSERT_NE(session, nullptr);
  auto buffer = session->Allocate("x", 1 << 20, {"grad", 0, false});
  ASSERT_TRUE(buffer.ok()) << buffer.status();

  absl::StatusOr<client::DaemonStatus> status = session->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->budget_bytes, uint64_t{6} << 30);
  EXPECT_EQ(status->socket_path, daemon.socket_path());
  EXPECT_EQ(status->sessions, 1u);

  absl::StatusOr<std::vector<client::SessionInfo>> sessions = session->ListSessions();
  ASSERT_TRUE(sessions.ok()) << sessions.status();
  ASSERT_EQ(sessions->size(), 1u);
  EXPECT_EQ((*sessions)[0].session_id, session->id());
  EXPECT_EQ((*sessions)[0].job_id, "typed");
  EXPECT_EQ((*sessions)[0].buffers, 1u);

  absl::StatusOr<client::MemoryReport> memory = session->GetMemory();
  ASSERT_TRUE(memory.ok()) << memory.status();
  EXPECT_EQ(memory->budget_bytes, uint64_t{6} << 30);
  uint64_t grad_bytes = 0;
  for (const client::UsageRow& row : memory->by_tag)
    grad_bytes += row.key == "grad" ? row.bytes : 0;
  EXPECT_EQ(grad_bytes, uint64_t{1} << 20);

  absl::StatusOr<uint64_t> seq =
      session->ReportEvent("typed_check", "numbers travel as numbers", {{"answer", 42}});
  ASSERT_TRUE(seq.ok()) << seq.status();
  absl::StatusOr<std::vector<client::Event>> events = session->ReadEvents(*seq - 1);
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_FALSE(events->empty());
  const client::Event& event = events->front();
  EXPECT_EQ(event.seq, *seq);
  EXPECT_EQ(event.kind, "client.typed_check");
  EXPECT_EQ(event.numbers.at("answer"), 42.0);

  absl::StatusOr<std::vector<client::BaseInfo>> bases = session->ListBases();
  ASSERT_TRUE(bases.ok()) << bases.status();
  EXPECT_TRUE(bases->empty());
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
