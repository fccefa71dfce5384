// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_ARENA_OFFSET_ALLOCATOR_H_
#define TRAINSTREAM_DAEMON_ARENA_OFFSET_ALLOCATOR_H_

#include <cstdint>
#include <map>
#include <optional>

namespace trainstream::daemon {

// First-fit allocation of aligned ranges within [0, capacity), with neighbouring free ranges
// merged on release. Its bookkeeping lives in the daemon's private memory, never inside the
// segment, where a client could rewrite it. Not thread-safe.
class OffsetAllocator {
 public:
  explicit OffsetAllocator(uint64_t capacity);

  // The offset of a free range of `bytes` aligned to `alignment` (a power of two), or nullopt.
  std::optional<uint64_t> Allocate(uint64_t bytes, uint64_t alignment);
  // Returns [offset, offset + bytes) to the free list. The range must come from Allocate().
  void Release(uint64_t offset, uint64_t bytes);

  uint64_t capacity() const { return capacity_; }
  uint64_t free_bytes() const { return free_bytes_; }
  bool empty() const { return free_bytes_ == capacity_; }

 private:
  uint64_t capacity_;
  uint64_t free_bytes_;
  std::map<uint64_t, uint64_t> free_;  // offset -> length
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_ARENA_OFFSET_ALLOCATOR_H_
