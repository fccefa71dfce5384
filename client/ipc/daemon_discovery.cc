// SPDX-License-Identifier: Apache-2.0
#include "ipc/daemon_discovery.h"

#include <grp.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "ipc/unix_socket.h"

namespace trainstream::ipc {
namespace {

std::string UserName(uid_t uid) {
  passwd entry{};
  passwd* found = nullptr;
  char buffer[4096];
  if (::getpwuid_r(uid, &entry, buffer, sizeof(buffer), &found) == 0 && found != nullptr) {
    return found->pw_name;
  }
  return absl::StrCat(uid);
}

std::string GroupName(gid_t gid) {
  group entry{};
  group* found = nullptr;
  char buffer[4096];
  if (::getgrgid_r(gid, &entry, buffer, sizeof(buffer), &found) == 0 && found != nullptr) {
    return found->gr_name;
  }
  return absl::StrCat(gid);
}

// Why `path` refused this process: who owns it and how to be let in.
std::string RefusalReason(const std::string& path) {
  const uid_t uid = ::getuid();
  const std::string user = UserName(uid);
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    return absl::StrCat(path, " refuses ", user, " (uid ", uid, "): its directory is closed");
  }
  const std::string group = GroupName(info.st_gid);
  return absl::StrFormat(
      "%s refuses %s (uid %d): the socket is owned by group %s with mode %04o; join that group "
      "(usermod -aG %s %s) and log in again, or start a daemon of your own",
      path, user, uid, group, info.st_mode & 07777, group, user);
}

}  // namespace

std::string DataSocketSeenFrom(const std::string& control_socket, const std::string& reported) {
  const size_t name = reported.rfind('/');
  const size_t folder = control_socket.rfind('/');
  if (name == std::string::npos || folder == std::string::npos) return reported;
  return control_socket.substr(0, folder) + reported.substr(name);
}

std::string SystemSocketPath() {
  if (const char* env = std::getenv("TRAINSTREAM_SYSTEM_SOCKET"); env != nullptr && *env != '\0') {
    return env;
  }
  return "/run/trainstream/trainstreamd.sock";
}

std::vector<std::string> SocketCandidates() {
  std::vector<std::string> candidates = {SystemSocketPath()};
  if (::getuid() != 0) candidates.push_back(UserSocketPath());
  return candidates;
}

std::vector<std::string> ClientSocketCandidates() {
  if (const char* env = std::getenv("TRAINSTREAM_SOCKET"); env != nullptr && *env != '\0') {
    return {env};
  }
  return SocketCandidates();
}

absl::StatusOr<std::string> FindDaemonSocket(const std::vector<std::string>& candidates) {
  std::vector<std::string> reasons;
  bool refused = false;
  for (const std::string& path : candidates) {
    absl::StatusOr<UniqueFd> probe = ConnectUnix(path, SOCK_STREAM);
    if (probe.ok()) return path;
    if (absl::IsPermissionDenied(probe.status())) {
      refused = true;
      reasons.push_back(RefusalReason(path));
    } else {
      reasons.push_back(std::string(probe.status().message()));
    }
  }
  const std::string message =
      absl::StrCat("no trainstreamd found: ", absl::StrJoin(reasons, "; "));
  return refused ? absl::PermissionDeniedError(message) : absl::UnavailableError(message);
}

}  // namespace trainstream::ipc
