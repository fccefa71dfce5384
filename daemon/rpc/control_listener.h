// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_RPC_CONTROL_LISTENER_H_
#define TRAINSTREAM_DAEMON_RPC_CONTROL_LISTENER_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "events/event_log.h"
#include "grpcpp/server.h"
#include "ipc/accept.h"
#include "ipc/unique_fd.h"
#include "rpc/connection_credentials.h"
#include "sessions/connection_limit.h"

namespace trainstream::daemon {

// Accepts control connections itself so it can read SO_PEERCRED, records the credentials, and
// hands each connected descriptor to the gRPC server chosen for the peer (gRPC's own Unix
// listener exposes no peer credentials). One thread. Stop() before shutting the servers down.
class ControlListener {
 public:
  using ServerForPeer = std::function<grpc::Server*(const PeerCredentials&)>;
  // A uid past `max_connections_per_uid` open connections (0: no cap; root and the admin group
  // never have one) has new ones closed at once, and `events` says so (every 10 s at most).
  // With `inherited` (a listening socket the service manager made at `socket_path`), that one
  // is served and its path is left for the manager to remove.
  static absl::StatusOr<std::unique_ptr<ControlListener>> Create(
      const std::string& socket_path, mode_t mode, const std::string& admin_group,
      ServerForPeer server_for, ConnectionCredentials* credentials,
      uint32_t max_connections_per_uid = 0, EventLog* events = nullptr,
      ipc::UniqueFd inherited = {});
  ~ControlListener();
  void Stop();

 private:
  ControlListener(std::string socket_path, bool owns_path, std::string admin_group,
                  ipc::UniqueFd listener, ipc::UniqueFd stop, ServerForPeer server_for,
                  ConnectionCredentials* credentials, uint32_t max_connections_per_uid,
                  EventLog* events);
  void Loop();
  // Says (every 10 s at most, per kind and uid) why connections are closed at once.
  void Report(const std::string& kind, uid_t uid, const std::string& message);

  const std::string socket_path_;
  const bool owns_path_;  // false for a socket-activated listener: the manager's to remove
  const std::string admin_group_;
  ipc::UniqueFd listener_;
  ipc::UniqueFd stop_;
  const ServerForPeer server_for_;
  ConnectionCredentials* const credentials_;
  ConnectionLimit limit_;
  EventLog* const events_;
  ipc::Acceptor acceptor_;  // the loop thread's only
  absl::flat_hash_map<std::string, absl::Time> last_report_;  // the loop thread's only
  std::thread thread_;
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_RPC_CONTROL_LISTENER_H_
