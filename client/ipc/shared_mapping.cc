// SPDX-License-Identifier: Apache-2.0
#include "ipc/shared_mapping.h"

#include <sys/mman.h>

#include <cerrno>
#include <utility>

#include "trainstream/status_macros.h"

namespace trainstream::ipc {

absl::StatusOr<SharedMapping> SharedMapping::Map(int fd, size_t bytes, bool writable) {
  if (bytes == 0) return absl::InvalidArgumentError("cannot map an empty segment");
  int prot = PROT_READ | (writable ? PROT_WRITE : 0);
  void* p = ::mmap(nullptr, bytes, prot, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    return ErrnoStatus(errno, writable ? "mmap of a segment for writing"
                                       : "mmap of a segment for reading");
  }
  return SharedMapping(static_cast<uint8_t*>(p), bytes, writable);
}

SharedMapping::~SharedMapping() { Unmap(); }

SharedMapping::SharedMapping(SharedMapping&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      writable_(other.writable_) {}

SharedMapping& SharedMapping::operator=(SharedMapping&& other) noexcept {
  if (this != &other) {
    Unmap();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    writable_ = other.writable_;
  }
  return *this;
}

void SharedMapping::Unmap() {
  if (data_ != nullptr) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace trainstream::ipc
