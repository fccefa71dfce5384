// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_CONFIG_DAEMON_OPTIONS_H_
#define TRAINSTREAM_DAEMON_CONFIG_DAEMON_OPTIONS_H_

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace trainstream::daemon {

// One uid's share of the memory budget unless configured: room is left for another user.
inline constexpr char kDefaultUidQuota[] = "90%";

// A TCP address to listen on: a numeric IPv4 or IPv6 host (empty: every interface) and a port
// (0: any free one).
struct ListenAddress {
  std::string host;  // "127.0.0.1", "::1" (no brackets) or ""
  uint16_t port = 0;
};

// "HOST:PORT", "[IPV6]:PORT" or ":PORT"; "localhost" reads as 127.0.0.1.
absl::StatusOr<ListenAddress> ParseListenAddress(const std::string& text);

// Everything trainstreamd is told, after the config file and the flags are merged.
struct DaemonOptions {
  std::string socket_path;
  std::string data_socket_path;
  mode_t socket_mode = 0600;
  uint64_t budget_bytes = 0;
  uint64_t uid_quota_bytes = 0;  // 0: none
  uint64_t shared_segment_bytes = uint64_t{64} << 20;
  uint64_t segment_granularity = uint64_t{2} << 20;
  uint32_t threads = 0;          // resolved: never 0
  std::string log_level = "info";
  std::string admin_group;
  absl::Duration lease = absl::Seconds(10);
  absl::Duration drain_timeout = absl::Seconds(30);
  uint32_t event_ring_size = 4096;
  absl::Duration optimizer_retention = absl::Minutes(10);
  bool optimizer_pin_threads = true;
  absl::Duration base_keep_warm = absl::Minutes(5);
  std::string gpu_pool_export = "auto";  // or "legacy_ipc"
  uint32_t max_connections_per_uid = 256;  // each socket; root and the admin group uncapped
  std::optional<ListenAddress> metrics_listen;  // none: no metrics endpoint
};

// Command-line values; unset ones fall back to the config file, then to defaults.
struct DaemonFlags {
  std::string config_path;
  std::optional<std::string> socket_path;
  std::optional<std::string> memory_budget;
  std::optional<std::string> uid_quota;
  std::optional<uint32_t> threads;
  std::optional<std::string> log_level;
  std::optional<uint32_t> lease_ms;
  std::optional<uint32_t> base_keep_warm_s;
  std::optional<std::string> gpu_pool_export;
  std::optional<std::string> metrics_listen;
};

// Reads the config file (protobuf text format of trainstream.daemon.DaemonConfig) if one is
// named and merges the flags over it. Errors name the file, line and field.
absl::StatusOr<DaemonOptions> LoadDaemonOptions(const DaemonFlags& flags);

// "123", "64K", "512M", "8G", "1T" (powers of 1024), or "N%" of `total_bytes`.
absl::StatusOr<uint64_t> ParseByteSize(const std::string& text, uint64_t total_bytes);

// MemTotal of /proc/meminfo in bytes.
absl::StatusOr<uint64_t> MachineMemoryBytes();

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_CONFIG_DAEMON_OPTIONS_H_
