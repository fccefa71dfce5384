// SPDX-License-Identifier: Apache-2.0
#include "bases/base_gpu_pools.h"

#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "trainstream/status_macros.h"

namespace trainstream::daemon {
namespace {

PoolSummary Find(GpuPools& pools, uid_t uid, uint64_t pool_id) {
  for (PoolSummary& pool : pools.List(uid)) {
    if (pool.id == pool_id) return pool;
  }
  return {};
}

}  // namespace

absl::StatusOr<PoolSummary> BaseGpuPools::Place(const Session& session, uint64_t base_id,
                                                const std::string& uuid) {
  const uid_t uid = session.owner.uid;
  std::shared_ptr<Placement> placement;
  {
    absl::MutexLock lock(&mu_);
    std::shared_ptr<Placement>& slot = placed_[std::make_tuple(uid, base_id, uuid)];
    if (!slot) slot = std::make_shared<Placement>();
    placement = slot;
  }
  absl::MutexLock lock(&placement->mu);
  if (placement->pool_id != 0) {
    // The session must be attached to the base, as the first one was.
    RETURN_IF_ERROR(bases_.HostBytes(session, base_id).status());
    absl::Status joined = Join(session, placement->pool_id);
    if (joined.ok()) {
      PoolSummary pool = Find(pools_, uid, placement->pool_id);
      events_.Emit("pool.joined",
                   absl::StrFormat("base %d on %s: pool %d, already in VRAM (%d importers)",
                                   base_id, uuid, pool.id, pool.importers.size()),
                   {{"bytes", static_cast<double>(pool.bytes)}}, session.id, uid);
      pool.fill_seconds = 0;
      return pool;
    }
    if (joined.code() != absl::StatusCode::kNotFound) return joined;
    placement->pool_id = 0;  // freed since: its last importer left
  }
  absl::StatusOr<PoolSummary> filled = Fill(session, base_id, uuid);
  if (filled.ok()) placement->pool_id = filled->id;
  return filled;
}

absl::Status BaseGpuPools::Join(const Session& session, uint64_t id) {
  RETURN_IF_ERROR(pools_.Import(id, session.id, session.owner.uid, session.owner.pid).status());
  // The registry forgets a session before its end is handled: if it is gone now, either that
  // handling comes after this import (and releases it), or it came before, and this does.
  if (!session_alive_(session)) {
    pools_.Release(id, session.id).IgnoreError();
    return absl::FailedPreconditionError("the session ended while its pool was being placed");
  }
  return absl::OkStatus();
}

absl::StatusOr<PoolSummary> BaseGpuPools::Fill(const Session& session, uint64_t base_id,
                                               const std::string& uuid) {
  const uid_t uid = session.owner.uid;
  // Pinned: the bytes stay while they are copied, whatever the session does meanwhile.
  ASSIGN_OR_RETURN(std::unique_ptr<BaseStore::HostPin> pin, bases_.HostBytes(session, base_id));
  ASSIGN_OR_RETURN(BaseSnapshot base, bases_.Get(uid, /*admin=*/false, base_id));
  std::vector<uint64_t> offsets;
  std::vector<HostPiece> pieces;
  uint64_t bytes = 0;
  for (std::span<const uint8_t> buffer : pin->bytes()) {
    bytes = (bytes + kPoolBufferAlignment - 1) / kPoolBufferAlignment * kPoolBufferAlignment;
    offsets.push_back(bytes);
    pieces.push_back(HostPiece{bytes, buffer.data(), buffer.size()});
    bytes += buffer.size();
  }
  if (bytes == 0) return absl::FailedPreconditionError(absl::StrFormat("base %d is empty", base_id));
  ASSIGN_OR_RETURN(PoolSummary pool,
                   pools_.Create(session.id, uid, uuid, bytes,
                                 absl::StrFormat("base %d: %s %s", base_id, base.name, base.format)));
  // From here the pool is the session's until it is filled and imported; on any failure the
  // owner frees it (no importer yet: at once).
  absl::Status filled = pools_.Describe(pool.id, base_id, offsets);
  if (filled.ok()) {
    // Seconds for a large base, during which the caller waits: said before it starts.
    events_.Emit("pool.filling",
                 absl::StrFormat("copying base %d (%s %s, %.2f GB) to %s for pool %d", base_id,
                                 base.name, base.format, bytes / 1e9, uuid, pool.id),
                 {{"bytes", static_cast<double>(bytes)}}, session.id, uid);
    filled = pools_.Write(pool.id, pieces);
  }
  if (filled.ok()) filled = Join(session, pool.id);
  pools_.Free(pool.id, session.id).IgnoreError();  // from now on it lives by its importers
  if (!filled.ok()) {
    events_.Emit("pool.refused",
                 absl::StrFormat("base %d could not be placed on %s: %s", base_id, uuid,
                                 filled.message()),
                 {}, session.id, uid);
    return filled;
  }
  PoolSummary now = Find(pools_, uid, pool.id);
  events_.Emit("pool.filled",
               absl::StrFormat("base %d (%s %s) copied to %s in %.2f s (%.2f GB/s): pool %d",
                               base_id, base.name, base.format, uuid, now.fill_seconds,
                               now.fill_seconds > 0 ? bytes / now.fill_seconds / 1e9 : 0.0,
                               pool.id),
               {{"bytes", static_cast<double>(bytes)}, {"seconds", now.fill_seconds}},
               session.id, uid);
  return now;
}

}  // namespace trainstream::daemon
