// SPDX-License-Identifier: Apache-2.0
// How many events each session may report per minute: the event ring is shared by every user
// of the machine, so one chatty client must not push everyone else's events out of it.
#ifndef TRAINSTREAM_DAEMON_RPC_REPORTED_EVENT_LIMITER_H_
#define TRAINSTREAM_DAEMON_RPC_REPORTED_EVENT_LIMITER_H_

#include <sys/types.h>

#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace trainstream::daemon {

class ReportedEventLimiter {
 public:
  explicit ReportedEventLimiter(int per_minute) : per_minute_(per_minute) {}

  // OK and counts the event, or RESOURCE_EXHAUSTED once `uid` has reported `per_minute` events
  // in the current minute, from all its sessions together: one user opening many sessions
  // cannot push everyone else's events out of the ring.
  absl::Status Admit(uid_t uid, absl::Time now);

 private:
  struct Window {
    absl::Time start;
    int count = 0;
  };
  const int per_minute_;
  absl::Mutex mu_;
  absl::flat_hash_map<uid_t, Window> windows_ ABSL_GUARDED_BY(mu_);
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_RPC_REPORTED_EVENT_LIMITER_H_
