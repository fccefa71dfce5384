// SPDX-License-Identifier: Apache-2.0
#include "service_sockets.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"

namespace trainstream::daemon {
namespace {

constexpr int kFirstPassedFd = 3;  // SD_LISTEN_FDS_START

int SocketOption(int fd, int option) {
  int value = -1;
  socklen_t size = sizeof(value);
  if (::getsockopt(fd, SOL_SOCKET, option, &value, &size) != 0) return -1;
  return value;
}

absl::StatusOr<std::string> ListeningPath(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("descriptor %d passed by the service manager is not a socket", fd));
  }
  if (SocketOption(fd, SO_DOMAIN) != AF_UNIX || SocketOption(fd, SO_ACCEPTCONN) != 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "descriptor %d passed by the service manager is not a listening Unix socket", fd));
  }
  sockaddr_un address{};
  socklen_t size = sizeof(address);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size) != 0 ||
      size <= offsetof(sockaddr_un, sun_path) || address.sun_path[0] == '\0') {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the socket passed as descriptor %d has no path (an abstract or unnamed socket); "
        "clients find the daemon by path",
        fd));
  }
  return std::string(address.sun_path,
                     strnlen(address.sun_path, size - offsetof(sockaddr_un, sun_path)));
}

}  // namespace

absl::StatusOr<std::optional<ServiceSockets>> TakeServiceSockets() {
  const char* pid_text = std::getenv("LISTEN_PID");
  const char* count_text = std::getenv("LISTEN_FDS");
  int pid = 0, count = 0;
  const bool for_us = pid_text != nullptr && count_text != nullptr &&
                      absl::SimpleAtoi(pid_text, &pid) && pid == ::getpid() &&
                      absl::SimpleAtoi(count_text, &count);
  ::unsetenv("LISTEN_PID");
  ::unsetenv("LISTEN_FDS");
  ::unsetenv("LISTEN_FDNAMES");
  if (!for_us || count == 0) return std::nullopt;
  const std::string expected =
      "the socket unit must declare exactly ListenStream=<path> and "
      "ListenSequentialPacket=<path>.data";
  if (count != 2) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the service manager passed %d sockets; %s", count, expected));
  }
  ServiceSockets sockets;
  for (int fd = kFirstPassedFd; fd < kFirstPassedFd + count; ++fd) {
    ipc::UniqueFd owned(fd);
    absl::StatusOr<std::string> path = ListeningPath(fd);
    if (!path.ok()) return path.status();
    ::fcntl(fd, F_SETFD, FD_CLOEXEC);  // passed to this process, not to whatever it starts
    const int type = SocketOption(fd, SO_TYPE);
    if (type == SOCK_STREAM && !sockets.control.valid()) {
      sockets.control = std::move(owned);
      sockets.control_path = *path;
    } else if (type == SOCK_SEQPACKET && !sockets.data.valid()) {
      sockets.data = std::move(owned);
      sockets.data_path = *path;
    } else {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the socket at %s is not the one stream and the one sequential-packet socket "
          "expected; %s", *path, expected));
    }
  }
  if (sockets.data_path != sockets.control_path + ".data") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the data socket is at %s; clients look for it at %s.data; %s", sockets.data_path,
        sockets.control_path, expected));
  }
  return sockets;
}

}  // namespace trainstream::daemon
