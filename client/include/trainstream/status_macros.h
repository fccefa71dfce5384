// SPDX-License-Identifier: Apache-2.0
// Propagation macros for absl::Status / absl::StatusOr. Debian's Abseil (20220623) predates
// absl/status/status_macros.h, so these are the project's one spelling of them.
#ifndef TRAINSTREAM_STATUS_MACROS_H_
#define TRAINSTREAM_STATUS_MACROS_H_

#include <cerrno>
#include <cstring>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define TS_CONCAT_INNER_(a, b) a##b
#define TS_CONCAT_(a, b) TS_CONCAT_INNER_(a, b)

// Returns the status from the enclosing function when `expr` is not OK.
#define RETURN_IF_ERROR(expr)                              \
  do {                                                     \
    ::absl::Status ts_status_ = (expr);                    \
    if (!ts_status_.ok()) return ts_status_;               \
  } while (0)

// `lhs = value of rexpr`, or returns its status from the enclosing function.
#define ASSIGN_OR_RETURN(lhs, rexpr) \
  ASSIGN_OR_RETURN_IMPL_(TS_CONCAT_(ts_statusor_, __LINE__), lhs, rexpr)
#define ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                           \
  if (!statusor.ok()) return statusor.status();      \
  lhs = std::move(statusor).value()

namespace trainstream {

// An error status for a failed system call: "context: strerror(errno)", with a canonical code
// chosen from errno so that, e.g., ENOMEM reads as RESOURCE_EXHAUSTED over the wire.
absl::Status ErrnoStatus(int error_number, absl::string_view context);

}  // namespace trainstream

#endif  // TRAINSTREAM_STATUS_MACROS_H_
