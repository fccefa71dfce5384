// SPDX-License-Identifier: Apache-2.0
// JobOptimizer's updates: the gradients' statistics, the decision they feed (clip, skip or fail),
// and each tensor's AdamW pass on the pool.
#include "optimizer/job_optimizer.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_format.h"
#include "optimizer/job_optimizer_internal.h"

namespace trainstream::daemon {
namespace {

using job_optimizer_internal::Chunks;
using job_optimizer_internal::Message;

}  // namespace

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

void JobOptimizer::StartChunkStats(Parameter& p, size_t chunks) {
  p.stats = {};
  p.chunk_sum_squares.assign(chunks, 0.0);
}

void JobOptimizer::AddChunkStats(Parameter& p, size_t chunk, const kernels::GradientStats& stats) {
  p.chunk_sum_squares[chunk] = stats.sum_squares;
  p.stats.nonfinite += stats.nonfinite;
}

void JobOptimizer::EndChunkStats(Parameter& p) {
  p.stats.sum_squares =
      std::accumulate(p.chunk_sum_squares.begin(), p.chunk_sum_squares.end(), 0.0);
}

void JobOptimizer::ScanGradientsLocked(uint32_t index,
                                       std::function<void(JobOptimizer&, Parameter&)> scanned) {
  Parameter& p = params_[index];
  auto grads = std::make_shared<std::vector<const void*>>(GradientsLocked(p));
  const kernels::ScalarType type =
      settings_.reduces_into_buffer() ? kernels::ScalarType::kFloat32 : p.desc.grad_type;
  const uint64_t numel = p.desc.numel;
  const size_t chunk = ChunkElementsLocked();
  const size_t chunks = Chunks(numel, chunk);
  p.chunks_left = chunks;
  StartChunkStats(p, chunks);
  auto self = shared_from_this();
  auto done = std::make_shared<std::function<void(JobOptimizer&, Parameter&)>>(std::move(scanned));
  for (size_t c = 0; c < chunks; ++c) {
    SubmitLocked([self, index, c, chunk, grads, type, numel, done] {
      const size_t b = c * chunk, e = std::min<size_t>(numel, b + chunk);
      const kernels::GradientStats stats = kernels::ComputeGradientStats(
          grads->data(), static_cast<int>(grads->size()), type, b, e, kernels::BestIsa());
      absl::MutexLock lock(&self->mu_);
      Parameter& q = self->params_[index];
      AddChunkStats(q, c, stats);
      if (--q.chunks_left != 0) return;
      EndChunkStats(q);
      (*done)(*self, q);
    });
  }
}

void JobOptimizer::GradientsFinalLocked(uint32_t index) {
  Parameter& p = params_[index];
  if (!GathersStatsLocked()) {
    StartUpdateLocked(index, MeanScaleLocked());
  } else if (!speculating_ || SteppedThisIterationLocked(p) ||
             (settings_.may_roll_back() && !EnsureBackupLocked(p))) {
    StartStatsLocked(index);  // waits for the decision
  } else {
    p.backed_up = settings_.may_roll_back();
    ++pending_report_.speculated_tensors;
    StartPassLocked(index, MeanScaleLocked(), Pass::kSpeculate);
  }
}

void JobOptimizer::StartStatsLocked(uint32_t index) {
  params_[index].phase = Phase::kStatsPending;
  ScanGradientsLocked(index, [](JobOptimizer& self, Parameter& q) {
    self.mu_.AssertHeld();
    q.phase = Phase::kStatsDone;
    ++self.params_with_stats_;
    if (self.failure_.empty()) self.MaybeDecideLocked();
  });
}

void JobOptimizer::MaybeDecideLocked() {
  if (params_with_stats_ != params_.size()) return;
  double sum_squares = contributed_sum_squares_;  // the ranks' GPU-updated gradients
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
  // 'guard' with the norm gathered sees every gradient before anything is published: the whole
  // step skips, as with 'skip'.
  const bool drop = nonfinite > 0 && settings_.nonfinite != NonFinitePolicy::kIgnore &&
                    (settings_.decides() || settings_.nonfinite == NonFinitePolicy::kGuard);
  if (drop && settings_.nonfinite == NonFinitePolicy::kError) {
    NoteDecisionLocked(/*scaled=*/true, 1.0f, norm);
    FailLocked(absl::StrFormat(
        "%d non-finite gradient values at iteration %d, first in '%s'; nothing was updated (use "
        "nonfinite='skip' to skip such steps)",
        nonfinite, iteration_ + 1, first_bad));
    return;
  }
  if (drop) {
    pending_report_.skipped = true;
    NoteDecisionLocked(/*scaled=*/true, 1.0f, norm);
    deps_.events->Emit("optimizer.step_skipped",
                       absl::StrFormat("iteration %d of job '%s' skipped: %d non-finite gradient "
                                       "values, first in '%s'",
                                       iteration_ + 1, job_.job_id, nonfinite, first_bad),
                       {{"nonfinite", static_cast<double>(nonfinite)}}, "", job_.uid);
    for (size_t i = 0; i < params_.size(); ++i) {
      Parameter& q = params_[i];
      if (q.phase == Phase::kDone) continue;
      if (q.phase == Phase::kSpeculated) {
        RestoreLocked(static_cast<uint32_t>(i));  // done, skipped, once its copy is back
        continue;
      }
      q.phase = Phase::kDone;
      ++params_done_;
      // A tensor stepped for this iteration before a failure keeps that step (see the class
      // comment): its rank must still copy the value in place.
      SendToAll(Message(ipc::DoorbellKind::kUpdateDone, i, iteration_ + 1, 0,
                        SteppedThisIterationLocked(q) ? 0 : ipc::kFlagSkipped));
    }
    MaybeFinishIterationLocked();
    return;
  }
  float coef = 1.0f;
  if (settings_.max_grad_norm > 0) {
    // As torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6), never above 1, in fp32.
    coef = std::min(
        1.0f, static_cast<float>(settings_.max_grad_norm) / (static_cast<float>(norm) + 1e-6f));
  }
  pending_report_.clip_coef = coef;
  NoteDecisionLocked(/*scaled=*/coef != 1.0f, coef, norm);
  // Clipping scales the averaged gradient, as torch clips the (already averaged) .grad.
  const float scale = coef == 1.0f ? mean : mean * coef;
  for (size_t i = 0; i < params_.size(); ++i) {
    const uint32_t index = static_cast<uint32_t>(i);
    if (params_[i].phase == Phase::kStatsDone) {
      StartUpdateLocked(index, scale);
    } else if (params_[i].phase == Phase::kSpeculated) {
      if (coef == 1.0f) {
        PublishLocked(index);
      } else {
        StartPassLocked(index, scale, Pass::kRedo);
      }
    }
  }
  MaybeFinishIterationLocked();  // every update may have been committed
}

void JobOptimizer::StartUpdateLocked(uint32_t index, float grad_scale) {
  if (SteppedThisIterationLocked(params_[index])) {
    KeepEarlierUpdateLocked(index);
    return;
  }
  if (settings_.nonfinite == NonFinitePolicy::kGuard && !GathersStatsLocked()) {
    CheckThenUpdateLocked(index, grad_scale);
  } else {
    ApplyUpdateLocked(index, grad_scale);
  }
}

void JobOptimizer::CheckThenUpdateLocked(uint32_t index, float grad_scale) {
  params_[index].phase = Phase::kUpdating;
  ScanGradientsLocked(index, [index, grad_scale](JobOptimizer& self, Parameter& q) {
    self.mu_.AssertHeld();
    if (!self.failure_.empty()) return;
    if (q.stats.nonfinite > 0 && !self.guard_tripped_) {
      self.guard_tripped_ = true;
      self.guard_first_ = q.desc.name;
      self.guard_tensors_before_ = self.params_updated_;
    }
    if (!self.guard_tripped_) {
      self.ApplyUpdateLocked(index, grad_scale);
      return;
    }
    // This tensor's gradient, or an earlier one's, held a non-finite value: it keeps its
    // weights and moments, and the client copies nothing back.
    self.update_nonfinite_ += q.stats.nonfinite;
    q.phase = Phase::kDone;
    ++self.params_done_;
    self.SendToAll(
        Message(ipc::DoorbellKind::kUpdateDone, index, self.iteration_ + 1, 0, ipc::kFlagSkipped));
    self.MaybeFinishIterationLocked();
  });
}

void JobOptimizer::StartPassLocked(uint32_t index, float grad_scale, Pass pass) {
  Parameter& p = params_[index];
  p.phase = pass == Pass::kSpeculate ? Phase::kSpeculating : Phase::kUpdating;
  const GroupHyperParameters& g = settings_.groups[p.desc.group];
  kernels::AdamWStep step;
  step.lr = g.lr;
  step.beta1 = g.beta1;
  step.beta2 = g.beta2;
  step.eps = g.eps;
  step.weight_decay = g.weight_decay;
  step.decoupled_weight_decay = settings_.decoupled_weight_decay;
  step.grad_scale = grad_scale;
  // A speculated update and its redo have the same step number and rounding seed: the tensor's
  // step count moves only when an update is published.
  kernels::SetStepNumber(&step, p.param_step + 1);
  step.rounding_seed = kernels::RoundingSeed(index, p.param_step + 1);
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
  const uint64_t bytes_per_element = kernels::ElementSize(tensor.grad_type) * tensor.num_grads + 8 +
                                     4 * kernels::ElementSize(settings_.moment_type) +
                                     (p.param_ptr ? kernels::ElementSize(p.desc.param_type) : 0);
  // The copy aside, written before a speculated update and put back before its redo.
  std::byte* backup = pass != Pass::kUpdate && p.backed_up ? p.backup.get() : nullptr;
  p.update_failed = false;
  if (params_done_ == 0 && update_bytes_ == 0) updates_start_ = absl::Now();
  const size_t chunk = ChunkElementsLocked();
  const size_t chunks = Chunks(p.desc.numel, chunk);
  p.chunks_left = chunks;
  if (pass == Pass::kSpeculate) StartChunkStats(p, chunks);
  auto self = shared_from_this();
  for (size_t c = 0; c < chunks; ++c) {
    SubmitLocked([self, index, c, chunk, grads, tensor, step, bytes_per_element, pass, backup] {
      const size_t b = c * chunk, e = std::min<size_t>(tensor.numel, b + chunk);
      const absl::Time start = absl::Now();
      kernels::GradientStats stats;
      if (pass == Pass::kSpeculate) {
        stats = kernels::ComputeGradientStats(tensor.grads, tensor.num_grads, tensor.grad_type, b,
                                              e, kernels::BestIsa());
      }
      if (backup != nullptr) {
        job_optimizer_internal::CopyAside(tensor, backup, b, e, /*restore=*/pass == Pass::kRedo);
      }
      uint64_t nonfinite = 0;
      absl::Status updated =
          kernels::AdamWUpdate(tensor, b, e, step, kernels::BestIsa(), &nonfinite);
      const double busy = absl::ToDoubleSeconds(absl::Now() - start);
      absl::MutexLock lock(&self->mu_);
      self->update_nonfinite_ += nonfinite;
      self->update_busy_s_ += busy;
      self->update_bytes_ += (e - b) * bytes_per_element;
      Parameter& q = self->params_[index];
      if (pass == Pass::kSpeculate) AddChunkStats(q, c, stats);
      if (!updated.ok()) {
        q.update_failed = true;
        self->FailLocked(std::string(updated.message()));
      }
      if (--q.chunks_left != 0) return;
      self->PassDoneLocked(index, pass);
    });
  }
}

void JobOptimizer::PassDoneLocked(uint32_t index, Pass pass) {
  Parameter& q = params_[index];
  if (pass == Pass::kSpeculate) {
    EndChunkStats(q);
    q.phase = Phase::kSpeculated;
    ++params_with_stats_;
    if (!q.backed_up) {
      PublishLocked(index);  // nothing can undo it (the norm is only reported): published now
    } else if (!failure_.empty()) {
      RestoreLocked(index);
    }
    if (!failure_.empty()) return;
    MaybeDecideLocked();
    MaybeFinishIterationLocked();
    return;
  }
  PublishLocked(index);
  if (failure_.empty()) MaybeFinishIterationLocked();
}

void JobOptimizer::PublishLocked(uint32_t index) {
  Parameter& q = params_[index];
  // Counted even when the job failed while it ran: every chunk did run, so the tensor is
  // stepped for this iteration, and a redone iteration must not step it again.
  q.phase = Phase::kDone;
  ++params_done_;
  if (!q.update_failed) {
    ++q.param_step;
    q.updated_in = iteration_ + 1;
    ++params_updated_;
  }
  if (failure_.empty()) SendToAll(Message(ipc::DoorbellKind::kUpdateDone, index, iteration_ + 1));
}

void JobOptimizer::KeepEarlierUpdateLocked(uint32_t index) {
  // Its weights, moments and step count already hold this iteration's update, and the shared
  // parameter slot its value: the ranks copy it back as for any update.
  params_[index].phase = Phase::kDone;
  ++params_done_;
  ++params_updated_;
  SendToAll(Message(ipc::DoorbellKind::kUpdateDone, index, iteration_ + 1));
  MaybeFinishIterationLocked();
}

}  // namespace trainstream::daemon
