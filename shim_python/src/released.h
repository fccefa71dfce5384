// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_SHIM_PYTHON_RELEASED_H_
#define TRAINSTREAM_SHIM_PYTHON_RELEASED_H_

#include <pybind11/pybind11.h>

#include <optional>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "status_exceptions.h"

namespace trainstream::python {

// Runs `fn` without the GIL and raises its status as a Python exception.
template <typename Fn>
auto Released(Fn&& fn) {
  using Result = decltype(fn());
  std::optional<Result> result;
  {
    pybind11::gil_scoped_release release;
    result.emplace(fn());
  }
  if constexpr (std::is_same_v<Result, absl::Status>) {
    OkOrThrow(*result);
  } else {
    return ValueOrThrow(std::move(*result));
  }
}

}  // namespace trainstream::python

#endif  // TRAINSTREAM_SHIM_PYTHON_RELEASED_H_
