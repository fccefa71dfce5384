// SPDX-License-Identifier: Apache-2.0
// Copies between host and device memory by pointers, and the CUDA this process can use.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "released.h"
#include "trainstream/cuda_transfer.h"

namespace trainstream::python {

namespace py = pybind11;

void BindTransfers(py::module_& m) {
  // Host<->device copies of (dst, src, bytes) pointer pieces, queued on `stream` in one call.
  using Piece = std::tuple<uintptr_t, uintptr_t, uint64_t>;
  m.def("copy_pieces", [](uintptr_t stream, const std::vector<Piece>& pieces) {
    std::vector<trainstream::client::CopyPiece> batch;
    batch.reserve(pieces.size());
    for (const auto& [dst, src, bytes] : pieces) {
      batch.push_back({reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes});
    }
    Released(
        [&] { return trainstream::client::CopyPieces(batch, reinterpret_cast<void*>(stream)); });
  });
  m.def("cuda_available", [] {
    std::string why;
    bool ok = trainstream::client::CudaAvailable(&why);
    return py::make_tuple(ok, why);
  });
  m.def("cuda_device_uuid", [](int device) {
    return Released([&] { return trainstream::client::CudaDeviceUuid(device); });
  });
}

}  // namespace trainstream::python
