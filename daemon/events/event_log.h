// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_EVENTS_EVENT_LOG_H_
#define TRAINSTREAM_DAEMON_EVENTS_EVENT_LOG_H_

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "events/logger.h"

namespace trainstream::daemon {

// The level an event's log line takes: errors for failures ("optimizer.failed",
// "doorbell.protocol_error"), warnings for refusals, skipped steps and fallbacks, info else.
LogLevel LogLevelOfEvent(absl::string_view kind);

// One decision, fallback or refusal, with the numbers behind it.
struct Event {
  uint64_t seq = 0;
  double time_unix_s = 0;
  std::string session_id;      // empty: machine-wide
  std::optional<uid_t> uid;    // whose session it concerns; unset: machine-wide
  std::string kind;            // dotted, e.g. "session.reclaimed"
  std::string message;         // for a person
  std::vector<std::pair<std::string, double>> numbers;
};

// A bounded ring of events, newest last; the oldest fall off. Every event is also logged.
// Thread-safe; readers may wait for new events.
class EventLog {
 public:
  explicit EventLog(size_t capacity);

  // Appends and returns the event's sequence number (1, 2, ...).
  uint64_t Emit(std::string kind, std::string message,
                std::vector<std::pair<std::string, double>> numbers = {},
                std::string session_id = "", std::optional<uid_t> uid = std::nullopt);

  // Events with seq > `after` still in the ring that `visible` accepts, oldest first.
  std::vector<Event> Since(uint64_t after, const std::function<bool(const Event&)>& visible) const;

  // Blocks until an event with seq > `after` exists or `timeout` passes; true if one does.
  bool WaitForNewer(uint64_t after, absl::Duration timeout) const;

  uint64_t last_seq() const;

  // Events emitted since the start (not only those still in the ring), by kind, counting those
  // whose owner `visible` accepts (unset: machine-wide). Clients' own kinds count together as
  // "client.*": they are theirs to name, and a metric's label must not grow without bound.
  std::map<std::string, uint64_t> CountsByKind(
      const std::function<bool(std::optional<uid_t>)>& visible) const;

 private:
  static std::string CountedKind(const std::string& kind);

  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::deque<Event> ring_ ABSL_GUARDED_BY(mu_);
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::pair<std::string, std::optional<uid_t>>, uint64_t> counts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_EVENTS_EVENT_LOG_H_
