// SPDX-License-Identifier: Apache-2.0
// Whom a daemon's socket may be trusted from. A client that talks to a daemon hands it its
// gradients and weights, so before its first request it checks who made the socket's directory
// and who runs the daemon at the other end (SO_PEERCRED), not anything the daemon says. A daemon
// checks the directory it is about to listen in the same way: another user may have made it
// first (a /tmp path, say) to catch its clients.
#ifndef TRAINSTREAM_IPC_SOCKET_TRUST_H_
#define TRAINSTREAM_IPC_SOCKET_TRUST_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace trainstream::ipc {

// The uids a daemon may run as for this process to trust it: its own, root's, and the system
// service's account ("trainstream", when it exists).
std::vector<uid_t> TrustedDaemonUids();

// The directory holding `socket_path` must be a real directory (no link), owned by one of
// `trusted`, and writable by nobody else unless it is sticky (as /tmp is: nobody can replace
// another's socket in it). PERMISSION_DENIED says what is wrong and what to do.
absl::Status CheckSocketDirectory(const std::string& socket_path,
                                  const std::vector<uid_t>& trusted);

// The process at the other end of the connected Unix socket `fd` runs as one of `trusted`;
// PERMISSION_DENIED names its uid otherwise.
absl::Status CheckPeerIsTrusted(int fd, const std::string& socket_path,
                                const std::vector<uid_t>& trusted);

// Both, for a control socket: its directory, then a connection's peer (the connection is
// closed again). UNAVAILABLE when nothing listens.
absl::Status VerifyDaemonSocket(const std::string& socket_path);

}  // namespace trainstream::ipc

#endif  // TRAINSTREAM_IPC_SOCKET_TRUST_H_
