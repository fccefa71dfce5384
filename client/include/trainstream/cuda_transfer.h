// SPDX-License-Identifier: Apache-2.0
// Host<->device copies between daemon buffers and device memory on a caller's CUDA stream.
#ifndef TRAINSTREAM_CUDA_TRANSFER_H_
#define TRAINSTREAM_CUDA_TRANSFER_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "trainstream/client.h"

namespace trainstream::client {

// Whether this library was built with CUDA and a GPU answers; `why` says why not.
bool CudaAvailable(std::string* why = nullptr);

// Asynchronous copies on `stream` (a cudaStream_t; 0 is the legacy default stream). The range
// [offset, offset + bytes) must lie inside the buffer (INVALID_ARGUMENT otherwise). Copies are
// split at the segment's registration chunks so each piece stays a DMA transfer. The buffer
// must outlive the copy: synchronise the stream or wait on an event first.
absl::Status CopyToDevice(const HostBuffer& buffer, uint64_t offset, void* device_dst,
                          uint64_t bytes, void* stream);
absl::Status CopyToHost(const HostBuffer& buffer, uint64_t offset, const void* device_src,
                        uint64_t bytes, void* stream);

}  // namespace trainstream::client

#endif  // TRAINSTREAM_CUDA_TRANSFER_H_
