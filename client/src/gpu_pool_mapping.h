// SPDX-License-Identifier: Apache-2.0
// Internal: a daemon GPU pool mapped into this process (see GpuPoolMapping in client.h).
#ifndef TRAINSTREAM_CLIENT_SRC_GPU_POOL_MAPPING_H_
#define TRAINSTREAM_CLIENT_SRC_GPU_POOL_MAPPING_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "ipc/unique_fd.h"
#include "trainstream/client.h"

namespace trainstream::client {

// Maps a pool on CUDA device `device`: a VMM allocation from its shareable descriptor
// (`fd`), or a legacy IPC handle. Frozen data: read-only where the driver allows it.
absl::StatusOr<std::unique_ptr<GpuPoolMapping>> MapVmmPool(uint64_t pool_id, int device,
                                                           ipc::UniqueFd fd, uint64_t bytes);
absl::StatusOr<std::unique_ptr<GpuPoolMapping>> MapLegacyPool(
    uint64_t pool_id, int device, const std::array<uint8_t, 64>& handle, uint64_t bytes);

}  // namespace trainstream::client

#endif  // TRAINSTREAM_CLIENT_SRC_GPU_POOL_MAPPING_H_
