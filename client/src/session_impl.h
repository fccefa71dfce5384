// SPDX-License-Identifier: Apache-2.0
// Internal: Session's implementation, shared with the other classes of the client library that
// speak to the daemon for a session (HostOptimizer).
#ifndef TRAINSTREAM_CLIENT_SRC_SESSION_IMPL_H_
#define TRAINSTREAM_CLIENT_SRC_SESSION_IMPL_H_

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "caller_files.h"
#include "control_channel.h"
#include "gpu_pool_mapping.h"
#include "ipc/daemon_discovery.h"
#include "ipc/doorbell_ring.h"
#include "ipc/fd_passing.h"
#include "ipc/socket_trust.h"
#include "ipc/unix_socket.h"
#include "mapped_segment.h"
#include "replies.h"
#include "trainstream/client.h"
#include "trainstream/status_macros.h"
#include "trainstream/version.h"

namespace trainstream::client {

absl::Status ReplyStatus(const v1::DataReply& reply);

class Session::Impl {
 public:
  Impl(const SessionOptions& options, std::string socket_path)
      : options_(options), channel_(std::move(socket_path), options.rpc_timeout) {}
  ~Impl() { Close().IgnoreError(); }

  absl::Status Open() {
    // Nothing is sent to a daemon before we know who runs it (ipc/socket_trust.h).
    const std::vector<uid_t> trusted = ipc::TrustedDaemonUids();
    RETURN_IF_ERROR(ipc::VerifyDaemonSocket(channel_.socket_path()));
    v1::OpenSessionRequest request;
    request.set_job_id(options_.job_id);
    request.set_rank(options_.rank);
    request.set_world_size(options_.world_size);
    request.set_pid(static_cast<uint32_t>(::getpid()));
    request.set_client_version(kTrainStreamVersion);
    v1::OpenSessionReply reply;
    RETURN_IF_ERROR(channel_.Call(
        [&](grpc::ClientContext* c) { return channel_.stub().OpenSession(c, request, &reply); }));
    id_ = reply.session_id();
    lease_ = absl::Milliseconds(reply.lease_ms());
    // The same checks hold for the data socket wherever this client sees it.
    const std::string data_socket =
        ipc::DataSocketSeenFrom(channel_.socket_path(), reply.data_socket_path());
    RETURN_IF_ERROR(ipc::CheckSocketDirectory(data_socket, trusted));
    ASSIGN_OR_RETURN(data_, ipc::ConnectUnix(data_socket, SOCK_SEQPACKET));
    RETURN_IF_ERROR(ipc::CheckPeerIsTrusted(data_.get(), data_socket, trusted));
    v1::DataRequest attach;
    attach.mutable_attach()->set_session_id(id_);
    attach.mutable_attach()->set_attach_token(reply.attach_token());
    ASSIGN_OR_RETURN(ipc::ReceivedMessage answer, DataExchange(attach, 3));
    if (answer.fds.size() != 3) {
      return absl::InternalError("the daemon's attach reply lacks the doorbell descriptors");
    }
    ASSIGN_OR_RETURN(doorbell_mapping_,
                     ipc::SharedMapping::Map(answer.fds[0].get(), ipc::DoorbellSegmentBytes(),
                                             /*writable=*/true));
    to_daemon_ = std::move(answer.fds[1]);
    to_client_ = std::move(answer.fds[2]);
    ASSIGN_OR_RETURN(ipc::DoorbellEndpoint endpoint,
                     ipc::DoorbellEndpoint::Attach(
                         doorbell_mapping_.data(), doorbell_mapping_.size(),
                         ipc::DoorbellSide::kClient, to_daemon_.get(), to_client_.get()));
    doorbell_ = std::make_unique<ipc::DoorbellEndpoint>(std::move(endpoint));
    heartbeat_ = std::thread([this] { HeartbeatLoop(); });
    pump_ = std::thread([this] { PumpLoop(); });
    return absl::OkStatus();
  }

  absl::Status Close(bool end_job = false) {
    {
      absl::MutexLock lock(&mu_);
      if (closed_) return absl::OkStatus();
      closed_ = true;
    }
    stop_heartbeat_.Notify();
    if (heartbeat_.joinable()) heartbeat_.join();
    if (pump_.joinable()) pump_.join();
    absl::Status status = absl::OkStatus();
    if (!id_.empty()) {
      v1::CloseSessionRequest request;
      request.set_session_id(id_);
      request.set_end_job(end_job);
      v1::CloseSessionReply reply;
      status = channel_.Call(
          [&](grpc::ClientContext* c) { return channel_.stub().CloseSession(c, request, &reply); });
      // A session the daemon already reclaimed is closed all the same.
      if (status.code() == absl::StatusCode::kNotFound) status = absl::OkStatus();
    }
    data_.Reset();
    return status;
  }

  absl::StatusOr<std::shared_ptr<HostBuffer>> Allocate(const std::string& name, uint64_t bytes,
                                                       const AllocateOptions& options) {
    RETURN_IF_ERROR(CheckUsable());
    v1::AllocateBufferRequest request;
    request.set_session_id(id_);
    request.set_name(name);
    request.set_bytes(bytes);
    request.set_alignment(options.alignment);
    request.set_tag(options.tag);
    request.set_sealable(options.sealable);
    v1::Buffer reply;
    RETURN_IF_ERROR(channel_.Call([&](grpc::ClientContext* c) {
      return channel_.stub().AllocateBuffer(c, request, &reply);
    }));
    return MapBuffer(FromProto(reply));
  }

  absl::StatusOr<std::shared_ptr<HostBuffer>> Lookup(const std::string& name) {
    RETURN_IF_ERROR(CheckUsable());
    v1::LookupBufferRequest request;
    request.set_session_id(id_);
    request.set_name(name);
    v1::Buffer reply;
    RETURN_IF_ERROR(channel_.Call(
        [&](grpc::ClientContext* c) { return channel_.stub().LookupBuffer(c, request, &reply); }));
    return MapBuffer(FromProto(reply));
  }

  absl::Status Free(const HostBuffer& buffer) {
    RETURN_IF_ERROR(CheckUsable());
    v1::FreeBufferRequest request;
    request.set_session_id(id_);
    request.set_buffer_id(buffer.info().buffer_id);
    v1::FreeBufferReply reply;
    return channel_.Call(
        [&](grpc::ClientContext* c) { return channel_.stub().FreeBuffer(c, request, &reply); });
  }

  absl::StatusOr<std::shared_ptr<HostBuffer>> Seal(const BufferInfo& info) {
    RETURN_IF_ERROR(CheckUsable());
    {
      absl::MutexLock lock(&segments_mu_);
      auto it = segments_.find(info.segment_id);
      if (it != segments_.end() && !it->second.expired()) {
        return absl::FailedPreconditionError(
            absl::StrCat("buffer '", info.name,
                         "' is still mapped in this process; drop every reference "
                         "to it (tensors, views) before sealing"));
      }
    }
    v1::SealBufferRequest request;
    request.set_session_id(id_);
    request.set_buffer_id(info.buffer_id);
    v1::Buffer reply;
    RETURN_IF_ERROR(channel_.Call(
        [&](grpc::ClientContext* c) { return channel_.stub().SealBuffer(c, request, &reply); }));
    return MapBuffer(FromProto(reply));
  }

  absl::Status Heartbeat() {
    RETURN_IF_ERROR(CheckUsable());
    v1::HeartbeatRequest request;
    request.set_session_id(id_);
    v1::HeartbeatReply reply;
    return channel_.Call(
        [&](grpc::ClientContext* c) { return channel_.stub().Heartbeat(c, request, &reply); });
  }

  void SetTransferTotals(uint64_t h2d_bytes, uint64_t d2h_bytes) {
    absl::MutexLock lock(&transfers_mu_);
    transfers_ = {h2d_bytes, d2h_bytes};
  }

  absl::Status Ring(const Notice& notice) {
    RETURN_IF_ERROR(CheckUsable());
    absl::MutexLock lock(&ring_mu_);
    return doorbell_->Send({notice.kind, notice.flags, notice.id, notice.step, notice.value});
  }

  absl::StatusOr<Notice> Wait(int timeout_ms) {
    const absl::Time deadline =
        timeout_ms < 0 ? absl::InfiniteFuture() : absl::Now() + absl::Milliseconds(timeout_ms);
    while (true) {
      // Checked between short waits, so a daemon that died ends a wait within a lease period.
      RETURN_IF_ERROR(CheckUsable());
      {
        absl::MutexLock lock(&notices_mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(notices_mu_) {
          return !notices_.empty() || !pump_status_.ok();
        };
        notices_mu_.AwaitWithTimeout(absl::Condition(&ready),
                                     std::min(absl::Milliseconds(200), deadline - absl::Now()));
        if (!notices_.empty()) {
          Notice notice = notices_.front();
          notices_.pop_front();
          return notice;
        }
        if (!pump_status_.ok()) return pump_status_;
      }
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError("no doorbell message in time");
      }
    }
  }

  // Runs on the pump thread for each notice before it is queued, so whatever it starts (a
  // returned update's copy, asynchronous) is under way before any Wait() sees the notice. One
  // owner at a time; its ClearDispatcher waits for a dispatch in progress, so what the
  // dispatcher touched may go once it returns.
  using Dispatcher = std::function<void(const Notice&)>;
  absl::Status SetDispatcher(const void* owner, Dispatcher dispatcher) {
    absl::MutexLock lock(&dispatch_mu_);
    if (dispatcher_owner_ != nullptr && dispatcher_owner_ != owner) {
      return absl::FailedPreconditionError(
          "another optimizer of this session already returns updates to the device");
    }
    dispatcher_owner_ = owner;
    dispatcher_ = std::move(dispatcher);
    return absl::OkStatus();
  }
  void ClearDispatcher(const void* owner) {
    absl::MutexLock lock(&dispatch_mu_);
    if (dispatcher_owner_ != owner) return;
    dispatcher_owner_ = nullptr;
    dispatcher_ = nullptr;
  }

  absl::StatusOr<absl::Duration> Ping() {
    const uint64_t token = ++ping_counter_;
    absl::Time start = absl::Now();
    RETURN_IF_ERROR(Ring({static_cast<uint32_t>(ipc::DoorbellKind::kPing), token, 0, 0}));
    ASSIGN_OR_RETURN(Notice pong,
                     Wait(static_cast<int>(absl::ToInt64Milliseconds(options_.rpc_timeout))));
    if (pong.kind != static_cast<uint32_t>(ipc::DoorbellKind::kPong) || pong.id != token) {
      return absl::InternalError("doorbell answered something other than the ping");
    }
    return absl::Now() - start;
  }

  template <typename Request, typename Reply, typename Method>
  absl::StatusOr<Reply> Inspect(Method method) {
    Request request;
    Reply reply;
    RETURN_IF_ERROR(channel_.Call(
        [&](grpc::ClientContext* c) { return (channel_.stub().*method)(c, request, &reply); }));
    return reply;
  }

  absl::StatusOr<std::vector<Event>> ReadEvents(uint64_t since_seq) {
    v1::StreamEventsRequest request;
    request.set_since_seq(since_seq);
    grpc::ClientContext context;
    channel_.PrepareContext(&context);
    auto reader = channel_.stub().StreamEvents(&context, request);
    std::vector<Event> events;
    v1::Event event;
    while (reader->Read(&event)) events.push_back(FromProto(event));
    RETURN_IF_ERROR(channel_.Explain(reader->Finish()));
    return events;
  }

  absl::StatusOr<v1::HostPlan> PlanHostMemory(uint64_t bytes, absl::Duration wait) {
    RETURN_IF_ERROR(CheckUsable());
    v1::PlanHostMemoryRequest request;
    request.set_session_id(id_);
    request.set_bytes(bytes);
    request.set_wait_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(wait)));
    v1::HostPlan reply;
    RETURN_IF_ERROR(channel_.CallWithTimeout(
        [&](grpc::ClientContext* c) { return channel_.stub().PlanHostMemory(c, request, &reply); },
        wait + absl::Seconds(10)));
    return reply;
  }

  // Hands `files` to the daemon (DataRequest.grant_files), as many a message as one may carry;
  // returns the grant's id for the request that is to use them.
  absl::StatusOr<uint64_t> GrantFiles(const std::vector<CallerFile>& files) {
    RETURN_IF_ERROR(CheckUsable());
    uint64_t grant = 0;
    for (size_t start = 0; start < files.size(); start += ipc::kMaxFdsPerDatagram) {
      const size_t end = std::min(files.size(), start + ipc::kMaxFdsPerDatagram);
      v1::DataRequest request;
      request.mutable_grant_files()->set_grant(grant);
      std::vector<int> fds;
      for (size_t i = start; i < end; ++i) {
        request.mutable_grant_files()->add_names(files[i].name);
        fds.push_back(files[i].fd.get());
      }
      ASSIGN_OR_RETURN(ParsedReply reply, DataExchangeParsed(request, 0, fds));
      grant = reply.reply.grant();
    }
    return grant;
  }

  absl::StatusOr<v1::BaseInfo> LoadBase(const Session::LoadBaseOptions& options) {
    RETURN_IF_ERROR(CheckUsable());
    // The files are opened here, with this process's rights, and handed over: the daemon reads
    // what the caller could, whichever user it runs as.
    ASSIGN_OR_RETURN(CheckpointFiles files, OpenCheckpointFiles(options.path));
    ASSIGN_OR_RETURN(const uint64_t grant, GrantFiles(files.files));
    v1::LoadBaseRequest request;
    request.set_session_id(id_);
    request.set_path(files.path);
    request.set_file_grant(grant);
    request.set_format(options.format);
    request.set_block(options.block);
    for (const std::string& name : options.quantize) request.add_quantize(name);
    request.set_name(options.name);
    request.set_plan_only(options.plan_only);
    v1::BaseInfo reply;
    RETURN_IF_ERROR(channel_.Call(
        [&](grpc::ClientContext* c) { return channel_.stub().LoadBase(c, request, &reply); }));
    return reply;
  }

  absl::StatusOr<v1::BaseInfo> GetBase(uint64_t base_id) {
    RETURN_IF_ERROR(CheckUsable());
    v1::GetBaseRequest request;
    request.set_session_id(id_);
    request.set_base_id(base_id);
    v1::BaseInfo reply;
    RETURN_IF_ERROR(channel_.Call(
        [&](grpc::ClientContext* c) { return channel_.stub().GetBase(c, request, &reply); }));
    return reply;
  }

  absl::Status DetachBase(uint64_t base_id) {
    RETURN_IF_ERROR(CheckUsable());
    v1::DetachBaseRequest request;
    request.set_session_id(id_);
    request.set_base_id(base_id);
    v1::DetachBaseReply reply;
    return channel_.Call(
        [&](grpc::ClientContext* c) { return channel_.stub().DetachBase(c, request, &reply); });
  }

  absl::StatusOr<std::vector<std::shared_ptr<HostBuffer>>> MapBase(uint64_t base_id) {
    ASSIGN_OR_RETURN(v1::BaseInfo info, GetBase(base_id));
    if (info.state() != "ready") {
      return absl::FailedPreconditionError(
          absl::StrFormat("base %d is %s%s", base_id, info.state(),
                          info.error().empty() ? "" : absl::StrCat(": ", info.error())));
    }
    std::vector<std::shared_ptr<HostBuffer>> buffers;
    for (const v1::Buffer& b : info.buffers()) {
      ASSIGN_OR_RETURN(std::shared_ptr<HostBuffer> mapped, MapBuffer(FromProto(b)));
      buffers.push_back(std::move(mapped));
    }
    return buffers;
  }

  absl::StatusOr<v1::GpuPoolInfo> PlaceBaseOnGpu(uint64_t base_id, const std::string& gpu_uuid) {
    RETURN_IF_ERROR(CheckUsable());
    v1::PlaceBaseOnGpuRequest request;
    request.set_session_id(id_);
    request.set_base_id(base_id);
    request.set_gpu_uuid(gpu_uuid);
    v1::GpuPoolInfo reply;
    // Filling a pool copies the whole base to the GPU: allow it time beyond a plain call's.
    RETURN_IF_ERROR(channel_.CallWithTimeout(
        [&](grpc::ClientContext* c) { return channel_.stub().PlaceBaseOnGpu(c, request, &reply); },
        options_.rpc_timeout + absl::Minutes(10)));
    return reply;
  }

  absl::StatusOr<std::unique_ptr<GpuPoolMapping>> ImportGpuPool(uint64_t pool_id, int device) {
    RETURN_IF_ERROR(CheckUsable());
    v1::DataRequest request;
    request.mutable_import_pool()->set_pool_id(pool_id);
    ASSIGN_OR_RETURN(ParsedReply answer, DataExchangeParsed(request, 1));
    const v1::DataReply& reply = answer.reply;
    // Mapped on another GPU, it would be read over peer access, slowly, or not at all.
    ASSIGN_OR_RETURN(std::string uuid, CudaDeviceUuid(device));
    if (uuid != reply.gpu_uuid()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "GPU pool %d is on %s; CUDA device %d is %s", pool_id, reply.gpu_uuid(), device, uuid));
    }
    if (reply.pool_kind() == "vmm") {
      if (answer.fds.size() != 1) return absl::InternalError("pool reply without a descriptor");
      return MapVmmPool(pool_id, device, std::move(answer.fds[0]), reply.bytes());
    }
    std::array<uint8_t, 64> handle{};
    if (reply.pool_kind() != "legacy_ipc" || reply.legacy_ipc_handle().size() != handle.size()) {
      return absl::InternalError(absl::StrCat("the daemon described a GPU pool of kind '",
                                              reply.pool_kind(), "' this client can't map"));
    }
    std::memcpy(handle.data(), reply.legacy_ipc_handle().data(), handle.size());
    return MapLegacyPool(pool_id, device, handle, reply.bytes());
  }

  absl::Status ReleaseGpuPool(uint64_t pool_id) {
    RETURN_IF_ERROR(CheckUsable());
    v1::ReleaseGpuPoolRequest request;
    request.set_session_id(id_);
    request.set_pool_id(pool_id);
    v1::ReleaseGpuPoolReply reply;
    return channel_.Call(
        [&](grpc::ClientContext* c) { return channel_.stub().ReleaseGpuPool(c, request, &reply); });
  }

  absl::StatusOr<uint64_t> ReportEvent(const std::string& kind, const std::string& message,
                                       const std::vector<std::pair<std::string, double>>& numbers) {
    RETURN_IF_ERROR(CheckUsable());
    v1::ReportEventRequest request;
    request.set_session_id(id_);
    request.set_kind(kind);
    request.set_message(message);
    for (const auto& [name, value] : numbers) (*request.mutable_numbers())[name] = value;
    v1::ReportEventReply reply;
    RETURN_IF_ERROR(channel_.Call(
        [&](grpc::ClientContext* c) { return channel_.stub().ReportEvent(c, request, &reply); }));
    return reply.seq();
  }

  const std::string& id() const { return id_; }
  const std::string& socket_path() const { return channel_.socket_path(); }
  ControlChannel& channel() { return channel_; }

 public:  // used by HostOptimizer as well
  absl::Status CheckUsable() {
    absl::MutexLock lock(&mu_);
    if (closed_) return absl::FailedPreconditionError("the session is closed");
    if (!lost_.ok()) return lost_;
    return absl::OkStatus();
  }

  struct ParsedReply {
    v1::DataReply reply;
    std::vector<ipc::UniqueFd> fds;
  };
  // One request and its reply on the data socket, serialised with other exchanges.
  absl::StatusOr<ParsedReply> DataExchangeParsed(const v1::DataRequest& request, size_t max_fds,
                                                 std::span<const int> send_fds = {}) {
    absl::MutexLock lock(&data_mu_);
    RETURN_IF_ERROR(ipc::SendMessage(data_.get(), request.SerializeAsString(), send_fds));
    ASSIGN_OR_RETURN(
        ipc::ReceivedMessage answer,
        ipc::ReceiveMessage(data_.get(), max_fds,
                            static_cast<int>(absl::ToInt64Milliseconds(options_.rpc_timeout))));
    ParsedReply parsed;
    if (!parsed.reply.ParseFromString(answer.payload)) {
      return absl::InternalError("the daemon's data-socket reply did not parse");
    }
    RETURN_IF_ERROR(ReplyStatus(parsed.reply));
    parsed.fds = std::move(answer.fds);
    return parsed;
  }
  // As DataExchangeParsed, with the reply as "<bytes>:ro" or "<bytes>:rw".
  absl::StatusOr<ipc::ReceivedMessage> DataExchange(const v1::DataRequest& request,
                                                    size_t max_fds) {
    ASSIGN_OR_RETURN(ParsedReply parsed, DataExchangeParsed(request, max_fds));
    ipc::ReceivedMessage answer;
    answer.payload =
        std::to_string(parsed.reply.bytes()) + (parsed.reply.read_only() ? ":ro" : ":rw");
    answer.fds = std::move(parsed.fds);
    return answer;
  }

  absl::StatusOr<std::shared_ptr<MappedSegment>> SegmentFor(uint64_t segment_id) {
    absl::MutexLock lock(&segments_mu_);
    if (auto it = segments_.find(segment_id); it != segments_.end()) {
      if (auto live = it->second.lock()) return live;
    }
    v1::DataRequest request;
    request.mutable_get_segment()->set_segment_id(segment_id);
    ASSIGN_OR_RETURN(ipc::ReceivedMessage answer, DataExchange(request, 1));
    if (answer.fds.size() != 1) return absl::InternalError("segment reply without a descriptor");
    const bool read_only = answer.payload.ends_with(":ro");
    const uint64_t bytes = std::stoull(answer.payload);
    ASSIGN_OR_RETURN(ipc::SharedMapping mapping,
                     ipc::SharedMapping::Map(answer.fds[0].get(), bytes, !read_only));
    std::unique_ptr<CudaHostRegistration> registration;
    if (options_.register_with_cuda && CudaDevicePresent(nullptr)) {
      ASSIGN_OR_RETURN(registration,
                       CudaHostRegistration::Register(mapping.data(), bytes, read_only));
    }
    auto segment =
        std::make_shared<MappedSegment>(segment_id, std::move(mapping), std::move(registration));
    segments_[segment_id] = segment;
    return segment;
  }

 public:
  absl::StatusOr<std::shared_ptr<HostBuffer>> MapBuffer(BufferInfo info) {
    ASSIGN_OR_RETURN(std::shared_ptr<MappedSegment> segment, SegmentFor(info.segment_id));
    if (info.offset > segment->size() || info.bytes > segment->size() - info.offset) {
      return absl::InternalError("the daemon described a buffer outside its segment");
    }
    return std::make_shared<HostBuffer>(std::move(info), std::move(segment));
  }

  // Drains the daemon's doorbell into a queue as messages come, so the ring never fills while
  // the caller is busy (a step announces every tensor's update).
 private:
  void PumpLoop() {
    while (!stop_heartbeat_.HasBeenNotified()) {
      ipc::DoorbellMessage m;
      absl::Status status = doorbell_->Receive(&m, 100, /*spin_ns=*/20000);
      if (status.code() == absl::StatusCode::kDeadlineExceeded) continue;
      if (!status.ok()) {
        absl::MutexLock lock(&notices_mu_);
        pump_status_ = status;
        return;
      }
      const Notice notice{m.kind, m.id, m.step, m.value, m.flags};
      {
        absl::MutexLock lock(&dispatch_mu_);
        if (dispatcher_) dispatcher_(notice);
      }
      absl::MutexLock lock(&notices_mu_);
      notices_.push_back(notice);
    }
  }

  void HeartbeatLoop() {
    const absl::Duration period = std::max(absl::Milliseconds(50), lease_ / 4);
    while (!stop_heartbeat_.WaitForNotificationWithTimeout(period)) {
      v1::HeartbeatRequest request;
      request.set_session_id(id_);
      {
        absl::MutexLock lock(&transfers_mu_);
        if (transfers_) {
          request.mutable_transfers()->set_h2d_bytes(transfers_->first);
          request.mutable_transfers()->set_d2h_bytes(transfers_->second);
        }
      }
      v1::HeartbeatReply reply;
      absl::Status status = channel_.Call(
          [&](grpc::ClientContext* c) { return channel_.stub().Heartbeat(c, request, &reply); });
      pollfd pfd{data_.get(), POLLRDHUP, 0};
      bool hung_up = ::poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR));
      if (!status.ok() || hung_up) {
        absl::MutexLock lock(&mu_);
        if (status.code() == absl::StatusCode::kNotFound || hung_up) {
          lost_ = absl::UnavailableError(absl::StrCat(
              "the daemon on ", channel_.socket_path(), " ended this session or stopped",
              status.ok() ? "" : absl::StrCat(": ", status.message())));
        } else if (status.code() == absl::StatusCode::kUnavailable) {
          lost_ = status;
        }
        if (!lost_.ok()) return;
      }
    }
  }

  const SessionOptions options_;
  ControlChannel channel_;
  std::string id_;
  absl::Duration lease_;
  ipc::UniqueFd data_;
  ipc::SharedMapping doorbell_mapping_;
  ipc::UniqueFd to_daemon_, to_client_;
  std::unique_ptr<ipc::DoorbellEndpoint> doorbell_;
  std::thread heartbeat_;
  absl::Notification stop_heartbeat_;
  std::atomic<uint64_t> ping_counter_{0};
  absl::Mutex transfers_mu_;
  std::optional<std::pair<uint64_t, uint64_t>> transfers_ ABSL_GUARDED_BY(transfers_mu_);

  absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status lost_ ABSL_GUARDED_BY(mu_);
  absl::Mutex data_mu_;
  absl::Mutex ring_mu_;
  std::thread pump_;
  absl::Mutex dispatch_mu_;
  const void* dispatcher_owner_ ABSL_GUARDED_BY(dispatch_mu_) = nullptr;
  Dispatcher dispatcher_ ABSL_GUARDED_BY(dispatch_mu_);
  absl::Mutex notices_mu_;
  std::deque<Notice> notices_ ABSL_GUARDED_BY(notices_mu_);
  absl::Status pump_status_ ABSL_GUARDED_BY(notices_mu_);
  absl::Mutex segments_mu_;
  std::map<uint64_t, std::weak_ptr<MappedSegment>> segments_ ABSL_GUARDED_BY(segments_mu_);
};

}  // namespace trainstream::client

#endif  // TRAINSTREAM_CLIENT_SRC_SESSION_IMPL_H_
