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

// A number from a cgroup file (nullopt: absent, "max", or v1's "no limit", a value past 2^62).
std::optional<uint64_t> ReadNumber(const std::string& file) {
  std::ifstream in(file);
  std::string value;
  uint64_t number = 0;
  if (!(in >> value) || !absl::SimpleAtoi(value, &number) || number >= (uint64_t{1} << 62)) {
    return std::nullopt;
  }
  return number;
}

// The tightest memory limit over this process's cgroup and its ancestors, and the room under
// it: cgroup v2 (memory.max, memory.current), or v1's memory controller (limit_in_bytes,
// usage_in_bytes, limits inherited as hierarchy). nullopt: no limit found.
struct CgroupRoom {
  uint64_t limit = 0;
  uint64_t room = 0;
};
std::optional<CgroupRoom> ReadCgroupRoom(const std::string& root) {
  std::ifstream self(root + "/proc/self/cgroup");
  std::string line, unified, v1;
  while (std::getline(self, line)) {
    if (line.rfind("0::", 0) == 0) unified = line.substr(3);
    const size_t memory = line.find(":memory:");
    if (memory != std::string::npos) v1 = line.substr(memory + 8);
  }
  const bool is_v1 = !v1.empty();
  std::string path = is_v1 ? v1 : unified;
  if (path.empty()) return std::nullopt;
  const std::string base = root + (is_v1 ? "/sys/fs/cgroup/memory" : "/sys/fs/cgroup");
  const char* limit_file = is_v1 ? "memory.limit_in_bytes" : "memory.max";
  const char* usage_file = is_v1 ? "memory.usage_in_bytes" : "memory.current";
  std::optional<CgroupRoom> tightest;
  while (true) {
    const std::string dir = base + (path == "/" ? std::string() : path) + "/";
    if (const std::optional<uint64_t> limit = ReadNumber(dir + limit_file)) {
      const uint64_t used = ReadNumber(dir + usage_file).value_or(*limit);
      const uint64_t room = *limit - std::min(used, *limit);
      if (!tightest || room < tightest->room) tightest = CgroupRoom{*limit, room};
    }
    if (path == "/" || path.empty()) break;
    const size_t slash = path.rfind('/');
    path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
  }
  return tightest;
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
  if (const std::optional<CgroupRoom> cgroup = ReadCgroupRoom(root)) {
    memory.available = memory.total == 0 ? cgroup->room : std::min(memory.available, cgroup->room);
    memory.total = memory.total == 0 ? cgroup->limit : std::min(memory.total, cgroup->limit);
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
  if (bytes > deps_.speculation_bytes - std::min(backup_bytes_, deps_.speculation_bytes)) {
    refusal =
        absl::StrFormat("the job's %d bytes for copies aside are taken", deps_.speculation_bytes);
  } else {
    // Read once an iteration (not once a tensor, under the lock the doorbell thread needs), and
    // less what this iteration has allocated since: a copy's pages count as used only once its
    // first pass writes them, and a step's copies are allocated all at once.
    if (!memory_seen_) {
      const job_optimizer_internal::HostMemory memory = job_optimizer_internal::ReadHostMemory();
      memory_seen_ = true;
      seen_total_ = memory.total;
      seen_available_ = memory.available;
      copied_since_seen_ = 0;
    }
    const uint64_t left = seen_available_ - std::min(copied_since_seen_, seen_available_);
    if (seen_total_ > 0 && bytes + seen_total_ / 10 > left) {
      refusal = absl::StrFormat(
          "%.1f GiB of memory is left of %.1f (the machine's, or the daemon's cgroup limit)",
          left / double(1 << 30), seen_total_ / double(1 << 30));
    } else {
      p.backup.reset(new (std::nothrow) std::byte[bytes]);
      if (p.backup == nullptr) refusal = "the allocation failed";
    }
  }
  if (refusal.empty()) {
    backup_bytes_ += bytes;
    copied_since_seen_ += bytes;
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
  p.restoring = true;
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
      q.restoring = false;
      if (!self->failure_.empty()) {
        q.phase = Phase::kStatsDone;  // untouched by the failed iteration
        if (self->undo_pending_ > 0) --self->undo_pending_;
        self->AnnounceFailureIfUndoneLocked();
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
  // Steps whose updates could have been undone: a step whose norm is only reported publishes
  // each update as it ends.
  if (settings_.may_roll_back() && pending_report_.speculated_tensors > 0) ++speculated_steps_;
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
