// SPDX-License-Identifier: Apache-2.0
// JobOptimizer's creation, the ranks' agreement on its settings, and registration: the state and
// gradient buffers each parameter gets from the arena.
#include "optimizer/job_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_format.h"
#include "trainstream/status_macros.h"

namespace trainstream::daemon {
namespace {

const char* UpdatesStartWhen(const OptimizerSettings& s) {
  if (s.defer_updates) return "after the last gradient (eager=False)";
  if (!s.may_roll_back()) return "as each gradient lands";
  return s.eager_updates ? "as each gradient lands, speculatively: undone and redone when "
                           "clipping or a check says so"
                         : "as each gradient lands after a step that needed no clipping "
                           "(speculatively: undone and redone when it does), else after the "
                           "last gradient";
}

}  // namespace

absl::StatusOr<std::shared_ptr<JobOptimizer>> JobOptimizer::Create(
    const JobKey& job, const OptimizerSettings& settings, uint32_t world_size, Deps deps) {
  RETURN_IF_ERROR(ValidateSettings(settings));
  auto optimizer = std::shared_ptr<JobOptimizer>(new JobOptimizer(job, settings, world_size, deps));
  deps.events->Emit(
      "optimizer.created",
      absl::StrFormat("%s for job '%s': %d group(s), %s moments, %s, updates %s",
                      settings.decoupled_weight_decay ? "AdamW" : "Adam", job.job_id,
                      settings.groups.size(), kernels::ScalarTypeName(settings.moment_type),
                      kernels::IsaName(kernels::BestIsa()),
                      UpdatesStartWhen(settings)),
      {{"world_size", world_size},
       {"threads", static_cast<double>(deps.pool->size())},
       {"accumulation_steps", settings.accumulation_steps},
       {"max_grad_norm", settings.max_grad_norm}},
      "", job.uid);
  return optimizer;
}

JobOptimizer::JobOptimizer(const JobKey& job, const OptimizerSettings& settings,
                           uint32_t world_size, Deps deps)
    : job_(job),
      owner_("optimizer"),
      world_size_(world_size == 0 ? 1 : world_size),
      deps_(deps),
      settings_(settings),
      last_activity_(absl::Now()) {}

JobOptimizer::~JobOptimizer() {
  uint64_t released = deps_.arena->ReleaseSession(job_, owner_);
  deps_.events->Emit("optimizer.freed",
                     absl::StrFormat("optimizer state of job '%s' freed", job_.job_id),
                     {{"released_bytes", static_cast<double>(released)}}, "", job_.uid);
}

absl::Status JobOptimizer::CheckSame(const OptimizerSettings& s, uint32_t world_size) const {
  absl::MutexLock lock(&mu_);
  const OptimizerSettings& mine = settings_;
  std::string difference;
  if (s.decoupled_weight_decay != mine.decoupled_weight_decay) difference = "the optimizer kind";
  else if (s.moment_type != mine.moment_type) difference = "moment_dtype";
  else if (s.accumulation_steps != mine.accumulation_steps) difference = "accumulation_steps";
  else if (s.machines != mine.machines) difference = "machines";
  else if (s.nonfinite != mine.nonfinite) difference = "the non-finite policy";
  else if (s.groups.size() != mine.groups.size()) difference = "the number of parameter groups";
  else if (s.max_grad_norm != mine.max_grad_norm) difference = "max_grad_norm";
  else if (s.threads != mine.threads) difference = "threads";
  else if (s.chunk_elements != mine.chunk_elements) difference = "chunk_elements";
  else if (s.defer_updates != mine.defer_updates || s.eager_updates != mine.eager_updates) {
    difference = "eager";
  }
  else if ((world_size == 0 ? 1 : world_size) != world_size_) difference = "world_size";
  if (!difference.empty()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "ranks do not agree: this rank's %s differs from the optimizer job '%s' already has",
        difference, job_.job_id));
  }
  return absl::OkStatus();
}

absl::Status JobOptimizer::SetGroups(const std::vector<GroupHyperParameters>& groups,
                                     double max_grad_norm) {
  RETURN_IF_ERROR(ValidateGroups(groups));
  if (!(max_grad_norm >= 0) || !std::isfinite(max_grad_norm)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("max_grad_norm %g is not a finite value >= 0", max_grad_norm));
  }
  absl::MutexLock lock(&mu_);
  for (const Parameter& p : params_) {
    if (p.desc.group >= groups.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%d groups given; parameter '%s' is in group %d (a group can be dropped only when "
          "no parameter is in it)",
          groups.size(), p.desc.name, p.desc.group));
    }
  }
  if ((max_grad_norm > 0) != (settings_.max_grad_norm > 0)) {
    return absl::FailedPreconditionError(
        "clipping can be retuned but not switched on or off after creation");
  }
  if (StepPendingLocked()) {
    // Some tensors of this iteration may have stepped already (updates start as gradients
    // land): the rest step with the same values, and the new ones wait for the next iteration.
    // Gradients that wait for a checkpoint's I/O count: they came first.
    next_groups_ = Retune{groups, max_grad_norm};
    deps_.events->Emit("optimizer.groups_deferred",
                       absl::StrFormat("job '%s': new hyper-parameters arrived during iteration "
                                       "%d; they apply from iteration %d",
                                       job_.job_id, iteration_ + 1, iteration_ + 2),
                       {{"iteration", static_cast<double>(iteration_ + 1)}}, "", job_.uid);
    return absl::OkStatus();
  }
  settings_.groups = groups;
  settings_.max_grad_norm = max_grad_norm;
  return absl::OkStatus();
}

absl::StatusOr<RegistrationResult> JobOptimizer::Register(
    const std::string& session_id, uint32_t rank, const std::vector<ParameterDescription>& params) {
  if (params.empty()) return absl::InvalidArgumentError("no parameters to register");
  absl::MutexLock lock(&mu_);
  // The failed iteration's tasks finish first: one still queued when the progress is reset
  // below would count its chunk against the iteration that follows (and hang it), or write a
  // tensor that a new update is writing. So does a checkpoint in flight, whose arrays are the
  // parameter list this may change.
  AwaitQuietLocked();
  // Every refusal comes before anything changes, and what this call allocates is given back if a
  // later allocation fails: a registration that returns an error leaves the job as it was.
  RETURN_IF_ERROR(CheckRegistrationLocked(session_id, rank, params));
  if (!failure_.empty() && rank_sessions_.empty()) {
    // A job whose ranks all left after a failure redoes the iteration that failed; the tensors
    // stepped for it before the failure keep that step (see the class comment).
    size_t kept = 0;
    for (const Parameter& p : params_) kept += SteppedThisIterationLocked(p) ? 1 : 0;
    deps_.events->Emit(
        "optimizer.recovered",
        absl::StrFormat("job '%s' redoes iteration %d after: %s (%d of %d tensors had been "
                        "stepped for it and keep that step)",
                        job_.job_id, iteration_ + 1, failure_, kept, params_.size()),
        {{"iteration", static_cast<double>(iteration_)},
         {"tensors_kept", static_cast<double>(kept)}},
        session_id, job_.uid);
    failure_.clear();
    ResetProgressLocked();
  }
  RegistrationResult result;
  const size_t before = params_.size();
  if (!registered_) {
    params_.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      params_[i].desc = params[i];
      absl::Status allocated = AllocateParameterLocked(params_[i], static_cast<uint32_t>(i));
      if (!allocated.ok()) {
        deps_.arena->ReleaseSession(job_, owner_);
        params_.clear();
        return allocated;
      }
    }
    result.initialize = true;
  } else if (params.size() > params_.size()) {
    RETURN_IF_ERROR(AddParametersLocked(params));
  }
  absl::Status grads = AllocateGradientsLocked(rank);
  if (!grads.ok()) {
    if (result.initialize) {
      deps_.arena->ReleaseSession(job_, owner_);
      params_.clear();
    } else {
      for (size_t k = before; k < params_.size(); ++k) ReleaseParameterLocked(params_[k]);
      params_.resize(before);
    }
    return grads;
  }
  registered_ = true;
  rank_sessions_[rank] = session_id;
  departed_.erase(rank);  // back (a restarted process)
  finished_ = false;
  if (!result.initialize && params_.size() > before) {
    uint64_t added = 0;
    for (size_t i = before; i < params_.size(); ++i) added += params_[i].desc.numel;
    deps_.events->Emit("optimizer.extended",
                       absl::StrFormat("job '%s' added %d tensors (%d elements) at iteration %d",
                                       job_.job_id, params_.size() - before, added, iteration_),
                       {{"tensors", static_cast<double>(params_.size() - before)},
                        {"elements", static_cast<double>(added)}},
                       session_id, job_.uid);
  }
  result.first_added = result.initialize ? 0 : static_cast<uint32_t>(before);
  for (size_t i = 0; i < params_.size(); ++i) {
    const Parameter& p = params_[i];
    ParameterSlots slots;
    slots.index = static_cast<uint32_t>(i);
    slots.master = p.master;
    slots.exp_avg = p.exp_avg;
    slots.exp_avg_sq = p.exp_avg_sq;
    slots.param = p.param;
    slots.grad = p.grads.at(rank);
    if (settings_.machines > 1 && rank == 0) slots.reduce = p.accum;
    result.params.push_back(std::move(slots));
  }
  result.iteration = iteration_;
  last_activity_ = absl::Now();
  return result;
}

absl::Status JobOptimizer::CheckRegistrationLocked(
    const std::string& session_id, uint32_t rank,
    const std::vector<ParameterDescription>& params) const {
  if (rank >= world_size_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank %d is not below the job's world_size %d", rank, world_size_));
  }
  for (const ParameterDescription& d : params) {
    if (d.numel == 0) {
      return absl::InvalidArgumentError(absl::StrFormat("parameter '%s' has no elements", d.name));
    }
    if (d.group >= settings_.groups.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "parameter '%s' is in group %d; the optimizer has %d", d.name, d.group,
          settings_.groups.size()));
    }
  }
  if (auto it = rank_sessions_.find(rank); it != rank_sessions_.end() && it->second != session_id) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "rank %d of job '%s' is already attached (session %s)", rank, job_.job_id, it->second));
  }
  if (!registered_) return absl::OkStatus();
  if (params.size() < params_.size()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "ranks do not agree: this rank registers %d parameters, the job has %d", params.size(),
        params_.size()));
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!(params[i] == params_[i].desc)) {
      const ParameterDescription& mine = params_[i].desc;
      return absl::FailedPreconditionError(absl::StrFormat(
          "ranks do not agree on parameter %d: this rank has '%s' (%d elements, %s), the job "
          "has '%s' (%d elements, %s)",
          i, params[i].name, params[i].numel, kernels::ScalarTypeName(params[i].param_type),
          mine.name, mine.numel, kernels::ScalarTypeName(mine.param_type)));
    }
  }
  return absl::OkStatus();
}

absl::Status JobOptimizer::AllocateGradientsLocked(uint32_t rank) {
  std::vector<size_t> allocated;  // parameters that got this rank's slot in this call
  absl::Status status;
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = params_[i];
    if (p.grads.contains(rank)) continue;
    absl::StatusOr<BufferRecord> grad =
        AllocateLocked(absl::StrFormat("opt/%d/grad%d", i, rank),
                       BufferBytesFor(settings_, p.desc).grad, "optimizer.grad");
    if (!grad.ok()) {
      status = grad.status();
      break;
    }
    absl::StatusOr<uint8_t*> data = Data(*grad);
    if (!data.ok()) {
      deps_.arena->Free(job_, owner_, grad->buffer_id).IgnoreError();
      status = data.status();
      break;
    }
    p.grads[rank] = *grad;
    p.grad_ptrs[rank] = *data;
    allocated.push_back(i);
  }
  if (status.ok()) return status;
  for (size_t i : allocated) {
    Parameter& p = params_[i];
    deps_.arena->Free(job_, owner_, p.grads[rank].buffer_id).IgnoreError();
    p.grads.erase(rank);
    p.grad_ptrs.erase(rank);
  }
  return status;
}

absl::Status JobOptimizer::AddParametersLocked(const std::vector<ParameterDescription>& params) {
  if (InProgressLocked()) {
    return absl::FailedPreconditionError(
        "parameters can be added only between steps (after step(), before the next backward)");
  }
  const size_t before = params_.size();
  params_.resize(params.size());
  for (size_t i = before; i < params.size(); ++i) {
    params_[i].desc = params[i];
    absl::Status allocated = AllocateParameterLocked(params_[i], static_cast<uint32_t>(i));
    if (!allocated.ok()) {
      // Give back what the new parameters got, so a retry (after freeing memory) starts clean.
      for (size_t k = before; k <= i; ++k) ReleaseParameterLocked(params_[k]);
      params_.resize(before);
      return allocated;
    }
  }
  return absl::OkStatus();
}

absl::Status JobOptimizer::AllocateParameterLocked(Parameter& p, uint32_t index) {
  const std::string prefix = absl::StrFormat("opt/%d/", index);
  const ParameterBufferBytes bytes = BufferBytesFor(settings_, p.desc);
  ASSIGN_OR_RETURN(p.master, AllocateLocked(prefix + "master", bytes.master, "optimizer.master"));
  ASSIGN_OR_RETURN(p.exp_avg,
                   AllocateLocked(prefix + "exp_avg", bytes.moment, "optimizer.moments"));
  ASSIGN_OR_RETURN(p.exp_avg_sq,
                   AllocateLocked(prefix + "exp_avg_sq", bytes.moment, "optimizer.moments"));
  ASSIGN_OR_RETURN(uint8_t * master, Data(p.master));
  ASSIGN_OR_RETURN(uint8_t * m, Data(p.exp_avg));
  ASSIGN_OR_RETURN(uint8_t * v, Data(p.exp_avg_sq));
  p.master_ptr = reinterpret_cast<float*>(master);
  p.exp_avg_ptr = m;
  p.exp_avg_sq_ptr = v;
  // Freed ranges are reused, so fresh state is cleared explicitly, by all the workers: a
  // billion-parameter model's moments are gigabytes.
  ClearInParallel(m, bytes.moment);
  ClearInParallel(v, bytes.moment);
  if (bytes.param > 0) {
    ASSIGN_OR_RETURN(p.param, AllocateLocked(prefix + "param", bytes.param, "optimizer.param"));
    ASSIGN_OR_RETURN(uint8_t * param, Data(*p.param));
    p.param_ptr = param;
  }
  if (bytes.accum > 0) {
    ASSIGN_OR_RETURN(p.accum, AllocateLocked(prefix + "accum", bytes.accum, "optimizer.accum"));
    ASSIGN_OR_RETURN(uint8_t * accum, Data(*p.accum));
    p.accum_ptr = reinterpret_cast<float*>(accum);
  }
  return absl::OkStatus();
}

absl::StatusOr<BufferRecord> JobOptimizer::AllocateLocked(const std::string& name, uint64_t bytes,
                                                         const std::string& tag) {
  AllocationRequest request;
  request.job = job_;
  request.session_id = owner_;
  request.name = name;
  request.bytes = std::max<uint64_t>(bytes, 1);
  request.alignment = kOptimizerBufferAlignment;
  request.tag = tag;
  return deps_.arena->Allocate(request);
}

absl::StatusOr<uint8_t*> JobOptimizer::Data(const BufferRecord& record) const {
  return deps_.arena->BufferData(job_, record.buffer_id);
}

void JobOptimizer::ClearInParallel(uint8_t* data, uint64_t bytes) {
  constexpr uint64_t kPiece = uint64_t{64} << 20;
  if (bytes <= kPiece) {
    std::memset(data, 0, bytes);
    return;
  }
  deps_.pool->ParallelFor((bytes + kPiece - 1) / kPiece, [&](size_t i) {
    const uint64_t begin = i * kPiece;
    std::memset(data + begin, 0, std::min(kPiece, bytes - begin));
  });
}

void JobOptimizer::ReleaseParameterLocked(Parameter& p) {
  auto release = [&](const std::optional<BufferRecord>& record) {
    if (record && record->buffer_id != 0) {
      deps_.arena->Free(job_, owner_, record->buffer_id).IgnoreError();
    }
  };
  release(p.master);
  release(p.exp_avg);
  release(p.exp_avg_sq);
  release(p.param);
  release(p.accum);
  for (const auto& [rank, grad] : p.grads) release(grad);
}

bool JobOptimizer::has_sessions() const {
  absl::MutexLock lock(&mu_);
  return !rank_sessions_.empty();
}

absl::Time JobOptimizer::last_activity() const {
  absl::MutexLock lock(&mu_);
  return last_activity_;
}

bool JobOptimizer::IdleFor(absl::Duration retention, absl::Time now) const {
  if (!mu_.TryLock()) return false;
  const bool idle = !file_io_ && rank_sessions_.empty() && now - last_activity_ > retention;
  mu_.Unlock();
  return idle;
}

}  // namespace trainstream::daemon
