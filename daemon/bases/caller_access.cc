// SPDX-License-Identifier: Apache-2.0
#include "bases/caller_access.h"

#include <sys/stat.h>
#include <unistd.h>

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
