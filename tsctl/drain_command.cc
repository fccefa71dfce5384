// SPDX-License-Identifier: Apache-2.0
// tsctl drain: the daemon stops taking sessions, waits for the open ones (up to its drain
// timeout) and exits, as on SIGTERM; --wait stays until it has.
#include <unistd.h>

#include <iostream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "commands.h"

namespace trainstream::tsctl {

absl::Status RunDrain(const Invocation& invocation) {
  bool wait = false;
  for (const std::string& arg : invocation.args) {
    if (arg == "--wait") {
      wait = true;
    } else {
      return UsageError(absl::StrCat(arg.starts_with("-") ? "unknown flag '" : "unexpected "
                                     "argument '", arg, "'"));
    }
  }
  v1::DrainReply reply;
  absl::Status status = invocation.channel->Call([&](grpc::ClientContext* context) {
    return invocation.channel->stub().Drain(context, v1::DrainRequest(), &reply);
  });
  if (!status.ok()) return status;
  if (invocation.json) {
    std::cout << client::ToJson(reply) << "\n";
  } else {
    std::cout << "draining: " << reply.sessions() << " sessions open; the daemon exits when they "
              << "have closed or at its drain timeout\n";
  }
  if (!wait) return absl::OkStatus();
  // Until the daemon no longer answers: its sockets go with it.
  while (true) {
    v1::Status now;
    const absl::Status answered = invocation.channel->Call([&](grpc::ClientContext* context) {
      return invocation.channel->stub().GetStatus(context, v1::GetStatusRequest(), &now);
    });
    if (!answered.ok()) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  if (!invocation.json) std::cout << "the daemon has stopped\n";
  return absl::OkStatus();
}

}  // namespace trainstream::tsctl
