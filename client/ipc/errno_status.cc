// SPDX-License-Identifier: Apache-2.0
#include <cerrno>
#include <cstring>

#include "trainstream/status_macros.h"

namespace trainstream {

absl::Status ErrnoStatus(int error_number, absl::string_view context) {
  std::string message = absl::StrCat(context, ": ", std::strerror(error_number));
  switch (error_number) {
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE:
    case EDQUOT:
    case EFBIG:
      return absl::ResourceExhaustedError(message);
    // What is wrong with a path the caller named (a checkpoint's, a base's): the caller's to fix,
    // not an internal error.
    case ENOTDIR:
    case EISDIR:
    case ENAMETOOLONG:
    case ELOOP:
      return absl::InvalidArgumentError(message);
    case EEXIST:
      return absl::AlreadyExistsError(message);
    case EROFS:
    case EXDEV:
    case ETXTBSY:
      return absl::FailedPreconditionError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case ENOENT:
      return absl::NotFoundError(message);
    case EINVAL:
      return absl::InvalidArgumentError(message);
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace trainstream
