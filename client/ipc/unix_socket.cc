// SPDX-License-Identifier: Apache-2.0
#include "ipc/unix_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "ipc/daemon_discovery.h"
#include "ipc/socket_trust.h"
#include "trainstream/status_macros.h"

namespace trainstream::ipc {
namespace {

absl::StatusOr<sockaddr_un> Address(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "socket path '", path, "' must be 1 to ", sizeof(addr.sun_path) - 1, " bytes long"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

}  // namespace

std::string UserSocketPath() {
  if (const char* xdg = std::getenv("XDG_RUNTIME_DIR"); xdg != nullptr && *xdg != '\0') {
    return absl::StrCat(xdg, "/trainstream/trainstreamd.sock");
  }
  return absl::StrCat("/tmp/trainstream-", ::getuid(), "/trainstreamd.sock");
}

std::string DefaultSocketPath() {
  if (const char* env = std::getenv("TRAINSTREAM_SOCKET"); env != nullptr && *env != '\0') {
    return env;
  }
  return ::getuid() == 0 ? SystemSocketPath() : UserSocketPath();
}

std::string DataSocketPath(const std::string& control_socket_path) {
  return control_socket_path + ".data";
}

absl::StatusOr<UniqueFd> ListenUnix(const std::string& path, int type, mode_t mode) {
  ASSIGN_OR_RETURN(sockaddr_un addr, Address(path));
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (!dir.empty() && !std::filesystem::exists(dir)) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) {
      return absl::PermissionDeniedError(
          absl::StrCat("cannot create the socket directory ", dir.string(), ": ", ec.message()));
    }
    // The directory lets through whoever the socket's mode lets in.
    ::chmod(dir.c_str(), 0700 | ((mode & 0070) ? 0050 : 0) | ((mode & 0007) ? 0005 : 0));
  } else if (!dir.empty()) {
    // A directory that was there already must be ours (or root's) and not open to others'
    // writes: another user may have made it to catch our clients.
    RETURN_IF_ERROR(CheckSocketDirectory(path, {::getuid(), 0}));
  }
  if (::access(path.c_str(), F_OK) == 0) {
    absl::StatusOr<UniqueFd> probe = ConnectUnix(path, type);
    if (probe.ok()) {
      return absl::AlreadyExistsError(
          absl::StrCat("another trainstreamd is already serving ", path));
    }
    ::unlink(path.c_str());  // a dead daemon's socket file
  }
  UniqueFd fd(::socket(AF_UNIX, type | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoStatus(errno, "socket");
  // Bind with a restrictive umask so the socket is never briefly open to everyone.
  mode_t old_umask = ::umask(0177);
  int rc = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int bind_errno = errno;
  ::umask(old_umask);
  if (rc != 0) return ErrnoStatus(bind_errno, absl::StrCat("binding ", path));
  if (::chmod(path.c_str(), mode) != 0) return ErrnoStatus(errno, absl::StrCat("chmod ", path));
  if (::listen(fd.get(), 128) != 0) return ErrnoStatus(errno, absl::StrCat("listening on ", path));
  return fd;
}

absl::StatusOr<UniqueFd> ConnectUnix(const std::string& path, int type) {
  ASSIGN_OR_RETURN(sockaddr_un addr, Address(path));
  UniqueFd fd(::socket(AF_UNIX, type | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoStatus(errno, "socket");
  int rc;
  do {
    rc = ::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    int error = errno;
    if (error == ENOENT || error == ECONNREFUSED) {
      return absl::UnavailableError(
          absl::StrCat("no trainstreamd is listening on ", path, " (", std::strerror(error), ")"));
    }
    return ErrnoStatus(error, absl::StrCat("connecting to ", path));
  }
  return fd;
}

}  // namespace trainstream::ipc
