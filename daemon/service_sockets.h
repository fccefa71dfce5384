// SPDX-License-Identifier: Apache-2.0
// Socket activation: the listening sockets a service manager opened for the daemon before it
// started (systemd's trainstreamd.socket; the sd_listen_fds(3) protocol, spoken directly as
// service_notify.cc speaks sd_notify). The manager holds them across restarts, so a client that
// connects while the daemon restarts waits in the backlog instead of finding no socket, and the
// daemon needs no right to create its socket directory.
#ifndef TRAINSTREAM_DAEMON_SERVICE_SOCKETS_H_
#define TRAINSTREAM_DAEMON_SERVICE_SOCKETS_H_

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "ipc/unique_fd.h"

namespace trainstream::daemon {

struct ServiceSockets {
  ipc::UniqueFd control;  // SOCK_STREAM: gRPC
  std::string control_path;
  ipc::UniqueFd data;     // SOCK_SEQPACKET: the data socket, at control_path + ".data"
  std::string data_path;
};

// The sockets passed to this process ($LISTEN_PID is its pid, $LISTEN_FDS of them from
// descriptor 3), or nullopt when none were. Exactly two listening Unix sockets with paths, one
// of each type, the data socket's path the control socket's plus ".data": anything else is
// INVALID_ARGUMENT saying what the socket unit must declare. The variables are removed from
// the environment either way, so no child takes them for its own.
absl::StatusOr<std::optional<ServiceSockets>> TakeServiceSockets();

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_SERVICE_SOCKETS_H_
