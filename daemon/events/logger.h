// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_EVENTS_LOGGER_H_
#define TRAINSTREAM_DAEMON_EVENTS_LOGGER_H_

#include <string>

#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace trainstream::daemon {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// "debug", "info", "warning" or "error".
absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name);
// Lines below `level` are dropped. Thread-safe.
void SetLogLevel(LogLevel level);
// One line on stderr (the journal under systemd), prefixed with the level. Thread-safe.
void Log(LogLevel level, absl::string_view message);

// The line Log writes: "trainstreamd <level>: <message>", led by the syslog priority in the
// form journald reads ("<3>" for errors ... "<7>" for debug) when `journal` is set.
std::string FormatLogLine(LogLevel level, absl::string_view message, bool journal);

// Whether stderr is the journal's stream: systemd names it in $JOURNAL_STREAM ("device:inode")
// for the service it starts, and a redirected stderr no longer matches it.
bool StderrIsJournal();

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_EVENTS_LOGGER_H_
