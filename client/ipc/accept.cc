// SPDX-License-Identifier: Apache-2.0
#include "ipc/accept.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

namespace trainstream::ipc {

Acceptor::Acceptor() : spare_(::open("/dev/null", O_RDONLY | O_CLOEXEC)) {}

Acceptor::Result Acceptor::Accept(int listener, int flags) {
  // Another thread may have taken the descriptor the last shed freed: taken again when it can.
  if (!spare_.valid()) spare_ = UniqueFd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  int fd;
  do {
    fd = ::accept4(listener, nullptr, nullptr, flags);
  } while (fd < 0 && errno == EINTR);
  if (fd >= 0) return {Outcome::kAccepted, UniqueFd(fd), 0};
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
