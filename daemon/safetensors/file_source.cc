// SPDX-License-Identifier: Apache-2.0
#include "safetensors/file_source.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace trainstream::daemon {
namespace {

class FilesystemSource final : public FileSource {
 public:
  absl::StatusOr<ipc::UniqueFd> OpenForReading(const std::string& path,
                                               uint64_t* bytes) const override {
    // Non-blocking: opening a FIFO does not wait for a writer; it is then refused below.
    ipc::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
    if (!fd.valid()) {
      const int err = errno;
      const std::string why = absl::StrFormat("cannot open %s: %s", path, std::strerror(err));
      if (err == ENOENT) return absl::NotFoundError(why);
      if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(why);
      return absl::InternalError(why);
    }
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) {
      return absl::InternalError(absl::StrFormat("stat %s: %s", path, std::strerror(errno)));
    }
    if (!S_ISREG(st.st_mode)) {
      return absl::InvalidArgumentError(absl::StrFormat("%s is not a regular file", path));
    }
    *bytes = static_cast<uint64_t>(st.st_size);
    // Tensors are read front to back: a longer readahead keeps the disk busy. Only a hint.
    ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
    return fd;
  }

  bool IsDirectory(const std::string& path) const override {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
  }

  bool Exists(const std::string& path) const override {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0;
  }

  absl::StatusOr<std::string> RealPath(const std::string& path) const override {
    char resolved[PATH_MAX];
    if (::realpath(path.c_str(), resolved) == nullptr) {
      const int err = errno;
      const std::string why = absl::StrFormat("%s: %s", path, std::strerror(err));
      if (err == EACCES) return absl::PermissionDeniedError(why);
      return absl::NotFoundError(why);
    }
    return std::string(resolved);
  }
};

}  // namespace

const FileSource& Filesystem() {
  static const FilesystemSource* const source = new FilesystemSource();
  return *source;
}

}  // namespace trainstream::daemon
