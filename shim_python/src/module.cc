// SPDX-License-Identifier: Apache-2.0
// trainstream._trainstream: the client library for Python, bound one concern a file
// (bindings.h). Blocking calls release the GIL.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "trainstream/version.h"

PYBIND11_MODULE(_trainstream, m) {
  m.doc() = "trainstream client library (C++), used by the trainstream package";
  m.attr("__version__") = trainstream::kTrainStreamVersion;
  namespace tp = trainstream::python;
  tp::BindReplies(m);
  tp::BindKernels(m);
  tp::BindTransfers(m);
  tp::BindSession(m);
  tp::BindHostOptimizer(m);
}
