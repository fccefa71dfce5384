// SPDX-License-Identifier: Apache-2.0
// Internal: pinning a mapping for DMA with cudaHostRegister.
#ifndef TRAINSTREAM_CLIENT_SRC_CUDA_HOST_REGISTRATION_H_
#define TRAINSTREAM_CLIENT_SRC_CUDA_HOST_REGISTRATION_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace trainstream::client {

// Registration chunk, when the driver refuses to register a whole mapping at once.
inline constexpr uint64_t kRegistrationChunkBytes = uint64_t{1} << 30;

// A host range registered with CUDA (whole, else chunk by chunk), and unregistered (after the
// device is idle with respect to it) on destruction. Not copyable; not thread-safe.
class CudaHostRegistration {
 public:
  // UNAVAILABLE when built without CUDA or no GPU answers; a failed chunk unregisters the
  // chunks before it and clears CUDA's sticky error.
  static absl::StatusOr<std::unique_ptr<CudaHostRegistration>> Register(void* data,
                                                                         uint64_t bytes,
                                                                         bool read_only);
  ~CudaHostRegistration();
  // The bytes of each registration (the whole range when one call took it): a copy must not
  // cross a multiple of this from the start of the range.
  uint64_t piece_bytes() const { return piece_bytes_; }
  CudaHostRegistration(const CudaHostRegistration&) = delete;
  CudaHostRegistration& operator=(const CudaHostRegistration&) = delete;

 private:
  CudaHostRegistration(void* data, uint64_t bytes, uint64_t piece_bytes)
      : data_(data), bytes_(bytes), piece_bytes_(piece_bytes) {}
  void* data_;
  uint64_t bytes_;
  uint64_t piece_bytes_;
};

// Whether a GPU answers (cached after the first call); `why` says why not.
bool CudaDevicePresent(std::string* why);

}  // namespace trainstream::client

#endif  // TRAINSTREAM_CLIENT_SRC_CUDA_HOST_REGISTRATION_H_
