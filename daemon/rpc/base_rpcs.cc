// SPDX-License-Identifier: Apache-2.0
// Shared frozen bases: load (or attach to) a base, read its state, detach, list.
#include <optional>

#include "absl/strings/str_format.h"
#include "rpc/optimizer_conversion.h"
#include "rpc/request_validation.h"
#include "rpc/trainstream_service.h"

namespace trainstream::daemon {
namespace {

constexpr size_t kMaxPathBytes = 4096;
constexpr int kMaxQuantizeNames = 1 << 16;

std::string StoredName(const BaseTensor& t) {
  switch (t.stored) {
    case StoredAs::kAsIs: return "as_is";
    case StoredAs::kBFloat16: return "bf16";
    case StoredAs::kQuantized: return kernels::QuantFormatName(t.format);
  }
  return "unknown";
}

void ToProto(const BaseSnapshot& s, v1::BaseInfo* out) {
  out->set_base_id(s.id);
  out->set_uid(s.uid);
  out->set_name(s.name);
  out->set_source(s.source);
  out->set_format(s.format);
  out->set_block(static_cast<uint32_t>(s.block));
  out->set_state(BaseStateName(s.state));
  out->set_error(s.error);
  out->set_stored_bytes(s.stored_bytes);
  out->set_source_bytes(s.source_bytes);
  out->set_read_bytes(s.read_bytes);
  out->set_read_total(s.read_total);
  out->set_load_seconds(s.load_seconds);
  out->set_users(static_cast<uint32_t>(s.users.size()));
  out->set_idle_s(s.idle_since ? absl::ToDoubleSeconds(absl::Now() - *s.idle_since) : 0.0);
  for (const BufferRecord& b : s.buffers) ToProto(b, out->add_buffers());
  for (const BaseTensor& t : s.tensors) {
    v1::BaseTensor* p = out->add_tensors();
    p->set_name(t.name);
    for (uint64_t d : t.shape) p->add_shape(d);
    p->set_source_dtype(t.source_dtype);
    p->set_stored(StoredName(t));
    p->set_block(static_cast<uint32_t>(t.block));
    p->set_tensor_scale(t.tensor_scale);
    p->set_buffer(t.buffer);
    p->set_data_offset(t.data_offset);
    p->set_data_bytes(t.data_bytes);
    p->set_scale_offset(t.scale_offset);
    p->set_scale_bytes(t.scale_bytes);
  }
}

}  // namespace

absl::Status TrainStreamService::ServeLoadBase(grpc::ServerContext* context,
                                               const v1::LoadBaseRequest* request,
                                               v1::BaseInfo* reply) {
  absl::StatusOr<std::shared_ptr<const Session>> session =
      CallersSession(context, request->session_id());
  if (!session.ok()) return session.status();
  // Taken before anything else can fail: a refused request leaves no descriptor behind.
  std::optional<FileGrant> granted;
  if (request->file_grant() != 0) {
    absl::StatusOr<FileGrant> taken = granted_files_->Take((*session)->id, request->file_grant());
    if (!taken.ok()) return taken.status();
    granted = *std::move(taken);
  }
  if (request->path().size() > kMaxPathBytes || request->name().size() > kMaxNameLength ||
      request->quantize_size() > kMaxQuantizeNames) {
    return absl::InvalidArgumentError(
        "path, name or the list of tensors to quantize is longer than a base request may be");
  }
  for (unsigned char c : request->name()) {
    if (c < 0x20 || c == 0x7f) {  // shown by tsctl and in events: no terminal control codes
      return absl::InvalidArgumentError("a base name holds no control characters");
    }
  }
  BaseLoadRequest load;
  load.path = request->path();
  load.format = request->format().empty() ? "bf16" : request->format();
  load.block = static_cast<int>(std::min<uint32_t>(request->block(), 1u << 30));
  load.quantize.assign(request->quantize().begin(), request->quantize().end());
  load.name = request->name();
  load.plan_only = request->plan_only();
  absl::StatusOr<BaseSnapshot> base =
      bases_->Load(**session, load, granted ? &*granted : nullptr);
  if (!base.ok()) {
    events_->Emit("base.refused", std::string(base.status().message()), {}, (*session)->id,
                  (*session)->owner.uid);
    return base.status();
  }
  ToProto(*base, reply);
  return absl::OkStatus();
}

absl::Status TrainStreamService::ServeGetBase(grpc::ServerContext* context,
                                              const v1::GetBaseRequest* request,
                                              v1::BaseInfo* reply) {
  absl::StatusOr<std::shared_ptr<const Session>> session =
      CallersSession(context, request->session_id());
  if (!session.ok()) return session.status();
  absl::StatusOr<BaseSnapshot> base =
      bases_->Get((*session)->owner.uid, /*admin=*/false, request->base_id());
  if (!base.ok()) return base.status();
  ToProto(*base, reply);
  return absl::OkStatus();
}

absl::Status TrainStreamService::ServeDetachBase(grpc::ServerContext* context,
                                                 const v1::DetachBaseRequest* request,
                                                 v1::DetachBaseReply* reply) {
  absl::StatusOr<std::shared_ptr<const Session>> session =
      CallersSession(context, request->session_id());
  if (!session.ok()) return session.status();
  return bases_->Detach(**session, request->base_id());
}

absl::Status TrainStreamService::ServeListBases(grpc::ServerContext* context,
                                                const v1::ListBasesRequest* request,
                                                v1::ListBasesReply* reply) {
  absl::StatusOr<PeerCredentials> caller = Caller(context);
  if (!caller.ok()) return caller.status();
  for (BaseSnapshot& base : bases_->List(caller->uid, caller->admin)) {
    base.tensors.clear();  // the listing is a summary; GetBase gives the table
    base.buffers.clear();
    ToProto(base, reply->add_bases());
  }
  return absl::OkStatus();
}

}  // namespace trainstream::daemon
