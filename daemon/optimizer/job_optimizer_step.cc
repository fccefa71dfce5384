// SPDX-License-Identifier: Apache-2.0
// JobOptimizer's step machine on the side of the ranks: gradients arriving, micro-steps summed,
// the cross-machine hand-off, the end of an iteration, and ranks that fail or leave.
#include "optimizer/job_optimizer.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <optional>

#include "absl/strings/str_format.h"
#include "optimizer/job_optimizer_internal.h"

namespace trainstream::daemon {
namespace {

using job_optimizer_internal::Chunks;
using job_optimizer_internal::Message;

constexpr uint64_t kFailedPreconditionCode = 9;  // the google.rpc code a kError carries

}  // namespace

std::optional<uint32_t> JobOptimizer::RankOfSenderLocked(const std::string& session_id,
                                                         const ipc::DoorbellMessage& message) {
  last_activity_ = absl::Now();
  for (const auto& [rank, session] : rank_sessions_) {
    if (session == session_id) return rank;
  }
  deps_.doorbells
      ->Send(session_id,
             Message(ipc::DoorbellKind::kError, message.id, message.step, kFailedPreconditionCode))
      .IgnoreError();
  return std::nullopt;
}

void JobOptimizer::OnGradientReady(const std::string& session_id,
                                   const ipc::DoorbellMessage& message) {
  absl::MutexLock lock(&mu_);
  if (DeferLocked({Deferred::Kind::kGradientReady, session_id, message})) return;
  GradientReadyLocked(session_id, message);
}

void JobOptimizer::OnReduced(const std::string& session_id, const ipc::DoorbellMessage& message) {
  absl::MutexLock lock(&mu_);
  if (DeferLocked({Deferred::Kind::kReduced, session_id, message})) return;
  ReducedLocked(session_id, message);
}

void JobOptimizer::OnNormContribution(const std::string& session_id,
                                      const ipc::DoorbellMessage& message) {
  absl::MutexLock lock(&mu_);
  if (DeferLocked({Deferred::Kind::kNormContribution, session_id, message})) return;
  NormContributionLocked(session_id, message);
}

void JobOptimizer::OnSessionEnded(const std::string& session_id, bool clean) {
  absl::MutexLock lock(&mu_);
  // After the session's messages that are waiting, as they came.
  if (DeferLocked({Deferred::Kind::kSessionEnded, session_id, {}, clean})) return;
  SessionEndedLocked(session_id, clean);
}

void JobOptimizer::GradientReadyLocked(const std::string& session_id,
                                       const ipc::DoorbellMessage& message) {
  const std::optional<uint32_t> rank = RankOfSenderLocked(session_id, message);
  if (!rank) return;
  if (!failure_.empty()) {
    // Until its speculated tensors are restored, the failure's own announcement is still to
    // come (AnnounceFailureIfUndoneLocked): an error now would let the rank read them half-way.
    if (!failure_unannounced_) {
      SendToRank(*rank, Message(ipc::DoorbellKind::kError, message.id, message.step,
                                kFailedPreconditionCode));
    }
    return;
  }
  if (!departed_.empty()) {
    FailLocked(absl::StrFormat("rank %d left the job; the other ranks cannot step without it",
                               *departed_.begin()));
    return;
  }
  if (message.id >= params_.size()) {
    FailLocked(absl::StrFormat("rank %d posted a gradient for parameter %d; the job has %d", *rank,
                               message.id, params_.size()));
    return;
  }
  Parameter& p = params_[message.id];
  if (message.step != iteration_ + 1) {
    FailLocked(absl::StrFormat(
        "rank %d posted '%s' for iteration %d, but the job is at iteration %d (a rank skipped or "
        "repeated a step)",
        *rank, p.desc.name, message.step, iteration_ + 1));
    return;
  }
  if (p.phase != Phase::kWaiting) {
    FailLocked(absl::StrFormat("rank %d posted '%s' again before its previous gradient was used",
                               *rank, p.desc.name));
    return;
  }
  if (message.value != p.micro) {
    FailLocked(absl::StrFormat("rank %d posted micro-step %d of '%s'; the job expects %d", *rank,
                               message.value, p.desc.name, p.micro));
    return;
  }
  if (p.arrived.contains(*rank)) {
    FailLocked(absl::StrFormat("rank %d posted '%s' twice in one step", *rank, p.desc.name));
    return;
  }
  if (!iteration_started_) {
    iteration_started_ = true;
    iteration_start_ = absl::Now();
    speculating_ = SpeculatesLocked();
  }
  p.arrived.insert(*rank);
  if (message.flags & ipc::kFlagNoGradient) p.absent.insert(*rank);
  if (p.arrived.size() == world_size_) AfterGradientsInLocked(static_cast<uint32_t>(message.id));
}

void JobOptimizer::AfterGradientsInLocked(uint32_t index) {
  Parameter& p = params_[index];
  const bool has_gradient = p.absent.size() < world_size_;
  const bool last_micro = p.micro + 1 >= settings_.accumulation_steps;
  if (has_gradient) p.machine_gradient = true;
  if (settings_.machines > 1 && last_micro) {
    // Every parameter goes out to the all-reduce every step, gradient or not (zeros then), so
    // the machines' collectives line up, as DistributedDataParallel's do.
    StartAccumulateLocked(index, /*final_micro=*/true);
    return;
  }
  if (settings_.reduces_into_buffer()) {
    if (has_gradient) {
      StartAccumulateLocked(index, last_micro);
      return;
    }
    if (!last_micro) {
      ++p.micro;
      p.arrived.clear();
      p.absent.clear();
      SendToAll(Message(ipc::DoorbellKind::kGradConsumed, index, iteration_ + 1, p.micro - 1));
      return;
    }
  } else {
    p.any_gradient = has_gradient;
  }
  if (!p.any_gradient) {
    LeaveWithoutGradientLocked(index);  // no rank had a gradient for it this iteration
    return;
  }
  GradientsFinalLocked(index);
}

void JobOptimizer::LeaveWithoutGradientLocked(uint32_t index) {
  // Like torch: a parameter without a gradient keeps its value, moments and step count.
  params_[index].phase = Phase::kDone;
  ++params_done_;
  ++params_with_stats_;
  if (SteppedThisIterationLocked(params_[index])) ++params_updated_;
  // One stepped for this iteration before a failure keeps that step (see the class comment):
  // its ranks must still copy the value in place.
  SendToAll(Message(ipc::DoorbellKind::kUpdateDone, index, iteration_ + 1, 0,
                    SteppedThisIterationLocked(params_[index]) ? 0 : ipc::kFlagNoGradient));
  if (GathersStatsLocked()) MaybeDecideLocked();
  MaybeFinishIterationLocked();
}

void JobOptimizer::StartAccumulateLocked(uint32_t index, bool final_micro) {
  Parameter& p = params_[index];
  p.phase = Phase::kAccumulating;
  const bool overwrite = !p.any_gradient;
  p.any_gradient = true;
  std::vector<const void*> sources;
  for (const auto& [rank, ptr] : p.grad_ptrs) {
    if (rank < world_size_ && !p.absent.contains(rank)) sources.push_back(ptr);
  }
  auto grads = std::make_shared<std::vector<const void*>>(std::move(sources));
  const size_t chunk = ChunkElementsLocked();
  const size_t chunks = Chunks(p.desc.numel, chunk);
  p.chunks_left = chunks;
  auto self = shared_from_this();
  for (size_t c = 0; c < chunks; ++c) {
    SubmitLocked([self, index, c, chunk, grads, overwrite, final_micro] {
      float* accum;
      kernels::ScalarType type;
      uint64_t numel;
      {
        absl::MutexLock lock(&self->mu_);
        const Parameter& q = self->params_[index];
        accum = q.accum_ptr;
        type = q.desc.grad_type;
        numel = q.desc.numel;
      }
      const size_t b = c * chunk, e = std::min<size_t>(numel, b + chunk);
      kernels::AccumulateGradients(accum, overwrite, grads->data(), static_cast<int>(grads->size()),
                                   type, b, e);
      absl::MutexLock lock(&self->mu_);
      Parameter& q = self->params_[index];
      if (--q.chunks_left != 0 || !self->failure_.empty()) return;
      if (final_micro && self->settings_.machines > 1) {
        q.phase = Phase::kCrossMachine;
        // value: whether any rank of this machine had a gradient (the leaders combine these,
        // so a parameter no machine had a gradient for is left alone, as on one machine).
        self->SendToRank(0, Message(ipc::DoorbellKind::kReduceReady, index, self->iteration_ + 1,
                                    q.machine_gradient ? 1 : 0));
        return;
      }
      if (final_micro) {
        self->GradientsFinalLocked(index);
        return;
      }
      ++q.micro;
      q.phase = Phase::kWaiting;
      q.arrived.clear();
      q.absent.clear();
      self->SendToAll(
          Message(ipc::DoorbellKind::kGradConsumed, index, self->iteration_ + 1, q.micro - 1));
    });
  }
}

void JobOptimizer::ReducedLocked(const std::string& session_id,
                                 const ipc::DoorbellMessage& message) {
  last_activity_ = absl::Now();
  auto leader = rank_sessions_.find(0);
  if (settings_.machines < 2 || leader == rank_sessions_.end() || leader->second != session_id) {
    deps_.doorbells
        ->Send(session_id, Message(ipc::DoorbellKind::kError, message.id, message.step,
                                   kFailedPreconditionCode))
        .IgnoreError();
    if (settings_.machines < 2) return;
    FailLocked("a rank other than the machine's rank 0 announced a cross-machine reduction");
    return;
  }
  if (!failure_.empty()) return;
  if (message.id >= params_.size() || message.step != iteration_ + 1 ||
      params_[message.id].phase != Phase::kCrossMachine) {
    FailLocked(absl::StrFormat(
        "rank 0 announced the cross-machine sum of parameter %d for iteration %d, which was not "
        "out for reduction (the job is at iteration %d)",
        message.id, message.step, iteration_ + 1));
    return;
  }
  const uint32_t index = static_cast<uint32_t>(message.id);
  Parameter& p = params_[index];
  if (message.value == 0) {
    LeaveWithoutGradientLocked(index);  // no machine had a gradient for it
    return;
  }
  p.any_gradient = true;
  GradientsFinalLocked(index);
}

void JobOptimizer::NormContributionLocked(const std::string& session_id,
                                          const ipc::DoorbellMessage& message) {
  const std::optional<uint32_t> rank = RankOfSenderLocked(session_id, message);
  if (!rank || !failure_.empty()) return;
  const double sum_squares = std::bit_cast<double>(message.value);
  if (!settings_.gathers_stats()) {
    FailLocked(absl::StrFormat(
        "rank %d sent a gradient norm contribution, but job '%s' neither clips nor reports its "
        "gradient norm",
        *rank, job_.job_id));
  } else if (message.step != iteration_ + 1) {
    FailLocked(absl::StrFormat(
        "rank %d sent a gradient norm contribution for iteration %d; the job is at iteration %d",
        *rank, message.step, iteration_ + 1));
  } else if (!(sum_squares >= 0) || !std::isfinite(sum_squares)) {
    FailLocked(absl::StrFormat(
        "rank %d sent a gradient norm contribution of %g; it must be a finite sum of squares",
        *rank, sum_squares));
  } else if (params_with_stats_ == params_.size()) {
    // The ring is ordered: sent before the rank's last posts, it can only be late if the
    // client broke that order.
    FailLocked(absl::StrFormat(
        "rank %d sent a gradient norm contribution after iteration %d's norm was decided", *rank,
        iteration_ + 1));
  } else {
    contributed_sum_squares_ += sum_squares;
  }
}

void JobOptimizer::MaybeFinishIterationLocked() {
  if (params_done_ != params_.size()) return;
  const absl::Time now = absl::Now();
  ++iteration_;
  pending_report_.iteration = iteration_;
  pending_report_.seconds = absl::ToDoubleSeconds(now - iteration_start_);
  pending_report_.update_seconds = update_busy_s_;
  const double wall = update_bytes_ > 0 ? absl::ToDoubleSeconds(now - updates_start_) : 0;
  pending_report_.gbps = wall > 0 ? static_cast<double>(update_bytes_) / wall / 1e9 : 0;
  if (!GathersStatsLocked()) {
    pending_report_.nonfinite = update_nonfinite_;
    if (guard_tripped_) {
      pending_report_.skipped = true;
      deps_.events->Emit(
          "optimizer.step_skipped",
          absl::StrFormat("iteration %d of job '%s': %d non-finite gradient values, first in "
                          "'%s'; no tensor was updated from there on (%d of %d had been before "
                          "it; nonfinite='guard')",
                          iteration_, job_.job_id, update_nonfinite_, guard_first_,
                          guard_tensors_before_, params_.size()),
          {{"nonfinite", static_cast<double>(update_nonfinite_)},
           {"tensors_updated_before", static_cast<double>(guard_tensors_before_)}},
          "", job_.uid);
    } else if (update_nonfinite_ > 0) {
      deps_.events->Emit("optimizer.nonfinite",
                         absl::StrFormat("iteration %d of job '%s' applied %d non-finite gradient "
                                         "values (nonfinite='ignore'); use 'skip' or 'error' to "
                                         "guard against them",
                                         iteration_, job_.job_id, update_nonfinite_),
                         {{"nonfinite", static_cast<double>(update_nonfinite_)}}, "", job_.uid);
    }
  }
  last_report_ = pending_report_;
  ResetProgressLocked();
}

void JobOptimizer::ResetProgressLocked() {
  for (Parameter& p : params_) {
    p.phase = Phase::kWaiting;
    p.micro = 0;
    p.arrived.clear();
    p.absent.clear();
    p.any_gradient = false;
    p.machine_gradient = false;
    p.stats = {};
    p.chunks_left = 0;
    p.backed_up = false;
    p.restoring = false;
  }
  // Called with the failure's tasks all run (AwaitQuietLocked), its announcement made.
  undo_pending_ = 0;
  failure_unannounced_ = false;
  iteration_started_ = false;
  speculating_ = false;
  memory_seen_ = false;
  params_done_ = 0;
  params_with_stats_ = 0;
  contributed_sum_squares_ = 0;
  params_updated_ = 0;
  update_busy_s_ = 0;
  update_bytes_ = 0;
  update_nonfinite_ = 0;
  guard_tripped_ = false;
  guard_first_.clear();
  guard_tensors_before_ = 0;
  pending_report_ = {};
  if (next_groups_) {
    settings_.groups = std::move(next_groups_->groups);
    settings_.max_grad_norm = next_groups_->max_grad_norm;
    next_groups_.reset();
  }
}

bool JobOptimizer::InProgressLocked() const {
  if (iteration_started_) return true;
  for (const Parameter& p : params_) {
    if (p.phase != Phase::kWaiting || p.micro != 0 || !p.arrived.empty()) return true;
  }
  return false;
}

void JobOptimizer::SessionEndedLocked(const std::string& session_id, bool clean) {
  std::optional<uint32_t> rank;
  for (const auto& [r, s] : rank_sessions_) {
    if (s == session_id) rank = r;
  }
  if (!rank) return;
  rank_sessions_.erase(*rank);
  last_activity_ = absl::Now();
  const bool others = !rank_sessions_.empty();
  if (InProgressLocked() || (others && !clean)) {
    FailLocked(absl::StrFormat("rank %d %s at iteration %d; the job cannot go on without it", *rank,
                               clean ? "left" : "died", iteration_ + 1));
  } else if (others) {
    // Failing the others now would list every job whose ranks end one after another (all of
    // them) as failed. They are told if they step again (GradientReadyLocked).
    departed_.insert(*rank);
  } else {
    departed_.clear();  // the next ranks to register start the job over
    finished_ = clean && failure_.empty();
  }
}

void JobOptimizer::FailLocked(const std::string& why) {
  if (!failure_.empty()) return;
  failure_ = why;
  RollBackOnFailureLocked();
  deps_.events->Emit("optimizer.failed", absl::StrFormat("job '%s': %s", job_.job_id, why),
                     {{"iteration", static_cast<double>(iteration_ + 1)}}, "", job_.uid);
  // A rank that reads its tensors when told of the failure must find the speculated ones
  // restored, never half-way: the error waits for the restores above and for those of the
  // speculating passes still running (PassDoneLocked). Updates under way are not waited for:
  // they complete and count (see the class comment).
  undo_pending_ = 0;
  for (const Parameter& p : params_) {
    if (p.restoring || (p.phase == Phase::kSpeculating && p.backed_up)) ++undo_pending_;
  }
  failure_unannounced_ = true;
  AnnounceFailureIfUndoneLocked();
}

void JobOptimizer::AnnounceFailureIfUndoneLocked() {
  if (!failure_unannounced_ || undo_pending_ != 0) return;
  failure_unannounced_ = false;
  SendToAll(
      Message(ipc::DoorbellKind::kError, ~uint64_t{0}, iteration_ + 1, kFailedPreconditionCode));
}

void JobOptimizer::SendToRank(uint32_t rank, const ipc::DoorbellMessage& message) {
  auto it = rank_sessions_.find(rank);
  if (it == rank_sessions_.end()) return;
  absl::Status sent = deps_.doorbells->Send(it->second, message);
  if (!sent.ok() && sent.code() != absl::StatusCode::kNotFound) {
    deps_.events->Emit("optimizer.notify_failed",
                       absl::StrFormat("could not notify rank %d: %s", rank, sent.message()), {},
                       it->second, job_.uid);
  }
}

size_t JobOptimizer::ChunkElementsLocked() const {
  return settings_.chunk_elements > 0 ? settings_.chunk_elements
                                      : job_optimizer_internal::kDefaultChunkElements;
}

void JobOptimizer::SubmitLocked(std::function<void()> task) {
  ++tasks_in_flight_;
  // A job limited to `threads` workers keeps its other tasks here, in order, and hands the
  // next one to the pool as each of its own finishes: other jobs' tasks never wait behind them.
  if (settings_.threads > 0 && tasks_running_ >= settings_.threads) {
    waiting_tasks_.push_back(std::move(task));
    return;
  }
  ++tasks_running_;
  RunOnPoolLocked(std::move(task));
}

void JobOptimizer::RunOnPoolLocked(std::function<void()> task) {
  deps_.pool->Submit([self = shared_from_this(), task = std::move(task)] {
    task();
    absl::MutexLock lock(&self->mu_);
    --self->tasks_in_flight_;
    if (self->waiting_tasks_.empty()) {
      --self->tasks_running_;
      return;
    }
    std::function<void()> next = std::move(self->waiting_tasks_.front());
    self->waiting_tasks_.pop_front();
    self->RunOnPoolLocked(std::move(next));
  });
}

void JobOptimizer::AwaitQuietLocked() {
  mu_.Await(absl::Condition(this, &JobOptimizer::QuietLocked));
}

void JobOptimizer::SendToAll(const ipc::DoorbellMessage& message) {
  for (const auto& [rank, session] : rank_sessions_) SendToRank(rank, message);
}

}  // namespace trainstream::daemon
