// SPDX-License-Identifier: Apache-2.0
// tsctl bases: the shared frozen bases: what they hold, how big, who uses them, load progress.
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "commands.h"
#include "table_format.h"

namespace trainstream::tsctl {

absl::Status RunBases(const Invocation& invocation) {
  if (absl::Status usage = ExpectNoArgs(invocation); !usage.ok()) return usage;
  v1::ListBasesReply reply;
  absl::Status status = invocation.channel->Call([&](grpc::ClientContext* context) {
    return invocation.channel->stub().ListBases(context, v1::ListBasesRequest(), &reply);
  });
  if (!status.ok()) return status;
  if (invocation.json) {
    std::cout << client::ToJson(reply) << "\n";
    return absl::OkStatus();
  }
  if (reply.bases().empty()) {
    std::cout << "no bases\n";
    return absl::OkStatus();
  }
  Table table({{"ID", Align::kRight},
               {"NAME"},
               {"FORMAT"},
               {"BYTES", Align::kRight},
               {"USERS", Align::kRight},
               {"STATE"},
               {"SOURCE"}});
  for (const v1::BaseInfo& b : reply.bases()) {
    std::string state = b.state();
    if (b.state() == "loading") {
      state = absl::StrFormat("loading %.0f%%",
                              100.0 * b.read_bytes() / std::max<uint64_t>(1, b.read_total()));
    } else if (b.state() == "ready" && b.users() == 0) {
      state = absl::StrCat("warm, idle ", HumanDuration(b.idle_s()));
    } else if (b.state() == "ready") {
      state = absl::StrCat("ready (loaded in ", HumanDuration(b.load_seconds()), ")");
    } else if (!b.error().empty()) {
      state = absl::StrCat("failed: ", b.error());
    }
    table.AddRow({absl::StrCat(b.base_id()), b.name(),
                  b.block() == 0 ? b.format() : absl::StrCat(b.format(), "/", b.block()),
                  HumanBytes(b.stored_bytes()), absl::StrCat(b.users()), state, b.source()});
  }
  std::cout << table.Render();
  return absl::OkStatus();
}

}  // namespace trainstream::tsctl
