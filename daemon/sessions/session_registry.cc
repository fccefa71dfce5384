// SPDX-License-Identifier: Apache-2.0
#include "sessions/session_registry.h"

#include <sys/random.h>

#include <cerrno>

#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"
#include "trainstream/status_macros.h"

namespace trainstream::daemon {
namespace {

absl::StatusOr<std::string> RandomBytes(size_t n) {
  std::string out(n, '\0');
  size_t filled = 0;
  while (filled < n) {
    ssize_t got = ::getrandom(out.data() + filled, n - filled, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "getrandom");
    }
    filled += static_cast<size_t>(got);
  }
  return out;
}

// Compares without an early exit, so the time taken tells nothing about the token.
bool ConstantTimeEqual(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

const char* SessionEndName(SessionEnd reason) {
  switch (reason) {
    case SessionEnd::kClosed: return "closed";
    case SessionEnd::kDisconnected: return "disconnected";
    case SessionEnd::kLeaseExpired: return "lease expired";
    case SessionEnd::kProtocolError: return "protocol error";
    case SessionEnd::kShutdown: return "daemon shutdown";
  }
  return "unknown";
}

std::string OwnerName(const Session& session) {
  const std::string own = session.pid_in_namespace == 0
                              ? ""
                              : absl::StrFormat("pid %d in its own", session.pid_in_namespace);
  if (session.owner.pid == 0) {
    return "a process outside the daemon's PID namespace" + (own.empty() ? "" : " (" + own + ")");
  }
  return absl::StrFormat("pid %d", session.owner.pid) +
         (own.empty() ? "" : " (" + own + " PID namespace)");
}

SessionRegistry::SessionRegistry(const Options& options, EndCallback on_end)
    : options_(options), on_end_(std::move(on_end)) {}

absl::StatusOr<std::shared_ptr<const Session>> SessionRegistry::Open(
    const PeerCredentials& caller, const OpenSessionParams& params) {
  // Identity is the kernel's (SO_PEERCRED, translated into this daemon's PID namespace). A
  // client in a container reports the pid its own namespace gives it: kept, to be said beside
  // the kernel's, and never required to match (that refused every containerized client).
  ASSIGN_OR_RETURN(std::string id_bytes, RandomBytes(8));
  ASSIGN_OR_RETURN(std::string token, RandomBytes(32));
  auto session = std::make_shared<Session>();
  session->id = "s-" + absl::BytesToHexString(id_bytes);
  session->attach_token = std::move(token);
  session->owner = caller;
  if (params.claimed_pid != 0 && params.claimed_pid != caller.pid) {
    session->pid_in_namespace = params.claimed_pid;
  }
  session->job = JobKey{caller.uid, params.job_id};
  session->rank = params.rank;
  session->world_size = params.world_size == 0 ? 1 : params.world_size;
  session->opened = absl::Now();

  absl::MutexLock lock(&mu_);
  if (draining_) {
    return absl::UnavailableError("the daemon is shutting down and accepts no new sessions");
  }
  uint32_t owned = 0;
  for (const auto& [id, entry] : sessions_) owned += entry.session->owner.uid == caller.uid;
  if (owned >= options_.max_sessions_per_uid) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "uid %d already has %d sessions, the most one user may hold", caller.uid, owned));
  }
  sessions_[session->id] = Entry{session, absl::Now() + options_.lease, false};
  return std::shared_ptr<const Session>(session);
}

absl::StatusOr<SessionRegistry::Entry*> SessionRegistry::FindOwnedLocked(
    const PeerCredentials& caller, const std::string& session_id) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    if (auto ended = ended_.find(session_id);
        ended != ended_.end() && ended->second.owner == caller.uid) {
      return absl::NotFoundError(absl::StrFormat(
          "session '%s' ended %.1f s ago (%s)", session_id,
          absl::ToDoubleSeconds(absl::Now() - ended->second.when),
          SessionEndName(ended->second.reason)));
    }
    return absl::NotFoundError(
        absl::StrFormat("no session '%s' (it ended, or never existed)", session_id));
  }
  if (it->second.session->owner.uid != caller.uid) {
    return absl::PermissionDeniedError(
        absl::StrFormat("session '%s' belongs to another user", session_id));
  }
  return &it->second;
}

absl::StatusOr<std::shared_ptr<const Session>> SessionRegistry::Get(
    const PeerCredentials& caller, const std::string& session_id) const {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Entry * entry,
                   const_cast<SessionRegistry*>(this)->FindOwnedLocked(caller, session_id));
  return entry->session;
}

absl::StatusOr<absl::Duration> SessionRegistry::Heartbeat(const PeerCredentials& caller,
                                                          const std::string& session_id) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Entry * entry, FindOwnedLocked(caller, session_id));
  entry->lease_deadline = absl::Now() + options_.lease;
  return options_.lease;
}

absl::StatusOr<std::shared_ptr<const Session>> SessionRegistry::Attach(
    const PeerCredentials& caller, const std::string& session_id, const std::string& token) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Entry * entry, FindOwnedLocked(caller, session_id));
  if (!ConstantTimeEqual(token, entry->session->attach_token)) {
    return absl::PermissionDeniedError("attach token does not match the session");
  }
  if (entry->attached) {
    return absl::FailedPreconditionError(
        absl::StrFormat("session '%s' already has a data connection", session_id));
  }
  entry->attached = true;
  entry->lease_deadline = absl::Now() + options_.lease;
  return entry->session;
}

absl::Status SessionRegistry::End(const std::string& session_id, SessionEnd reason) {
  std::shared_ptr<const Session> session;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) {
      return absl::NotFoundError(absl::StrFormat("no session '%s'", session_id));
    }
    session = it->second.session;
    sessions_.erase(it);
    ended_[session_id] = Ended{session->owner.uid, reason, absl::Now()};
    ended_order_.push_back(session_id);
    if (ended_order_.size() > kEndedKept) {
      ended_.erase(ended_order_.front());
      ended_order_.pop_front();
    }
  }
  on_end_(*session, reason);
  return absl::OkStatus();
}

absl::Status SessionRegistry::Close(const PeerCredentials& caller,
                                    const std::string& session_id) {
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(FindOwnedLocked(caller, session_id).status());
  }
  return End(session_id, SessionEnd::kClosed);
}

int SessionRegistry::ExpireLeases(absl::Time now) {
  std::vector<std::string> expired;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, entry] : sessions_) {
      if (entry.lease_deadline < now) expired.push_back(id);
    }
  }
  int ended = 0;
  for (const std::string& id : expired) ended += End(id, SessionEnd::kLeaseExpired).ok();
  return ended;
}

std::vector<SessionSnapshot> SessionRegistry::List(const PeerCredentials& viewer) const {
  absl::MutexLock lock(&mu_);
  std::vector<SessionSnapshot> out;
  const absl::Time now = absl::Now();
  for (const auto& [id, entry] : sessions_) {
    if (!viewer.admin && entry.session->owner.uid != viewer.uid) continue;
    out.push_back({entry.session, entry.attached, entry.lease_deadline - now});
  }
  return out;
}

size_t SessionRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return sessions_.size();
}

void SessionRegistry::StartDraining() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

bool SessionRegistry::draining() const {
  absl::MutexLock lock(&mu_);
  return draining_;
}

void SessionRegistry::EndAll(SessionEnd reason) {
  std::vector<std::string> ids;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, entry] : sessions_) ids.push_back(id);
  }
  for (const std::string& id : ids) End(id, reason).IgnoreError();
}

}  // namespace trainstream::daemon
