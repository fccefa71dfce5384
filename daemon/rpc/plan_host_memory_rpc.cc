// SPDX-License-Identifier: Apache-2.0
// PlanHostMemory: admission of a job's whole host-memory plan against the machine's budget.
#include "absl/strings/str_format.h"
#include "rpc/request_validation.h"
#include "rpc/trainstream_service.h"

namespace trainstream::daemon {

absl::Status TrainStreamService::ServePlanHostMemory(grpc::ServerContext* context,
                                                     const v1::PlanHostMemoryRequest* request,
                                                     v1::HostPlan* reply) {
  constexpr uint32_t kMaxWaitMs = 3'600'000;
  if (request->bytes() > kMaxBufferBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "bytes %d is more than any plan can hold (16 TiB)", request->bytes()));
  }
  if (request->wait_ms() > kMaxWaitMs) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "wait_ms %d is longer than an hour; wait in several calls", request->wait_ms()));
  }
  absl::StatusOr<std::shared_ptr<const Session>> session =
      CallersSession(context, request->session_id());
  if (!session.ok()) return session.status();
  const Session& s = **session;
  absl::StatusOr<PlanOutcome> outcome =
      arena_->Plan(s.job, request->bytes(), absl::Milliseconds(request->wait_ms()));
  if (!outcome.ok()) {
    events_->Emit("arena.plan_refused", std::string(outcome.status().message()),
                  {{"bytes", static_cast<double>(request->bytes())}}, s.id, s.owner.uid);
    return outcome.status();
  }
  events_->Emit("arena.plan",
                absl::StrFormat("job '%s' plans %.2f GiB of host memory (machine: %.2f of %.2f "
                                "GiB held or planned)",
                                s.job.job_id, outcome->planned / double(1 << 30),
                                outcome->committed / double(1 << 30),
                                outcome->budget / double(1 << 30)),
                {{"planned_bytes", static_cast<double>(outcome->planned)},
                 {"committed_bytes", static_cast<double>(outcome->committed)}},
                s.id, s.owner.uid);
  reply->set_job_id(s.job.job_id);
  reply->set_planned_bytes(outcome->planned);
  reply->set_used_bytes(outcome->used);
  reply->set_budget_bytes(outcome->budget);
  reply->set_committed_bytes(outcome->committed);
  return absl::OkStatus();
}

}  // namespace trainstream::daemon
