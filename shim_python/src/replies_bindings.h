// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_PYTHON_REPLIES_BINDINGS_H_
#define TRAINSTREAM_PYTHON_REPLIES_BINDINGS_H_

#include <pybind11/pybind11.h>

namespace trainstream::python {

// Binds the reply structs into `m` (before any function that returns one).
void BindReplies(pybind11::module_& m);

}  // namespace trainstream::python

#endif  // TRAINSTREAM_PYTHON_REPLIES_BINDINGS_H_
