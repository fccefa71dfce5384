// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_RPC_CONTROL_LISTENER_H_
#define TRAINSTREAM_DAEMON_RPC_CONTROL_LISTENER_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "grpcpp/server.h"
#include "ipc/unique_fd.h"
#include "rpc/connection_credentials.h"

namespace trainstream::daemon {

// Accepts control connections itself so it can read SO_PEERCRED, records the credentials, and
// hands each connected descriptor to the gRPC server chosen for the peer (gRPC's own Unix
// listener exposes no peer credentials). One thread. Stop() before shutting the servers down.
class ControlListener {
 public:
  using ServerForPeer = std::function<grpc::Server*(const PeerCredentials&)>;
  static absl::StatusOr<std::unique_ptr<ControlListener>> Create(
      const std::string& socket_path, mode_t mode, const std::string& admin_group,
      ServerForPeer server_for, ConnectionCredentials* credentials);
  ~ControlListener();
  void Stop();

 private:
  ControlListener(std::string socket_path, std::string admin_group, ipc::UniqueFd listener,
                  ipc::UniqueFd stop, ServerForPeer server_for, ConnectionCredentials* credentials);
  void Loop();

  const std::string socket_path_;
  const std::string admin_group_;
  ipc::UniqueFd listener_;
  ipc::UniqueFd stop_;
  const ServerForPeer server_for_;
  ConnectionCredentials* const credentials_;
  std::thread thread_;
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_RPC_CONTROL_LISTENER_H_
