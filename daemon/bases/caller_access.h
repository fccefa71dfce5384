// SPDX-License-Identifier: Apache-2.0
// Files the daemon opens for a client are opened with the client's rights. A system daemon runs
// as root and could read files its caller can't: while a CallerFiles scope lives, this thread's
// filesystem identity (fsuid, fsgid, groups) is the caller's, so the kernel itself checks every
// folder, symlink, mode bit and ACL on the way. A daemon that can't switch (not root) reads only
// files the caller could by their permission bits (CheckCallerMayRead), which follows the real
// path but can't see ACLs.
#ifndef TRAINSTREAM_DAEMON_BASES_CALLER_ACCESS_H_
#define TRAINSTREAM_DAEMON_BASES_CALLER_ACCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "sessions/credentials.h"

namespace trainstream::daemon {

class CallerFiles {
 public:
  // Takes `peer`'s filesystem identity for this thread when the daemon runs as root and `peer`
  // is another user; otherwise changes nothing (switched() is false).
  static absl::StatusOr<std::unique_ptr<CallerFiles>> Enter(const PeerCredentials& peer);
  ~CallerFiles();  // gives the thread its own identity back
  CallerFiles(const CallerFiles&) = delete;
  CallerFiles& operator=(const CallerFiles&) = delete;

  // True when the kernel checks opens as the caller; false when the daemon is the caller's own
  // user (nothing to check) or could not switch (check with CheckCallerMayRead).
  bool switched() const { return switched_; }

 private:
  CallerFiles() = default;
  bool switched_ = false;
  uid_t fsuid_ = 0;
  gid_t fsgid_ = 0;
  std::vector<gid_t> groups_;
};

// OK when `peer` is the daemon's own user or root, or when every folder on the way to `path`
// (a real path: no symlinks) lets it through and the file lets it read; PERMISSION_DENIED
// naming the path otherwise. Only the peer's primary group counts; ACLs are not read.
absl::Status CheckCallerMayRead(const std::string& path, const PeerCredentials& peer);

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_BASES_CALLER_ACCESS_H_
