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
      return absl::ResourceExhaustedError(message);
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
