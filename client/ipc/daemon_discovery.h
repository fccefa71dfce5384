// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_IPC_DAEMON_DISCOVERY_H_
#define TRAINSTREAM_IPC_DAEMON_DISCOVERY_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace trainstream::ipc {

// The system daemon's control socket (deploy/): $TRAINSTREAM_SYSTEM_SOCKET where set (a
// non-standard layout, the tests), else /run/trainstream/trainstreamd.sock.
std::string SystemSocketPath();

// Where a client looks for a daemon when no socket is named, in order: the system socket, then,
// for a user other than root, the per-user one (DefaultSocketPath without $TRAINSTREAM_SOCKET).
std::vector<std::string> SocketCandidates();

// The sockets a client tries when none is named: the one $TRAINSTREAM_SOCKET names, alone (an
// error when no daemon is there, never a quiet fallback), else SocketCandidates().
std::vector<std::string> ClientSocketCandidates();

// The first of `candidates` a daemon listens on. Otherwise UNAVAILABLE saying, for each, why
// not (no such socket, a stale one), or PERMISSION_DENIED when a socket refused this user: the
// message names the socket's group and how to join it.
absl::StatusOr<std::string> FindDaemonSocket(const std::vector<std::string>& candidates);

// The daemon's data socket as this client reaches it: the file the daemon named (`reported`, a
// path in the daemon's own mount namespace), in the folder of the control socket this client
// connected through. They differ where the daemon's socket folder is mounted at another path
// here (the daemon in a container, its folder a hostPath that clients mount elsewhere); the
// daemon keeps both sockets in one folder.
std::string DataSocketSeenFrom(const std::string& control_socket, const std::string& reported);

}  // namespace trainstream::ipc

#endif  // TRAINSTREAM_IPC_DAEMON_DISCOVERY_H_
