// SPDX-License-Identifier: Apache-2.0
#include "optimizer/optimizer_registry.h"

#include "absl/strings/str_format.h"
#include "trainstream/status_macros.h"

namespace trainstream::daemon {

OptimizerRegistry::OptimizerRegistry(const Options& options, Arena* arena,
                                     DoorbellDispatcher* doorbells, EventLog* events)
    : options_(options),
      pool_(options.threads, options.pin_threads),
      deps_{arena, &pool_, doorbells, events} {}

absl::StatusOr<std::shared_ptr<JobOptimizer>> OptimizerRegistry::CreateOrJoin(
    const Session& session, const OptimizerSettings& settings) {
  if (settings.threads > pool_.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "threads=%d, but trainstreamd runs %d AdamW workers for every job (its --threads); ask "
        "for at most that many, or none for all of them",
        settings.threads, pool_.size()));
  }
  absl::MutexLock lock(&mu_);
  if (auto it = jobs_.find(session.job); it != jobs_.end()) {
    RETURN_IF_ERROR(it->second->CheckSame(settings, session.world_size));
    return it->second;
  }
  ASSIGN_OR_RETURN(std::shared_ptr<JobOptimizer> optimizer,
                   JobOptimizer::Create(session.job, settings, session.world_size, deps_));
  jobs_[session.job] = optimizer;
  return optimizer;
}

absl::StatusOr<std::shared_ptr<JobOptimizer>> OptimizerRegistry::ForSession(
    const Session& session) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(session.job);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrFormat(
        "job '%s' has no optimizer; call CreateOptimizer first", session.job.job_id));
  }
  return it->second;
}

std::shared_ptr<JobOptimizer> OptimizerRegistry::ForDoorbell(
    const Session& session, const ipc::DoorbellMessage& message) {
  absl::StatusOr<std::shared_ptr<JobOptimizer>> optimizer = ForSession(session);
  if (optimizer.ok()) return *optimizer;
  deps_.doorbells
      ->Send(session.id, {static_cast<uint32_t>(ipc::DoorbellKind::kError), 0, message.id,
                          message.step, static_cast<uint64_t>(absl::StatusCode::kNotFound)})
      .IgnoreError();
  return nullptr;
}

void OptimizerRegistry::OnGradientReady(const Session& session,
                                        const ipc::DoorbellMessage& message) {
  if (auto optimizer = ForDoorbell(session, message)) {
    optimizer->OnGradientReady(session.id, message);
  }
}

void OptimizerRegistry::OnNormContribution(const Session& session,
                                           const ipc::DoorbellMessage& message) {
  if (auto optimizer = ForDoorbell(session, message)) {
    optimizer->OnNormContribution(session.id, message);
  }
}

void OptimizerRegistry::OnReduced(const Session& session, const ipc::DoorbellMessage& message) {
  if (auto optimizer = ForDoorbell(session, message)) optimizer->OnReduced(session.id, message);
}

void OptimizerRegistry::OnSessionEnded(const Session& session, bool clean) {
  std::shared_ptr<JobOptimizer> optimizer;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(session.job);
    if (it == jobs_.end()) return;
    optimizer = it->second;
  }
  optimizer->OnSessionEnded(session.id, clean);
}

bool OptimizerRegistry::EndIfIdle(const JobKey& job) {
  std::shared_ptr<JobOptimizer> ended;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job);
    if (it == jobs_.end() || it->second->has_sessions()) return false;
    ended = std::move(it->second);
    jobs_.erase(it);
  }
  return true;  // destroyed here, outside the lock
}

void OptimizerRegistry::ExpireIdle(absl::Time now) {
  std::vector<std::shared_ptr<JobOptimizer>> expired;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = jobs_.begin(); it != jobs_.end();) {
      // Never waits on a job (one writing a checkpoint holds its lock for the write): this
      // thread holds the registry's lock, which every other job's gradients need.
      if (it->second->IdleFor(options_.retention, now)) {
        expired.push_back(std::move(it->second));
        jobs_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  // Destroyed here, outside the lock (tasks in flight hold their own references).
}

std::vector<OptimizerReport> OptimizerRegistry::List(const PeerCredentials& viewer) const {
  std::vector<std::pair<JobKey, std::shared_ptr<JobOptimizer>>> jobs;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, optimizer] : jobs_) {
      if (viewer.admin || key.uid == viewer.uid) jobs.emplace_back(key, optimizer);
    }
  }
  std::vector<OptimizerReport> out;
  for (const auto& [key, optimizer] : jobs) out.push_back(optimizer->Report());
  return out;
}

}  // namespace trainstream::daemon
