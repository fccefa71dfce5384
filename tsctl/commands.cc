// SPDX-License-Identifier: Apache-2.0
#include "commands.h"

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace trainstream::tsctl {
namespace {

constexpr Command kCommands[] = {
    {"status", "", "daemon version, uptime, memory budget and GPUs", &RunStatus},
    {"sessions", "", "the sessions you may see, one per line", &RunSessions},
    {"memory", "", "the memory budget and who holds what", &RunMemory},
    {"optimizers", "", "each job's host optimizer: size, step, last step time and GB/s",
     &RunOptimizers},
    {"bases", "", "the shared frozen bases: format, bytes, users, load progress", &RunBases},
    {"pools", "", "the GPU pools: GPU, bytes, what they hold, importers", &RunPools},
    {"events", "[-f|--follow] [--since=N]", "recent events; -f keeps streaming new ones",
     &RunEvents},
    {"metrics", "[--textfile=PATH.prom [--interval=S]]",
     "Prometheus metrics; --textfile writes them for node_exporter, every S seconds with "
     "--interval",
     &RunMetrics},
    {"drain", "[--wait]",
     "stop taking sessions, wait for the open ones, exit (root, the daemon's user and its admin "
     "group); --wait returns once it has",
     &RunDrain},
};

// The payload that marks a status as tsctl's own usage error, so that a daemon's
// INVALID_ARGUMENT is never mistaken for one.
constexpr absl::string_view kUsagePayload = "type.trainstream.dev/tsctl.UsageError";

}  // namespace

absl::Span<const Command> Commands() { return kCommands; }

const Command* FindCommand(absl::string_view name) {
  for (const Command& command : kCommands) {
    if (command.name == name) return &command;
  }
  return nullptr;
}

absl::Status UsageError(absl::string_view message) {
  absl::Status status = absl::InvalidArgumentError(message);
  status.SetPayload(kUsagePayload, absl::Cord());
  return status;
}

bool IsUsageError(const absl::Status& status) {
  return status.GetPayload(kUsagePayload).has_value();
}

absl::Status ExpectNoArgs(const Invocation& invocation) {
  if (invocation.args.empty()) return absl::OkStatus();
  const std::string& first = invocation.args.front();
  return UsageError(absl::StrCat(
      absl::StartsWith(first, "-") ? "unknown flag '" : "unexpected argument '", first, "'"));
}

}  // namespace trainstream::tsctl
