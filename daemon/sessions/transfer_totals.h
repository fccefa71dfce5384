// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_SESSIONS_TRANSFER_TOTALS_H_
#define TRAINSTREAM_DAEMON_SESSIONS_TRANSFER_TOTALS_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "sessions/credentials.h"
#include "sessions/session.h"

namespace trainstream::daemon {

// Bytes a job's processes moved between host memory and their GPUs, as their clients count and
// report them: the copies are the clients' (the daemon never sees PCIe), so these are the
// clients' word, kept for metrics and for tsctl. Each session reports its running totals; the
// job's total grows by what each report adds. A job is forgotten with its last reporting session
// (a later one starts again from zero, as a restarted exporter's counter does). Thread-safe.
class TransferTotals {
 public:
  struct JobRow {
    JobKey job;
    uint64_t h2d_bytes = 0;
    uint64_t d2h_bytes = 0;
  };

  // INVALID_ARGUMENT when a total went down: a session's totals only grow.
  absl::Status Report(const Session& session, uint64_t h2d_bytes, uint64_t d2h_bytes);
  void SessionEnded(const Session& session);
  // The jobs the viewer may see: its own uid's, or all for an admin.
  std::vector<JobRow> List(const PeerCredentials& viewer) const;

 private:
  struct Totals {
    uint64_t h2d = 0;
    uint64_t d2h = 0;
  };
  using Key = std::pair<uid_t, std::string>;  // the job

  mutable absl::Mutex mu_;
  std::map<std::string, std::pair<Key, Totals>> sessions_ ABSL_GUARDED_BY(mu_);
  std::map<Key, Totals> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_SESSIONS_TRANSFER_TOTALS_H_
