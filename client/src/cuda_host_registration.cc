// SPDX-License-Identifier: Apache-2.0
#include "cuda_host_registration.h"

#include <algorithm>
#include <mutex>

#include "absl/strings/str_cat.h"

#ifdef TRAINSTREAM_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace trainstream::client {

bool CudaDevicePresent(std::string* why) {
#ifdef TRAINSTREAM_HAVE_CUDA
  static std::once_flag once;
  static bool present = false;
  static std::string reason;
  std::call_once(once, [] {
    int count = 0;
    cudaError_t rc = cudaGetDeviceCount(&count);
    if (rc != cudaSuccess) {
      reason = absl::StrCat("no usable GPU: ", cudaGetErrorString(rc));
      cudaGetLastError();
    } else if (count == 0) {
      reason = "no GPU found";
    } else {
      present = true;
    }
  });
  if (why != nullptr) *why = reason;
  return present;
#else
  if (why != nullptr) *why = "this build of trainstream has no CUDA support";
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<CudaHostRegistration>> CudaHostRegistration::Register(
    void* data, uint64_t bytes, bool read_only) {
  std::string why;
  if (!CudaDevicePresent(&why)) return absl::UnavailableError(why);
#ifdef TRAINSTREAM_HAVE_CUDA
  // Mapped: kernels may read and write the memory in place over PCIe (kernels/cuda/
  // adamw_mapped.cu); under unified addressing the host pointer is the device's too.
  unsigned int flags = cudaHostRegisterPortable | cudaHostRegisterMapped |
                       (read_only ? cudaHostRegisterReadOnly : 0);
  // One registration for the whole mapping: CUDA treats each registration as an allocation of
  // its own, and a copy whose range spans two of them fails (cudaErrorInvalidValue), so a tensor
  // anywhere in the mapping must sit inside one. Only when the driver refuses one that large is
  // the mapping registered chunk by chunk (copies then go piece by piece: see cuda_transfer.cc).
  if (cudaHostRegister(data, bytes, flags) == cudaSuccess) {
    return std::unique_ptr<CudaHostRegistration>(new CudaHostRegistration(data, bytes, bytes));
  }
  cudaGetLastError();
  for (uint64_t done = 0; done < bytes; done += kRegistrationChunkBytes) {
    uint64_t chunk = std::min(kRegistrationChunkBytes, bytes - done);
    cudaError_t rc = cudaHostRegister(static_cast<uint8_t*>(data) + done, chunk, flags);
    if (rc != cudaSuccess) {
      std::string message = cudaGetErrorString(rc);
      cudaGetLastError();
      for (uint64_t undo = 0; undo < done; undo += kRegistrationChunkBytes) {
        cudaHostUnregister(static_cast<uint8_t*>(data) + undo);
      }
      return absl::ResourceExhaustedError(absl::StrCat(
          "cudaHostRegister of ", chunk >> 20, " MiB at offset ", done >> 20,
          " MiB failed: ", message, " (is LimitMEMLOCK/ulimit -l high enough?)"));
    }
  }
  return std::unique_ptr<CudaHostRegistration>(
      new CudaHostRegistration(data, bytes, std::min(bytes, kRegistrationChunkBytes)));
#else
  return absl::UnavailableError(why);
#endif
}

CudaHostRegistration::~CudaHostRegistration() {
#ifdef TRAINSTREAM_HAVE_CUDA
  // Unregistering memory a copy still reads would corrupt it: wait for the device first.
  cudaDeviceSynchronize();
  for (uint64_t done = 0; done < bytes_; done += piece_bytes_) {
    cudaHostUnregister(static_cast<uint8_t*>(data_) + done);
  }
  cudaGetLastError();
#endif
}

}  // namespace trainstream::client
