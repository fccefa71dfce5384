// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_SESSIONS_CONNECTION_LIMIT_H_
#define TRAINSTREAM_DAEMON_SESSIONS_CONNECTION_LIMIT_H_

#include <sys/types.h>

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "sessions/credentials.h"

namespace trainstream::daemon {

// Open connections per uid, capped so that one user cannot take the daemon's descriptors
// (20,239 connections from one user once left root's tsctl unanswered). Root and the admin
// group are never capped: there is always room for the people who fix things. A connection is
// counted from Admit() until Release(), or until its descriptor no longer names the socket it
// was admitted with (control connections are closed by gRPC, which tells nobody). Thread-safe.
class ConnectionLimit {
 public:
  explicit ConnectionLimit(uint32_t per_uid) : per_uid_(per_uid) {}

  // Whether `fd`, just accepted from `peer`, may stay open; counted if so. 0 means no cap.
  bool Admit(const PeerCredentials& peer, int fd);
  // Before `fd` is closed.
  void Release(int fd);
  // Connections counted for `uid` now (stale ones dropped first).
  size_t OpenFor(uid_t uid);
  uint32_t per_uid() const { return per_uid_; }

 private:
  struct Open {
    int fd;
    ino_t inode;
    dev_t device;
  };
  void DropClosedLocked(std::vector<Open>& open) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint32_t per_uid_;
  absl::Mutex mu_;
  absl::flat_hash_map<uid_t, std::vector<Open>> by_uid_ ABSL_GUARDED_BY(mu_);
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_SESSIONS_CONNECTION_LIMIT_H_
