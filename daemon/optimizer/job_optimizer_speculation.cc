// SPDX-License-Identifier: Apache-2.0
// JobOptimizer's speculative updates: when a step speculates, each tensor's copy aside, and what
// the step's decision does with the speculated tensors (publish them, or put the copies back).
#include "optimizer/job_optimizer.h"

#include <bit>
#include <cstring>
#include <fstream>
#include <new>
#include <optional>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "optimizer/job_optimizer_internal.h"

namespace trainstream::daemon {
namespace job_optimizer_internal {
namespace {

// The parts of a tensor's state in its copy aside, one after another: master, exp_avg,
// exp_avg_sq, parameter slot.
struct Part {
  void* data;
  size_t element_bytes;
};

std::vector<Part> PartsOf(const kernels::AdamWTensor& t) {
  std::vector<Part> parts = {{t.master, 4},
                             {t.exp_avg, kernels::ElementSize(t.moment_type)},
                             {t.exp_avg_sq, kernels::ElementSize(t.moment_type)}};
  if (t.param_out != nullptr) parts.push_back({t.param_out, kernels::ElementSize(t.param_type)});
  return parts;
}

}  // namespace

uint64_t CopyAsideBytes(const kernels::AdamWTensor& tensor) {
  uint64_t bytes = 0;
  for (const Part& part : PartsOf(tensor)) bytes += part.element_bytes * tensor.numel;
  return bytes;
}

void CopyAside(const kernels::AdamWTensor& tensor, std::byte* backup, size_t begin, size_t end,
               bool restore) {
  std::byte* base = backup;
  for (const Part& part : PartsOf(tensor)) {
    std::byte* live = static_cast<std::byte*>(part.data) + begin * part.element_bytes;
    std::byte* aside = base + begin * part.element_bytes;
    const size_t bytes = (end - begin) * part.element_bytes;
    if (restore) {
      std::memcpy(live, aside, bytes);
    } else {
      std::memcpy(aside, live, bytes);
    }
    base += tensor.numel * part.element_bytes;
  }
}

namespace {

// A cgroup v2 file of this process's cgroup as a number (nullopt: absent, or "max").
std::optional<uint64_t> ReadCgroupValue(const std::string& root, const std::string& file) {
  std::ifstream self(root + "/proc/self/cgroup");
  std::string line, path;
  while (std::getline(self, line)) {
    if (line.rfind("0::", 0) == 0) path = line.substr(3);
  }
  if (path.empty()) return std::nullopt;
  std::ifstream in(root + "/sys/fs/cgroup" + (path == "/" ? std::string() : path) + "/" + file);
  std::string value;
  if (!(in >> value) || value == "max") return std::nullopt;
  uint64_t number = 0;
  if (!absl::SimpleAtoi(value, &number)) return std::nullopt;
  return number;
}

}  // namespace

HostMemory ReadHostMemory(const std::string& root) {
  HostMemory memory;
  std::ifstream meminfo(root + "/proc/meminfo");
  std::string key, unit;
  uint64_t kib = 0;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemTotal:") memory.total = kib << 10;
    if (key == "MemAvailable:") memory.available = kib << 10;
  }
  const std::optional<uint64_t> limit = ReadCgroupValue(root, "memory.max");
  if (limit && (memory.total == 0 || *limit < memory.total)) {
    const uint64_t used = ReadCgroupValue(root, "memory.current").value_or(*limit);
    const uint64_t room = *limit - std::min(used, *limit);
    memory.available = memory.total == 0 ? room : std::min(memory.available, room);
    memory.total = *limit;
  }
  return memory;
}

}  // namespace job_optimizer_internal

namespace {

using job_optimizer_internal::Chunks;
using job_optimizer_internal::Message;

// The copy aside's layout over the tensor's live buffers (no gradients: only the sizes count).
kernels::AdamWTensor StateOf(const float* master, void* exp_avg, void* exp_avg_sq, void* param,
                             kernels::ScalarType moment_type, kernels::ScalarType param_type,
                             uint64_t numel) {
  kernels::AdamWTensor tensor;
  tensor.master = const_cast<float*>(master);
  tensor.exp_avg = exp_avg;
  tensor.exp_avg_sq = exp_avg_sq;
  tensor.moment_type = moment_type;
  tensor.param_out = param;
  tensor.param_type = param_type;
  tensor.numel = numel;
  return tensor;
}

}  // namespace

bool JobOptimizer::SpeculatesLocked() const {
  if (!settings_.gathers_stats() || settings_.defer_updates) return false;
  if (!settings_.may_roll_back()) return true;  // the norm only reported: nothing to undo
  return settings_.eager_updates || !last_step_scaled_;
}

bool JobOptimizer::EnsureBackupLocked(Parameter& p) {
  if (p.backup != nullptr) return true;
  const uint64_t bytes = job_optimizer_internal::CopyAsideBytes(
      StateOf(p.master_ptr, p.exp_avg_ptr, p.exp_avg_sq_ptr, p.param_ptr, settings_.moment_type,
              p.desc.param_type, p.desc.numel));
  std::string refusal;
  const job_optimizer_internal::HostMemory memory = job_optimizer_internal::ReadHostMemory();
  if (bytes > deps_.speculation_bytes - std::min(backup_bytes_, deps_.speculation_bytes)) {
    refusal =
        absl::StrFormat("the job's %d bytes for copies aside are taken", deps_.speculation_bytes);
  } else if (memory.total > 0 && bytes + memory.total / 10 > memory.available) {
    refusal = absl::StrFormat(
        "%.1f GiB of memory is available of %.1f (the machine's, or the "
        "daemon's cgroup limit)",
        memory.available / double(1 << 30), memory.total / double(1 << 30));
  } else {
    p.backup.reset(new (std::nothrow) std::byte[bytes]);
    if (p.backup == nullptr) refusal = "the allocation failed";
  }
  if (refusal.empty()) {
    backup_bytes_ += bytes;
    return true;
  }
  if (!backup_refusal_said_) {
    backup_refusal_said_ = true;
    deps_.events->Emit(
        "optimizer.speculation_limited",
        absl::StrFormat("job '%s': no room to copy '%s' (%d bytes) aside before updating it "
                        "speculatively (%s); it and any other tensor without a copy wait for the "
                        "step's last gradient (%d bytes of copies made)",
                        job_.job_id, p.desc.name, bytes, refusal, backup_bytes_),
        {{"copied_bytes", static_cast<double>(backup_bytes_)}}, "", job_.uid);
  }
  return false;
}

void JobOptimizer::RestoreLocked(uint32_t index) {
  Parameter& p = params_[index];
  p.phase = Phase::kUpdating;
  const kernels::AdamWTensor tensor =
      StateOf(p.master_ptr, p.exp_avg_ptr, p.exp_avg_sq_ptr, p.param_ptr, settings_.moment_type,
              p.desc.param_type, p.desc.numel);
  std::byte* backup = p.backup.get();
  const size_t chunk = ChunkElementsLocked();
  const size_t chunks = Chunks(p.desc.numel, chunk);
  p.chunks_left = chunks;
  auto self = shared_from_this();
  for (size_t c = 0; c < chunks; ++c) {
    SubmitLocked([self, index, c, chunk, tensor, backup] {
      const size_t b = c * chunk, e = std::min<size_t>(tensor.numel, b + chunk);
      job_optimizer_internal::CopyAside(tensor, backup, b, e, /*restore=*/true);
      absl::MutexLock lock(&self->mu_);
      Parameter& q = self->params_[index];
      if (--q.chunks_left != 0) return;
      q.backed_up = false;
      if (!self->failure_.empty()) {
        q.phase = Phase::kStatsDone;  // untouched by the failed iteration
        return;
      }
      // A skipped step: the tensor keeps its weights and moments, and the ranks copy nothing.
      q.phase = Phase::kDone;
      ++self->params_done_;
      self->SendToAll(Message(ipc::DoorbellKind::kUpdateDone, index, self->iteration_ + 1, 0,
                              ipc::kFlagSkipped));
      self->MaybeFinishIterationLocked();
    });
  }
}

void JobOptimizer::RollBackOnFailureLocked() {
  // Those still speculating put their copies back when their pass ends (PassDoneLocked).
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].phase == Phase::kSpeculated && params_[i].backed_up) {
      RestoreLocked(static_cast<uint32_t>(i));
    }
  }
}

void JobOptimizer::NoteDecisionLocked(bool scaled, float coef, double norm) {
  size_t undone = 0;
  for (const Parameter& p : params_) undone += p.backed_up ? 1 : 0;
  if (pending_report_.speculated_tensors > 0) ++speculated_steps_;
  if (settings_.may_roll_back()) last_step_scaled_ = scaled;
  if (!scaled || undone == 0) return;
  ++rolled_back_steps_;
  pending_report_.rolled_back = true;
  // The default policy cannot roll back two steps running; eager_updates may on every step, so
  // it is told at the 1st, 2nd, 4th, 8th... rollback.
  if (settings_.eager_updates && !std::has_single_bit(rolled_back_steps_)) return;
  const std::string why =
      pending_report_.skipped || pending_report_.nonfinite > 0
          ? absl::StrFormat("%d non-finite gradient values", pending_report_.nonfinite)
          : absl::StrFormat("the gradient norm %.4g was clipped to %g (coefficient %.4g)", norm,
                            settings_.max_grad_norm, coef);
  const std::string then =
      settings_.eager_updates ? "eager updates speculate on every step"
                              : "updates wait for the last gradient until a step needs no clipping";
  deps_.events->Emit(
      "optimizer.rolled_back",
      absl::StrFormat("iteration %d of job '%s': %s, so the %d tensors updated before the norm "
                      "was known were restored%s (%d of %d speculated steps rolled back); %s",
                      iteration_ + 1, job_.job_id, why, undone,
                      pending_report_.skipped || pending_report_.nonfinite > 0
                          ? ""
                          : " and updated again with the clipped gradient",
                      rolled_back_steps_, speculated_steps_, then),
      {{"tensors", static_cast<double>(undone)},
       {"rolled_back_steps", static_cast<double>(rolled_back_steps_)},
       {"speculated_steps", static_cast<double>(speculated_steps_)}},
      "", job_.uid);
}

}  // namespace trainstream::daemon
