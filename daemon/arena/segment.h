// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_ARENA_SEGMENT_H_
#define TRAINSTREAM_DAEMON_ARENA_SEGMENT_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "ipc/shared_mapping.h"
#include "ipc/unique_fd.h"

namespace trainstream::daemon {

// One shared-memory segment: an anonymous memfd whose pages are reserved up front (fallocate),
// so that a shortfall of RAM, tmpfs or cgroup memory fails here with RESOURCE_EXHAUSTED instead
// of as SIGBUS at first touch. Its size is sealed at creation (a client holding the fd cannot
// shrink it under the daemon's mapping); Seal() makes it read-only for every process.
// Not thread-safe: the Arena serialises access.
class Segment {
 public:
  static absl::StatusOr<std::unique_ptr<Segment>> Create(uint64_t id, uint64_t bytes);

  uint64_t id() const { return id_; }
  uint64_t bytes() const { return bytes_; }
  int fd() const { return fd_.get(); }
  bool sealed() const { return sealed_; }
  // The daemon's own mapping (read-write until sealed, read-only after).
  uint8_t* data() const { return mapping_.data(); }

  // Forbids writes through any mapping or descriptor, now and later. FAILED_PRECONDITION while
  // any process still holds a writable mapping of it.
  absl::Status Seal();

 private:
  Segment(uint64_t id, uint64_t bytes, ipc::UniqueFd fd, ipc::SharedMapping mapping)
      : id_(id), bytes_(bytes), fd_(std::move(fd)), mapping_(std::move(mapping)) {}

  uint64_t id_;
  uint64_t bytes_;
  ipc::UniqueFd fd_;
  ipc::SharedMapping mapping_;
  bool sealed_ = false;
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_ARENA_SEGMENT_H_
