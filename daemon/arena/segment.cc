// SPDX-License-Identifier: Apache-2.0
#include "arena/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_format.h"
#include "trainstream/status_macros.h"

namespace trainstream::daemon {

absl::StatusOr<std::unique_ptr<Segment>> Segment::Create(uint64_t id, uint64_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("a segment needs at least one byte");
  ipc::UniqueFd fd(::memfd_create("trainstream-segment", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return ErrnoStatus(errno, "memfd_create");
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    return ErrnoStatus(errno, "sizing a segment");
  }
  if (int rc = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(bytes)); rc != 0) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "could not reserve %d MiB of host memory for a segment (%s); the machine, its "
        "tmpfs or this service's memory cgroup is short",
        bytes >> 20, std::strerror(rc)));
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    return ErrnoStatus(errno, "sealing a segment's size");
  }
  ASSIGN_OR_RETURN(ipc::SharedMapping mapping,
                   ipc::SharedMapping::Map(fd.get(), bytes, /*writable=*/true));
  // Large transfers to and from these pages are DMA; huge pages cut the page-table walks.
  ::madvise(mapping.data(), bytes, MADV_HUGEPAGE);
  return std::unique_ptr<Segment>(new Segment(id, bytes, std::move(fd), std::move(mapping)));
}

absl::Status Segment::Seal() {
  if (sealed_) return absl::OkStatus();
  // The kernel refuses F_SEAL_WRITE while any writable shared mapping exists, ours included.
  mapping_ = ipc::SharedMapping();
  if (::fcntl(fd_.get(), F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SEAL) != 0) {
    int error = errno;
    ASSIGN_OR_RETURN(mapping_, ipc::SharedMapping::Map(fd_.get(), bytes_, /*writable=*/true));
    if (error == EBUSY) {
      return absl::FailedPreconditionError(
          "the buffer is still mapped writable by a process; unmap it before sealing");
    }
    return ErrnoStatus(error, "sealing a segment read-only");
  }
  sealed_ = true;
  ASSIGN_OR_RETURN(mapping_, ipc::SharedMapping::Map(fd_.get(), bytes_, /*writable=*/false));
  return absl::OkStatus();
}

}  // namespace trainstream::daemon
