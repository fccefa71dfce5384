// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_IPC_UNIX_SOCKET_H_
#define TRAINSTREAM_IPC_UNIX_SOCKET_H_

#include <sys/types.h>

#include <string>

#include "absl/status/statusor.h"
#include "ipc/unique_fd.h"

namespace trainstream::ipc {

// The socket a daemon listens on when none is named: $TRAINSTREAM_SOCKET if set; else, for
// root, the system socket (SystemSocketPath); else the per-user one (UserSocketPath). Clients
// look further (daemon_discovery.h).
std::string DefaultSocketPath();

// $XDG_RUNTIME_DIR/trainstream/trainstreamd.sock, or /tmp/trainstream-<uid>/trainstreamd.sock
// without XDG_RUNTIME_DIR.
std::string UserSocketPath();

// The data socket that belongs to a control socket.
std::string DataSocketPath(const std::string& control_socket_path);

// Binds and listens on `path` (type SOCK_STREAM or SOCK_SEQPACKET) with permissions `mode`,
// creating its directory (0700, or 0750 when `mode` grants the group) if needed. A stale socket
// file left by a dead daemon is replaced; a live one is ALREADY_EXISTS. Paths over 107 bytes
// are INVALID_ARGUMENT.
absl::StatusOr<UniqueFd> ListenUnix(const std::string& path, int type, mode_t mode);

// Connects to `path`; UNAVAILABLE, naming the path, when nothing listens there.
absl::StatusOr<UniqueFd> ConnectUnix(const std::string& path, int type);

}  // namespace trainstream::ipc

#endif  // TRAINSTREAM_IPC_UNIX_SOCKET_H_
