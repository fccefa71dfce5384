// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_DATAPLANE_DATA_CHANNEL_SERVER_H_
#define TRAINSTREAM_DAEMON_DATAPLANE_DATA_CHANNEL_SERVER_H_

#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "arena/arena.h"
#include "bases/base_store.h"
#include "doorbell/doorbell_dispatcher.h"
#include "events/event_log.h"
#include "gpu/gpu_pools.h"
#include "ipc/accept.h"
#include "sessions/connection_limit.h"
#include "sessions/granted_files.h"
#include "ipc/unique_fd.h"
#include "sessions/session_registry.h"

namespace trainstream::daemon {

// The data socket (SOCK_SEQPACKET): where a client attaches its session and receives segment
// descriptors (SCM_RIGHTS). Each session keeps exactly one connection open for its whole life;
// the daemon ends the session the moment that connection closes (a crashed or killed client
// included), so its memory (and its imports of GPU pools) is reclaimed without waiting for the
// lease. Clients also hand over files they opened with their own rights (grant_files), for
// the daemon to read or write in their place. Requests and replies are
// trainstream.v1.DataRequest / DataReply. One thread, epoll. Thread-safe.
class DataChannelServer {
 public:
  struct Options {
    std::string socket_path;
    mode_t socket_mode = 0600;
    std::string admin_group;
    uint32_t max_connections_per_uid = 0;  // 0: no cap (root and the admin group never have one)
  };
  static absl::StatusOr<std::unique_ptr<DataChannelServer>> Create(
      const Options& options, SessionRegistry* registry, Arena* arena,
      DoorbellDispatcher* doorbells, EventLog* events, BaseStore* bases,
      GrantedFiles* granted_files, GpuPools* gpu_pools = nullptr,
      ipc::UniqueFd inherited = {});  // a socket-activated listener at options.socket_path
  ~DataChannelServer();

  // Closes the session's data connection if it has one (after the session ended elsewhere).
  void Disconnect(const std::string& session_id);
  void Stop();

 private:
  struct Connection {
    ipc::UniqueFd fd;
    PeerCredentials peer;
    std::shared_ptr<const Session> session;  // set once attached
  };
  DataChannelServer(const Options& options, bool owns_path, ipc::UniqueFd listener,
                    ipc::UniqueFd epoll,
                    ipc::UniqueFd stop, SessionRegistry* registry, Arena* arena,
                    DoorbellDispatcher* doorbells, EventLog* events, BaseStore* bases,
                    GrantedFiles* granted_files, GpuPools* gpu_pools);
  void Loop();
  void Accept();
  // Returns false when the connection must close.
  bool Serve(Connection& connection);
  void Close(int fd);

  const Options options_;
  const bool owns_path_;  // false for a socket-activated listener: the manager's to remove
  ipc::UniqueFd listener_;
  ipc::UniqueFd epoll_;
  ipc::UniqueFd stop_;
  SessionRegistry* const registry_;
  Arena* const arena_;
  DoorbellDispatcher* const doorbells_;
  EventLog* const events_;
  BaseStore* const bases_;  // a base's segments, for the sessions attached to it
  GrantedFiles* const granted_files_;  // files clients opened and hand over (grant_files)
  GpuPools* const gpu_pools_;  // pools' handles, for the sessions that imported them
  absl::Mutex mu_;
  std::map<int, Connection> connections_ ABSL_GUARDED_BY(mu_);
  ConnectionLimit limit_;
  ipc::Acceptor acceptor_;  // the loop thread's only
  absl::flat_hash_map<uid_t, absl::Time> last_refusal_;  // the loop thread's only
  absl::Time last_shed_ = absl::InfinitePast();
  std::thread thread_;
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_DATAPLANE_DATA_CHANNEL_SERVER_H_
