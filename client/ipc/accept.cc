// SPDX-License-Identifier: Apache-2.0
#include "ipc/accept.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

namespace trainstream::ipc {
namespace {

// Descriptors no accepted connection may take: the process's own.
constexpr rlim_t kReserved = 32;

}  // namespace

Acceptor::Acceptor() : spare_(::open("/dev/null", O_RDONLY | O_CLOEXEC)) {}

Acceptor::Result Acceptor::Accept(int listener, int flags) {
  // Another thread may have taken the descriptor the last shed freed: taken again when it can.
  if (!spare_.valid()) spare_ = UniqueFd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  int fd;
  do {
    fd = ::accept4(listener, nullptr, nullptr, flags);
  } while (fd < 0 && errno == EINTR);
  if (fd >= 0) {
    // Descriptors are numbered lowest first: one this close to the limit means the table is
    // nearly full. The connection is closed at once, keeping the last ones for the process's
    // own work (gRPC's wake-ups, new segments), which fails far worse than a refused client.
    rlimit files{};
    if (::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY &&
        static_cast<rlim_t>(fd) + kReserved >= files.rlim_cur) {
      ::close(fd);
      return {Outcome::kShed, UniqueFd(), EMFILE};
    }
    return {Outcome::kAccepted, UniqueFd(fd), 0};
  }
  const int error = errno;
  if (error == EAGAIN || error == EWOULDBLOCK || error == ECONNABORTED) {
    return {Outcome::kNothing, UniqueFd(), error};
  }
  if ((error == EMFILE || error == ENFILE) && spare_.valid()) {
    spare_.Reset();
    int shed = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (shed >= 0) ::close(shed);
    spare_ = UniqueFd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    return {Outcome::kShed, UniqueFd(), error};
  }
  return {Outcome::kFailed, UniqueFd(), error};
}

}  // namespace trainstream::ipc
