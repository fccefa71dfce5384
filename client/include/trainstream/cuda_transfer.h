// SPDX-License-Identifier: Apache-2.0
// Host<->device copies between daemon buffers and device memory on a caller's CUDA stream.
#ifndef TRAINSTREAM_CUDA_TRANSFER_H_
#define TRAINSTREAM_CUDA_TRANSFER_H_

#include <cstdint>
#include <string>
#include <vector>

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

// One piece of a CopyPieces batch: `bytes` from `src` to `dst`, either of them pinned host
// memory (registered or allocated pinned) and the other device memory.
struct CopyPiece {
  void* dst;
  const void* src;
  uint64_t bytes;
};

// Enqueues every piece on `stream` in order, the direction told by the addresses: one call for
// a block's weights or activations, where torch would dispatch each tensor's copy on its own.
// The memory must stay valid until the copies have run on `stream`; nothing tells an allocator
// so (torch's pinned-memory pool would hand a freed buffer out again before the copy ran). A
// failure leaves the pieces before it enqueued.
absl::Status CopyPieces(const std::vector<CopyPiece>& pieces, void* stream);

}  // namespace trainstream::client

#endif  // TRAINSTREAM_CUDA_TRANSFER_H_
