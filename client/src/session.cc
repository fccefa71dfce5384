// SPDX-License-Identifier: Apache-2.0
#include "ipc/daemon_discovery.h"
#include "session_impl.h"

namespace trainstream::client {

absl::Status ReplyStatus(const v1::DataReply& reply) {
  return absl::Status(static_cast<absl::StatusCode>(reply.code()), reply.message());
}

HostBuffer::HostBuffer(BufferInfo info, std::shared_ptr<MappedSegment> segment)
    : info_(std::move(info)), segment_(std::move(segment)) {}
uint8_t* HostBuffer::data() const { return segment_->data() + info_.offset; }
bool HostBuffer::writable() const { return segment_->writable(); }
bool HostBuffer::cuda_registered() const { return segment_->cuda_registered(); }
uint64_t HostBuffer::registration_piece_bytes() const {
  return segment_->registration_piece_bytes();
}

Session::Session(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Session::~Session() = default;

absl::StatusOr<std::unique_ptr<Session>> Session::Create(const SessionOptions& options) {
  std::string path = options.socket_path;
  if (path.empty()) {
    ASSIGN_OR_RETURN(path, FindDaemonSocket());
  }
  auto impl = std::make_unique<Impl>(options, path);
  RETURN_IF_ERROR(impl->Open());
  return std::unique_ptr<Session>(new Session(std::move(impl)));
}

const std::string& Session::id() const { return impl_->id(); }
const std::string& Session::socket_path() const { return impl_->socket_path(); }
absl::Status Session::Close(bool end_job) { return impl_->Close(end_job); }
absl::StatusOr<std::shared_ptr<HostBuffer>> Session::Allocate(const std::string& name,
                                                              uint64_t bytes,
                                                              const AllocateOptions& options) {
  return impl_->Allocate(name, bytes, options);
}
absl::StatusOr<std::shared_ptr<HostBuffer>> Session::Lookup(const std::string& name) {
  return impl_->Lookup(name);
}
absl::Status Session::Free(const HostBuffer& buffer) { return impl_->Free(buffer); }
absl::StatusOr<std::shared_ptr<HostBuffer>> Session::Seal(const BufferInfo& buffer) {
  return impl_->Seal(buffer);
}
absl::Status Session::Heartbeat() { return impl_->Heartbeat(); }
void Session::SetTransferTotals(uint64_t h2d_bytes, uint64_t d2h_bytes) {
  impl_->SetTransferTotals(h2d_bytes, d2h_bytes);
}
absl::Status Session::Ring(const Notice& notice) { return impl_->Ring(notice); }
absl::StatusOr<Notice> Session::Wait(int timeout_ms) { return impl_->Wait(timeout_ms); }
absl::StatusOr<absl::Duration> Session::Ping() { return impl_->Ping(); }
absl::StatusOr<DaemonStatus> Session::GetStatus() {
  ASSIGN_OR_RETURN(
      v1::Status reply,
      (impl_->Inspect<v1::GetStatusRequest, v1::Status>(&v1::TrainStream::Stub::GetStatus)));
  return FromProto(reply);
}
absl::StatusOr<std::vector<SessionInfo>> Session::ListSessions() {
  ASSIGN_OR_RETURN(v1::ListSessionsReply reply,
                   (impl_->Inspect<v1::ListSessionsRequest, v1::ListSessionsReply>(
                       &v1::TrainStream::Stub::ListSessions)));
  return FromProto(reply);
}
absl::StatusOr<MemoryReport> Session::GetMemory() {
  ASSIGN_OR_RETURN(
      v1::MemoryReport reply,
      (impl_->Inspect<v1::GetMemoryRequest, v1::MemoryReport>(&v1::TrainStream::Stub::GetMemory)));
  return FromProto(reply);
}
absl::StatusOr<std::vector<Event>> Session::ReadEvents(uint64_t since_seq) {
  return impl_->ReadEvents(since_seq);
}

absl::StatusOr<BaseInfo> Session::LoadBase(const LoadBaseOptions& options) {
  ASSIGN_OR_RETURN(v1::BaseInfo info, impl_->LoadBase(options));
  return FromProto(info);
}
absl::StatusOr<BaseInfo> Session::GetBase(uint64_t base_id) {
  ASSIGN_OR_RETURN(v1::BaseInfo info, impl_->GetBase(base_id));
  return FromProto(info);
}
absl::Status Session::DetachBase(uint64_t base_id) { return impl_->DetachBase(base_id); }
absl::StatusOr<std::vector<BaseInfo>> Session::ListBases() {
  ASSIGN_OR_RETURN(v1::ListBasesReply reply,
                   (impl_->Inspect<v1::ListBasesRequest, v1::ListBasesReply>(
                       &v1::TrainStream::Stub::ListBases)));
  return FromProto(reply);
}
absl::StatusOr<std::vector<std::shared_ptr<HostBuffer>>> Session::MapBase(uint64_t base_id) {
  return impl_->MapBase(base_id);
}

absl::StatusOr<GpuPoolInfo> Session::PlaceBaseOnGpu(uint64_t base_id, const std::string& gpu_uuid) {
  ASSIGN_OR_RETURN(v1::GpuPoolInfo pool, impl_->PlaceBaseOnGpu(base_id, gpu_uuid));
  return FromProto(pool);
}
absl::StatusOr<std::unique_ptr<GpuPoolMapping>> Session::ImportGpuPool(uint64_t pool_id,
                                                                       int device) {
  return impl_->ImportGpuPool(pool_id, device);
}
absl::Status Session::ReleaseGpuPool(uint64_t pool_id) { return impl_->ReleaseGpuPool(pool_id); }
absl::StatusOr<GpuPools> Session::ListGpuPools() {
  ASSIGN_OR_RETURN(v1::ListGpuPoolsReply reply,
                   (impl_->Inspect<v1::ListGpuPoolsRequest, v1::ListGpuPoolsReply>(
                       &v1::TrainStream::Stub::ListGpuPools)));
  return FromProto(reply);
}

absl::StatusOr<HostPlan> Session::PlanHostMemory(uint64_t bytes, absl::Duration wait) {
  ASSIGN_OR_RETURN(v1::HostPlan plan, impl_->PlanHostMemory(bytes, wait));
  return FromProto(plan);
}

absl::StatusOr<uint64_t> Session::ReportEvent(
    const std::string& kind, const std::string& message,
    const std::vector<std::pair<std::string, double>>& numbers) {
  return impl_->ReportEvent(kind, message, numbers);
}

std::string DefaultSocketPath() { return ipc::DefaultSocketPath(); }

absl::StatusOr<std::string> FindDaemonSocket() {
  return ipc::FindDaemonSocket(ipc::ClientSocketCandidates());
}

absl::StatusOr<absl::Duration> PingDaemon(const std::string& socket_path) {
  ControlChannel channel(socket_path, absl::Seconds(5));
  v1::GetStatusRequest request;
  v1::Status reply;
  absl::Time start = absl::Now();
  RETURN_IF_ERROR(channel.Call(
      [&](grpc::ClientContext* c) { return channel.stub().GetStatus(c, request, &reply); }));
  return absl::Now() - start;
}

}  // namespace trainstream::client
