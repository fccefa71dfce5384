// SPDX-License-Identifier: Apache-2.0
// The parts of the module `_trainstream`, one per concern; module.cc calls each once.
#ifndef TRAINSTREAM_SHIM_PYTHON_BINDINGS_H_
#define TRAINSTREAM_SHIM_PYTHON_BINDINGS_H_

#include <pybind11/pybind11.h>

namespace trainstream::python {

// The reply structs (include/trainstream/replies.h), before any function that returns one.
void BindReplies(pybind11::module_& m);
// The kernels on raw pointers: AdamW (host reference and GPU), the quantizer and
// dequantizers, the causal-LM cross-entropy.
void BindKernels(pybind11::module_& m);
// Host<->device copies by pointer pieces, and what CUDA this process has.
void BindTransfers(pybind11::module_& m);
// Finding and opening the daemon: Session, its HostBuffers and GpuPoolMappings.
void BindSession(pybind11::module_& m);
// A job's optimizer in the daemon (HostOptimizer) and its host-memory estimate.
void BindHostOptimizer(pybind11::module_& m);

}  // namespace trainstream::python

#endif  // TRAINSTREAM_SHIM_PYTHON_BINDINGS_H_
