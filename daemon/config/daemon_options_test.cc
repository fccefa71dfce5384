// SPDX-License-Identifier: Apache-2.0
#include "config/daemon_options.h"

#include <fstream>

#include "gtest/gtest.h"

namespace trainstream::daemon {
namespace {

TEST(ParseByteSizeTest, SuffixesAndPercentages) {
  EXPECT_EQ(*ParseByteSize("4096", 0), 4096u);
  EXPECT_EQ(*ParseByteSize("64K", 0), 64u << 10);
  EXPECT_EQ(*ParseByteSize("512M", 0), 512u << 20);
  EXPECT_EQ(*ParseByteSize("8G", 0), uint64_t{8} << 30);
  EXPECT_EQ(*ParseByteSize("1.5GiB", 0), uint64_t{3} << 29);
  EXPECT_EQ(*ParseByteSize("25%", 1000), 250u);
  for (const char* bad : {"", "lots", "-1G", "150%", "12Q"}) {
    EXPECT_EQ(ParseByteSize(bad, 1000).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

std::string WriteFile(const std::string& text) {
  // One file per test: ctest runs the tests of this binary in parallel processes.
  std::string path = ::testing::TempDir() + "/trainstreamd_" +
                     ::testing::UnitTest::GetInstance()->current_test_info()->name() + ".conf";
  std::ofstream(path) << text;
  return path;
}

TEST(LoadDaemonOptionsTest, FlagsOverrideTheFile) {
  DaemonFlags flags;
  flags.config_path = WriteFile(
      "# comment\nsocket_path: \"/tmp/ts-test/d.sock\"\nmemory_budget: \"1G\"\n"
      "socket_mode: \"0660\"\nlease_ms: 500\n");
  flags.memory_budget = "2G";
  absl::StatusOr<DaemonOptions> options = LoadDaemonOptions(flags);
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->socket_path, "/tmp/ts-test/d.sock");
  EXPECT_EQ(options->data_socket_path, "/tmp/ts-test/d.sock.data");
  EXPECT_EQ(options->budget_bytes, uint64_t{2} << 30);
  EXPECT_EQ(options->socket_mode, 0660u);
  EXPECT_EQ(options->lease, absl::Milliseconds(500));
  EXPECT_GT(options->threads, 0u);
}

TEST(LoadDaemonOptionsTest, EachUidMayTakeAShareOfTheBudgetByDefault) {
  // Unset: 90% of the budget, so that another user's job finds room to start.
  DaemonFlags flags;
  flags.memory_budget = "10G";
  absl::StatusOr<DaemonOptions> options = LoadDaemonOptions(flags);
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->uid_quota_bytes, uint64_t{9} << 30);
  // A share is of the budget, not of the machine; a size is a size; "0" is no quota.
  flags.uid_quota = "25%";
  EXPECT_EQ(LoadDaemonOptions(flags)->uid_quota_bytes, (uint64_t{10} << 30) / 4);
  flags.uid_quota = "3G";
  EXPECT_EQ(LoadDaemonOptions(flags)->uid_quota_bytes, uint64_t{3} << 30);
  flags.uid_quota = "0";
  EXPECT_EQ(LoadDaemonOptions(flags)->uid_quota_bytes, 0u);
}

TEST(LoadDaemonOptionsTest, ErrorsNameTheProblem) {
  DaemonFlags flags;
  flags.config_path = WriteFile("memory_budjet: \"1G\"\n");
  absl::Status status = LoadDaemonOptions(flags).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("line 1"), std::string::npos) << status;
  EXPECT_NE(status.message().find("memory_budjet"), std::string::npos) << status;

  flags.config_path = "/nonexistent/trainstreamd.conf";
  EXPECT_EQ(LoadDaemonOptions(flags).status().code(), absl::StatusCode::kNotFound);

  DaemonFlags long_path;
  long_path.socket_path = "/tmp/" + std::string(110, 'x');
  EXPECT_EQ(LoadDaemonOptions(long_path).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(LoadDaemonOptionsTest, GpuPoolExportIsAutoOrLegacyIpc) {
  DaemonFlags flags;
  flags.config_path = WriteFile("gpu_pool_export: \"legacy_ipc\"\n");
  absl::StatusOr<DaemonOptions> options = LoadDaemonOptions(flags);
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->gpu_pool_export, "legacy_ipc");
  flags.gpu_pool_export = "auto";
  EXPECT_EQ(LoadDaemonOptions(flags)->gpu_pool_export, "auto");
  flags.gpu_pool_export = "vmm-please";
  absl::Status refused = LoadDaemonOptions(flags).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("auto or legacy_ipc"), std::string::npos) << refused;
  EXPECT_EQ(LoadDaemonOptions(DaemonFlags{})->gpu_pool_export, "auto");
}

TEST(LoadDaemonOptionsTest, MetricsListenIsOffByDefaultAndAHostAndPort) {
  EXPECT_FALSE(LoadDaemonOptions(DaemonFlags{})->metrics_listen.has_value());
  DaemonFlags flags;
  flags.config_path = WriteFile("metrics_listen: \"127.0.0.1:9478\"\n");
  absl::StatusOr<DaemonOptions> options = LoadDaemonOptions(flags);
  ASSERT_TRUE(options.ok()) << options.status();
  ASSERT_TRUE(options->metrics_listen.has_value());
  EXPECT_EQ(options->metrics_listen->host, "127.0.0.1");
  EXPECT_EQ(options->metrics_listen->port, 9478);
  flags.metrics_listen = "[::1]:0";  // the flag wins over the file
  options = LoadDaemonOptions(flags);
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->metrics_listen->host, "::1");
  EXPECT_EQ(options->metrics_listen->port, 0);
  EXPECT_EQ(ParseListenAddress(":9478")->host, "");
  EXPECT_EQ(ParseListenAddress("localhost:80")->host, "127.0.0.1");
  for (const char* bad : {"9478", "127.0.0.1", "127.0.0.1:65536", "127.0.0.1:-1",
                          "host.example:80", "::1:80", "[::1:80", "[not-v6]:80",
                          "127.0.0.1:http"}) {
    absl::Status refused = ParseListenAddress(bad).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(refused.message().find("HOST:PORT"), std::string::npos) << refused;
  }
}

TEST(LoadDaemonOptionsTest, SegmentSizesAreReadAndChecked) {
  DaemonFlags flags;
  absl::StatusOr<DaemonOptions> defaults = LoadDaemonOptions(flags);
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->shared_segment_bytes, uint64_t{64} << 20);
  EXPECT_EQ(defaults->segment_granularity, uint64_t{2} << 20);
  flags.config_path = WriteFile("shared_segment_size: \"128M\"\nsegment_granularity: \"64M\"\n");
  absl::StatusOr<DaemonOptions> options = LoadDaemonOptions(flags);
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->shared_segment_bytes, uint64_t{128} << 20);
  EXPECT_EQ(options->segment_granularity, uint64_t{64} << 20);
  for (const char* bad : {"segment_granularity: \"3M\"\n", "segment_granularity: \"1000\"\n",
                          "segment_granularity: \"0\"\n"}) {
    flags.config_path = WriteFile(bad);
    absl::Status refused = LoadDaemonOptions(flags).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(refused.message().find("divides shared_segment_size"), std::string::npos) << refused;
  }
}

}  // namespace
}  // namespace trainstream::daemon
