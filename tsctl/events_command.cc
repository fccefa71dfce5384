// SPDX-License-Identifier: Apache-2.0
// tsctl events: the daemon's event ring, one line per event; -f keeps streaming new ones.
#include <algorithm>
#include <cmath>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "commands.h"

namespace trainstream::tsctl {
namespace {

struct EventsArgs {
  bool follow = false;
  uint64_t since = 0;
};

absl::Status ParseEventsArgs(const std::vector<std::string>& args, EventsArgs* out) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "-f" || arg == "--follow") {
      out->follow = true;
      continue;
    }
    std::string value;
    if (absl::StartsWith(arg, "--since=")) {
      value = arg.substr(std::string("--since=").size());
    } else if (arg == "--since") {
      if (i + 1 == args.size()) return UsageError("--since needs a sequence number");
      value = args[++i];
    } else {
      return UsageError(absl::StrCat("unknown argument '", arg, "' for events"));
    }
    if (!absl::SimpleAtoi(value, &out->since)) {
      return UsageError(absl::StrCat("--since wants a sequence number, not '", value, "'"));
    }
  }
  return absl::OkStatus();
}

// Counts print as integers; anything else with six significant digits.
std::string FormatNumber(double value) {
  if (std::isfinite(value) && value == std::trunc(value) && std::fabs(value) < 1e15) {
    return absl::StrFormat("%.0f", value);
  }
  return absl::StrFormat("%.6g", value);
}

// "09:38:20.953  session.open  s-f7e2...  pid 6655 opened rank 0/1 of job 'demo'  pid=6655 rank=0"
std::string FormatEvent(const v1::Event& event) {
  const absl::Time time =
      absl::FromUnixMicros(static_cast<int64_t>(std::llround(event.time_unix_s() * 1e6)));
  std::string line = absl::StrCat(
      absl::FormatTime("%H:%M:%E3S", time, absl::LocalTimeZone()), "  ", event.kind(), "  ",
      event.session_id().empty() ? "-" : event.session_id(), "  ", event.message());
  // The map's order is unspecified; sort so that lines compare and grep stably.
  std::vector<std::pair<std::string, double>> numbers(event.numbers().begin(),
                                                      event.numbers().end());
  std::sort(numbers.begin(), numbers.end());
  for (size_t i = 0; i < numbers.size(); ++i) {
    absl::StrAppend(&line, i == 0 ? "  " : " ", numbers[i].first, "=",
                    FormatNumber(numbers[i].second));
  }
  return line;
}

}  // namespace

absl::Status RunEvents(const Invocation& invocation) {
  EventsArgs args;
  if (absl::Status usage = ParseEventsArgs(invocation.args, &args); !usage.ok()) return usage;

  grpc::ClientContext context;
  // A followed stream runs until interrupted, so only a one-shot read gets a deadline.
  if (!args.follow) invocation.channel->PrepareContext(&context);
  v1::StreamEventsRequest request;
  request.set_since_seq(args.since);
  request.set_follow(args.follow);
  std::unique_ptr<grpc::ClientReader<v1::Event>> reader =
      invocation.channel->stub().StreamEvents(&context, request);

  v1::Event event;
  while (reader->Read(&event)) {
    std::cout << (invocation.json ? client::ToJson(event) : FormatEvent(event)) << "\n";
    // Someone is watching (or piping into grep): show each event as it arrives.
    if (args.follow) std::cout.flush();
  }
  absl::Status finished = invocation.channel->Explain(reader->Finish());
  if (args.follow && finished.ok()) {
    // A followed stream has no end of its own: the daemon ended it, stopping or draining.
    // Scripts that wait on `tsctl events -f` must see that as a failure, not as success.
    return absl::UnavailableError("the daemon ended the event stream (it stopped or drains)");
  }
  return finished;
}

}  // namespace trainstream::tsctl
