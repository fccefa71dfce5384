// SPDX-License-Identifier: Apache-2.0
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "control_channel.h"
#include "ipc/doorbell_ring.h"
#include "ipc/fd_passing.h"
#include "ipc/unix_socket.h"
#include "mapped_segment.h"
#include "trainstream/client.h"
#include "trainstream/status_macros.h"
#include "trainstream/version.h"

namespace trainstream::client {
namespace {

BufferInfo FromProto(const v1::Buffer& b) {
  return BufferInfo{b.buffer_id(), b.name(),      b.segment_id(),      b.offset(),
                    b.bytes(),     b.tag(),       b.read_only(),       b.owner_session_id()};
}

absl::Status ReplyStatus(const v1::DataReply& reply) {
  return absl::Status(static_cast<absl::StatusCode>(reply.code()), reply.message());
}

}  // namespace

HostBuffer::HostBuffer(BufferInfo info, std::shared_ptr<MappedSegment> segment)
    : info_(std::move(info)), segment_(std::move(segment)) {}
uint8_t* HostBuffer::data() const { return segment_->data() + info_.offset; }
bool HostBuffer::writable() const { return segment_->writable(); }
bool HostBuffer::cuda_registered() const { return segment_->cuda_registered(); }

class Session::Impl {
 public:
  Impl(const SessionOptions& options, std::string socket_path)
      : options_(options), channel_(std::move(socket_path), options.rpc_timeout) {}
  ~Impl() { Close().IgnoreError(); }

  absl::Status Open() {
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
    ASSIGN_OR_RETURN(data_, ipc::ConnectUnix(reply.data_socket_path(), SOCK_SEQPACKET));
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
    return absl::OkStatus();
  }

  absl::Status Close() {
    {
      absl::MutexLock lock(&mu_);
      if (closed_) return absl::OkStatus();
      closed_ = true;
    }
    stop_heartbeat_.Notify();
    if (heartbeat_.joinable()) heartbeat_.join();
    absl::Status status = absl::OkStatus();
    if (!id_.empty()) {
      v1::CloseSessionRequest request;
      request.set_session_id(id_);
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
    RETURN_IF_ERROR(channel_.Call(
        [&](grpc::ClientContext* c) { return channel_.stub().AllocateBuffer(c, request, &reply); }));
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
        return absl::FailedPreconditionError(absl::StrCat(
            "buffer '", info.name, "' is still mapped in this process; drop every reference "
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

  absl::Status Ring(const Notice& notice) {
    RETURN_IF_ERROR(CheckUsable());
    absl::MutexLock lock(&ring_mu_);
    return doorbell_->Send({notice.kind, 0, notice.id, notice.step, notice.value});
  }

  absl::StatusOr<Notice> Wait(int timeout_ms) {
    RETURN_IF_ERROR(CheckUsable());
    absl::MutexLock lock(&wait_mu_);
    ipc::DoorbellMessage m;
    absl::Status status = doorbell_->Receive(&m, timeout_ms);
    if (!status.ok()) {
      if (status.code() == absl::StatusCode::kDeadlineExceeded) RETURN_IF_ERROR(CheckUsable());
      return status;
    }
    return Notice{m.kind, m.id, m.step, m.value};
  }

  absl::StatusOr<absl::Duration> Ping() {
    const uint64_t token = ++ping_counter_;
    absl::Time start = absl::Now();
    RETURN_IF_ERROR(Ring({static_cast<uint32_t>(ipc::DoorbellKind::kPing), token, 0, 0}));
    ASSIGN_OR_RETURN(Notice pong, Wait(static_cast<int>(absl::ToInt64Milliseconds(options_.rpc_timeout))));
    if (pong.kind != static_cast<uint32_t>(ipc::DoorbellKind::kPong) || pong.id != token) {
      return absl::InternalError("doorbell answered something other than the ping");
    }
    return absl::Now() - start;
  }

  template <typename Request, typename Reply, typename Method>
  absl::StatusOr<std::string> Inspect(Method method) {
    Request request;
    Reply reply;
    RETURN_IF_ERROR(channel_.Call([&](grpc::ClientContext* c) {
      return (channel_.stub().*method)(c, request, &reply);
    }));
    return ToJson(reply);
  }

  absl::StatusOr<std::string> EventsJson(uint64_t since_seq) {
    v1::StreamEventsRequest request;
    request.set_since_seq(since_seq);
    grpc::ClientContext context;
    channel_.PrepareContext(&context);
    auto reader = channel_.stub().StreamEvents(&context, request);
    std::string out = "[";
    v1::Event event;
    bool first = true;
    while (reader->Read(&event)) {
      absl::StrAppend(&out, first ? "" : ",", ToJson(event));
      first = false;
    }
    RETURN_IF_ERROR(channel_.Explain(reader->Finish()));
    return out + "]";
  }

  const std::string& id() const { return id_; }
  const std::string& socket_path() const { return channel_.socket_path(); }
  ControlChannel& channel() { return channel_; }

 private:
  absl::Status CheckUsable() {
    absl::MutexLock lock(&mu_);
    if (closed_) return absl::FailedPreconditionError("the session is closed");
    if (!lost_.ok()) return lost_;
    return absl::OkStatus();
  }

  // One request and its reply on the data socket, serialised with other exchanges.
  absl::StatusOr<ipc::ReceivedMessage> DataExchange(const v1::DataRequest& request,
                                                    size_t max_fds) {
    absl::MutexLock lock(&data_mu_);
    RETURN_IF_ERROR(ipc::SendMessage(data_.get(), request.SerializeAsString()));
    ASSIGN_OR_RETURN(ipc::ReceivedMessage answer,
                     ipc::ReceiveMessage(data_.get(), max_fds,
                                         static_cast<int>(absl::ToInt64Milliseconds(options_.rpc_timeout))));
    v1::DataReply reply;
    if (!reply.ParseFromString(answer.payload)) {
      return absl::InternalError("the daemon's data-socket reply did not parse");
    }
    RETURN_IF_ERROR(ReplyStatus(reply));
    answer.payload = std::to_string(reply.bytes()) + (reply.read_only() ? ":ro" : ":rw");
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

  absl::StatusOr<std::shared_ptr<HostBuffer>> MapBuffer(BufferInfo info) {
    ASSIGN_OR_RETURN(std::shared_ptr<MappedSegment> segment, SegmentFor(info.segment_id));
    if (info.offset > segment->size() || info.bytes > segment->size() - info.offset) {
      return absl::InternalError("the daemon described a buffer outside its segment");
    }
    return std::make_shared<HostBuffer>(std::move(info), std::move(segment));
  }

  void HeartbeatLoop() {
    const absl::Duration period = std::max(absl::Milliseconds(50), lease_ / 4);
    while (!stop_heartbeat_.WaitForNotificationWithTimeout(period)) {
      v1::HeartbeatRequest request;
      request.set_session_id(id_);
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

  absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status lost_ ABSL_GUARDED_BY(mu_);
  absl::Mutex data_mu_;
  absl::Mutex ring_mu_;
  absl::Mutex wait_mu_;
  absl::Mutex segments_mu_;
  std::map<uint64_t, std::weak_ptr<MappedSegment>> segments_ ABSL_GUARDED_BY(segments_mu_);
};

Session::Session(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Session::~Session() = default;

absl::StatusOr<std::unique_ptr<Session>> Session::Create(const SessionOptions& options) {
  std::string path = options.socket_path.empty() ? ipc::DefaultSocketPath() : options.socket_path;
  auto impl = std::make_unique<Impl>(options, path);
  RETURN_IF_ERROR(impl->Open());
  return std::unique_ptr<Session>(new Session(std::move(impl)));
}

const std::string& Session::id() const { return impl_->id(); }
const std::string& Session::socket_path() const { return impl_->socket_path(); }
absl::Status Session::Close() { return impl_->Close(); }
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
absl::Status Session::Ring(const Notice& notice) { return impl_->Ring(notice); }
absl::StatusOr<Notice> Session::Wait(int timeout_ms) { return impl_->Wait(timeout_ms); }
absl::StatusOr<absl::Duration> Session::Ping() { return impl_->Ping(); }
absl::StatusOr<std::string> Session::StatusJson() {
  return impl_->Inspect<v1::GetStatusRequest, v1::Status>(&v1::TrainStream::Stub::GetStatus);
}
absl::StatusOr<std::string> Session::SessionsJson() {
  return impl_->Inspect<v1::ListSessionsRequest, v1::ListSessionsReply>(
      &v1::TrainStream::Stub::ListSessions);
}
absl::StatusOr<std::string> Session::MemoryJson() {
  return impl_->Inspect<v1::GetMemoryRequest, v1::MemoryReport>(&v1::TrainStream::Stub::GetMemory);
}
absl::StatusOr<std::string> Session::EventsJson(uint64_t since_seq) {
  return impl_->EventsJson(since_seq);
}

std::string DefaultSocketPath() { return ipc::DefaultSocketPath(); }

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
