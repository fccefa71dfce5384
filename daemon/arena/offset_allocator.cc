// SPDX-License-Identifier: Apache-2.0
#include "arena/offset_allocator.h"

#include <iterator>

namespace trainstream::daemon {

OffsetAllocator::OffsetAllocator(uint64_t capacity) : capacity_(capacity), free_bytes_(capacity) {
  if (capacity > 0) free_[0] = capacity;
}

std::optional<uint64_t> OffsetAllocator::Allocate(uint64_t bytes, uint64_t alignment) {
  if (bytes == 0 || bytes > free_bytes_) return std::nullopt;
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    const uint64_t start = it->first;
    const uint64_t end = start + it->second;
    const uint64_t aligned = (start + alignment - 1) & ~(alignment - 1);
    if (aligned < start || aligned > end || end - aligned < bytes) continue;
    free_.erase(it);
    if (aligned > start) free_[start] = aligned - start;
    if (aligned + bytes < end) free_[aligned + bytes] = end - (aligned + bytes);
    free_bytes_ -= bytes;
    return aligned;
  }
  return std::nullopt;
}

void OffsetAllocator::Release(uint64_t offset, uint64_t bytes) {
  auto [it, inserted] = free_.emplace(offset, bytes);
  free_bytes_ += bytes;
  auto next = std::next(it);
  if (next != free_.end() && it->first + it->second == next->first) {
    it->second += next->second;
    free_.erase(next);
  }
  if (it != free_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      free_.erase(it);
    }
  }
}

}  // namespace trainstream::daemon
