// SPDX-License-Identifier: Apache-2.0
#include "ipc/socket_trust.h"

#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ipc/unix_socket.h"
#include "trainstream/status_macros.h"

namespace trainstream::ipc {
namespace {

// The account deploy/trainstreamd.service runs the system daemon as.
constexpr char kServiceUser[] = "trainstream";

std::string Who(const std::vector<uid_t>& trusted) {
  std::string out = absl::StrCat("you (uid ", ::getuid(), "), root");
  for (uid_t uid : trusted) {
    if (uid != ::getuid() && uid != 0) {
      absl::StrAppend(&out, " or the ", kServiceUser, " service (uid ", uid, ")");
    }
  }
  return out;
}

bool Trusted(uid_t uid, const std::vector<uid_t>& trusted) {
  return std::find(trusted.begin(), trusted.end(), uid) != trusted.end();
}

}  // namespace

std::vector<uid_t> TrustedDaemonUids() {
  std::vector<uid_t> uids = {::getuid()};
  if (::getuid() != 0) uids.push_back(0);
  passwd entry{};
  passwd* found = nullptr;
  char buffer[4096];
  if (::getpwnam_r(kServiceUser, &entry, buffer, sizeof(buffer), &found) == 0 && found != nullptr &&
      !Trusted(found->pw_uid, uids)) {
    uids.push_back(found->pw_uid);
  }
  return uids;
}

absl::Status CheckSocketDirectory(const std::string& socket_path,
                                  const std::vector<uid_t>& trusted) {
  std::filesystem::path dir = std::filesystem::path(socket_path).parent_path();
  if (dir.empty()) dir = ".";
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT) {
      return absl::UnavailableError(absl::StrCat("no trainstreamd is listening on ", socket_path,
                                                 " (its directory ", dir.string(),
                                                 " does not exist)"));
    }
    return ErrnoStatus(errno, absl::StrCat("examining the socket directory ", dir.string()));
  }
  const std::string advice =
      "; another user may have made it to catch trainstream's clients. Remove it, or use a "
      "directory only you can write (XDG_RUNTIME_DIR, or TRAINSTREAM_SOCKET / --socket)";
  if (!S_ISDIR(st.st_mode)) {
    return absl::PermissionDeniedError(
        absl::StrCat("the socket directory ", dir.string(), " is not a directory (a link?)",
                     advice));
  }
  if (!Trusted(st.st_uid, trusted)) {
    return absl::PermissionDeniedError(absl::StrCat("the socket directory ", dir.string(),
                                                    " belongs to uid ", st.st_uid, ", not ",
                                                    Who(trusted), advice));
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (st.st_mode & S_ISVTX) == 0) {
    return absl::PermissionDeniedError(
        absl::StrFormat("the socket directory %s is writable by others (mode %04o)%s",
                        dir.string(), st.st_mode & 07777, advice));
  }
  return absl::OkStatus();
}

absl::Status CheckPeerIsTrusted(int fd, const std::string& socket_path,
                                const std::vector<uid_t>& trusted) {
  ucred peer{};
  socklen_t size = sizeof(peer);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &size) != 0) {
    return ErrnoStatus(errno,
                       absl::StrCat("reading the credentials of ", socket_path, "'s daemon"));
  }
  if (!Trusted(peer.uid, trusted)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the trainstreamd on ", socket_path, " runs as uid ", peer.uid, " (pid ", peer.pid,
        "), not ", Who(trusted), ": refusing to send it anything. Another user may be "
        "impersonating the daemon; use a socket in a directory only you can write"));
  }
  return absl::OkStatus();
}

absl::Status VerifyDaemonSocket(const std::string& socket_path) {
  const std::vector<uid_t> trusted = TrustedDaemonUids();
  RETURN_IF_ERROR(CheckSocketDirectory(socket_path, trusted));
  ASSIGN_OR_RETURN(UniqueFd fd, ConnectUnix(socket_path, SOCK_STREAM));
  return CheckPeerIsTrusted(fd.get(), socket_path, trusted);
}

}  // namespace trainstream::ipc
