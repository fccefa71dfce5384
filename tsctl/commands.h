// SPDX-License-Identifier: Apache-2.0
// tsctl's subcommands: one handler per file, found by name in Commands().
#ifndef TRAINSTREAM_TSCTL_COMMANDS_H_
#define TRAINSTREAM_TSCTL_COMMANDS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "control_channel.h"

namespace trainstream::tsctl {

// What a handler gets: the channel to the daemon, the output mode, and the arguments that
// follow the subcommand's name with the common flags (--json, --socket) already taken out.
struct Invocation {
  client::ControlChannel* channel = nullptr;  // not owned; never null
  bool json = false;                          // print the reply as JSON (lines, for streams)
  std::vector<std::string> args;
};

// Prints to stdout. Returns OK, a UsageError() for bad arguments, or the daemon's error as
// returned by ControlChannel (UNAVAILABLE / DEADLINE_EXCEEDED when no daemon answers).
using Handler = absl::Status (*)(const Invocation& invocation);

struct Command {
  absl::string_view name;
  absl::string_view args;     // synopsis of the subcommand's own flags, e.g. "[-f] [--since=N]"
  absl::string_view summary;  // one line for the usage text
  Handler run;
};

// The subcommands, in the order the usage text lists them.
absl::Span<const Command> Commands();

// nullptr when no subcommand is called `name`.
const Command* FindCommand(absl::string_view name);

// A status that main() reports as a usage error (exit code 2) rather than a daemon's error.
absl::Status UsageError(absl::string_view message);
bool IsUsageError(const absl::Status& status);

// For subcommands that take no arguments of their own: OK, or a UsageError naming the first.
absl::Status ExpectNoArgs(const Invocation& invocation);

// The handlers, one per *_command.cc.
absl::Status RunStatus(const Invocation& invocation);
absl::Status RunSessions(const Invocation& invocation);
absl::Status RunMemory(const Invocation& invocation);
absl::Status RunEvents(const Invocation& invocation);
absl::Status RunOptimizers(const Invocation& invocation);
absl::Status RunBases(const Invocation& invocation);
absl::Status RunPools(const Invocation& invocation);
absl::Status RunMetrics(const Invocation& invocation);
absl::Status RunDrain(const Invocation& invocation);

}  // namespace trainstream::tsctl

#endif  // TRAINSTREAM_TSCTL_COMMANDS_H_
