// SPDX-License-Identifier: Apache-2.0
// tsctl pools: the daemon's GPU pools: which GPU, how big, what they hold, who imports them.
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "commands.h"
#include "table_format.h"

namespace trainstream::tsctl {

absl::Status RunPools(const Invocation& invocation) {
  if (absl::Status usage = ExpectNoArgs(invocation); !usage.ok()) return usage;
  v1::ListGpuPoolsReply reply;
  absl::Status status = invocation.channel->Call([&](grpc::ClientContext* context) {
    return invocation.channel->stub().ListGpuPools(context, v1::ListGpuPoolsRequest(), &reply);
  });
  if (!status.ok()) return status;
  if (invocation.json) {
    std::cout << client::ToJson(reply) << "\n";
    return absl::OkStatus();
  }
  if (reply.pools().empty()) {
    std::cout << "no GPU pools" << (reply.note().empty() ? "" : absl::StrCat(": ", reply.note()))
              << "\n";
    return absl::OkStatus();
  }
  Table table({{"ID", Align::kRight},
               {"GPU"},
               {"BYTES", Align::kRight},
               {"KIND"},
               {"HOLDS"},
               {"FILLED IN", Align::kRight},
               {"IMPORTERS", Align::kRight},
               {"SESSIONS"}});
  for (const v1::GpuPoolInfo& p : reply.pools()) {
    table.AddRow({absl::StrCat(p.pool_id()), p.gpu_uuid(), HumanBytes(p.bytes()), p.kind(),
                  p.purpose(), HumanDuration(p.fill_seconds()), absl::StrCat(p.importers_size()),
                  absl::StrJoin(p.importers(), ",")});
  }
  std::cout << table.Render();
  return absl::OkStatus();
}

}  // namespace trainstream::tsctl
