// SPDX-License-Identifier: Apache-2.0
// ReportEvent: a client's decision recorded in the daemon's event log under its session.
#include <algorithm>

#include "absl/strings/str_format.h"
#include "rpc/request_validation.h"
#include "rpc/trainstream_service.h"

namespace trainstream::daemon {

absl::Status TrainStreamService::ServeReportEvent(grpc::ServerContext* context,
                                                  const v1::ReportEventRequest* request,
                                                  v1::ReportEventReply* reply) {
  absl::Status valid = ValidateEventKind(request->kind());
  if (valid.ok()) valid = ValidateEventMessage(request->message());
  if (valid.ok() && request->numbers_size() > static_cast<int>(kMaxEventNumbers)) {
    valid = absl::InvalidArgumentError(absl::StrFormat(
        "the event carries %d numbers; the most is %d", request->numbers_size(), kMaxEventNumbers));
  }
  // A map's order is unspecified: sort, so the stored event does not depend on it.
  std::vector<std::pair<std::string, double>> numbers(request->numbers().begin(),
                                                      request->numbers().end());
  std::sort(numbers.begin(), numbers.end());
  for (const auto& [name, value] : numbers) {
    if (!valid.ok()) break;
    valid = ValidateEventNumber(name, value);
  }
  if (!valid.ok()) return valid;
  absl::StatusOr<std::shared_ptr<const Session>> session =
      CallersSession(context, request->session_id());
  if (!session.ok()) return session.status();
  absl::Status admitted = reported_events_.Admit((*session)->owner.uid, absl::Now());
  if (!admitted.ok()) return admitted;
  reply->set_seq(events_->Emit("client." + request->kind(), request->message(),
                               std::move(numbers), (*session)->id, (*session)->owner.uid));
  return absl::OkStatus();
}

}  // namespace trainstream::daemon
