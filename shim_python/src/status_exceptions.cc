// SPDX-License-Identifier: Apache-2.0
#include "status_exceptions.h"

#include <pybind11/pybind11.h>

#include <string>

namespace trainstream::python {

void ThrowStatus(const absl::Status& status) {
  pybind11::gil_scoped_acquire gil;
  pybind11::module_ errors = pybind11::module_::import("trainstream.errors");
  pybind11::object cls = errors.attr("exception_for_code")(static_cast<int>(status.code()));
  PyErr_SetString(cls.ptr(), std::string(status.message()).c_str());
  throw pybind11::error_already_set();
}

}  // namespace trainstream::python
