// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_SESSIONS_SESSION_REGISTRY_H_
#define TRAINSTREAM_DAEMON_SESSIONS_SESSION_REGISTRY_H_

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "sessions/session.h"

namespace trainstream::daemon {

struct OpenSessionParams {
  std::string job_id;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  pid_t claimed_pid = 0;  // what the client says its pid is (0: nothing said); never trusted
};

struct SessionSnapshot {
  std::shared_ptr<const Session> session;
  bool attached = false;
  absl::Duration lease_left;
};

// All live sessions, their leases and their data-socket attachment. A session ends when its
// client closes it, when its data connection drops, when its lease runs out, or at shutdown;
// the `on_end` callback (run outside the registry's lock, once per session) releases what it
// held. Thread-safe.
class SessionRegistry {
 public:
  struct Options {
    absl::Duration lease = absl::Seconds(10);
    uint32_t max_sessions_per_uid = 256;
  };
  using EndCallback = std::function<void(const Session&, SessionEnd)>;
  SessionRegistry(const Options& options, EndCallback on_end);

  // UNAVAILABLE while draining; INVALID_ARGUMENT for a claimed pid that is not the caller's;
  // RESOURCE_EXHAUSTED past the per-uid session limit.
  absl::StatusOr<std::shared_ptr<const Session>> Open(const PeerCredentials& caller,
                                                      const OpenSessionParams& params);
  // The caller's session: NOT_FOUND for an unknown id, PERMISSION_DENIED for another uid's.
  absl::StatusOr<std::shared_ptr<const Session>> Get(const PeerCredentials& caller,
                                                     const std::string& session_id) const;
  // Renews the lease; returns its length.
  absl::StatusOr<absl::Duration> Heartbeat(const PeerCredentials& caller,
                                           const std::string& session_id);
  // Binds the data connection: the token must match and the uid must be the owner's.
  absl::StatusOr<std::shared_ptr<const Session>> Attach(const PeerCredentials& caller,
                                                        const std::string& session_id,
                                                        const std::string& token);
  // Ends a session for `reason`; NOT_FOUND if it already ended.
  absl::Status End(const std::string& session_id, SessionEnd reason);
  // Ends, for a caller, its own session.
  absl::Status Close(const PeerCredentials& caller, const std::string& session_id);
  // Ends every session whose lease ran out before `now`; returns how many.
  int ExpireLeases(absl::Time now);

  // Sessions the viewer may see: its own uid's, or all for an admin.
  std::vector<SessionSnapshot> List(const PeerCredentials& viewer) const;
  size_t size() const;

  // Refuses new sessions from now on.
  void StartDraining();
  bool draining() const;
  // Ends every session (for shutdown).
  void EndAll(SessionEnd reason);

 private:
  struct Entry {
    std::shared_ptr<const Session> session;
    absl::Time lease_deadline;
    bool attached = false;
  };
  absl::StatusOr<Entry*> FindOwnedLocked(const PeerCredentials& caller,
                                         const std::string& session_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Why a session ended, kept a while: a client that finds its session gone is told why, not
  // only that it is (its owner alone: another user learns nothing of it).
  struct Ended {
    uid_t owner = 0;
    SessionEnd reason = SessionEnd::kClosed;
    absl::Time when;
  };
  static constexpr size_t kEndedKept = 1024;

  const Options options_;
  const EndCallback on_end_;
  mutable absl::Mutex mu_;
  std::map<std::string, Entry> sessions_ ABSL_GUARDED_BY(mu_);
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, Ended> ended_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> ended_order_ ABSL_GUARDED_BY(mu_);  // oldest first
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_SESSIONS_SESSION_REGISTRY_H_
