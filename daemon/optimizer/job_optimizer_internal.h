// SPDX-License-Identifier: Apache-2.0
// What JobOptimizer's source files (job_optimizer*.cc) share; nothing else includes it.
#ifndef TRAINSTREAM_DAEMON_OPTIMIZER_JOB_OPTIMIZER_INTERNAL_H_
#define TRAINSTREAM_DAEMON_OPTIMIZER_JOB_OPTIMIZER_INTERNAL_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "cpu/adamw.h"
#include "ipc/doorbell_ring.h"

namespace trainstream::daemon::job_optimizer_internal {

// A tensor's accumulate, statistics and update passes go to the pool in chunks of this many
// elements (unless the job asks for another size), so one large tensor spreads over every
// worker.
inline constexpr size_t kDefaultChunkElements = size_t{1} << 18;  // ~7 MB of traffic per task

inline size_t Chunks(uint64_t numel, size_t chunk) { return (numel + chunk - 1) / chunk; }

inline ipc::DoorbellMessage Message(ipc::DoorbellKind kind, uint64_t id, uint64_t step,
                                    uint64_t value = 0, uint32_t flags = 0) {
  return {static_cast<uint32_t>(kind), flags, id, step, value};
}

// The memory this process may still take, in bytes (0 when unreadable): the machine's
// (MemTotal, MemAvailable), or less where its cgroup or one above it has a limit (v2's
// memory.max, v1's limit_in_bytes: a container's, a slice's or the service's MemoryMax), which
// the kernel enforces by killing the process. `root` prefixes /proc and /sys (a test's
// directory).
struct HostMemory {
  uint64_t total = 0;
  uint64_t available = 0;
};
HostMemory ReadHostMemory(const std::string& root = "");

// The bytes a tensor's copy aside takes: its master, both moments and its parameter slot.
uint64_t CopyAsideBytes(const kernels::AdamWTensor& tensor);
// Elements [begin, end) of the tensor's state into `backup` (or, `restore`, back from it).
// Disjoint ranges may run on different threads.
void CopyAside(const kernels::AdamWTensor& tensor, std::byte* backup, size_t begin, size_t end,
               bool restore);

}  // namespace trainstream::daemon::job_optimizer_internal

#endif  // TRAINSTREAM_DAEMON_OPTIMIZER_JOB_OPTIMIZER_INTERNAL_H_
