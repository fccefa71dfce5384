// SPDX-License-Identifier: Apache-2.0
#include "optimizer/job_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_format.h"
#include "optimizer/checkpoint.h"
#include "trainstream/status_macros.h"

namespace trainstream::daemon {
namespace {

constexpr size_t kChunkElements = size_t{1} << 18;  // ~7 MB of traffic per task
constexpr uint64_t kFailedPreconditionCode = 9;

size_t Chunks(uint64_t numel) { return (numel + kChunkElements - 1) / kChunkElements; }

uint64_t Mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

ipc::DoorbellMessage Message(ipc::DoorbellKind kind, uint64_t id, uint64_t step, uint64_t value = 0,
                             uint32_t flags = 0) {
  return {static_cast<uint32_t>(kind), flags, id, step, value};
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
                      settings.deferred() ? "after the last gradient (clipping or checks)"
                                          : "as each gradient lands"),
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
  else if ((world_size == 0 ? 1 : world_size) != world_size_) difference = "world_size";
  if (!difference.empty()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "ranks do not agree: this rank's %s differs from the optimizer job '%s' already has",
        difference, job_.job_id));
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

absl::StatusOr<RegistrationResult> JobOptimizer::Register(
    const std::string& session_id, uint32_t rank, const std::vector<ParameterDescription>& params) {
  if (params.empty()) return absl::InvalidArgumentError("no parameters to register");
  absl::MutexLock lock(&mu_);
  if (rank >= world_size_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank %d is not below the job's world_size %d", rank, world_size_));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const ParameterDescription& d = params[i];
    if (d.numel == 0) {
      return absl::InvalidArgumentError(absl::StrFormat("parameter '%s' has no elements", d.name));
    }
    if (d.group >= settings_.groups.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "parameter '%s' is in group %d; the optimizer has %d", d.name, d.group,
          settings_.groups.size()));
    }
  }
  RegistrationResult result;
  size_t first_added = params.size();
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
    registered_ = true;
    result.initialize = true;
  } else {
    if (params.size() < params_.size()) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "ranks do not agree: this rank registers %d parameters, the job has %d",
          params.size(), params_.size()));
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
    if (params.size() > params_.size()) {
      first_added = params_.size();
      RETURN_IF_ERROR(AddParametersLocked(params, session_id));
    }
  }
  result.first_added = result.initialize ? 0 : static_cast<uint32_t>(first_added);
  if (auto it = rank_sessions_.find(rank); it != rank_sessions_.end() && it->second != session_id) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "rank %d of job '%s' is already attached (session %s)", rank, job_.job_id, it->second));
  }
  if (!failure_.empty() && rank_sessions_.empty()) {
    // A job whose ranks all left after a failure starts over from its last complete iteration.
    deps_.events->Emit("optimizer.recovered",
                       absl::StrFormat("job '%s' resumes at iteration %d after: %s", job_.job_id,
                                       iteration_, failure_),
                       {{"iteration", static_cast<double>(iteration_)}}, session_id, job_.uid);
    failure_.clear();
    ResetProgressLocked();
  }
  rank_sessions_[rank] = session_id;
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = params_[i];
    if (!p.grads.contains(rank)) {
      ASSIGN_OR_RETURN(BufferRecord grad,
                       AllocateLocked(absl::StrFormat("opt/%d/grad%d", i, rank),
                                      BufferBytesFor(settings_, p.desc).grad, "optimizer.grad"));
      ASSIGN_OR_RETURN(uint8_t * data, Data(grad));
      p.grads[rank] = grad;
      p.grad_ptrs[rank] = data;
    }
    ParameterSlots slots;
    slots.index = static_cast<uint32_t>(i);
    slots.master = p.master;
    slots.exp_avg = p.exp_avg;
    slots.exp_avg_sq = p.exp_avg_sq;
    slots.param = p.param;
    slots.grad = p.grads[rank];
    if (settings_.machines > 1 && rank == 0) slots.reduce = p.accum;
    result.params.push_back(std::move(slots));
  }
  result.iteration = iteration_;
  last_activity_ = absl::Now();
  return result;
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

absl::Status JobOptimizer::AddParametersLocked(const std::vector<ParameterDescription>& params,
                                              const std::string& session_id) {
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
  uint64_t added = 0;
  for (size_t i = before; i < params.size(); ++i) added += params[i].numel;
  deps_.events->Emit("optimizer.extended",
                     absl::StrFormat("job '%s' added %d tensors (%d elements) at iteration %d",
                                     job_.job_id, params.size() - before, added, iteration_),
                     {{"tensors", static_cast<double>(params.size() - before)},
                      {"elements", static_cast<double>(added)}},
                     session_id, job_.uid);
  return absl::OkStatus();
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

void JobOptimizer::SendToAll(const ipc::DoorbellMessage& message) {
  for (const auto& [rank, session] : rank_sessions_) SendToRank(rank, message);
}

void JobOptimizer::FailLocked(const std::string& why) {
  if (!failure_.empty()) return;
  failure_ = why;
  deps_.events->Emit("optimizer.failed", absl::StrFormat("job '%s': %s", job_.job_id, why),
                     {{"iteration", static_cast<double>(iteration_ + 1)}}, "", job_.uid);
  SendToAll(Message(ipc::DoorbellKind::kError, ~uint64_t{0}, iteration_ + 1,
                    kFailedPreconditionCode));
}

float JobOptimizer::MeanScaleLocked() const {
  return 1.0f / static_cast<float>(world_size_ * settings_.machines);
}

std::vector<const void*> JobOptimizer::GradientsLocked(const Parameter& p) const {
  std::vector<const void*> grads;
  if (settings_.reduces_into_buffer()) {
    grads.push_back(p.accum_ptr);
    return grads;
  }
  for (const auto& [rank, ptr] : p.grad_ptrs) {
    if (rank < world_size_ && !p.absent.contains(rank)) grads.push_back(ptr);
  }
  return grads;
}

void JobOptimizer::OnGradientReady(const std::string& session_id,
                                   const ipc::DoorbellMessage& message) {
  absl::MutexLock lock(&mu_);
  last_activity_ = absl::Now();
  std::optional<uint32_t> rank;
  for (const auto& [r, s] : rank_sessions_) {
    if (s == session_id) rank = r;
  }
  if (!rank) {
    deps_.doorbells->Send(session_id, Message(ipc::DoorbellKind::kError, message.id, message.step,
                                              kFailedPreconditionCode))
        .IgnoreError();
    return;
  }
  if (!failure_.empty()) {
    SendToRank(*rank, Message(ipc::DoorbellKind::kError, message.id, message.step,
                              kFailedPreconditionCode));
    return;
  }
  if (message.id >= params_.size()) {
    FailLocked(absl::StrFormat("rank %d posted a gradient for parameter %d; the job has %d",
                               *rank, message.id, params_.size()));
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
  }
  p.arrived.insert(*rank);
  if (message.flags & ipc::kFlagNoGradient) p.absent.insert(*rank);
  if (p.arrived.size() == world_size_) AfterGradientsInLocked(static_cast<uint32_t>(message.id));
}

void JobOptimizer::LeaveWithoutGradientLocked(uint32_t index) {
  // Like torch: a parameter without a gradient keeps its value, moments and step count.
  params_[index].phase = Phase::kDone;
  ++params_done_;
  ++params_with_stats_;
  SendToAll(Message(ipc::DoorbellKind::kUpdateDone, index, iteration_ + 1, 0,
                    ipc::kFlagNoGradient));
  if (settings_.deferred()) MaybeDecideLocked();
  MaybeFinishIterationLocked();
}

void JobOptimizer::OnReduced(const std::string& session_id, const ipc::DoorbellMessage& message) {
  absl::MutexLock lock(&mu_);
  last_activity_ = absl::Now();
  auto leader = rank_sessions_.find(0);
  if (settings_.machines < 2 || leader == rank_sessions_.end() || leader->second != session_id) {
    deps_.doorbells->Send(session_id, Message(ipc::DoorbellKind::kError, message.id, message.step,
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
  if (settings_.deferred()) {
    StartStatsLocked(index);
  } else {
    StartUpdateLocked(index, MeanScaleLocked());
  }
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
  if (settings_.deferred()) {
    StartStatsLocked(index);
  } else {
    StartUpdateLocked(index, MeanScaleLocked());
  }
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
  const size_t chunks = Chunks(p.desc.numel);
  p.chunks_left = chunks;
  auto self = shared_from_this();
  for (size_t c = 0; c < chunks; ++c) {
    deps_.pool->Submit([self, index, c, grads, overwrite, final_micro] {
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
      const size_t b = c * kChunkElements, e = std::min<size_t>(numel, b + kChunkElements);
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
        if (self->settings_.deferred()) {
          self->StartStatsLocked(index);
        } else {
          self->StartUpdateLocked(index, self->MeanScaleLocked());
        }
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

void JobOptimizer::StartStatsLocked(uint32_t index) {
  Parameter& p = params_[index];
  p.phase = Phase::kStatsPending;
  p.stats = {};
  auto grads = std::make_shared<std::vector<const void*>>(GradientsLocked(p));
  const kernels::ScalarType type =
      settings_.reduces_into_buffer() ? kernels::ScalarType::kFloat32 : p.desc.grad_type;
  const size_t chunks = Chunks(p.desc.numel);
  const uint64_t numel = p.desc.numel;
  p.chunks_left = chunks;
  auto self = shared_from_this();
  for (size_t c = 0; c < chunks; ++c) {
    deps_.pool->Submit([self, index, c, grads, type, numel] {
      const size_t b = c * kChunkElements, e = std::min<size_t>(numel, b + kChunkElements);
      kernels::GradientStats stats =
          kernels::ComputeGradientStats(grads->data(), static_cast<int>(grads->size()), type, b, e,
                                        kernels::BestIsa());
      absl::MutexLock lock(&self->mu_);
      Parameter& q = self->params_[index];
      q.stats.sum_squares += stats.sum_squares;
      q.stats.nonfinite += stats.nonfinite;
      if (--q.chunks_left != 0) return;
      q.phase = Phase::kStatsDone;
      ++self->params_with_stats_;
      if (self->failure_.empty()) self->MaybeDecideLocked();
    });
  }
}

void JobOptimizer::MaybeDecideLocked() {
  if (params_with_stats_ != params_.size()) return;
  double sum_squares = 0;
  uint64_t nonfinite = 0;
  std::string first_bad;
  for (const Parameter& p : params_) {
    sum_squares += p.stats.sum_squares;
    nonfinite += p.stats.nonfinite;
    if (p.stats.nonfinite > 0 && first_bad.empty()) first_bad = p.desc.name;
  }
  const float mean = MeanScaleLocked();
  const double norm = std::sqrt(sum_squares) * mean;
  pending_report_.grad_norm = norm;
  pending_report_.nonfinite = nonfinite;
  if (nonfinite > 0 && settings_.nonfinite != NonFinitePolicy::kIgnore) {
    // kGuard deferred by clipping sees every gradient before any update: the whole step skips.
    if (settings_.nonfinite == NonFinitePolicy::kSkipStep ||
        settings_.nonfinite == NonFinitePolicy::kGuard) {
      pending_report_.skipped = true;
      deps_.events->Emit("optimizer.step_skipped",
                         absl::StrFormat("iteration %d of job '%s' skipped: %d non-finite gradient "
                                         "values, first in '%s'",
                                         iteration_ + 1, job_.job_id, nonfinite, first_bad),
                         {{"nonfinite", static_cast<double>(nonfinite)}}, "", job_.uid);
      for (size_t i = 0; i < params_.size(); ++i) {
        if (params_[i].phase == Phase::kDone) continue;
        params_[i].phase = Phase::kDone;
        ++params_done_;
        SendToAll(Message(ipc::DoorbellKind::kUpdateDone, i, iteration_ + 1, 0,
                          ipc::kFlagSkipped));
      }
      MaybeFinishIterationLocked();
      return;
    }
    FailLocked(absl::StrFormat(
        "%d non-finite gradient values at iteration %d, first in '%s'; nothing was updated (use "
        "nonfinite='skip' to skip such steps)",
        nonfinite, iteration_ + 1, first_bad));
    return;
  }
  float coef = 1.0f;
  if (settings_.max_grad_norm > 0) {
    // As torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6), never above 1, in fp32.
    coef = std::min(1.0f, static_cast<float>(settings_.max_grad_norm) /
                              (static_cast<float>(norm) + 1e-6f));
  }
  pending_report_.clip_coef = coef;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].phase == Phase::kStatsDone) {
      // Clipping scales the averaged gradient, as torch clips the (already averaged) .grad.
      StartUpdateLocked(static_cast<uint32_t>(i), coef == 1.0f ? mean : mean * coef);
    }
  }
}

void JobOptimizer::StartUpdateLocked(uint32_t index, float grad_scale) {
  if (settings_.nonfinite == NonFinitePolicy::kGuard && !settings_.deferred()) {
    CheckThenUpdateLocked(index, grad_scale);
  } else {
    ApplyUpdateLocked(index, grad_scale);
  }
}

void JobOptimizer::CheckThenUpdateLocked(uint32_t index, float grad_scale) {
  Parameter& p = params_[index];
  p.phase = Phase::kUpdating;
  p.stats = {};
  auto grads = std::make_shared<std::vector<const void*>>(GradientsLocked(p));
  const kernels::ScalarType type =
      settings_.reduces_into_buffer() ? kernels::ScalarType::kFloat32 : p.desc.grad_type;
  const uint64_t numel = p.desc.numel;
  const size_t chunks = Chunks(numel);
  p.chunks_left = chunks;
  auto self = shared_from_this();
  for (size_t c = 0; c < chunks; ++c) {
    deps_.pool->Submit([self, index, c, grads, type, numel, grad_scale] {
      const size_t b = c * kChunkElements, e = std::min<size_t>(numel, b + kChunkElements);
      const uint64_t nonfinite =
          kernels::ComputeGradientStats(grads->data(), static_cast<int>(grads->size()), type, b,
                                        e, kernels::BestIsa())
              .nonfinite;
      absl::MutexLock lock(&self->mu_);
      Parameter& q = self->params_[index];
      q.stats.nonfinite += nonfinite;
      if (--q.chunks_left != 0 || !self->failure_.empty()) return;
      if (q.stats.nonfinite > 0 && !self->guard_tripped_) {
        self->guard_tripped_ = true;
        self->guard_first_ = q.desc.name;
        self->guard_tensors_before_ = self->params_done_;
      }
      if (!self->guard_tripped_) {
        self->ApplyUpdateLocked(index, grad_scale);
        return;
      }
      // This tensor's gradient, or an earlier one's, held a non-finite value: it keeps its
      // weights and moments, and the client copies nothing back.
      self->update_nonfinite_ += q.stats.nonfinite;
      q.phase = Phase::kDone;
      ++self->params_done_;
      self->SendToAll(Message(ipc::DoorbellKind::kUpdateDone, index, self->iteration_ + 1, 0,
                              ipc::kFlagSkipped));
      self->MaybeFinishIterationLocked();
    });
  }
}

void JobOptimizer::ApplyUpdateLocked(uint32_t index, float grad_scale) {
  Parameter& p = params_[index];
  p.phase = Phase::kUpdating;
  const GroupHyperParameters& g = settings_.groups[p.desc.group];
  kernels::AdamWStep step;
  step.lr = g.lr;
  step.beta1 = g.beta1;
  step.beta2 = g.beta2;
  step.eps = g.eps;
  step.weight_decay = g.weight_decay;
  step.decoupled_weight_decay = settings_.decoupled_weight_decay;
  step.grad_scale = grad_scale;
  kernels::SetStepNumber(&step, p.param_step + 1);
  // A function of the tensor and its step alone, so a run restored from a checkpoint (in any
  // job) rounds exactly as the uninterrupted run would have.
  step.rounding_seed = Mix64(Mix64(index + 0x9e3779b97f4a7c15ull) ^ (p.param_step + 1));
  auto grads = std::make_shared<std::vector<const void*>>(GradientsLocked(p));
  kernels::AdamWTensor tensor;
  tensor.master = p.master_ptr;
  tensor.exp_avg = p.exp_avg_ptr;
  tensor.exp_avg_sq = p.exp_avg_sq_ptr;
  tensor.moment_type = settings_.moment_type;
  tensor.grads = grads->data();
  tensor.num_grads = static_cast<int>(grads->size());
  tensor.grad_type =
      settings_.reduces_into_buffer() ? kernels::ScalarType::kFloat32 : p.desc.grad_type;
  tensor.param_out = p.param_ptr;
  tensor.param_type = p.desc.param_type;
  tensor.numel = p.desc.numel;
  // Bytes the pass must move per element: each gradient read, the master and both moments read
  // and written, the parameter written.
  const uint64_t bytes_per_element =
      kernels::ElementSize(tensor.grad_type) * tensor.num_grads + 8 +
      4 * kernels::ElementSize(settings_.moment_type) +
      (p.param_ptr ? kernels::ElementSize(p.desc.param_type) : 0);
  if (params_done_ == 0 && update_bytes_ == 0) updates_start_ = absl::Now();
  const size_t chunks = Chunks(p.desc.numel);
  p.chunks_left = chunks;
  auto self = shared_from_this();
  for (size_t c = 0; c < chunks; ++c) {
    deps_.pool->Submit([self, index, c, grads, tensor, step, bytes_per_element] {
      const size_t b = c * kChunkElements, e = std::min<size_t>(tensor.numel, b + kChunkElements);
      const absl::Time start = absl::Now();
      uint64_t nonfinite = 0;
      absl::Status updated =
          kernels::AdamWUpdate(tensor, b, e, step, kernels::BestIsa(), &nonfinite);
      const double busy = absl::ToDoubleSeconds(absl::Now() - start);
      absl::MutexLock lock(&self->mu_);
      self->update_nonfinite_ += nonfinite;
      self->update_busy_s_ += busy;
      self->update_bytes_ += (e - b) * bytes_per_element;
      if (!updated.ok()) self->FailLocked(std::string(updated.message()));
      Parameter& q = self->params_[index];
      if (--q.chunks_left != 0 || !self->failure_.empty()) return;
      ++q.param_step;
      q.phase = Phase::kDone;
      ++self->params_done_;
      self->SendToAll(Message(ipc::DoorbellKind::kUpdateDone, index, self->iteration_ + 1));
      self->MaybeFinishIterationLocked();
    });
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
  if (!settings_.deferred()) {
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
  }
  iteration_started_ = false;
  params_done_ = 0;
  params_with_stats_ = 0;
  update_busy_s_ = 0;
  update_bytes_ = 0;
  update_nonfinite_ = 0;
  guard_tripped_ = false;
  guard_first_.clear();
  guard_tensors_before_ = 0;
  pending_report_ = {};
}

bool JobOptimizer::InProgressLocked() const {
  if (iteration_started_) return true;
  for (const Parameter& p : params_) {
    if (p.phase != Phase::kWaiting || p.micro != 0 || !p.arrived.empty()) return true;
  }
  return false;
}

void JobOptimizer::OnSessionEnded(const std::string& session_id, bool clean) {
  absl::MutexLock lock(&mu_);
  std::optional<uint32_t> rank;
  for (const auto& [r, s] : rank_sessions_) {
    if (s == session_id) rank = r;
  }
  if (!rank) return;
  rank_sessions_.erase(*rank);
  last_activity_ = absl::Now();
  const bool others = !rank_sessions_.empty();
  if (InProgressLocked() || (others && !clean)) {
    FailLocked(absl::StrFormat("rank %d %s at iteration %d; the job cannot go on without it",
                               *rank, clean ? "left" : "died", iteration_ + 1));
  } else if (others) {
    FailLocked(absl::StrFormat("rank %d left the job; the other ranks cannot step without it",
                               *rank));
  }
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
  settings_.groups = groups;
  settings_.max_grad_norm = max_grad_norm;
  return absl::OkStatus();
}

absl::Status JobOptimizer::SetSteps(uint64_t iteration, const std::vector<uint64_t>& param_steps) {
  absl::MutexLock lock(&mu_);
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
  }
  failure_.clear();
  ResetProgressLocked();
  return absl::OkStatus();
}

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
  r.state = !failure_.empty() ? "failed: " + failure_
            : InProgressLocked() ? "stepping"
                                 : "ready";
  return r;
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
  const bool idle = rank_sessions_.empty() && now - last_activity_ > retention;
  mu_.Unlock();
  return idle;
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
  absl::MutexLock lock(&mu_);
  if (InProgressLocked()) {
    return absl::FailedPreconditionError("a step is in progress; checkpoint between steps");
  }
  if (!registered_) return absl::FailedPreconditionError("no parameters are registered yet");
  return WriteCheckpoint(path, ContentsLocked());
}

absl::Status JobOptimizer::Load(const std::string& path) {
  absl::MutexLock lock(&mu_);
  if (InProgressLocked() && failure_.empty()) {
    return absl::FailedPreconditionError("a step is in progress; restore between steps");
  }
  if (!registered_) {
    return absl::FailedPreconditionError("register the parameters before restoring a checkpoint");
  }
  // The live arrays are the destination; they are written only after the whole file checks out.
  ASSIGN_OR_RETURN(CheckpointContents loaded, ReadCheckpoint(path, ContentsLocked()));
  iteration_ = loaded.iteration;
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].param_step = loaded.params[i].step;
    // The model-dtype copy follows the restored master.
    if (params_[i].param_ptr != nullptr) {
      kernels::ConvertFromFloat(params_[i].master_ptr, params_[i].param_ptr,
                                params_[i].desc.param_type, params_[i].desc.numel);
    }
  }
  failure_.clear();
  ResetProgressLocked();
  return absl::OkStatus();
}

}  // namespace trainstream::daemon
