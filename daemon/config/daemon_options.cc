// SPDX-License-Identifier: Apache-2.0
#include "config/daemon_options.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "config/daemon_config.pb.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "ipc/unix_socket.h"
#include "trainstream/status_macros.h"

namespace trainstream::daemon {
namespace {

// Collects the text-format parser's complaints so the error can quote them.
class ParseErrors : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, int column, const std::string& message) override {
    absl::StrAppend(&text, text.empty() ? "" : "; ", "line ", line + 1, " column ", column + 1,
                    ": ", message);
  }
  std::string text;
};

absl::StatusOr<DaemonConfig> ReadConfigFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read config file ", path));
  std::stringstream contents;
  contents << in.rdbuf();
  DaemonConfig config;
  google::protobuf::TextFormat::Parser parser;
  ParseErrors errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(contents.str(), &config)) {
    return absl::InvalidArgumentError(absl::StrCat("config file ", path, ": ", errors.text));
  }
  return config;
}

}  // namespace

absl::StatusOr<uint64_t> MachineMemoryBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  uint64_t kib = 0;
  while (in >> key >> kib >> unit) {
    if (key == "MemTotal:") return kib * 1024;
  }
  return absl::InternalError("MemTotal not found in /proc/meminfo");
}

absl::StatusOr<uint64_t> ParseByteSize(const std::string& raw, uint64_t total_bytes) {
  std::string text(absl::StripAsciiWhitespace(raw));
  auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", raw, "' is not a size: use bytes, a K/M/G/T suffix (e.g. 64G) or a percentage"));
  };
  if (text.empty()) return bad();
  if (text.back() == '%') {
    double percent = 0;
    if (!absl::SimpleAtod(text.substr(0, text.size() - 1), &percent) || percent < 0 ||
        percent > 100) {
      return bad();
    }
    return static_cast<uint64_t>(static_cast<double>(total_bytes) * percent / 100.0);
  }
  // Accept "8G", "8GB" and "8GiB" alike: all mean 8 << 30.
  if (text.size() > 1 && absl::ascii_toupper(text.back()) == 'B' &&
      absl::ascii_isalpha(text[text.size() - 2])) {
    text.pop_back();
  }
  if (text.size() > 1 && text.back() == 'i') text.pop_back();
  uint64_t shift = 0;
  switch (absl::ascii_toupper(text.back())) {
    case 'K': shift = 10; break;
    case 'M': shift = 20; break;
    case 'G': shift = 30; break;
    case 'T': shift = 40; break;
    default: break;
  }
  if (shift != 0) text.pop_back();
  double value = 0;
  if (!absl::SimpleAtod(text, &value) || value < 0 || value >= 1e15) return bad();
  return static_cast<uint64_t>(value * static_cast<double>(uint64_t{1} << shift));
}

absl::StatusOr<DaemonOptions> LoadDaemonOptions(const DaemonFlags& flags) {
  DaemonConfig config;
  if (!flags.config_path.empty()) {
    ASSIGN_OR_RETURN(config, ReadConfigFile(flags.config_path));
  }
  ASSIGN_OR_RETURN(uint64_t machine_bytes, MachineMemoryBytes());
  DaemonOptions options;
  options.socket_path = flags.socket_path.value_or(
      config.socket_path().empty() ? ipc::DefaultSocketPath() : config.socket_path());
  options.data_socket_path = ipc::DataSocketPath(options.socket_path);
  if (options.data_socket_path.size() > 107) {
    return absl::InvalidArgumentError(absl::StrCat(
        "socket path '", options.socket_path, "' is too long: with '.data' it must fit 107 bytes"));
  }
  if (!config.socket_mode().empty()) {
    uint32_t mode = 0;
    if (!absl::numbers_internal::safe_strtou32_base(config.socket_mode(), &mode, 8) ||
        mode > 0777) {
      return absl::InvalidArgumentError(
          absl::StrCat("socket_mode '", config.socket_mode(), "' is not an octal mode like 0660"));
    }
    options.socket_mode = mode;
  }
  std::string budget = flags.memory_budget.value_or(
      config.memory_budget().empty() ? "50%" : config.memory_budget());
  ASSIGN_OR_RETURN(options.budget_bytes, ParseByteSize(budget, machine_bytes));
  if (options.budget_bytes == 0) {
    return absl::InvalidArgumentError("memory_budget must be above zero");
  }
  // A share of the budget ("90%"), not of the machine: by default one uid may reserve 90% of
  // it, so another user's job always finds room to start ("0": no quota).
  std::string quota = flags.uid_quota.value_or(
      config.uid_quota().empty() ? kDefaultUidQuota : config.uid_quota());
  ASSIGN_OR_RETURN(options.uid_quota_bytes, ParseByteSize(quota, options.budget_bytes));
  if (!config.shared_segment_size().empty()) {
    ASSIGN_OR_RETURN(options.shared_segment_bytes,
                     ParseByteSize(config.shared_segment_size(), machine_bytes));
  }
  if (!config.segment_granularity().empty()) {
    ASSIGN_OR_RETURN(options.segment_granularity,
                     ParseByteSize(config.segment_granularity(), machine_bytes));
  }
  if (options.segment_granularity == 0 || options.segment_granularity % 4096 != 0 ||
      options.shared_segment_bytes % options.segment_granularity != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "segment_granularity %d must be a multiple of 4 KiB that divides shared_segment_size %d",
        options.segment_granularity, options.shared_segment_bytes));
  }
  options.threads = flags.threads.value_or(config.threads());
  if (options.threads == 0) options.threads = std::max(1u, std::thread::hardware_concurrency());
  options.log_level = flags.log_level.value_or(
      config.log_level().empty() ? "info" : config.log_level());
  options.admin_group = config.admin_group();
  if (config.max_connections_per_uid() != 0) {
    options.max_connections_per_uid = config.max_connections_per_uid();
  }
  uint32_t lease_ms = flags.lease_ms.value_or(config.lease_ms() == 0 ? 10000 : config.lease_ms());
  if (lease_ms < 100) return absl::InvalidArgumentError("lease_ms must be at least 100");
  options.lease = absl::Milliseconds(lease_ms);
  if (config.drain_timeout_s() != 0) options.drain_timeout = absl::Seconds(config.drain_timeout_s());
  if (config.event_ring_size() != 0) options.event_ring_size = config.event_ring_size();
  if (config.has_optimizer_pin_threads()) {
    options.optimizer_pin_threads = config.optimizer_pin_threads();
  }
  if (flags.base_keep_warm_s || config.has_base_keep_warm_s()) {
    options.base_keep_warm =
        absl::Seconds(flags.base_keep_warm_s.value_or(config.base_keep_warm_s()));
  }
  options.gpu_pool_export = flags.gpu_pool_export.value_or(
      config.gpu_pool_export().empty() ? "auto" : config.gpu_pool_export());
  if (options.gpu_pool_export != "auto" && options.gpu_pool_export != "legacy_ipc") {
    return absl::InvalidArgumentError(absl::StrCat("gpu_pool_export '", options.gpu_pool_export,
                                                   "': use auto or legacy_ipc"));
  }
  if (config.optimizer_retention_s() != 0) {
    options.optimizer_retention = absl::Seconds(config.optimizer_retention_s());
  }
  const std::string metrics_listen = flags.metrics_listen.value_or(config.metrics_listen());
  if (!metrics_listen.empty()) {
    ASSIGN_OR_RETURN(options.metrics_listen, ParseListenAddress(metrics_listen));
  }
  return options;
}

absl::StatusOr<ListenAddress> ParseListenAddress(const std::string& text) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics_listen '", text, "': ", why,
        " (write HOST:PORT, such as 127.0.0.1:9478, [::1]:9478 or :9478 for every interface)"));
  };
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos) return bad("no port");
  ListenAddress address;
  uint32_t port = 0;
  if (!absl::SimpleAtoi(text.substr(colon + 1), &port) || port > 65535) {
    return bad("the port is not a number from 0 to 65535");
  }
  address.port = static_cast<uint16_t>(port);
  std::string host = text.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
    in6_addr v6{};
    if (::inet_pton(AF_INET6, host.c_str(), &v6) != 1) return bad("not an IPv6 address");
  } else if (host == "localhost") {
    host = "127.0.0.1";
  } else if (!host.empty()) {
    in_addr v4{};
    if (::inet_pton(AF_INET, host.c_str(), &v4) != 1) {
      return bad("the host is not a numeric IPv4 address or a bracketed IPv6 one");
    }
  }
  address.host = host;
  return address;
}

}  // namespace trainstream::daemon
