// SPDX-License-Identifier: Apache-2.0
// tsctl sessions: the sessions the caller may see, one row each.
#include <iostream>

#include "absl/strings/str_cat.h"
#include "commands.h"
#include "table_format.h"

namespace trainstream::tsctl {

absl::Status RunSessions(const Invocation& invocation) {
  if (absl::Status usage = ExpectNoArgs(invocation); !usage.ok()) return usage;
  v1::ListSessionsReply reply;
  absl::Status status = invocation.channel->Call([&](grpc::ClientContext* context) {
    return invocation.channel->stub().ListSessions(context, v1::ListSessionsRequest(), &reply);
  });
  if (!status.ok()) return status;
  if (invocation.json) {
    std::cout << client::ToJson(reply) << "\n";
    return absl::OkStatus();
  }
  if (reply.sessions().empty()) {
    std::cout << "no sessions\n";
    return absl::OkStatus();
  }

  Table table({{"SESSION"},
               {"UID", Align::kRight},
               {"PID", Align::kRight},
               {"JOB"},
               {"RANK", Align::kRight},
               {"BUFFERS", Align::kRight},
               {"BYTES", Align::kRight},
               {"AGE", Align::kRight},
               {"LEASE", Align::kRight},
               {"ATTACHED"}});
  for (const v1::SessionInfo& s : reply.sessions()) {
    // world_size 0 is read as 1 by the daemon, so show it that way too.
    const uint32_t world = s.world_size() == 0 ? 1 : s.world_size();
    table.AddRow({s.session_id(), absl::StrCat(s.uid()), absl::StrCat(s.pid()), s.job_id(),
                  absl::StrCat(s.rank(), "/", world), absl::StrCat(s.buffers()),
                  HumanBytes(s.buffer_bytes()), HumanDuration(s.age_s()),
                  HumanDuration(s.lease_left_s()), s.attached() ? "yes" : "no"});
  }
  std::cout << table.Render();
  return absl::OkStatus();
}

}  // namespace trainstream::tsctl
