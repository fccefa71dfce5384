// SPDX-License-Identifier: Apache-2.0
// The sd_notify(3) protocol, spoken directly: one datagram of "KEY=value" lines to the socket
// $NOTIFY_SOCKET names (a path, or "@name" in the abstract namespace). systemd documents it as a
// stable interface for services to implement themselves; libsystemd would add a build
// dependency the GPU machine does not have, and a build without it would leave the Type=notify
// unit waiting for a READY that never comes.
#include "service_notify.h"

#include <sys/socket.h>
#include <sys/un.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "ipc/unique_fd.h"

namespace trainstream::daemon {
namespace {

void Notify(const std::string& state) {
  const char* target = std::getenv("NOTIFY_SOCKET");
  if (target == nullptr || *target == '\0') return;
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  const size_t length = std::strlen(target);
  if ((target[0] != '/' && target[0] != '@') || length >= sizeof(address.sun_path)) return;
  std::memcpy(address.sun_path, target, length);
  if (target[0] == '@') address.sun_path[0] = '\0';  // the abstract namespace
  ipc::UniqueFd fd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return;
  // A service manager that is gone is nothing to report to: failures are ignored, as
  // sd_notify's callers do.
  ::sendto(fd.get(), state.data(), state.size(), MSG_NOSIGNAL,
           reinterpret_cast<const sockaddr*>(&address),
           static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + length));
}

}  // namespace

void NotifyReady(const std::string& status) {
  Notify(absl::StrCat("READY=1\nSTATUS=", status));
}

void NotifyStopping(const std::string& status) {
  Notify(absl::StrCat("STOPPING=1\nSTATUS=", status));
}

}  // namespace trainstream::daemon
