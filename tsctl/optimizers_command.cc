// SPDX-License-Identifier: Apache-2.0
// tsctl optimizers: each job's host optimizer, with the figures of its last step.
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "commands.h"
#include "table_format.h"

namespace trainstream::tsctl {

absl::Status RunOptimizers(const Invocation& invocation) {
  if (absl::Status usage = ExpectNoArgs(invocation); !usage.ok()) return usage;
  v1::ListOptimizersReply reply;
  absl::Status status = invocation.channel->Call([&](grpc::ClientContext* context) {
    return invocation.channel->stub().ListOptimizers(context, v1::ListOptimizersRequest(), &reply);
  });
  if (!status.ok()) return status;
  if (invocation.json) {
    std::cout << client::ToJson(reply) << "\n";
    return absl::OkStatus();
  }
  if (reply.optimizers().empty()) {
    std::cout << "no optimizers\n";
    return absl::OkStatus();
  }
  Table table({{"JOB"},
               {"KIND"},
               {"RANKS", Align::kRight},
               {"PARAMS", Align::kRight},
               {"TENSORS", Align::kRight},
               {"STATE BYTES", Align::kRight},
               {"STEP", Align::kRight},
               {"LAST STEP", Align::kRight},
               {"UPDATE GB/S", Align::kRight},
               {"GRAD NORM", Align::kRight},
               // Steps whose updates were undone by the norm, of those that speculated.
               {"ROLLED BACK", Align::kRight},
               {"ISA"},
               {"STATE"}});
  for (const v1::OptimizerInfo& o : reply.optimizers()) {
    const v1::StepStats& last = o.last_step();
    table.AddRow({o.job_id(),
                  absl::StrCat(o.spec().kind() == v1::ADAM ? "adam" : "adamw",
                               o.spec().moment_dtype() == v1::BFLOAT16 ? "/bf16" : "/fp32"),
                  absl::StrCat(o.ranks_attached(), "/", o.world_size()),
                  absl::StrFormat("%.1fM", static_cast<double>(o.params()) / 1e6),
                  absl::StrCat(o.tensors()), HumanBytes(o.state_bytes()), absl::StrCat(o.step()),
                  last.step() == 0 ? "-" : HumanDuration(last.seconds()),
                  last.step() == 0 ? "-" : absl::StrFormat("%.1f", last.gbps()),
                  last.grad_norm() == 0 ? "-" : absl::StrFormat("%.4g", last.grad_norm()),
                  o.speculated_steps() == 0
                      ? "-"
                      : absl::StrCat(o.rolled_back_steps(), "/", o.speculated_steps()),
                  absl::StrCat(o.isa(), " x", o.threads()), o.state()});
  }
  std::cout << table.Render();
  return absl::OkStatus();
}

}  // namespace trainstream::tsctl
