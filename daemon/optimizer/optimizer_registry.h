// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_OPTIMIZER_OPTIMIZER_REGISTRY_H_
#define TRAINSTREAM_DAEMON_OPTIMIZER_OPTIMIZER_REGISTRY_H_

#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "optimizer/job_optimizer.h"
#include "sessions/session.h"

namespace trainstream::daemon {

// Every job's optimizer, and the worker pool they share. A job's state outlives its sessions
// for `retention` (so a restarted training process can re-attach), then it is freed.
// Thread-safe.
class OptimizerRegistry {
 public:
  struct Options {
    size_t threads = 1;
    bool pin_threads = true;
    absl::Duration retention = absl::Minutes(10);
  };
  OptimizerRegistry(const Options& options, Arena* arena, DoorbellDispatcher* doorbells,
                    EventLog* events);

  // The job's optimizer, created by the first rank; later ranks must agree with it.
  absl::StatusOr<std::shared_ptr<JobOptimizer>> CreateOrJoin(const Session& session,
                                                             const OptimizerSettings& settings);
  // NOT_FOUND (with what to do) when the session's job has none.
  absl::StatusOr<std::shared_ptr<JobOptimizer>> ForSession(const Session& session) const;
  // Doorbell handler for kGradientReady.
  void OnGradientReady(const Session& session, const ipc::DoorbellMessage& message);
  void OnReduced(const Session& session, const ipc::DoorbellMessage& message);
  void OnNormContribution(const Session& session, const ipc::DoorbellMessage& message);
  void OnSessionEnded(const Session& session, bool clean);
  // Frees optimizers whose job has had no session for longer than the retention.
  void ExpireIdle(absl::Time now);
  // Frees the job's optimizer now if none of its sessions is open (a client that made the job
  // and was refused asks for this: nothing is left to re-attach to). Returns whether it did.
  bool EndIfIdle(const JobKey& job);
  // Optimizers the viewer may see (its own uid's; all for an admin).
  std::vector<OptimizerReport> List(const PeerCredentials& viewer) const;
  size_t threads() const { return pool_.size(); }

 private:
  // The session's job optimizer, or null after telling the session there is none.
  std::shared_ptr<JobOptimizer> ForDoorbell(const Session& session,
                                            const ipc::DoorbellMessage& message);
  const Options options_;
  ThreadPool pool_;
  JobOptimizer::Deps deps_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<JobKey, std::shared_ptr<JobOptimizer>> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_OPTIMIZER_OPTIMIZER_REGISTRY_H_
