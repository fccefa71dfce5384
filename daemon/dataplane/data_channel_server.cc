// SPDX-License-Identifier: Apache-2.0
#include "dataplane/data_channel_server.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "ipc/fd_passing.h"
#include "ipc/unix_socket.h"
#include "ipc/event_signal.h"
#include "trainstream/status_macros.h"
#include "trainstream/v1/trainstream.pb.h"

namespace trainstream::daemon {
namespace {

constexpr uint64_t kListenerKey = ~uint64_t{0};
constexpr uint64_t kStopKey = ~uint64_t{0} - 1;

absl::Status Reply(int fd, const absl::Status& status, uint64_t bytes = 0, bool read_only = false,
                   std::span<const int> fds = {}) {
  v1::DataReply reply;
  reply.set_code(static_cast<int>(status.code()));
  reply.set_message(std::string(status.message()));
  reply.set_bytes(bytes);
  reply.set_read_only(read_only);
  return ipc::SendMessage(fd, reply.SerializeAsString(), fds);
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataChannelServer>> DataChannelServer::Create(
    const Options& options, SessionRegistry* registry, Arena* arena,
    DoorbellDispatcher* doorbells, EventLog* events, BaseStore* bases,
    GrantedFiles* granted_files, GpuPools* gpu_pools, ipc::UniqueFd inherited) {
  const bool owns_path = !inherited.valid();
  ipc::UniqueFd listener = std::move(inherited);
  if (owns_path) {
    ASSIGN_OR_RETURN(listener,
                     ipc::ListenUnix(options.socket_path, SOCK_SEQPACKET, options.socket_mode));
  }
  ipc::UniqueFd epoll(::epoll_create1(EPOLL_CLOEXEC));
  ipc::UniqueFd stop(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!epoll.valid() || !stop.valid()) return ErrnoStatus(errno, "epoll/eventfd");
  for (auto [fd, key] : {std::pair{listener.get(), kListenerKey}, {stop.get(), kStopKey}}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = key;
    if (::epoll_ctl(epoll.get(), EPOLL_CTL_ADD, fd, &ev) != 0) return ErrnoStatus(errno, "epoll_ctl");
  }
  return std::unique_ptr<DataChannelServer>(
      new DataChannelServer(options, owns_path, std::move(listener), std::move(epoll),
                            std::move(stop),
                            registry, arena, doorbells, events, bases, granted_files,
                            gpu_pools));
}

DataChannelServer::DataChannelServer(const Options& options, bool owns_path,
                                     ipc::UniqueFd listener, ipc::UniqueFd epoll,
                                     ipc::UniqueFd stop,
                                     SessionRegistry* registry, Arena* arena,
                                     DoorbellDispatcher* doorbells, EventLog* events,
                                     BaseStore* bases, GrantedFiles* granted_files,
                                     GpuPools* gpu_pools)
    : options_(options),
      owns_path_(owns_path),
      listener_(std::move(listener)),
      epoll_(std::move(epoll)),
      stop_(std::move(stop)),
      registry_(registry),
      arena_(arena),
      doorbells_(doorbells),
      events_(events),
      bases_(bases),
      granted_files_(granted_files),
      gpu_pools_(gpu_pools),
      limit_(options.max_connections_per_uid) {
  thread_ = std::thread([this] { Loop(); });
}

DataChannelServer::~DataChannelServer() { Stop(); }

void DataChannelServer::Stop() {
  if (thread_.joinable()) {
    ipc::SignalEventFd(stop_.get());
    thread_.join();
  }
  absl::MutexLock lock(&mu_);
  connections_.clear();
  if (listener_.valid()) {
    listener_.Reset();
    if (owns_path_) ::unlink(options_.socket_path.c_str());
  }
}

void DataChannelServer::Disconnect(const std::string& session_id) {
  absl::MutexLock lock(&mu_);
  for (auto& [fd, connection] : connections_) {
    // shutdown() rather than close(): the loop sees the hang-up and cleans up on its thread.
    if (connection.session && connection.session->id == session_id) ::shutdown(fd, SHUT_RDWR);
  }
}

void DataChannelServer::Loop() {
  epoll_event events[64];
  while (true) {
    int n = ::epoll_wait(epoll_.get(), events, 64, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    for (int i = 0; i < n; ++i) {
      const uint64_t key = events[i].data.u64;
      if (key == kStopKey) return;
      if (key == kListenerKey) {
        Accept();
        continue;
      }
      const int fd = static_cast<int>(key);
      bool keep = false;
      if (events[i].events & EPOLLIN) {
        absl::MutexLock lock(&mu_);
        auto it = connections_.find(fd);
        if (it != connections_.end()) keep = Serve(it->second);
      }
      if (!keep) Close(fd);
    }
  }
}

void DataChannelServer::Accept() {
  ipc::Acceptor::Result accepted = acceptor_.Accept(listener_.get(), SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (accepted.outcome != ipc::Acceptor::Outcome::kAccepted) {
    if (accepted.outcome != ipc::Acceptor::Outcome::kNothing &&
        absl::Now() - last_shed_ > absl::Seconds(10)) {
      last_shed_ = absl::Now();
      events_->Emit("daemon.descriptors_exhausted",
                    absl::StrCat("the data socket could not accept a connection (",
                                 std::strerror(accepted.error), "); it was closed at once"));
    }
    if (accepted.outcome == ipc::Acceptor::Outcome::kFailed) absl::SleepFor(absl::Milliseconds(50));
    return;
  }
  ipc::UniqueFd fd = std::move(accepted.fd);
  absl::StatusOr<PeerCredentials> peer = ReadPeerCredentials(fd.get(), options_.admin_group);
  if (!peer.ok()) return;
  if (!limit_.Admit(*peer, fd.get())) {
    absl::Time& last = last_refusal_[peer->uid];
    if (absl::Now() - last > absl::Seconds(10)) {
      last = absl::Now();
      events_->Emit("daemon.connections_refused",
                    absl::StrFormat("uid %d has %d data connections open, the most one user may "
                                    "(max_connections_per_uid); new ones are closed at once",
                                    peer->uid, limit_.per_uid()),
                    {{"limit", static_cast<double>(limit_.per_uid())}}, "", peer->uid);
    }
    return;
  }
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.u64 = static_cast<uint64_t>(fd.get());
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd.get(), &ev) != 0) {
    limit_.Release(fd.get());
    return;
  }
  absl::MutexLock lock(&mu_);
  int raw = fd.get();
  connections_[raw] = Connection{std::move(fd), *peer, nullptr};
}

void DataChannelServer::Close(int fd) {
  std::shared_ptr<const Session> session;
  {
    absl::MutexLock lock(&mu_);
    auto it = connections_.find(fd);
    if (it == connections_.end()) return;
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr);
    limit_.Release(fd);
    session = it->second.session;
    connections_.erase(it);
  }
  // The session may already have ended (closed by RPC); then there is nothing left to do.
  if (session) registry_->End(session->id, SessionEnd::kDisconnected).IgnoreError();
}

bool DataChannelServer::Serve(Connection& connection) {
  const int fd = connection.fd.get();
  // Only grant_files carries descriptors; any other request brings is closed unused.
  absl::StatusOr<ipc::ReceivedMessage> message =
      ipc::ReceiveMessage(fd, ipc::kMaxFdsPerDatagram, 0);
  if (!message.ok()) {
    if (message.status().code() == absl::StatusCode::kDeadlineExceeded) return true;  // spurious
    return false;
  }
  v1::DataRequest request;
  if (!request.ParseFromString(message->payload)) {
    return Reply(fd, absl::InvalidArgumentError("data-socket message is not a DataRequest")).ok();
  }
  if (!message->fds.empty() && request.request_case() != v1::DataRequest::kGrantFiles) {
    return Reply(fd, absl::InvalidArgumentError(
                         "only grant_files carries descriptors; the ones sent were closed"))
        .ok();
  }
  switch (request.request_case()) {
    case v1::DataRequest::kAttach: {
      if (connection.session) {
        return Reply(fd, absl::FailedPreconditionError("this connection is already attached"))
            .ok();
      }
      absl::StatusOr<std::shared_ptr<const Session>> session = registry_->Attach(
          connection.peer, request.attach().session_id(), request.attach().attach_token());
      if (!session.ok()) {
        events_->Emit("session.attach_refused", std::string(session.status().message()), {},
                      "", connection.peer.uid);
        return Reply(fd, session.status()).ok();
      }
      absl::StatusOr<DoorbellGrant> grant = doorbells_->Add(*session);
      if (!grant.ok()) return Reply(fd, grant.status()).ok();
      connection.session = *session;
      int fds[] = {grant->segment.get(), grant->to_daemon.get(), grant->to_client.get()};
      return Reply(fd, absl::OkStatus(), grant->bytes, false, fds).ok();
    }
    case v1::DataRequest::kGetSegment: {
      if (!connection.session) {
        return Reply(fd, absl::FailedPreconditionError(
                             "attach a session on this connection before asking for segments"))
            .ok();
      }
      const uint64_t segment_id = request.get_segment().segment_id();
      absl::StatusOr<SegmentGrant> grant =
          arena_->GrantSegment(connection.session->job, segment_id);
      if (grant.status().code() == absl::StatusCode::kNotFound && bases_ != nullptr) {
        // Not the job's own: a shared base's, if the session is attached to it.
        grant = bases_->GrantSegment(*connection.session, segment_id);
      }
      if (!grant.ok()) return Reply(fd, grant.status()).ok();
      int fds[] = {grant->fd.get()};
      return Reply(fd, absl::OkStatus(), grant->bytes, grant->read_only, fds).ok();
    }
    case v1::DataRequest::kImportPool: {
      if (!connection.session) {
        return Reply(fd, absl::FailedPreconditionError(
                             "attach a session on this connection before importing a GPU pool"))
            .ok();
      }
      const uint64_t pool_id = request.import_pool().pool_id();
      absl::StatusOr<PoolImport> pool =
          gpu_pools_ != nullptr
              ? gpu_pools_->Handle(pool_id, connection.session->id)
              : absl::StatusOr<PoolImport>(absl::NotFoundError(absl::StrFormat(
                    "this session has not imported GPU pool %d", pool_id)));
      if (!pool.ok()) return Reply(fd, pool.status()).ok();
      v1::DataReply reply;
      reply.set_bytes(pool->bytes);
      reply.set_read_only(true);  // frozen data: importers map it read-only
      reply.set_pool_kind(PoolKindName(pool->kind));
      reply.set_gpu_uuid(pool->uuid);
      std::vector<int> fds;
      if (pool->kind == PoolKind::kVmm) {
        fds.push_back(pool->fd.get());
      } else {
        reply.set_legacy_ipc_handle(pool->legacy_handle.data(), pool->legacy_handle.size());
      }
      return ipc::SendMessage(fd, reply.SerializeAsString(), fds).ok();
    }
    case v1::DataRequest::kGrantFiles: {
      if (!connection.session) {
        return Reply(fd, absl::FailedPreconditionError(
                             "attach a session on this connection before handing over files"))
            .ok();
      }
      const v1::DataRequest::GrantFiles& files = request.grant_files();
      absl::StatusOr<uint64_t> grant =
          granted_files_->Add(connection.session->id, files.grant(),
                              {files.names().begin(), files.names().end()},
                              std::move(message->fds));
      if (!grant.ok()) return Reply(fd, grant.status()).ok();
      v1::DataReply reply;
      reply.set_grant(*grant);
      return ipc::SendMessage(fd, reply.SerializeAsString()).ok();
    }
    default:
      return Reply(fd, absl::InvalidArgumentError("empty or unknown data-socket request")).ok();
  }
}

}  // namespace trainstream::daemon
