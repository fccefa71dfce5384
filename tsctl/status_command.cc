// SPDX-License-Identifier: Apache-2.0
// tsctl status: what the daemon is and what it has.
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "commands.h"
#include "table_format.h"

namespace trainstream::tsctl {

absl::Status RunStatus(const Invocation& invocation) {
  if (absl::Status usage = ExpectNoArgs(invocation); !usage.ok()) return usage;
  v1::Status reply;
  absl::Status status = invocation.channel->Call([&](grpc::ClientContext* context) {
    return invocation.channel->stub().GetStatus(context, v1::GetStatusRequest(), &reply);
  });
  if (!status.ok()) return status;
  if (invocation.json) {
    std::cout << client::ToJson(reply) << "\n";
    return absl::OkStatus();
  }

  std::vector<std::pair<std::string, std::string>> fields = {
      {"version", reply.version()},
      {"pid", absl::StrCat(reply.pid())},
      {"uptime", HumanDuration(reply.uptime_s())},
      {"socket", reply.socket_path()},
      {"draining", reply.draining() ? "yes" : "no"},
      {"sessions", absl::StrCat(reply.sessions())},
      {"memory", absl::StrCat(HumanBytes(reply.reserved_bytes()), " reserved of ",
                              HumanBytes(reply.budget_bytes()), " budget")},
      {"threads", absl::StrCat(reply.threads())},
  };
  if (!reply.metrics_url().empty()) fields.emplace_back("metrics", reply.metrics_url());
  if (reply.gpus().empty()) {
    fields.emplace_back(
        "gpus", reply.gpu_note().empty() ? "none" : absl::StrCat("none (", reply.gpu_note(), ")"));
  }
  std::cout << RenderFields(fields);
  if (reply.gpus().empty()) return absl::OkStatus();
  Table gpus({{"GPU", Align::kRight}, {"NAME"}, {"UUID"}, {"MEMORY", Align::kRight}});
  for (const v1::GpuInfo& gpu : reply.gpus()) {
    gpus.AddRow({absl::StrCat(gpu.index()), gpu.name(), gpu.uuid(), HumanBytes(gpu.total_bytes())});
  }
  std::cout << "\n" << gpus.Render();
  return absl::OkStatus();
}

}  // namespace trainstream::tsctl
