// SPDX-License-Identifier: Apache-2.0
// GPU pools: place a shared base in VRAM for the processes on that GPU, release it, list pools.
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "rpc/trainstream_service.h"

namespace trainstream::daemon {
namespace {

// "GPU-" and 32 hex digits in 8-4-4-4-12 groups, as the driver and nvidia-smi write them.
bool IsGpuUuid(const std::string& uuid) {
  if (uuid.size() != 40 || !absl::StartsWith(uuid, "GPU-")) return false;
  for (size_t i = 4; i < uuid.size(); ++i) {
    const bool dash = i == 12 || i == 17 || i == 22 || i == 27;
    const char c = uuid[i];
    if (dash ? c != '-' : !((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

void ToProto(const PoolSummary& pool, v1::GpuPoolInfo* out) {
  out->set_pool_id(pool.id);
  out->set_gpu_uuid(pool.uuid);
  out->set_bytes(pool.bytes);
  out->set_kind(PoolKindName(pool.kind));
  out->set_purpose(pool.purpose);
  out->set_uid(pool.uid);
  for (const std::string& session : pool.importers) out->add_importers(session);
  out->set_base_id(pool.base_id);
  for (uint64_t offset : pool.buffer_offsets) out->add_buffer_offsets(offset);
  out->set_fill_seconds(pool.fill_seconds);
}

}  // namespace

absl::Status TrainStreamService::ServePlaceBaseOnGpu(grpc::ServerContext* context,
                                                     const v1::PlaceBaseOnGpuRequest* request,
                                                     v1::GpuPoolInfo* reply) {
  if (!IsGpuUuid(request->gpu_uuid())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "'%s' is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, lower-case hex)",
        request->gpu_uuid().substr(0, 64)));
  }
  absl::StatusOr<std::shared_ptr<const Session>> session =
      CallersSession(context, request->session_id());
  if (!session.ok()) return session.status();
  if (gpu_pools_.bases == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("this daemon makes no GPU pools: ", gpu_pools_.note));
  }
  absl::StatusOr<PoolSummary> pool =
      gpu_pools_.bases->Place(**session, request->base_id(), request->gpu_uuid());
  if (!pool.ok()) return pool.status();
  ToProto(*pool, reply);
  return absl::OkStatus();
}

absl::Status TrainStreamService::ServeReleaseGpuPool(grpc::ServerContext* context,
                                                     const v1::ReleaseGpuPoolRequest* request,
                                                     v1::ReleaseGpuPoolReply*) {
  absl::StatusOr<std::shared_ptr<const Session>> session =
      CallersSession(context, request->session_id());
  if (!session.ok()) return session.status();
  if (gpu_pools_.pools == nullptr) {
    return absl::NotFoundError(
        absl::StrFormat("this session has not imported GPU pool %d", request->pool_id()));
  }
  return gpu_pools_.pools->Release(request->pool_id(), (*session)->id);
}

absl::Status TrainStreamService::ServeListGpuPools(grpc::ServerContext* context,
                                                   const v1::ListGpuPoolsRequest*,
                                                   v1::ListGpuPoolsReply* reply) {
  absl::StatusOr<PeerCredentials> caller = Caller(context);
  if (!caller.ok()) return caller.status();
  reply->set_note(gpu_pools_.note);
  if (gpu_pools_.pools == nullptr) return absl::OkStatus();
  for (const PoolSummary& pool : gpu_pools_.pools->List(
           caller->admin ? std::nullopt : std::optional<uid_t>(caller->uid))) {
    ToProto(pool, reply->add_pools());
  }
  return absl::OkStatus();
}

}  // namespace trainstream::daemon
