// SPDX-License-Identifier: Apache-2.0
#include "rpc/control_listener.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "grpcpp/server_posix.h"
#include "ipc/unix_socket.h"
#include "ipc/event_signal.h"
#include "trainstream/status_macros.h"

namespace trainstream::daemon {

absl::StatusOr<std::unique_ptr<ControlListener>> ControlListener::Create(
    const std::string& socket_path, mode_t mode, const std::string& admin_group,
    ServerForPeer server_for, ConnectionCredentials* credentials) {
  ASSIGN_OR_RETURN(ipc::UniqueFd listener, ipc::ListenUnix(socket_path, SOCK_STREAM, mode));
  ipc::UniqueFd stop(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!stop.valid()) return ErrnoStatus(errno, "eventfd");
  return std::unique_ptr<ControlListener>(new ControlListener(
      socket_path, admin_group, std::move(listener), std::move(stop), std::move(server_for),
      credentials));
}

ControlListener::ControlListener(std::string socket_path, std::string admin_group,
                                 ipc::UniqueFd listener, ipc::UniqueFd stop,
                                 ServerForPeer server_for, ConnectionCredentials* credentials)
    : socket_path_(std::move(socket_path)),
      admin_group_(std::move(admin_group)),
      listener_(std::move(listener)),
      stop_(std::move(stop)),
      server_for_(std::move(server_for)),
      credentials_(credentials) {
  thread_ = std::thread([this] { Loop(); });
}

ControlListener::~ControlListener() { Stop(); }

void ControlListener::Stop() {
  if (!thread_.joinable()) return;
  ipc::SignalEventFd(stop_.get());
  thread_.join();
  listener_.Reset();
  ::unlink(socket_path_.c_str());
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
    int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) continue;
    absl::StatusOr<PeerCredentials> peer = ReadPeerCredentials(fd, admin_group_);
    if (!peer.ok()) {
      ::close(fd);
      continue;
    }
    grpc::Server* server = server_for_(*peer);
    if (server == nullptr) {
      ::close(fd);
      continue;
    }
    credentials_->Record(fd, *peer);
    grpc::AddInsecureChannelFromFd(server, fd);  // gRPC owns the descriptor from here on
  }
}

}  // namespace trainstream::daemon
