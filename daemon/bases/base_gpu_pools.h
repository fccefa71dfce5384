// SPDX-License-Identifier: Apache-2.0
// Shared bases placed in GPU pools: one VRAM copy of a base per GPU for every process of its
// user on that GPU. The first session to ask has the daemon make the pool and fill it from the
// base's host copy; later ones join it. Each is an importer of the pool until it releases it
// or ends, and the pool goes with its last importer.
#ifndef TRAINSTREAM_DAEMON_BASES_BASE_GPU_POOLS_H_
#define TRAINSTREAM_DAEMON_BASES_BASE_GPU_POOLS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "bases/base_store.h"
#include "events/event_log.h"
#include "gpu/gpu_pools.h"
#include "sessions/session.h"

namespace trainstream::daemon {

// Where a base's buffers start in a pool: each at a multiple of this, so that every tensor in
// them keeps the alignment it has in host memory.
inline constexpr uint64_t kPoolBufferAlignment = 4096;

class BaseGpuPools {
 public:
  // `session_alive` says whether a session is still open (an import made for one that ended
  // meanwhile is released at once: its end has already been handled).
  BaseGpuPools(BaseStore& bases, GpuPools& pools, EventLog& events,
               std::function<bool(const Session&)> session_alive)
      : bases_(bases), pools_(pools), events_(events), session_alive_(std::move(session_alive)) {}
  BaseGpuPools(const BaseGpuPools&) = delete;
  BaseGpuPools& operator=(const BaseGpuPools&) = delete;

  // Base `base_id` (ready, and `session` attached to it) in a pool on GPU `uuid`: the one there
  // already, or a new one filled now from host memory. `session` becomes one of its importers.
  absl::StatusOr<PoolSummary> Place(const Session& session, uint64_t base_id,
                                    const std::string& uuid);

 private:
  // One base on one GPU for one user: its pool, if it has one. Its lock makes a second process
  // asking for the same base wait for the first one's fill instead of making a second copy;
  // other bases and GPUs don't wait.
  struct Placement {
    absl::Mutex mu;
    uint64_t pool_id ABSL_GUARDED_BY(mu) = 0;  // 0: none yet, or freed since
  };
  absl::StatusOr<PoolSummary> Fill(const Session& session, uint64_t base_id,
                                   const std::string& uuid);
  // Imports pool `id` for `session`, undone if the session has ended meanwhile.
  absl::Status Join(const Session& session, uint64_t id);

  BaseStore& bases_;
  GpuPools& pools_;
  EventLog& events_;
  const std::function<bool(const Session&)> session_alive_;
  absl::Mutex mu_;
  std::map<std::tuple<uid_t, uint64_t, std::string>, std::shared_ptr<Placement>> placed_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_BASES_BASE_GPU_POOLS_H_
