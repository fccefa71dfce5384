// SPDX-License-Identifier: Apache-2.0
// The CUDA calls that make VRAM shareable with other processes, behind an interface: the
// driver's implementation on machines with a GPU, and test doubles that refuse one way or the
// other so that the fallbacks are exercised without a GPU.
#ifndef TRAINSTREAM_DAEMON_GPU_VRAM_API_H_
#define TRAINSTREAM_DAEMON_GPU_VRAM_API_H_

#include <array>
#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ipc/unique_fd.h"

namespace trainstream::daemon {

// Physical VRAM made with the virtual-memory API (cuMemCreate), exportable as a file
// descriptor (cuMemExportToShareableHandle) that the data socket passes with SCM_RIGHTS.
struct VmmAllocation {
  std::string uuid;      // the GPU it is on
  uint64_t handle = 0;   // the driver's CUmemGenericAllocationHandle
  uint64_t bytes = 0;    // rounded up to the granularity
  ipc::UniqueFd fd;      // the shareable handle
};

// VRAM from cudaMalloc with its legacy IPC handle: the handle covers the whole allocation and
// is valid only while the exporter keeps it.
struct LegacyAllocation {
  std::string uuid;      // the GPU it is on
  uint64_t device_pointer = 0;
  uint64_t bytes = 0;
  std::array<uint8_t, 64> handle{};  // cudaIpcMemHandle_t
};

// Host bytes to copy into a pool, at `offset` from its start.
struct HostPiece {
  uint64_t offset = 0;
  const void* data = nullptr;
  uint64_t bytes = 0;
};

class VramApi {
 public:
  virtual ~VramApi() = default;
  // OK when `uuid`'s memory can be made with file-descriptor handles; the reason otherwise.
  virtual absl::Status CheckFdHandles(const std::string& uuid) = 0;
  virtual absl::StatusOr<VmmAllocation> CreateExportable(const std::string& uuid,
                                                         uint64_t bytes) = 0;
  virtual void ReleaseExportable(const VmmAllocation& allocation) = 0;
  virtual absl::StatusOr<LegacyAllocation> CreateLegacy(const std::string& uuid,
                                                        uint64_t bytes) = 0;
  virtual void ReleaseLegacy(const LegacyAllocation& allocation) = 0;
  // Copies `pieces` from host memory into the allocation (the daemon fills a pool this way
  // before any importer reads it).
  virtual absl::Status WriteExportable(const VmmAllocation& allocation,
                                       std::span<const HostPiece> pieces) = 0;
  virtual absl::Status WriteLegacy(const LegacyAllocation& allocation,
                                   std::span<const HostPiece> pieces) = 0;
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_GPU_VRAM_API_H_
