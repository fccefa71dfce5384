// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_IPC_SHARED_MAPPING_H_
#define TRAINSTREAM_IPC_SHARED_MAPPING_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace trainstream::ipc {

// A MAP_SHARED mapping of a whole file (a memfd segment), unmapped on destruction. Move-only.
// The bytes may be read and written from any thread; the object itself is not thread-safe.
class SharedMapping {
 public:
  // Maps `bytes` of `fd` from offset 0, read-only or read-write. Fails with the errno's
  // message (a sealed segment refuses a writable mapping with PERMISSION_DENIED).
  static absl::StatusOr<SharedMapping> Map(int fd, size_t bytes, bool writable);

  SharedMapping() = default;
  ~SharedMapping();
  SharedMapping(SharedMapping&& other) noexcept;
  SharedMapping& operator=(SharedMapping&& other) noexcept;
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool writable() const { return writable_; }

 private:
  SharedMapping(uint8_t* data, size_t size, bool writable)
      : data_(data), size_(size), writable_(writable) {}
  void Unmap();

  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  bool writable_ = false;
};

}  // namespace trainstream::ipc

#endif  // TRAINSTREAM_IPC_SHARED_MAPPING_H_
