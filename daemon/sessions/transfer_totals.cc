// SPDX-License-Identifier: Apache-2.0
#include "sessions/transfer_totals.h"

#include <limits>

#include "absl/strings/str_format.h"

namespace trainstream::daemon {
namespace {

uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  return b > std::numeric_limits<uint64_t>::max() - a ? std::numeric_limits<uint64_t>::max()
                                                      : a + b;
}

}  // namespace

absl::Status TransferTotals::Report(const Session& session, uint64_t h2d_bytes,
                                    uint64_t d2h_bytes) {
  absl::MutexLock lock(&mu_);
  const Key job{session.job.uid, session.job.job_id};
  auto [it, first] = sessions_.try_emplace(session.id, job, Totals{});
  Totals& last = it->second.second;
  if (h2d_bytes < last.h2d || d2h_bytes < last.d2h) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "transfer totals went down (to the device %d after %d, to the host %d after %d): a "
        "session reports what it moved since it opened, which only grows",
        h2d_bytes, last.h2d, d2h_bytes, last.d2h));
  }
  Totals& total = jobs_[job];
  total.h2d = SaturatingAdd(total.h2d, h2d_bytes - last.h2d);
  total.d2h = SaturatingAdd(total.d2h, d2h_bytes - last.d2h);
  last = Totals{h2d_bytes, d2h_bytes};
  return absl::OkStatus();
}

void TransferTotals::SessionEnded(const Session& session) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session.id);
  if (it == sessions_.end()) return;
  const Key job = it->second.first;
  sessions_.erase(it);
  for (const auto& [id, entry] : sessions_) {
    if (entry.first == job) return;
  }
  jobs_.erase(job);
}

std::vector<TransferTotals::JobRow> TransferTotals::List(const PeerCredentials& viewer) const {
  std::vector<JobRow> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [job, totals] : jobs_) {
    if (!viewer.admin && job.first != viewer.uid) continue;
    out.push_back(JobRow{JobKey{job.first, job.second}, totals.h2d, totals.d2h});
  }
  return out;
}

}  // namespace trainstream::daemon
