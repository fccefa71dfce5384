// SPDX-License-Identifier: Apache-2.0
#include "sessions/credentials.h"

#include <grp.h>
#include <pwd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <vector>

#include "trainstream/status_macros.h"

namespace trainstream::daemon {
namespace {

bool InGroup(uid_t uid, gid_t primary_gid, const std::string& group_name) {
  if (group_name.empty()) return false;
  std::vector<char> buf(16384);
  group grp{};
  group* found = nullptr;
  if (getgrnam_r(group_name.c_str(), &grp, buf.data(), buf.size(), &found) != 0 || !found) {
    return false;
  }
  const gid_t wanted = found->gr_gid;
  if (primary_gid == wanted) return true;
  passwd pw{};
  passwd* user = nullptr;
  std::vector<char> pbuf(16384);
  if (getpwuid_r(uid, &pw, pbuf.data(), pbuf.size(), &user) != 0 || !user) return false;
  std::vector<gid_t> groups(256);
  int count = static_cast<int>(groups.size());
  if (getgrouplist(user->pw_name, primary_gid, groups.data(), &count) < 0) return false;
  for (int i = 0; i < count; ++i) {
    if (groups[i] == wanted) return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<PeerCredentials> ReadPeerCredentials(int socket_fd,
                                                    const std::string& admin_group) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(socket_fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return ErrnoStatus(errno, "reading the peer's credentials");
  }
  PeerCredentials out{cred.pid, cred.uid, cred.gid, false};
  out.admin = cred.uid == 0 || InGroup(cred.uid, cred.gid, admin_group);
  return out;
}

PeerCredentials OwnCredentials() {
  return PeerCredentials{::getpid(), ::getuid(), ::getgid(), ::getuid() == 0};
}

}  // namespace trainstream::daemon
