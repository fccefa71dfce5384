// SPDX-License-Identifier: Apache-2.0
// Admission: jobs declare their whole host-memory plan up front, so a run that cannot fit is
// refused before it allocates anything, and two jobs cannot both half-start on memory only one
// of them can have.
#include <algorithm>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "arena/arena.h"

namespace trainstream::daemon {
namespace {

std::string Gib(uint64_t bytes) {
  return absl::StrFormat("%.2f GiB", static_cast<double>(bytes) / (uint64_t{1} << 30));
}

// Another user's job ids are theirs: a refusal names only the caller's own jobs.
std::string Label(const JobKey& other, const JobKey& asking) {
  if (other.uid != asking.uid) return "a job of another user";
  return absl::StrFormat("your job '%s'", other.job_id);
}

}  // namespace

uint64_t Arena::UsedLocked(const JobKey& job) const {
  auto it = reserved_by_job_.find(job);
  return it == reserved_by_job_.end() ? 0 : it->second;
}

uint64_t Arena::OutstandingPlansLocked(const JobKey* except) const {
  uint64_t outstanding = 0;
  for (const auto& [job, planned] : plans_) {
    if (except != nullptr && job == *except) continue;
    const uint64_t used = UsedLocked(job);
    if (planned > used) outstanding += planned - used;
  }
  return outstanding;
}

absl::StatusOr<PlanOutcome> Arena::Plan(const JobKey& job, uint64_t bytes, absl::Duration wait) {
  absl::MutexLock lock(&mu_);
  // Everything held, plus what other jobs planned and do not hold yet, plus what this job will
  // hold at most: it must fit in the budget.
  auto committed_with_plan = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    const uint64_t used = UsedLocked(job);
    return reserved_ + retiring_ - used + OutstandingPlansLocked(&job) + std::max(bytes, used);
  };
  auto fits = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return committed_with_plan() <= options_.budget_bytes;
  };
  auto fits_or_nothing_retiring = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return fits() || retiring_ == 0;
  };
  if (!fits() && retiring_ > 0) {
    // Segments being unmapped are the machine's again within moments: not a reason to refuse.
    mu_.AwaitWithTimeout(absl::Condition(&fits_or_nothing_retiring), kRetiringWait);
  }
  if (!fits() && wait > absl::ZeroDuration()) {
    // Freed segments and dropped plans change the condition; absl re-checks it on each unlock.
    mu_.AwaitWithTimeout(absl::Condition(&fits), wait);
  }
  if (!fits()) {
    struct Holder {
      uint64_t bytes;
      std::string label;
    };
    std::vector<Holder> holders;
    for (const auto& [other, used] : reserved_by_job_) {
      if (other == job) continue;
      auto plan = plans_.find(other);
      const uint64_t held = std::max(used, plan == plans_.end() ? 0 : plan->second);
      holders.push_back({held, Label(other, job) + ": " + Gib(held)});
    }
    for (const auto& [other, planned] : plans_) {
      if (other == job || reserved_by_job_.contains(other)) continue;
      holders.push_back({planned, Label(other, job) + ": " + Gib(planned) + " planned"});
    }
    std::sort(holders.begin(), holders.end(),
              [](const Holder& a, const Holder& b) { return a.bytes > b.bytes; });
    std::vector<std::string> named;
    for (size_t i = 0; i < holders.size() && i < 3; ++i) named.push_back(holders[i].label);
    if (holders.size() > 3) named.push_back(absl::StrFormat("%d more", holders.size() - 3));
    const uint64_t others = committed_with_plan() - std::max(bytes, UsedLocked(job));
    const uint64_t left = options_.budget_bytes > others ? options_.budget_bytes - others : 0;
    return absl::ResourceExhaustedError(absl::StrFormat(
        "job '%s' plans %s of host memory; the daemon's budget is %s and other jobs hold or "
        "planned %s of it (%s), leaving %s%s%s. Wait for them to finish, free memory, plan for "
        "less (e.g. bf16 moments), or raise --memory_budget",
        job.job_id, Gib(bytes), Gib(options_.budget_bytes), Gib(others),
        named.empty() ? "none" : absl::StrJoin(named, "; "), Gib(left),
        retiring_ > 0 ? absl::StrFormat(" (%s more is being released now: try again in a "
                                        "moment)", Gib(retiring_))
                      : "",
        wait > absl::ZeroDuration()
            ? absl::StrFormat(" after waiting %s", absl::FormatDuration(wait))
            : ""));
  }
  if (options_.uid_quota_bytes != 0) {
    // What the uid holds, what its other jobs planned beyond that, and this plan: within the
    // uid's quota, or the job would fail at an allocation midway instead of here.
    const uint64_t used = UsedLocked(job);
    const auto held = reserved_by_uid_.find(job.uid);
    uint64_t mine = (held == reserved_by_uid_.end() ? 0 : held->second - used) +
                    std::max(bytes, used);
    for (const auto& [other, planned] : plans_) {
      if (other.uid != job.uid || other == job) continue;
      const uint64_t other_used = UsedLocked(other);
      if (planned > other_used) mine += planned - other_used;
    }
    if (mine > options_.uid_quota_bytes) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "job '%s' plans %s of host memory; with what uid %d's other jobs hold or planned that "
          "is %s, over the uid's %s quota (of the daemon's %s budget). Plan for less (e.g. bf16 "
          "moments), end another of your jobs, or raise --uid_quota",
          job.job_id, Gib(bytes), job.uid, Gib(mine), Gib(options_.uid_quota_bytes),
          Gib(options_.budget_bytes)));
    }
  }
  if (bytes == 0) {
    plans_.erase(job);
  } else {
    plans_[job] = bytes;
  }
  PlanOutcome outcome;
  outcome.planned = bytes;
  outcome.used = UsedLocked(job);
  outcome.budget = options_.budget_bytes;
  outcome.committed = reserved_ + retiring_ + OutstandingPlansLocked(nullptr);
  return outcome;
}

}  // namespace trainstream::daemon
