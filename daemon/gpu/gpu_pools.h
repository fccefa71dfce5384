// SPDX-License-Identifier: Apache-2.0
// The daemon's VRAM pools: memory it holds on a GPU (named by UUID) and lends to its user's
// processes, which import it (a VMM file descriptor, or a legacy IPC handle where the
// virtual-memory API can't export) and map it. A pool lives until its owner frees it or ends
// and no importer is left; an importer that ends releases its imports.
#ifndef TRAINSTREAM_DAEMON_GPU_GPU_POOLS_H_
#define TRAINSTREAM_DAEMON_GPU_GPU_POOLS_H_

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "events/event_log.h"
#include "gpu/vram_api.h"
#include "ipc/unique_fd.h"

namespace trainstream::daemon {

enum class PoolKind { kVmm, kLegacyIpc };
const char* PoolKindName(PoolKind kind);

// What an importer is given.
struct PoolImport {
  uint64_t pool_id = 0;
  std::string uuid;
  uint64_t bytes = 0;
  PoolKind kind = PoolKind::kVmm;
  ipc::UniqueFd fd;                       // kVmm: a descriptor of its own, to pass on
  std::array<uint8_t, 64> legacy_handle{};  // kLegacyIpc
};

struct PoolSummary {
  uint64_t id = 0;
  std::string uuid;
  uint64_t bytes = 0;
  PoolKind kind = PoolKind::kVmm;
  std::string purpose;            // what it holds, for a person ("base 3: qwen2.5-14b nf4")
  uint64_t base_id = 0;           // the base it holds, if it holds one
  std::vector<uint64_t> buffer_offsets;  // where each of that base's buffers starts
  double fill_seconds = 0;        // Write()'s copies from host memory
  uid_t uid = 0;
  std::string owner_session;      // empty once the owner has ended or freed it
  std::vector<std::string> importers;
};

class GpuPools {
 public:
  // `legacy_only`: every pool is exported with legacy IPC (the daemon's --gpu_pool_export).
  GpuPools(VramApi& api, EventLog& events, bool legacy_only = false)
      : api_(api), events_(events), legacy_only_(legacy_only) {}
  GpuPools(const GpuPools&) = delete;
  GpuPools& operator=(const GpuPools&) = delete;
  ~GpuPools();

  // A pool of `bytes` on GPU `uuid` for `session` (of `uid`): the virtual-memory API first,
  // legacy IPC where it can't export (an event says why and what it costs), FAILED_PRECONDITION
  // naming both reasons where neither can.
  absl::StatusOr<PoolSummary> Create(const std::string& session, uid_t uid,
                                     const std::string& uuid, uint64_t bytes,
                                     const std::string& purpose);
  // Records what pool `id` holds (for List and the importers).
  absl::Status Describe(uint64_t id, uint64_t base_id, std::vector<uint64_t> buffer_offsets);
  // Fills pool `id` from host memory (its owner, before anyone imports it).
  absl::Status Write(uint64_t id, std::span<const HostPiece> pieces);
  // `session` (of process `pid`) imports pool `id`; another uid's pool is NOT_FOUND, as a pool
  // that isn't.
  absl::StatusOr<PoolImport> Import(uint64_t id, const std::string& session, uid_t uid,
                                    pid_t pid = 0);
  // The handle of pool `id` for `session`, which has imported it (the data socket passes it
  // on); counts nothing.
  absl::StatusOr<PoolImport> Handle(uint64_t id, const std::string& session) const;
  // `session` no longer uses pool `id` (one import of it: a session that imported twice
  // releases twice).
  absl::Status Release(uint64_t id, const std::string& session);
  // The owner is done with pool `id`: freed now, or when its last importer releases it (others
  // may still join it until then: a shared base's pool lives by its users).
  absl::Status Free(uint64_t id, const std::string& session);
  // A session ended (closed or reclaimed): its imports are released and its pools freed as
  // Free() would. A legacy-IPC pool is not freed under a process that may still have it open
  // (a session can end before its process: closed, or its lease reclaimed): it waits for that
  // process to exit (Sweep).
  void SessionEnded(const std::string& session);
  // Frees the legacy-IPC pools whose last lingering process has exited.
  void Sweep();
  // Pools of `uid` (every pool when unset).
  std::vector<PoolSummary> List(std::optional<uid_t> uid = std::nullopt) const;

 private:
  struct Pool {
    PoolSummary summary;
    std::map<std::string, int> importers;  // session -> imports not yet released
    std::map<std::string, pid_t> importer_pids;  // session -> its process
    std::vector<pid_t> lingering;  // legacy IPC: ended importers' processes, maybe still mapping
    int writers = 0;               // Write() calls copying into it now
    VmmAllocation vmm;        // kVmm
    LegacyAllocation legacy;  // kLegacyIpc
  };
  // Frees `pool` when its owner is gone and no importer is left; returns whether it did.
  bool FreeIfUnused(std::map<uint64_t, Pool>::iterator pool) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  PoolSummary Summarize(const Pool& pool) const;
  absl::StatusOr<PoolImport> HandleLocked(const Pool& pool) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);

  VramApi& api_;
  EventLog& events_;
  const bool legacy_only_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, Pool> pools_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_GPU_GPU_POOLS_H_
