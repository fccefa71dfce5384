// SPDX-License-Identifier: Apache-2.0
#include "events/logger.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>

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

std::string FormatLogLine(LogLevel level, absl::string_view message, bool journal) {
  // syslog priorities (sd-daemon(3)): err 3, warning 4, info 6, debug 7.
  constexpr const char* kPriorities[] = {"<7>", "<6>", "<4>", "<3>"};
  const int i = static_cast<int>(level);
  return absl::StrCat(journal ? kPriorities[i] : "", "trainstreamd ", kNames[i], ": ", message,
                      "\n");
}

bool StderrIsJournal() {
  const char* stream = std::getenv("JOURNAL_STREAM");
  unsigned long long device = 0, inode = 0;  // NOLINT(runtime/int): strtoull's width
  if (stream == nullptr || std::sscanf(stream, "%llu:%llu", &device, &inode) != 2) return false;
  struct stat st{};
  return ::fstat(STDERR_FILENO, &st) == 0 && st.st_dev == device && st.st_ino == inode;
}

void Log(LogLevel level, absl::string_view message) {
  if (static_cast<int>(level) < g_level.load()) return;
  static const bool journal = StderrIsJournal();
  // One write per line keeps lines from different threads whole.
  const std::string line = FormatLogLine(level, message, journal);
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace trainstream::daemon
