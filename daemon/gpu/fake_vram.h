// SPDX-License-Identifier: Apache-2.0
// A VramApi for tests on machines without a GPU (see gpu_pools_test.cc, base_gpu_pools_test.cc).
#ifndef TRAINSTREAM_DAEMON_GPU_FAKE_VRAM_H_
#define TRAINSTREAM_DAEMON_GPU_FAKE_VRAM_H_

#include <sys/mman.h>
#include <unistd.h>

#include <functional>
#include <string>

#include "absl/strings/str_cat.h"
#include "gpu/vram_api.h"

namespace trainstream::daemon {

// Memory that isn't there: counts what was made and given back. A VMM allocation is a memfd of
// its size (so importers' descriptors and the bytes written into a pool can be checked); a
// legacy one is a string.
class FakeVram : public VramApi {
 public:
  bool fd_handles = true;
  bool legacy = true;
  int live = 0;
  int released = 0;

  absl::Status CheckFdHandles(const std::string& uuid) override {
    if (!fd_handles) {
      return absl::UnimplementedError(
          absl::StrCat(uuid, " does not support POSIX file-descriptor handles"));
    }
    return absl::OkStatus();
  }
  absl::StatusOr<VmmAllocation> CreateExportable(const std::string&, uint64_t bytes) override {
    VmmAllocation a;
    a.handle = 1000 + live;
    a.bytes = (bytes + kGranularity - 1) / kGranularity * kGranularity;
    a.fd = ipc::UniqueFd(::memfd_create("fake-vram", MFD_CLOEXEC));
    if (::ftruncate(a.fd.get(), static_cast<off_t>(a.bytes)) != 0) return absl::InternalError("ftruncate");
    ++live;
    return a;
  }
  void ReleaseExportable(const VmmAllocation&) override {
    --live;
    ++released;
  }
  absl::StatusOr<LegacyAllocation> CreateLegacy(const std::string&, uint64_t bytes) override {
    if (!legacy) return absl::PermissionDeniedError("cudaIpcGetMemHandle: not permitted");
    LegacyAllocation a;
    a.device_pointer = 0x7000000;
    a.bytes = bytes;
    a.handle.fill(0xab);
    legacy_bytes.assign(bytes, '\0');
    ++live;
    return a;
  }
  void ReleaseLegacy(const LegacyAllocation&) override {
    --live;
    ++released;
  }

  absl::Status WriteExportable(const VmmAllocation& allocation,
                               std::span<const HostPiece> pieces) override {
    if (fail_writes) return absl::InternalError("cuMemcpyHtoD failed: out of memory");
    if (during_write) during_write();
    for (const HostPiece& piece : pieces) {
      if (piece.offset + piece.bytes > allocation.bytes) return absl::OutOfRangeError("past the end");
      if (::pwrite(allocation.fd.get(), piece.data, piece.bytes,
                   static_cast<off_t>(piece.offset)) != static_cast<ssize_t>(piece.bytes)) {
        return absl::InternalError("pwrite");
      }
    }
    ++writes;
    return absl::OkStatus();
  }
  absl::Status WriteLegacy(const LegacyAllocation& allocation,
                           std::span<const HostPiece> pieces) override {
    if (fail_writes) return absl::InternalError("cuMemcpyHtoD failed: out of memory");
    for (const HostPiece& piece : pieces) {
      if (piece.offset + piece.bytes > allocation.bytes) return absl::OutOfRangeError("past the end");
      legacy_bytes.replace(piece.offset, piece.bytes, static_cast<const char*>(piece.data),
                           piece.bytes);
    }
    ++writes;
    return absl::OkStatus();
  }

  bool fail_writes = false;
  std::function<void()> during_write;  // runs inside each VMM write, before the copies
  int writes = 0;
  std::string legacy_bytes;  // the last legacy allocation's contents
  static constexpr uint64_t kGranularity = 2 << 20;
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_GPU_FAKE_VRAM_H_
