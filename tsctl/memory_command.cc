// SPDX-License-Identifier: Apache-2.0
// tsctl memory: the budget, the jobs' plans, then who holds what (by uid, by session, by tag).
#include <iostream>

#include "absl/strings/str_cat.h"
#include "commands.h"
#include "table_format.h"

namespace trainstream::tsctl {
namespace {

// One usage table under a title, or a line saying it is empty. `bytes_header` differs because
// by-uid rows count reserved segment bytes while the others count buffer bytes.
void PrintUsage(absl::string_view title, const std::string& key_header,
                const std::string& bytes_header,
                const google::protobuf::RepeatedPtrField<v1::UsageRow>& rows) {
  std::cout << "\n" << title << ":\n";
  if (rows.empty()) {
    std::cout << "(none)\n";
    return;
  }
  Table table({{key_header}, {bytes_header, Align::kRight}, {"BUFFERS", Align::kRight}});
  for (const v1::UsageRow& row : rows) {
    table.AddRow({row.key().empty() ? "-" : row.key(), HumanBytes(row.bytes()),
                  absl::StrCat(row.buffers())});
  }
  std::cout << table.Render();
}

}  // namespace

absl::Status RunMemory(const Invocation& invocation) {
  if (absl::Status usage = ExpectNoArgs(invocation); !usage.ok()) return usage;
  v1::MemoryReport reply;
  absl::Status status = invocation.channel->Call([&](grpc::ClientContext* context) {
    return invocation.channel->stub().GetMemory(context, v1::GetMemoryRequest(), &reply);
  });
  if (!status.ok()) return status;
  if (invocation.json) {
    std::cout << client::ToJson(reply) << "\n";
    return absl::OkStatus();
  }

  std::cout << RenderFields({
      {"budget", HumanBytes(reply.budget_bytes())},
      {"reserved", HumanBytes(reply.reserved_bytes())},
      {"committed", absl::StrCat(HumanBytes(reply.committed_bytes()),
                                 " (reserved, plus planned and not yet reserved)")},
      {"uid quota", reply.uid_quota_bytes() == 0 ? "none" : HumanBytes(reply.uid_quota_bytes())},
      {"segments", absl::StrCat(reply.segments())},
  });
  std::cout << "\nplans by job:\n";
  if (reply.plans().empty()) {
    std::cout << "(none)\n";
  } else {
    Table table({{"UID", Align::kRight}, {"JOB"}, {"PLANNED", Align::kRight},
                 {"HELD", Align::kRight}});
    for (const v1::JobPlan& plan : reply.plans()) {
      table.AddRow({absl::StrCat(plan.uid()), plan.job_id(), HumanBytes(plan.planned_bytes()),
                    HumanBytes(plan.used_bytes())});
    }
    std::cout << table.Render();
  }
  PrintUsage("by uid", "UID", "RESERVED", reply.by_uid());
  PrintUsage("by session", "SESSION", "BYTES", reply.by_session());
  PrintUsage("by tag", "TAG", "BYTES", reply.by_tag());
  return absl::OkStatus();
}

}  // namespace trainstream::tsctl
