// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_RPC_USER_SERVERS_H_
#define TRAINSTREAM_DAEMON_RPC_USER_SERVERS_H_

#include <sys/types.h>

#include <map>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/server.h"
#include "rpc/trainstream_service.h"

namespace trainstream::daemon {

// One gRPC server per connecting uid, each with a service bound to that uid. gRPC names a
// connection handed to it as a descriptor only "fd:N", and N is reused once a connection
// closes, so a lookup by that name could, in a race, attribute one connection's request to the
// next connection on the same number. Binding the uid at the server closes that hole: a request
// can only ever act for the uid whose connections that server receives. Thread-safe.
class UserServers {
 public:
  struct Shared {
    DaemonFacts facts;
    SessionRegistry* sessions = nullptr;
    Arena* arena = nullptr;
    EventLog* events = nullptr;
    const ConnectionCredentials* credentials = nullptr;
    OptimizerRegistry* optimizers = nullptr;
    BaseStore* bases = nullptr;
    GrantedFiles* granted_files = nullptr;
    TransferTotals* transfers = nullptr;
    GpuPoolAccess gpu_pools;
  };
  explicit UserServers(Shared shared) : shared_(std::move(shared)) {}
  ~UserServers() { Shutdown(); }

  // The server for `peer`'s uid, started on first use; null once shut down or if gRPC failed.
  grpc::Server* ServerFor(const PeerCredentials& peer);
  // A channel, in this process only, to a server bound to the daemon itself as an administrator:
  // the daemon's own readers of the control plane (the metrics endpoint) see what an admin's
  // tsctl sees, through the same handlers. No socket leads to it. Null once shut down.
  std::shared_ptr<grpc::Channel> DaemonChannel();
  // Health status of every server, now and for those started later.
  void SetServing(bool serving);
  // Ends open streams and shuts every server down.
  void Shutdown();

 private:
  struct Entry {
    std::unique_ptr<TrainStreamService> service;
    std::unique_ptr<grpc::Server> server;
  };
  const Shared shared_;
  absl::Mutex mu_;
  Entry Build(const PeerCredentials& identity) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::map<uid_t, Entry> servers_ ABSL_GUARDED_BY(mu_);
  Entry daemon_itself_ ABSL_GUARDED_BY(mu_);
  bool serving_ ABSL_GUARDED_BY(mu_) = true;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_RPC_USER_SERVERS_H_
