// SPDX-License-Identifier: Apache-2.0
#include "bases/caller_access.h"

#include <grp.h>
#include <sys/fsuid.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_format.h"

namespace trainstream::daemon {
namespace {

// The permission bit `owner_bit` (S_IRUSR or S_IXUSR) as it applies to `peer`.
bool Allows(const struct stat& st, const PeerCredentials& peer, mode_t owner_bit) {
  if (st.st_uid == peer.uid) return st.st_mode & owner_bit;
  if (st.st_gid == peer.gid) return st.st_mode & (owner_bit >> 3);
  return st.st_mode & (owner_bit >> 6);
}

}  // namespace

absl::StatusOr<std::unique_ptr<CallerFiles>> CallerFiles::Enter(const PeerCredentials& peer) {
  std::unique_ptr<CallerFiles> scope(new CallerFiles());
  if (peer.uid == ::geteuid() || ::geteuid() != 0) return scope;
  // The raw system calls: glibc's setgroups() changes every thread of the process, and only
  // this thread is to act as the caller. (setfsuid/setfsgid are per thread already.)
  const int count = ::getgroups(0, nullptr);
  scope->groups_.resize(count > 0 ? count : 0);
  if (count > 0 && ::getgroups(count, scope->groups_.data()) != count) {
    return absl::InternalError(absl::StrFormat("getgroups: %s", std::strerror(errno)));
  }
  const gid_t caller_groups[] = {peer.gid};
  if (::syscall(SYS_setgroups, 1, caller_groups) != 0) {
    return absl::InternalError(absl::StrFormat("setgroups: %s", std::strerror(errno)));
  }
  scope->fsgid_ = static_cast<gid_t>(::setfsgid(peer.gid));
  scope->fsuid_ = static_cast<uid_t>(::setfsuid(peer.uid));
  scope->switched_ = true;  // the destructor restores from here on, whatever happens below
  // setfsuid reports the previous value, not success: ask again with an invalid id.
  if (static_cast<uid_t>(::setfsuid(static_cast<uid_t>(-1))) != peer.uid ||
      static_cast<gid_t>(::setfsgid(static_cast<gid_t>(-1))) != peer.gid) {
    return absl::InternalError("could not take the caller's filesystem identity");
  }
  return scope;
}

CallerFiles::~CallerFiles() {
  if (!switched_) return;
  ::setfsuid(fsuid_);
  ::setfsgid(fsgid_);
  ::syscall(SYS_setgroups, groups_.size(), groups_.data());
}

absl::Status CheckCallerMayRead(const std::string& path, const PeerCredentials& peer) {
  if (peer.uid == 0 || peer.uid == ::geteuid()) return absl::OkStatus();
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(absl::StrFormat("'%s' is not an absolute path", path));
  }
  struct stat st {};
  for (size_t slash = path.find('/', 1); slash != std::string::npos;
       slash = path.find('/', slash + 1)) {
    const std::string folder = path.substr(0, slash);
    if (::stat(folder.c_str(), &st) == 0 && !Allows(st, peer, S_IXUSR)) {
      return absl::PermissionDeniedError(
          absl::StrFormat("uid %d may not enter %s, so the daemon does not read %s for it",
                          peer.uid, folder, path));
    }
  }
  if (::stat(path.c_str(), &st) == 0 && !Allows(st, peer, S_IRUSR)) {
    return absl::PermissionDeniedError(
        absl::StrFormat("uid %d may not read %s, so the daemon does not read it for it",
                        peer.uid, path));
  }
  return absl::OkStatus();
}

}  // namespace trainstream::daemon
