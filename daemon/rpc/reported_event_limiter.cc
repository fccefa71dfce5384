// SPDX-License-Identifier: Apache-2.0
#include "rpc/reported_event_limiter.h"

#include "absl/strings/str_format.h"

namespace trainstream::daemon {

absl::Status ReportedEventLimiter::Admit(uid_t uid, absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (windows_.size() > 4096) {
    // Users gone quiet leave their windows behind; drop every one that has expired.
    absl::erase_if(windows_, [&](const auto& entry) {
      return now - entry.second.start >= absl::Minutes(1);
    });
  }
  Window& window = windows_[uid];
  if (now - window.start >= absl::Minutes(1)) window = Window{now, 0};
  if (window.count >= per_minute_) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "uid %d reported %d events this minute from all its sessions, the most a user may; the "
        "rest are dropped until %s",
        uid, window.count, absl::FormatTime(window.start + absl::Minutes(1))));
  }
  ++window.count;
  return absl::OkStatus();
}

}  // namespace trainstream::daemon
