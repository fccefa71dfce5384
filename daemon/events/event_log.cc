// SPDX-License-Identifier: Apache-2.0
#include "events/event_log.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace trainstream::daemon {

LogLevel LogLevelOfEvent(absl::string_view kind) {
  for (absl::string_view failure : {"failed", "error", "exhausted"}) {
    if (absl::StrContains(kind, failure)) return LogLevel::kError;
  }
  for (absl::string_view caution : {"refused", "nonfinite", "skipped", "fallback"}) {
    if (absl::StrContains(kind, caution)) return LogLevel::kWarning;
  }
  return LogLevel::kInfo;
}

EventLog::EventLog(size_t capacity) : capacity_(capacity == 0 ? 1 : capacity) {}

uint64_t EventLog::Emit(std::string kind, std::string message,
                        std::vector<std::pair<std::string, double>> numbers,
                        std::string session_id, std::optional<uid_t> uid) {
  Event event;
  event.time_unix_s = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  event.session_id = std::move(session_id);
  event.uid = uid;
  event.kind = std::move(kind);
  event.message = std::move(message);
  event.numbers = std::move(numbers);
  std::string line = absl::StrCat(event.kind, " ", event.session_id.empty() ? "-" : event.session_id,
                                  ": ", event.message);
  for (const auto& [key, value] : event.numbers) {
    // Byte counts are whole numbers: print them in full rather than as 1.07374e+09.
    const bool whole = value == static_cast<double>(static_cast<int64_t>(value));
    absl::StrAppend(&line, " ", key, "=",
                    whole ? absl::StrCat(static_cast<int64_t>(value)) : absl::StrCat(value));
  }
  const LogLevel level = LogLevelOfEvent(event.kind);
  uint64_t seq = 0;
  {
    absl::MutexLock lock(&mu_);
    seq = event.seq = next_seq_++;
    ++counts_[{CountedKind(event.kind), event.uid}];
    ring_.push_back(std::move(event));
    while (ring_.size() > capacity_) ring_.pop_front();
  }
  Log(level, line);
  return seq;
}

std::string EventLog::CountedKind(const std::string& kind) {
  return kind.starts_with("client.") ? "client.*" : kind;
}

std::map<std::string, uint64_t> EventLog::CountsByKind(
    const std::function<bool(std::optional<uid_t>)>& visible) const {
  std::map<std::string, uint64_t> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [key, count] : counts_) {
    if (visible(key.second)) out[key.first] += count;
  }
  return out;
}

std::vector<Event> EventLog::Since(uint64_t after,
                                   const std::function<bool(const Event&)>& visible) const {
  absl::MutexLock lock(&mu_);
  std::vector<Event> out;
  for (const Event& event : ring_) {
    if (event.seq > after && visible(event)) out.push_back(event);
  }
  return out;
}

bool EventLog::WaitForNewer(uint64_t after, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto newer = [this, after]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return next_seq_ - 1 > after; };
  return mu_.AwaitWithTimeout(absl::Condition(&newer), timeout);
}

uint64_t EventLog::last_seq() const {
  absl::MutexLock lock(&mu_);
  return next_seq_ - 1;
}

}  // namespace trainstream::daemon
