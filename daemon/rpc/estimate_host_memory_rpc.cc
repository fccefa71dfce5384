// SPDX-License-Identifier: Apache-2.0
// EstimateHostMemory: a job's host memory, sized by the optimizer's own buffer list and placed
// by the arena's own rules, so that the plan a client makes (PlanHostMemory) matches what its
// job will take instead of re-deriving the daemon's rounding.
#include "absl/strings/str_format.h"
#include "optimizer/optimizer_settings.h"
#include "rpc/optimizer_conversion.h"
#include "rpc/request_validation.h"
#include "rpc/trainstream_service.h"
#include "trainstream/status_macros.h"

namespace trainstream::daemon {
namespace {

// Bounds the work one request may ask for: a model of a million tensors on 64 ranks is far
// beyond any job seen.
constexpr uint64_t kMaxEstimatedBuffers = uint64_t{1} << 26;

absl::Status Estimate(const Arena& arena, const v1::EstimateHostMemoryRequest& request,
                      v1::HostMemoryEstimate* reply) {
  // The groups' hyper-parameters do not change the state's size: a spec without them is fine.
  v1::OptimizerSpec spec = request.spec();
  if (spec.groups().empty()) spec.add_groups()->set_lr(1e-3);
  ASSIGN_OR_RETURN(OptimizerSettings settings, FromProto(spec));
  ASSIGN_OR_RETURN(std::vector<ParameterDescription> params, FromProto(request.params()));
  const uint32_t ranks = request.ranks() == 0 ? 1 : request.ranks();
  if (ranks > kMaxWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrFormat("ranks %d is more than a job may have (%d)", ranks, kMaxWorldSize));
  }
  const uint64_t count = params.size() * (3 + 2 + uint64_t{ranks}) +
                         static_cast<uint64_t>(request.other_buffers_size());
  if (count > kMaxEstimatedBuffers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%d parameters on %d ranks and %d other buffers are more buffers than a job may plan "
        "(%d)", params.size(), ranks, request.other_buffers_size(), kMaxEstimatedBuffers));
  }
  std::vector<Arena::PlannedBuffer> optimizer;
  uint64_t buffer_bytes = 0;
  for (uint64_t bytes : JobBufferBytes(settings, params, ranks)) {
    optimizer.push_back({bytes, kOptimizerBufferAlignment});
    buffer_bytes += bytes;
  }
  std::vector<Arena::PlannedBuffer> everything = optimizer;
  for (size_t i = 0; i < static_cast<size_t>(request.other_buffers_size()); ++i) {
    const uint64_t bytes = request.other_buffers(static_cast<int>(i));
    if (bytes == 0 || bytes > kMaxBufferBytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "other_buffers[%d] is %d bytes; a buffer holds between 1 byte and 16 TiB", i, bytes));
    }
    everything.push_back({bytes, Arena::PlannedBuffer{}.alignment});
    buffer_bytes += bytes;
  }
  reply->set_bytes(arena.ReservationFor(everything));
  reply->set_optimizer_bytes(arena.ReservationFor(optimizer));
  reply->set_buffer_bytes(buffer_bytes);
  reply->set_buffers(everything.size());
  reply->set_segment_bytes(arena.options().segment_bytes);
  reply->set_segment_granularity(arena.options().segment_granularity);
  return absl::OkStatus();
}

}  // namespace

absl::Status TrainStreamService::ServeEstimateHostMemory(
    grpc::ServerContext* context, const v1::EstimateHostMemoryRequest* request,
    v1::HostMemoryEstimate* reply) {
  absl::StatusOr<std::shared_ptr<const Session>> session =
      CallersSession(context, request->session_id());
  if (!session.ok()) return session.status();
  return Estimate(*arena_, *request, reply);
}

}  // namespace trainstream::daemon
