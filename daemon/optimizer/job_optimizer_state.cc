// SPDX-License-Identifier: Apache-2.0
// JobOptimizer's state seen from outside: its report, and checkpoints saved and restored with the
// job's lock released through their I/O (the job's messages wait for it in deferred_).
#include "optimizer/job_optimizer.h"

#include "absl/strings/str_format.h"
#include "optimizer/checkpoint.h"
#include "trainstream/status_macros.h"

namespace trainstream::daemon {

OptimizerReport JobOptimizer::Report() const {
  absl::MutexLock lock(&mu_);
  OptimizerReport r;
  r.job_id = job_.job_id;
  r.settings = settings_;
  r.iteration = iteration_;
  r.world_size = world_size_;
  r.ranks_attached = static_cast<uint32_t>(rank_sessions_.size());
  r.tensors = static_cast<uint32_t>(params_.size());
  for (const Parameter& p : params_) {
    r.elements += p.desc.numel;
    r.state_bytes += p.master.bytes + p.exp_avg.bytes + p.exp_avg_sq.bytes +
                     (p.param ? p.param->bytes : 0) + (p.accum ? p.accum->bytes : 0);
    for (const auto& [rank, grad] : p.grads) r.state_bytes += grad.bytes;
    r.param_steps.push_back(p.param_step);
  }
  r.last_step = last_report_;
  r.speculated_steps = speculated_steps_;
  r.rolled_back_steps = rolled_back_steps_;
  r.state = !failure_.empty() ? "failed: " + failure_
            : InProgressLocked() ? "stepping"
            : finished_          ? "finished"
                                 : "ready";
  return r;
}

CheckpointContents JobOptimizer::ContentsLocked() const {
  CheckpointContents contents;
  contents.job_id = job_.job_id;
  contents.iteration = iteration_;
  contents.settings = settings_;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Parameter& p = params_[i];
    contents.params.push_back({p.desc, p.param_step});
    contents.arrays.push_back({absl::StrFormat("%d.master", i), kernels::ScalarType::kFloat32,
                               p.desc.numel, p.master_ptr});
    contents.arrays.push_back({absl::StrFormat("%d.exp_avg", i), settings_.moment_type,
                               p.desc.numel, p.exp_avg_ptr});
    contents.arrays.push_back({absl::StrFormat("%d.exp_avg_sq", i), settings_.moment_type,
                               p.desc.numel, p.exp_avg_sq_ptr});
  }
  return contents;
}

absl::StatusOr<uint64_t> JobOptimizer::Save(const std::string& path) {
  return SaveWith(
      [&](const CheckpointContents& contents) { return WriteCheckpoint(path, contents); });
}

absl::StatusOr<uint64_t> JobOptimizer::SaveTo(int fd, const std::string& name) {
  return SaveWith([&](const CheckpointContents& contents) {
    return WriteCheckpointToFile(fd, name, contents);
  });
}

absl::StatusOr<uint64_t> JobOptimizer::SaveWith(const CheckpointWriter& write) {
  CheckpointContents contents;
  {
    absl::MutexLock lock(&mu_);
    AwaitQuietLocked();
    if (InProgressLocked()) {
      return absl::FailedPreconditionError("a step is in progress; checkpoint between steps");
    }
    if (!registered_) return absl::FailedPreconditionError("no parameters are registered yet");
    contents = ContentsLocked();
    file_io_ = true;
  }
  // Written without the lock: the doorbell thread takes it for each of this job's messages, and
  // every other job's wait behind them while it is held (a 0.75 GiB save held them 0.5 s). No
  // update runs meanwhile (file_io_), so the arrays keep the state taken above.
  absl::StatusOr<uint64_t> written = write(contents);
  absl::MutexLock lock(&mu_);
  EndFileIoLocked();
  return written;
}

absl::Status JobOptimizer::Load(const std::string& path, const FileSource& source) {
  CheckpointContents live;
  {
    absl::MutexLock lock(&mu_);
    // A failed iteration's update still queued would otherwise write over the restored state.
    AwaitQuietLocked();
    if (InProgressLocked() && failure_.empty()) {
      return absl::FailedPreconditionError("a step is in progress; restore between steps");
    }
    if (!registered_) {
      return absl::FailedPreconditionError(
          "register the parameters before restoring a checkpoint");
    }
    live = ContentsLocked();
    file_io_ = true;
  }
  // The live arrays are the destination; they are written only after the whole file checks out.
  // Read without the lock, as a save writes (see SaveWith).
  absl::StatusOr<CheckpointContents> loaded = ReadCheckpoint(path, live, source);
  absl::MutexLock lock(&mu_);
  if (loaded.ok()) {
    iteration_ = loaded->iteration;
    for (size_t i = 0; i < params_.size(); ++i) {
      params_[i].param_step = loaded->params[i].step;
      params_[i].updated_in = 0;  // the restored state holds no update of the next iteration
      // The model-dtype copy follows the restored master.
      if (params_[i].param_ptr != nullptr) {
        kernels::ConvertFromFloat(params_[i].master_ptr, params_[i].param_ptr,
                                  params_[i].desc.param_type, params_[i].desc.numel);
      }
    }
    failure_.clear();
    ResetProgressLocked();
  }
  EndFileIoLocked();
  return loaded.status();
}

absl::Status JobOptimizer::SetSteps(uint64_t iteration, const std::vector<uint64_t>& param_steps) {
  absl::MutexLock lock(&mu_);
  // As in Load: none of a failed iteration's tasks may run after the progress is reset.
  AwaitQuietLocked();
  if (InProgressLocked() && failure_.empty()) {
    return absl::FailedPreconditionError("a step is in progress; set the step between steps");
  }
  if (!param_steps.empty() && param_steps.size() != params_.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%d parameter steps given for %d parameters", param_steps.size(), params_.size()));
  }
  iteration_ = iteration;
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].param_step = param_steps.empty() ? iteration : param_steps[i];
    params_[i].updated_in = 0;  // the caller's state replaces what a failed iteration did
  }
  failure_.clear();
  ResetProgressLocked();
  return absl::OkStatus();
}

bool JobOptimizer::DeferLocked(Deferred deferred) {
  if (!file_io_) return false;
  // A rank waits for each gradient it posted to be used before it posts that tensor's next, so
  // the job's messages during one save are about a step's worth. A session's end is never
  // dropped: its rank would stay attached.
  const size_t bound = 2 * (params_.size() + 2) * world_size_ + 64;
  if (deferred.kind != Deferred::Kind::kSessionEnded && deferred_.size() >= bound) {
    FailLocked(absl::StrFormat(
        "the ranks sent %d doorbell messages while a checkpoint was being written or read, more "
        "than a step has",
        deferred_.size() + 1));
    return true;
  }
  deferred_.push_back(std::move(deferred));
  return true;
}

void JobOptimizer::EndFileIoLocked() {
  file_io_ = false;
  std::vector<Deferred> waiting;
  waiting.swap(deferred_);
  for (const Deferred& d : waiting) {
    switch (d.kind) {
      case Deferred::Kind::kGradientReady:
        GradientReadyLocked(d.session_id, d.message);
        break;
      case Deferred::Kind::kReduced:
        ReducedLocked(d.session_id, d.message);
        break;
      case Deferred::Kind::kNormContribution:
        NormContributionLocked(d.session_id, d.message);
        break;
      case Deferred::Kind::kSessionEnded:
        SessionEndedLocked(d.session_id, d.clean);
        break;
    }
  }
}

}  // namespace trainstream::daemon
