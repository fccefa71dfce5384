// SPDX-License-Identifier: Apache-2.0
// tsctl: global flags, the subcommand looked up by name, its status turned into an exit code.
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "commands.h"
#include "control_channel.h"
#include "ipc/daemon_discovery.h"
#include "trainstream/version.h"

namespace {

using trainstream::tsctl::Command;

enum ExitCode { kOk = 0, kDaemonError = 1, kUsage = 2, kNoDaemon = 3 };

struct CommandLine {
  const Command* command = nullptr;
  bool help = false;
  bool version = false;
  bool json = false;
  std::string socket_path;
  absl::Duration timeout = absl::Seconds(5);
  std::vector<std::string> args;  // the subcommand's own
};

// "events [-f|--follow] [--since=N]", or just the name for a subcommand without flags.
std::string Synopsis(const Command& c) {
  return c.args.empty() ? std::string(c.name) : absl::StrCat(c.name, " ", c.args);
}

std::string Usage(const std::string& socket_path) {
  std::string out =
      "usage: tsctl [--socket=PATH] [--timeout=DURATION] [--json] <command> [args]\n\n"
      "commands:\n";
  size_t width = 0;
  for (const Command& c : trainstream::tsctl::Commands()) {
    width = std::max(width, Synopsis(c).size());
  }
  for (const Command& c : trainstream::tsctl::Commands()) {
    absl::StrAppend(&out, absl::StrFormat("  %-*s  %s\n", width, Synopsis(c), c.summary));
  }
  absl::StrAppend(&out,
                  "\nflags (before or after the command):\n"
                  "  --socket=PATH       the daemon's control socket (default ",
                  socket_path,
                  ")\n"
                  "  --json              print the reply as JSON (events: one object a line)\n"
                  "  --timeout=DURATION  how long to wait for an answer (default 5s)\n"
                  "  -h, --help          this text\n"
                  "  --version           tsctl's release\n\n"
                  "exit codes: 0 ok, 1 the daemon answered with an error, 2 usage error,\n"
                  "            3 no daemon answered\n");
  return out;
}

// Flags common to all subcommands are taken wherever they appear; the rest after the
// subcommand's name are left for its handler.
absl::Status ParseCommandLine(int argc, char** argv, CommandLine* out) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value_of = [&](absl::string_view flag, std::string* value) {
      if (absl::StartsWith(arg, absl::StrCat(flag, "="))) {
        *value = arg.substr(flag.size() + 1);
        return true;
      }
      if (arg == flag && i + 1 < argc) {
        *value = argv[++i];
        return true;
      }
      return false;
    };
    std::string value;
    if (arg == "-h" || arg == "--help") {
      out->help = true;
    } else if (arg == "--version") {
      out->version = true;
    } else if (arg == "--json") {
      out->json = true;
    } else if (value_of("--socket", &value)) {
      out->socket_path = value;
    } else if (value_of("--timeout", &value)) {
      if (!absl::ParseDuration(value, &out->timeout) || out->timeout <= absl::ZeroDuration()) {
        return trainstream::tsctl::UsageError(
            absl::StrCat("--timeout wants a duration such as 5s or 500ms, not '", value, "'"));
      }
    } else if (out->command != nullptr) {
      out->args.push_back(arg);
    } else if (absl::StartsWith(arg, "-")) {
      return trainstream::tsctl::UsageError(absl::StrCat("unknown flag '", arg, "'"));
    } else if ((out->command = trainstream::tsctl::FindCommand(arg)) == nullptr) {
      return trainstream::tsctl::UsageError(absl::StrCat("unknown command '", arg, "'"));
    }
  }
  return absl::OkStatus();
}

int ExitCodeFor(const absl::Status& status) {
  if (status.ok()) return kOk;
  if (trainstream::tsctl::IsUsageError(status)) return kUsage;
  if (absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status)) return kNoDaemon;
  return kDaemonError;
}

}  // namespace

int main(int argc, char** argv) {
  CommandLine line;
  const std::vector<std::string> candidates = trainstream::ipc::ClientSocketCandidates();
  const std::string default_help = absl::StrJoin(candidates, ", then ");
  absl::Status status = ParseCommandLine(argc, argv, &line);
  if (!status.ok()) {
    std::cerr << "tsctl: " << status.message() << "\n\n" << Usage(default_help);
    return kUsage;
  }
  if (line.version) {
    std::cout << "tsctl " << trainstream::kTrainStreamVersion << "\n";
    return kOk;
  }
  if (line.help || line.command == nullptr) {
    (line.help ? std::cout : std::cerr) << Usage(default_help);
    return line.help ? kOk : kUsage;
  }
  if (line.socket_path.empty()) {
    absl::StatusOr<std::string> found = trainstream::ipc::FindDaemonSocket(candidates);
    if (!found.ok()) {
      std::cerr << "tsctl: " << found.status().message() << "\n";
      return kNoDaemon;
    }
    line.socket_path = *found;
  }

  trainstream::client::ControlChannel channel(line.socket_path, line.timeout);
  status = line.command->run({&channel, line.json, line.args});
  std::cout.flush();
  const int code = ExitCodeFor(status);
  if (code == kUsage) {
    std::cerr << "tsctl " << line.command->name << ": " << status.message() << "\nusage: tsctl "
              << Synopsis(*line.command) << " [--json]\n";
  } else if (code == kDaemonError) {
    std::cerr << "tsctl: " << absl::StatusCodeToString(status.code()) << ": " << status.message()
              << "\n";
  } else if (code == kNoDaemon) {
    std::cerr << "tsctl: " << status.message() << "\n";
  }
  return code;
}
