// SPDX-License-Identifier: Apache-2.0
#include "rpc/control_listener.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

#include "grpcpp/server_posix.h"
#include "ipc/unix_socket.h"
#include "ipc/event_signal.h"
#include "trainstream/status_macros.h"

namespace trainstream::daemon {

absl::StatusOr<std::unique_ptr<ControlListener>> ControlListener::Create(
    const std::string& socket_path, mode_t mode, const std::string& admin_group,
    ServerForPeer server_for, ConnectionCredentials* credentials,
    uint32_t max_connections_per_uid, EventLog* events, ipc::UniqueFd inherited) {
  const bool owns_path = !inherited.valid();
  ipc::UniqueFd listener = std::move(inherited);
  if (owns_path) {
    ASSIGN_OR_RETURN(listener, ipc::ListenUnix(socket_path, SOCK_STREAM, mode));
  }
  ipc::UniqueFd stop(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!stop.valid()) return ErrnoStatus(errno, "eventfd");
  return std::unique_ptr<ControlListener>(new ControlListener(
      socket_path, owns_path, admin_group, std::move(listener), std::move(stop),
      std::move(server_for), credentials, max_connections_per_uid, events));
}

ControlListener::ControlListener(std::string socket_path, bool owns_path,
                                 std::string admin_group, ipc::UniqueFd listener,
                                 ipc::UniqueFd stop, ServerForPeer server_for,
                                 ConnectionCredentials* credentials,
                                 uint32_t max_connections_per_uid, EventLog* events)
    : socket_path_(std::move(socket_path)),
      owns_path_(owns_path),
      admin_group_(std::move(admin_group)),
      listener_(std::move(listener)),
      stop_(std::move(stop)),
      server_for_(std::move(server_for)),
      credentials_(credentials),
      limit_(max_connections_per_uid),
      events_(events) {
  thread_ = std::thread([this] { Loop(); });
}

ControlListener::~ControlListener() { Stop(); }

void ControlListener::Stop() {
  if (!thread_.joinable()) return;
  ipc::SignalEventFd(stop_.get());
  thread_.join();
  listener_.Reset();
  if (owns_path_) ::unlink(socket_path_.c_str());
}

void ControlListener::Loop() {
  while (true) {
    pollfd fds[2] = {{listener_.get(), POLLIN, 0}, {stop_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents) return;
    // gRPC drives the connection from its event engine, which expects a non-blocking socket.
    ipc::Acceptor::Result accepted =
        acceptor_.Accept(listener_.get(), SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (accepted.outcome != ipc::Acceptor::Outcome::kAccepted) {
      if (accepted.outcome != ipc::Acceptor::Outcome::kNothing) {
        Report("daemon.descriptors_exhausted", 0,
               absl::StrCat("the control socket could not accept a connection (",
                            std::strerror(accepted.error), "); it was closed at once"));
      }
      if (accepted.outcome == ipc::Acceptor::Outcome::kFailed) {
        // Not a spin: the next try waits a little (or for Stop()).
        pollfd wait = {stop_.get(), POLLIN, 0};
        if (::poll(&wait, 1, 50) > 0) return;
      }
      continue;
    }
    ipc::UniqueFd fd = std::move(accepted.fd);
    absl::StatusOr<PeerCredentials> peer = ReadPeerCredentials(fd.get(), admin_group_);
    if (!peer.ok()) continue;
    if (!limit_.Admit(*peer, fd.get())) {
      Report("daemon.connections_refused", peer->uid,
             absl::StrFormat("uid %d has %d control connections open, the most one user may "
                             "(max_connections_per_uid); new ones are closed at once",
                             peer->uid, limit_.per_uid()));
      continue;
    }
    grpc::Server* server = server_for_(*peer);
    if (server == nullptr) continue;
    credentials_->Record(fd.get(), *peer);
    // gRPC owns the descriptor from here on (and closes it; the limit notices).
    grpc::AddInsecureChannelFromFd(server, fd.Release());
  }
}

void ControlListener::Report(const std::string& kind, uid_t uid, const std::string& message) {
  if (events_ == nullptr) return;
  absl::Time& last = last_report_[absl::StrCat(kind, "/", uid)];
  if (absl::Now() - last < absl::Seconds(10)) return;
  last = absl::Now();
  // A refusal is the refused user's to see; running out of descriptors is the machine's.
  std::optional<uid_t> owner;
  if (kind == "daemon.connections_refused") owner = uid;
  events_->Emit(kind, message, {{"limit", static_cast<double>(limit_.per_uid())}}, "", owner);
}

}  // namespace trainstream::daemon
