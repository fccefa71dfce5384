// SPDX-License-Identifier: Apache-2.0
#include "events/logger.h"

#include <atomic>
#include <cstdio>

#include "absl/strings/str_cat.h"

namespace trainstream::daemon {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
constexpr const char* kNames[] = {"debug", "info", "warning", "error"};
}  // namespace

absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name) {
  for (int i = 0; i < 4; ++i) {
    if (name == kNames[i]) return static_cast<LogLevel>(i);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("log level '", name, "' is not one of debug, info, warning, error"));
}

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level)); }

void Log(LogLevel level, absl::string_view message) {
  if (static_cast<int>(level) < g_level.load()) return;
  // One fprintf per line keeps lines from different threads whole.
  std::fprintf(stderr, "trainstreamd %s: %.*s\n", kNames[static_cast<int>(level)],
               static_cast<int>(message.size()), message.data());
}

}  // namespace trainstream::daemon
