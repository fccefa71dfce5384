// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_SESSIONS_SESSION_H_
#define TRAINSTREAM_DAEMON_SESSIONS_SESSION_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "arena/arena.h"
#include "sessions/credentials.h"

namespace trainstream::daemon {

// One client process's session. Its identity fields are fixed at open; the lease and attach
// state are kept by the SessionRegistry. Shared (std::shared_ptr) between the registry and the
// request in flight; every field here is immutable after construction.
struct Session {
  std::string id;           // "s-" and 16 random hex digits
  std::string attach_token; // 32 random bytes, proves ownership on the data socket
  PeerCredentials owner;    // uid and pid as the kernel saw them at OpenSession
  // The pid the client reported where it differs from the kernel's: its own, in a PID
  // namespace of its own (a container). Said, never trusted (0: the same, or none reported).
  pid_t pid_in_namespace = 0;
  JobKey job;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  absl::Time opened;
};

// Who owns a session, for events: "pid 4242", "pid 4242 (pid 1 in its own PID namespace)", or,
// where the kernel gave pid 0 (the client's process is outside this daemon's PID namespace, as
// when the daemon runs in a container of its own), "a process outside the daemon's PID
// namespace (pid 1 in its own)".
std::string OwnerName(const Session& session);

// Why a session ended, for events and for tests.
enum class SessionEnd { kClosed, kDisconnected, kLeaseExpired, kProtocolError, kShutdown };
const char* SessionEndName(SessionEnd reason);

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_SESSIONS_SESSION_H_
