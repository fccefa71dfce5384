// SPDX-License-Identifier: Apache-2.0
#include "trainstream/cuda_transfer.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "cuda_host_registration.h"
#include "mapped_segment.h"

#ifdef TRAINSTREAM_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "cuda_status.h"
#endif

namespace trainstream::client {
namespace {

absl::Status CheckRange(const HostBuffer& buffer, uint64_t offset, uint64_t bytes) {
  if (offset > buffer.size() || bytes > buffer.size() - offset) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "copy of %d bytes at offset %d runs past the end of buffer '%s' (%d bytes)", bytes,
        offset, buffer.info().name, buffer.size()));
  }
  return absl::OkStatus();
}

// Copies [offset, offset + bytes) of the buffer, never across two registrations of its segment
// (a copy spanning two fails), so that every piece is a pinned (DMA) transfer.
absl::Status ChunkedCopy(const HostBuffer& buffer, uint64_t offset, void* device, uint64_t bytes,
                         void* stream, bool to_device) {
  if (!buffer.cuda_registered()) {
    std::string why;
    CudaDevicePresent(&why);
    return absl::FailedPreconditionError(absl::StrFormat(
        "buffer '%s' is not registered with CUDA (%s)", buffer.info().name,
        why.empty() ? "the session was opened with register_with_cuda off" : why));
  }
#ifdef TRAINSTREAM_HAVE_CUDA
  const uint64_t segment_offset = buffer.info().offset + offset;
  const uint64_t piece_bytes = buffer.segment()->registration_piece_bytes();
  uint64_t done = 0;
  while (done < bytes) {
    uint64_t at = segment_offset + done;
    uint64_t chunk_end = (at / piece_bytes + 1) * piece_bytes;
    uint64_t piece = std::min(bytes - done, chunk_end - at);
    uint8_t* host = buffer.segment()->data() + at;
    uint8_t* dev = static_cast<uint8_t*>(device) + done;
    cudaError_t rc =
        to_device ? cudaMemcpyAsync(dev, host, piece, cudaMemcpyHostToDevice,
                                    static_cast<cudaStream_t>(stream))
                  : cudaMemcpyAsync(host, dev, piece, cudaMemcpyDeviceToHost,
                                    static_cast<cudaStream_t>(stream));
    if (rc != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError(absl::StrFormat("cudaMemcpyAsync for buffer '%s' failed: %s",
                                                 buffer.info().name, cudaGetErrorString(rc)));
    }
    done += piece;
  }
  return absl::OkStatus();
#else
  return absl::UnavailableError("this build of trainstream has no CUDA support");
#endif
}

}  // namespace

bool CudaAvailable(std::string* why) { return CudaDevicePresent(why); }

absl::Status CopyToDevice(const HostBuffer& buffer, uint64_t offset, void* device_dst,
                          uint64_t bytes, void* stream) {
  absl::Status range = CheckRange(buffer, offset, bytes);
  if (!range.ok()) return range;
  return ChunkedCopy(buffer, offset, device_dst, bytes, stream, /*to_device=*/true);
}

absl::Status CopyToHost(const HostBuffer& buffer, uint64_t offset, const void* device_src,
                        uint64_t bytes, void* stream) {
  absl::Status range = CheckRange(buffer, offset, bytes);
  if (!range.ok()) return range;
  if (!buffer.writable()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("buffer '%s' is sealed read-only", buffer.info().name));
  }
  return ChunkedCopy(buffer, offset, const_cast<void*>(device_src), bytes, stream,
                     /*to_device=*/false);
}

absl::Status CopyPieces(const std::vector<CopyPiece>& pieces, void* stream) {
#ifdef TRAINSTREAM_HAVE_CUDA
  for (size_t i = 0; i < pieces.size(); ++i) {
    const CopyPiece& p = pieces[i];
    const cudaError_t rc =
        cudaMemcpyAsync(p.dst, p.src, p.bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream));
    if (rc != cudaSuccess) {  // the message is built only on failure: this is a hot path
      const std::string what = absl::StrFormat("cudaMemcpyAsync of piece %d of %d (%d bytes)", i,
                                               pieces.size(), p.bytes);
      return CudaStatus(rc, what.c_str());
    }
  }
  return absl::OkStatus();
#else
  if (pieces.empty()) return absl::OkStatus();
  return absl::UnavailableError("this build of trainstream has no CUDA support");
#endif
}

}  // namespace trainstream::client
