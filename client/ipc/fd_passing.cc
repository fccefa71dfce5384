// SPDX-License-Identifier: Apache-2.0
#include "ipc/fd_passing.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "trainstream/status_macros.h"

namespace trainstream::ipc {

absl::Status SendMessage(int socket_fd, std::string_view payload, std::span<const int> fds) {
  if (payload.size() > kMaxDatagramBytes) {
    return absl::InvalidArgumentError("datagram larger than the data socket accepts");
  }
  if (fds.size() > kMaxFdsPerDatagram) {
    return absl::InvalidArgumentError("too many descriptors for one datagram");
  }
  // A zero-length SOCK_SEQPACKET datagram reads as end of stream on the other side.
  char empty = 0;
  iovec iov{const_cast<char*>(payload.empty() ? &empty : payload.data()),
            payload.empty() ? 1 : payload.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerDatagram)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t n;
  do {
    n = ::sendmsg(socket_fd, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return ErrnoStatus(errno, "sending on the data socket");
  return absl::OkStatus();
}

absl::StatusOr<ReceivedMessage> ReceiveMessage(int socket_fd, size_t max_fds, int timeout_ms) {
  if (max_fds > kMaxFdsPerDatagram) max_fds = kMaxFdsPerDatagram;
  pollfd pfd{socket_fd, POLLIN, 0};
  int ready;
  do {
    ready = ::poll(&pfd, 1, timeout_ms);
  } while (ready < 0 && errno == EINTR);
  if (ready < 0) return ErrnoStatus(errno, "waiting on the data socket");
  if (ready == 0) return absl::DeadlineExceededError("no reply on the data socket in time");

  ReceivedMessage out;
  out.payload.resize(kMaxDatagramBytes);
  iovec iov{out.payload.data(), out.payload.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerDatagram)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (max_fds > 0) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * max_fds);
  }
  ssize_t n;
  do {
    n = ::recvmsg(socket_fd, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return ErrnoStatus(errno, "receiving on the data socket");
  if (n == 0) return absl::UnavailableError("peer closed the connection");
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        out.fds.emplace_back(fd);
      }
    }
  }
  if (msg.msg_flags & MSG_CTRUNC) {
    return absl::InvalidArgumentError("peer sent file descriptors that were not expected");
  }
  if (msg.msg_flags & MSG_TRUNC) {
    return absl::InvalidArgumentError("datagram larger than the data socket accepts");
  }
  out.payload.resize(static_cast<size_t>(n));
  return out;
}

}  // namespace trainstream::ipc
