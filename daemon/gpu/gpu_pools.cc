// SPDX-License-Identifier: Apache-2.0
#include "gpu/gpu_pools.h"

#include <fcntl.h>
#include <signal.h>

#include <cerrno>

#include <utility>

#include "absl/strings/str_format.h"
#include "trainstream/status_macros.h"

namespace trainstream::daemon {

const char* PoolKindName(PoolKind kind) {
  return kind == PoolKind::kVmm ? "vmm" : "legacy_ipc";
}

GpuPools::~GpuPools() {
  absl::MutexLock lock(&mu_);
  for (auto& [id, pool] : pools_) {
    if (pool.summary.kind == PoolKind::kVmm) {
      api_.ReleaseExportable(pool.vmm);
    } else {
      api_.ReleaseLegacy(pool.legacy);
    }
  }
}

absl::StatusOr<PoolSummary> GpuPools::Create(const std::string& session, uid_t uid,
                                             const std::string& uuid, uint64_t bytes,
                                             const std::string& purpose) {
  if (bytes == 0) return absl::InvalidArgumentError("a GPU pool needs at least one byte");
  if (uuid.empty()) return absl::InvalidArgumentError("a GPU pool needs the GPU's UUID");
  Pool pool;
  absl::Status vmm = legacy_only_ ? absl::FailedPreconditionError(
                                       "this daemon is set to --gpu_pool_export=legacy_ipc")
                                 : api_.CheckFdHandles(uuid);
  if (vmm.ok()) {
    absl::StatusOr<VmmAllocation> made = api_.CreateExportable(uuid, bytes);
    if (made.ok()) {
      pool.summary.kind = PoolKind::kVmm;
      pool.vmm = std::move(*made);
      bytes = pool.vmm.bytes;
    } else {
      vmm = made.status();
    }
  }
  if (!vmm.ok()) {
    absl::StatusOr<LegacyAllocation> made = api_.CreateLegacy(uuid, bytes);
    if (!made.ok()) {
      std::string message = absl::StrFormat(
          "no GPU pool on %s: the virtual-memory API can't export its memory (%s), and legacy "
          "IPC failed too (%s)",
          uuid, vmm.message(), made.status().message());
      events_.Emit("pool.refused", message, {{"bytes", static_cast<double>(bytes)}}, session,
                   uid);
      return absl::FailedPreconditionError(message);
    }
    pool.summary.kind = PoolKind::kLegacyIpc;
    pool.legacy = *made;
    bytes = pool.legacy.bytes;
    events_.Emit("pool.fallback",
                 absl::StrFormat("GPU pool on %s uses legacy IPC: the virtual-memory API can't "
                                 "export its memory (%s); a legacy handle covers the whole "
                                 "allocation, so importers map all of it",
                                 uuid, vmm.message()),
                 {{"bytes", static_cast<double>(bytes)}}, session, uid);
  }
  pool.summary.uuid = uuid;
  pool.summary.bytes = bytes;
  pool.summary.purpose = purpose;
  pool.summary.uid = uid;
  pool.summary.owner_session = session;
  absl::MutexLock lock(&mu_);
  pool.summary.id = next_id_++;
  PoolSummary summary = pool.summary;
  events_.Emit("pool.created",
               absl::StrFormat("GPU pool %d on %s: %d bytes (%s) for %s", summary.id, uuid,
                               bytes, PoolKindName(summary.kind), purpose),
               {{"bytes", static_cast<double>(bytes)}}, session, uid);
  pools_.emplace(summary.id, std::move(pool));
  return summary;
}

absl::Status GpuPools::Describe(uint64_t id, uint64_t base_id,
                                std::vector<uint64_t> buffer_offsets) {
  absl::MutexLock lock(&mu_);
  auto it = pools_.find(id);
  if (it == pools_.end()) return absl::NotFoundError(absl::StrFormat("no GPU pool %d", id));
  it->second.summary.base_id = base_id;
  it->second.summary.buffer_offsets = std::move(buffer_offsets);
  return absl::OkStatus();
}

absl::Status GpuPools::Write(uint64_t id, std::span<const HostPiece> pieces) {
  // The copies run without the lock (seconds for a large base), the pool pinned meanwhile:
  // whoever ends its owner or last importer during the copy leaves the freeing to this call.
  Pool* pool = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto it = pools_.find(id);
    if (it == pools_.end()) return absl::NotFoundError(absl::StrFormat("no GPU pool %d", id));
    pool = &it->second;  // map nodes don't move
    ++pool->writers;
  }
  const absl::Time began = absl::Now();
  absl::Status written = pool->summary.kind == PoolKind::kVmm
                             ? api_.WriteExportable(pool->vmm, pieces)
                             : api_.WriteLegacy(pool->legacy, pieces);
  absl::MutexLock lock(&mu_);
  --pool->writers;
  if (written.ok()) pool->summary.fill_seconds += absl::ToDoubleSeconds(absl::Now() - began);
  if (FreeIfUnused(pools_.find(id)) && written.ok()) {
    return absl::NotFoundError(
        absl::StrFormat("GPU pool %d was let go while it was being filled", id));
  }
  return written;
}

absl::StatusOr<PoolImport> GpuPools::HandleLocked(const Pool& pool) const {
  PoolImport out;
  out.pool_id = pool.summary.id;
  out.uuid = pool.summary.uuid;
  out.bytes = pool.summary.bytes;
  out.kind = pool.summary.kind;
  if (pool.summary.kind == PoolKind::kVmm) {
    // A descriptor of the importer's own: the pool's stays with the pool.
    out.fd = ipc::UniqueFd(::fcntl(pool.vmm.fd.get(), F_DUPFD_CLOEXEC, 0));
    if (!out.fd.valid()) return ErrnoStatus(errno, "duplicating a GPU pool's handle");
  } else {
    out.legacy_handle = pool.legacy.handle;
  }
  return out;
}

absl::StatusOr<PoolImport> GpuPools::Import(uint64_t id, const std::string& session,
                                            uid_t uid, pid_t pid) {
  absl::MutexLock lock(&mu_);
  auto it = pools_.find(id);
  if (it == pools_.end() || it->second.summary.uid != uid) {
    // Another user's pool is not said to exist. One its owner let go still takes importers
    // while it is imported: it lives until the last leaves.
    return absl::NotFoundError(absl::StrFormat("no GPU pool %d", id));
  }
  if (it->second.summary.kind == PoolKind::kLegacyIpc && pid <= 0) {
    // A legacy-IPC pool outlives an ended importer only while its process lives, which the
    // daemon checks by pid: one it cannot see could be left holding freed memory.
    return absl::FailedPreconditionError(absl::StrFormat(
        "GPU pool %d is shared through legacy CUDA IPC, which this daemon can only do with "
        "processes in its PID namespace; this one is outside it (run the daemon with the "
        "host's PID namespace, e.g. hostPID in Kubernetes, or where the driver exports "
        "pools as descriptors)", id));
  }
  ASSIGN_OR_RETURN(PoolImport out, HandleLocked(it->second));
  ++it->second.importers[session];
  if (pid > 0) it->second.importer_pids[session] = pid;
  return out;
}

absl::StatusOr<PoolImport> GpuPools::Handle(uint64_t id, const std::string& session) const {
  absl::MutexLock lock(&mu_);
  auto it = pools_.find(id);
  if (it == pools_.end() || !it->second.importers.count(session)) {
    return absl::NotFoundError(absl::StrFormat("this session has not imported GPU pool %d", id));
  }
  return HandleLocked(it->second);
}

absl::Status GpuPools::Release(uint64_t id, const std::string& session) {
  absl::MutexLock lock(&mu_);
  auto it = pools_.find(id);
  auto importer = it == pools_.end() ? decltype(it->second.importers)::iterator()
                                     : it->second.importers.find(session);
  if (it == pools_.end() || importer == it->second.importers.end()) {
    return absl::NotFoundError(absl::StrFormat("this session has not imported GPU pool %d", id));
  }
  // Released by the process itself, after it unmapped: nothing lingers.
  if (--importer->second == 0) {
    it->second.importers.erase(importer);
    it->second.importer_pids.erase(session);
  }
  FreeIfUnused(it);
  return absl::OkStatus();
}

absl::Status GpuPools::Free(uint64_t id, const std::string& session) {
  absl::MutexLock lock(&mu_);
  auto it = pools_.find(id);
  if (it == pools_.end() || it->second.summary.owner_session != session) {
    return absl::NotFoundError(absl::StrFormat("this session owns no GPU pool %d", id));
  }
  it->second.summary.owner_session.clear();
  FreeIfUnused(it);
  return absl::OkStatus();
}

void GpuPools::SessionEnded(const std::string& session) {
  absl::MutexLock lock(&mu_);
  for (auto it = pools_.begin(); it != pools_.end();) {
    auto next = std::next(it);
    Pool& pool = it->second;
    if (pool.importers.erase(session) > 0) {
      auto pid = pool.importer_pids.find(session);
      // A legacy handle stays open in its process until that process closes it or exits.
      if (pool.summary.kind == PoolKind::kLegacyIpc && pid != pool.importer_pids.end()) {
        pool.lingering.push_back(pid->second);
        events_.Emit("pool.lingering",
                     absl::StrFormat("GPU pool %d (legacy IPC) is kept until process %d exits: "
                                     "its session ended, and the handle may still be open there",
                                     pool.summary.id, pid->second),
                     {{"pid", static_cast<double>(pid->second)}}, session, pool.summary.uid);
      }
      if (pid != pool.importer_pids.end()) pool.importer_pids.erase(pid);
    }
    if (pool.summary.owner_session == session) pool.summary.owner_session.clear();
    FreeIfUnused(it);
    it = next;
  }
}

void GpuPools::Sweep() {
  absl::MutexLock lock(&mu_);
  for (auto it = pools_.begin(); it != pools_.end();) {
    auto next = std::next(it);
    FreeIfUnused(it);
    it = next;
  }
}

bool GpuPools::FreeIfUnused(std::map<uint64_t, Pool>::iterator it) {
  if (it == pools_.end()) return false;
  Pool& pool = it->second;
  // kill(pid, 0): ESRCH once the process is gone; EPERM means it exists (another uid's).
  std::erase_if(pool.lingering,
                [](pid_t pid) { return ::kill(pid, 0) != 0 && errno == ESRCH; });
  if (!pool.summary.owner_session.empty() || !pool.importers.empty() || pool.writers > 0 ||
      !pool.lingering.empty()) {
    return false;
  }
  if (pool.summary.kind == PoolKind::kVmm) {
    api_.ReleaseExportable(pool.vmm);
  } else {
    api_.ReleaseLegacy(pool.legacy);
  }
  events_.Emit("pool.freed",
               absl::StrFormat("GPU pool %d on %s freed: %d bytes", pool.summary.id,
                               pool.summary.uuid, pool.summary.bytes),
               {{"bytes", static_cast<double>(pool.summary.bytes)}}, "", pool.summary.uid);
  pools_.erase(it);
  return true;
}

PoolSummary GpuPools::Summarize(const Pool& pool) const {
  PoolSummary summary = pool.summary;
  for (const auto& [session, count] : pool.importers) summary.importers.push_back(session);
  return summary;
}

std::vector<PoolSummary> GpuPools::List(std::optional<uid_t> uid) const {
  absl::MutexLock lock(&mu_);
  std::vector<PoolSummary> out;
  for (const auto& [id, pool] : pools_) {
    if (!uid.has_value() || pool.summary.uid == *uid) out.push_back(Summarize(pool));
  }
  return out;
}

}  // namespace trainstream::daemon
