// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_SHIM_PYTHON_STATUS_EXCEPTIONS_H_
#define TRAINSTREAM_SHIM_PYTHON_STATUS_EXCEPTIONS_H_

#include "absl/status/statusor.h"

namespace trainstream::python {

// Raises the Python exception for `status` (a subclass of trainstream.TrainStreamError chosen
// by its code, defined in trainstream/errors.py). The one place codes become exceptions.
[[noreturn]] void ThrowStatus(const absl::Status& status);

template <typename T>
T ValueOrThrow(absl::StatusOr<T> value) {
  if (!value.ok()) ThrowStatus(value.status());
  return *std::move(value);
}

inline void OkOrThrow(const absl::Status& status) {
  if (!status.ok()) ThrowStatus(status);
}

}  // namespace trainstream::python

#endif  // TRAINSTREAM_SHIM_PYTHON_STATUS_EXCEPTIONS_H_
