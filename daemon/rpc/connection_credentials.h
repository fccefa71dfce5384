// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_RPC_CONNECTION_CREDENTIALS_H_
#define TRAINSTREAM_DAEMON_RPC_CONNECTION_CREDENTIALS_H_

#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "sessions/credentials.h"

namespace trainstream::daemon {

// The kernel credentials of each control connection, keyed by the peer name gRPC gives a
// connection handed to it as a file descriptor ("fd:N"). Entries are replaced when a
// descriptor number is reused by a newer connection, which is accepted (and recorded here)
// before gRPC sees any of its requests. Thread-safe.
class ConnectionCredentials {
 public:
  void Record(int fd, const PeerCredentials& peer);
  // The credentials for a ServerContext::peer() string; nullopt for anything not recorded
  // (such as a connection that did not come through the daemon's own accept loop).
  std::optional<PeerCredentials> Find(const std::string& grpc_peer) const;

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, PeerCredentials> by_peer_ ABSL_GUARDED_BY(mu_);
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_RPC_CONNECTION_CREDENTIALS_H_
