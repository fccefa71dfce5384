// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_DAEMON_H_
#define TRAINSTREAM_DAEMON_DAEMON_H_

#include <memory>
#include <mutex>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "config/daemon_options.h"
#include "ipc/unique_fd.h"

namespace trainstream::daemon {

class Arena;
class BaseGpuPools;
class BaseStore;
class ControlListener;
class ConnectionCredentials;
class DataChannelServer;
class DoorbellDispatcher;
class EventLog;
class GrantedFiles;
class GpuPools;
class MetricsEndpoint;
class OptimizerRegistry;
class SessionRegistry;
class TransferTotals;
class UserServers;
class VramApi;

// trainstreamd: wires the parts together and runs them until Shutdown(). Create() binds both
// sockets (or serves the listening ones it is given: socket activation, at the options' paths)
// and starts serving; Shutdown() drains (no new sessions, waits for the current ones up to the
// drain timeout) and stops. Thread-safe.
class Daemon {
 public:
  static absl::StatusOr<std::unique_ptr<Daemon>> Create(const DaemonOptions& options,
                                                        ipc::UniqueFd control_listener = {},
                                                        ipc::UniqueFd data_listener = {});
  ~Daemon();

  // Blocks until Shutdown() has finished.
  void Wait();
  // As Wait(), for at most `timeout`; true when the daemon has stopped.
  bool WaitFor(absl::Duration timeout);
  // Drains and stops; the second call returns at once.
  void Shutdown();

 private:
  explicit Daemon(const DaemonOptions& options);
  absl::Status Start(ipc::UniqueFd control_listener, ipc::UniqueFd data_listener);
  void Housekeeping();

  const DaemonOptions options_;
  std::unique_ptr<EventLog> events_;
  std::unique_ptr<Arena> arena_;
  std::unique_ptr<ConnectionCredentials> credentials_;
  std::unique_ptr<TransferTotals> transfers_;
  std::unique_ptr<GrantedFiles> granted_files_;  // before sessions_: ended sessions close theirs
  std::unique_ptr<SessionRegistry> sessions_;
  std::unique_ptr<DoorbellDispatcher> doorbells_;
  std::unique_ptr<OptimizerRegistry> optimizers_;  // after doorbells_: destroyed before them
  std::unique_ptr<BaseStore> bases_;  // after arena_: its loads stop before the arena goes
  std::unique_ptr<VramApi> vram_;
  std::unique_ptr<GpuPools> gpu_pools_;       // after vram_: releases its pools through it
  std::unique_ptr<BaseGpuPools> base_pools_;
  std::unique_ptr<DataChannelServer> data_server_;
  std::unique_ptr<UserServers> servers_;
  std::unique_ptr<MetricsEndpoint> metrics_;  // after servers_: it reads through one of them
  std::unique_ptr<ControlListener> listener_;
  absl::Notification stopping_;
  absl::Notification stopped_;
  std::thread housekeeping_;
  std::once_flag shutdown_once_;
  bool started_ = false;
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_DAEMON_H_
