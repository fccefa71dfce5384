// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_DOORBELL_DOORBELL_DISPATCHER_H_
#define TRAINSTREAM_DAEMON_DOORBELL_DOORBELL_DISPATCHER_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "doorbell/doorbell_channel.h"
#include "ipc/unique_fd.h"
#include "sessions/session.h"

namespace trainstream::daemon {

// Owns every session's doorbell and reads them all from one thread (epoll over their
// eventfds). Pings are answered here; other kinds go to the handler registered for them; a
// kind nobody handles is answered with kError. A ring the client corrupted ends its session
// through `on_protocol_error`. Thread-safe.
class DoorbellDispatcher {
 public:
  using Handler = std::function<void(const Session&, const ipc::DoorbellMessage&,
                                     DoorbellChannel&)>;
  using ProtocolErrorCallback = std::function<void(const std::string& session_id,
                                                   const std::string& why)>;

  static absl::StatusOr<std::unique_ptr<DoorbellDispatcher>> Create(
      ProtocolErrorCallback on_protocol_error);
  ~DoorbellDispatcher();

  // Registers `handler` for `kind` (before sessions attach).
  void SetHandler(ipc::DoorbellKind kind, Handler handler);
  // Creates the session's doorbell and returns what its client needs to attach.
  absl::StatusOr<DoorbellGrant> Add(std::shared_ptr<const Session> session);
  // Posts `message` to the session's client. NOT_FOUND when the session has no doorbell;
  // RESOURCE_EXHAUSTED when its ring is full (the client stopped reading).
  absl::Status Send(const std::string& session_id, const ipc::DoorbellMessage& message);
  // Forgets the session's doorbell (no-op if it has none).
  void Remove(const std::string& session_id);
  // Stops the thread; called by the destructor.
  void Stop();

 private:
  struct Entry {
    std::shared_ptr<const Session> session;
    std::shared_ptr<DoorbellChannel> channel;
    uint64_t key;
  };
  explicit DoorbellDispatcher(ProtocolErrorCallback on_protocol_error, ipc::UniqueFd epoll,
                              ipc::UniqueFd stop);
  void Loop();
  void Serve(const Entry& entry);

  const ProtocolErrorCallback on_protocol_error_;
  ipc::UniqueFd epoll_;
  ipc::UniqueFd stop_;
  absl::Mutex mu_;
  std::map<ipc::DoorbellKind, Handler> handlers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Entry> by_session_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::string> by_key_ ABSL_GUARDED_BY(mu_);
  uint64_t next_key_ ABSL_GUARDED_BY(mu_) = 1;
  std::thread thread_;
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_DOORBELL_DOORBELL_DISPATCHER_H_
