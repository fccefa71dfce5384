// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_SESSIONS_CREDENTIALS_H_
#define TRAINSTREAM_DAEMON_SESSIONS_CREDENTIALS_H_

#include <sys/types.h>

#include <string>

#include "absl/status/statusor.h"

namespace trainstream::daemon {

// Who is on the other end of a connection, as the kernel reported it (SO_PEERCRED) when the
// connection was accepted. Never taken from a request.
struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  bool admin = false;  // root, or a member of the daemon's admin group
};

// SO_PEERCRED of a connected Unix socket, with `admin` set from `admin_group` (may be empty).
absl::StatusOr<PeerCredentials> ReadPeerCredentials(int socket_fd, const std::string& admin_group);

// The credentials of this process (for tests and for in-process callers).
PeerCredentials OwnCredentials();

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_SESSIONS_CREDENTIALS_H_
