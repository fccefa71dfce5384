// SPDX-License-Identifier: Apache-2.0
// Internal: a CUDA runtime result as an absl::Status (CUDA builds only).
#ifndef TRAINSTREAM_CLIENT_SRC_CUDA_STATUS_H_
#define TRAINSTREAM_CLIENT_SRC_CUDA_STATUS_H_

#ifdef TRAINSTREAM_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace trainstream::client {

// INTERNAL naming `what` and CUDA's reason unless `rc` is cudaSuccess. A non-sticky error is
// cleared, so the next call is not blamed for it.
inline absl::Status CudaStatus(cudaError_t rc, const char* what) {
  if (rc == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrFormat("%s failed: %s", what, cudaGetErrorString(rc)));
}

}  // namespace trainstream::client

#endif  // TRAINSTREAM_HAVE_CUDA
#endif  // TRAINSTREAM_CLIENT_SRC_CUDA_STATUS_H_
