// SPDX-License-Identifier: Apache-2.0
#include "bases/base_store.h"


#include <algorithm>
#include <atomic>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bases/caller_access.h"
#include "safetensors/checkpoint_set.h"
#include "trainstream/status_macros.h"

namespace trainstream::daemon {
namespace {

constexpr uint64_t kTensorAlignment = 256;  // every tensor starts where a GPU copy likes it

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

std::string Gb(double bytes) { return absl::StrFormat("%.2f GB", bytes / 1e9); }

bool QuantizedByDefault(const SafetensorsTensor& t) {
  const bool is_float = t.dtype == "F32" || t.dtype == "F16" || t.dtype == "BF16" ||
                        t.dtype == "F64";
  return is_float && t.shape.size() == 2 && !absl::StrContains(t.name, "embed") &&
         !absl::StrContains(t.name, "lm_head");
}

}  // namespace

const char* BaseStateName(BaseState state) {
  switch (state) {
    case BaseState::kLoading: return "loading";
    case BaseState::kReady: return "ready";
    case BaseState::kFailed: return "failed";
    case BaseState::kPlanned: return "planned";
  }
  return "unknown";
}

struct BaseStore::Base {
  uint64_t id = 0;
  uid_t uid = 0;
  std::string key;  // what makes two requests the same base
  std::string name, source, format;
  int block = 0;
  BaseState state = BaseState::kLoading;
  std::string error;
  JobKey job;             // the arena job its buffers belong to
  std::string owner;      // the arena "session" owning them
  std::unique_ptr<CheckpointSet> checkpoint;
  std::vector<BufferRecord> buffers;
  std::vector<BaseTensor> tensors;
  uint64_t stored_bytes = 0, source_bytes = 0, read_total = 0;
  std::atomic<uint64_t> read_bytes{0};
  absl::Time started;
  double load_seconds = 0;
  std::set<std::string> users;    // attached (LoadBase), until DetachBase or their end
  std::set<std::string> mappers;  // granted its segments, until their end
  std::optional<absl::Time> idle_since;
  std::vector<uint64_t> buffer_sizes;  // allocated by the loader
};

BaseStore::BaseStore(const Options& options, Arena* arena, EventLog* events)
    : options_(options), arena_(arena), events_(events) {}

BaseStore::~BaseStore() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;  // loads stop at their next tensor
  mu_.Await(absl::Condition(
      +[](int* active) { return *active == 0; }, &active_loaders_));
}

absl::StatusOr<BaseSnapshot> BaseStore::Load(const Session& session,
                                             const BaseLoadRequest& request,
                                             const FileSource* granted) {
  if (request.path.empty() || request.path[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrFormat("base path '%s' must be absolute", request.path));
  }
  std::optional<kernels::QuantFormat> quant;
  if (request.format != "bf16") {
    absl::StatusOr<kernels::QuantFormat> parsed = kernels::ParseQuantFormat(request.format);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "base format '%s': one of bf16, int8, nf4, fp8, nvfp4", request.format));
    }
    quant = *parsed;
    if (absl::Status s = kernels::LayoutFor(*quant, 2, request.block).status(); !s.ok()) {
      return s;
    }
  } else if (request.block != 0) {
    return absl::InvalidArgumentError("a bf16 base has no quantization block size");
  }
  const int block = quant ? kernels::LayoutFor(*quant, 2, request.block)->block : 0;
  const std::set<std::string> chosen(request.quantize.begin(), request.quantize.end());
  std::unique_ptr<CheckpointSet> checkpoint;
  if (granted != nullptr) {
    // The caller's own descriptors: the kernel checked its rights when it opened them.
    absl::StatusOr<CheckpointSet> opened = CheckpointSet::Open(request.path, *granted);
    if (!opened.ok()) return opened.status();
    checkpoint = std::make_unique<CheckpointSet>(*std::move(opened));
  } else {
    // Every file is opened as the caller: the kernel checks its rights on the way (when the
    // daemon can't take them, the permission bits of each file's real path are checked).
    absl::StatusOr<std::unique_ptr<CallerFiles>> as_caller = CallerFiles::Enter(session.owner);
    if (!as_caller.ok()) return as_caller.status();
    if (!(*as_caller)->switched()) {
      // Before anything is opened: a folder the caller can't enter says nothing of what lies
      // inside, not even whether it exists.
      if (absl::Status s = CheckCallerMayRead(request.path, session.owner); !s.ok()) return s;
    }
    absl::StatusOr<CheckpointSet> opened = CheckpointSet::Open(request.path);
    if (!opened.ok()) return opened.status();
    checkpoint = std::make_unique<CheckpointSet>(*std::move(opened));
    if (!(*as_caller)->switched()) {
      std::vector<std::string> paths = {checkpoint->index_path()};
      for (const auto& file : checkpoint->files()) paths.push_back(file->path());
      for (const std::string& real : paths) {
        if (real.empty()) continue;
        if (absl::Status s = CheckCallerMayRead(real, session.owner); !s.ok()) return s;
      }
    }
  }
  const std::string path = checkpoint->index_path().empty()
                               ? checkpoint->files().front()->path()
                               : checkpoint->index_path();
  // Two requests for the same content are one base: same user, files (by device and inode,
  // size and modification time, whichever name or descriptor led to them), format, block and
  // the set of names to quantize.
  std::string key = absl::StrCat(session.owner.uid, "\n", request.format, "\n", block, "\n",
                                 absl::StrJoin(chosen, "\n"), "\n\n");
  for (const auto& file : checkpoint->files()) absl::StrAppend(&key, file->Identity(), "\n");

  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the daemon is stopping");
  // A session that ended while this request read headers is not attached to anything: it
  // would keep the base alive with no one to leave it.
  if (options_.session_alive && !options_.session_alive(session)) {
    return absl::NotFoundError("the session ended while the base was requested");
  }
  for (auto& [id, base] : bases_) {
    if (base->key == key && base->state != BaseState::kFailed) {
      if (request.plan_only) return SnapshotLocked(*base);  // held already: nothing more
      base->users.insert(session.id);
      base->idle_since.reset();
      events_->Emit("base.attached",
                    absl::StrFormat("session attached to base %d '%s' (%s, %s): %d users", id,
                                    base->name, base->format, BaseStateName(base->state),
                                    base->users.size()),
                    {{"base", static_cast<double>(id)},
                     {"users", static_cast<double>(base->users.size())}},
                    session.id, session.owner.uid);
      return SnapshotLocked(*base);
    }
  }

  auto base = std::make_shared<Base>();
  base->id = request.plan_only ? 0 : next_id_++;
  base->uid = session.owner.uid;
  base->key = key;
  base->source = path;
  base->format = request.format;
  base->block = block;
  base->name = request.name;
  if (base->name.empty()) {
    std::string trimmed = path;
    if (absl::EndsWith(trimmed, ".json") || absl::EndsWith(trimmed, ".safetensors")) {
      trimmed = trimmed.substr(0, trimmed.rfind('/'));
    }
    base->name = trimmed.substr(trimmed.rfind('/') + 1);
    for (char& c : base->name) {  // shown by tsctl and in events: no terminal control codes
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
    }
  }
  // '#' is in no job id a client may choose: no session shares the base's arena job.
  base->job = JobKey{session.owner.uid, absl::StrCat("base#", base->id)};
  base->owner = base->job.job_id;
  for (const std::string& name : chosen) {
    if (checkpoint->Find(name) == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensor '%s' named for quantization is not in %s", name, path));
    }
  }
  // Lay the tensors out: packed into buffers of up to buffer_bytes, each aligned.
  std::vector<uint64_t> buffer_sizes = {0};
  for (const CheckpointTensor& ct : checkpoint->tensors()) {
    const SafetensorsTensor& t = *ct.tensor;
    const bool is_float = t.dtype == "F32" || t.dtype == "F16" || t.dtype == "BF16" ||
                          t.dtype == "F64";
    const bool quantize = quant && (chosen.empty() ? QuantizedByDefault(t) : chosen.count(t.name));
    // A bf16 base converts every float; a quantized one keeps what it does not quantize
    // (norms, biases, embeddings) exactly as the file has it.
    const StoredAs as = quantize               ? StoredAs::kQuantized
                        : (is_float && !quant) ? StoredAs::kBFloat16
                                               : StoredAs::kAsIs;
    absl::StatusOr<StoredLayout> layout =
        StoredLayoutFor(t, as, quant.value_or(kernels::QuantFormat::kInt8), request.block);
    if (!layout.ok()) return layout.status();
    const uint64_t need = AlignUp(layout->data_bytes, kTensorAlignment) +
                          AlignUp(layout->scale_bytes, kTensorAlignment);
    if (buffer_sizes.back() > 0 && buffer_sizes.back() + need > options_.buffer_bytes) {
      buffer_sizes.push_back(0);
    }
    BaseTensor bt;
    bt.name = t.name;
    bt.shape = t.shape;
    bt.source_dtype = t.dtype;
    bt.stored = as;
    bt.format = layout->quant.format;
    bt.block = layout->quant.block;
    bt.buffer = static_cast<uint32_t>(buffer_sizes.size() - 1);
    bt.data_offset = buffer_sizes.back();
    bt.data_bytes = layout->data_bytes;
    bt.scale_offset = bt.data_offset + AlignUp(layout->data_bytes, kTensorAlignment);
    bt.scale_bytes = layout->scale_bytes;
    buffer_sizes.back() += need;
    base->tensors.push_back(std::move(bt));
    base->source_bytes += t.bytes;
    base->read_total += t.bytes * (as == StoredAs::kQuantized &&
                                           layout->quant.format == kernels::QuantFormat::kNvfp4
                                       ? 2
                                       : 1);
  }
  for (uint64_t b : buffer_sizes) base->stored_bytes += b;
  if (request.plan_only) {
    base->state = BaseState::kPlanned;
    return SnapshotLocked(*base);
  }
  // Admission first: a base that can't fit is refused with the numbers before any allocation.
  absl::StatusOr<PlanOutcome> planned =
      arena_->Plan(base->job, base->stored_bytes, absl::ZeroDuration());
  if (!planned.ok()) {
    arena_->ReleaseSession(base->job, base->owner);
    if (planned.status().code() != absl::StatusCode::kResourceExhausted) return planned.status();
    const ArenaUsage usage = arena_->Totals();
    return absl::ResourceExhaustedError(absl::StrFormat(
        "base %s as %s needs %s of host memory; the daemon's budget is %s and jobs hold or "
        "planned %s of it. Use a smaller format (nf4 holds about a quarter of bf16, int8 about "
        "half), end other jobs, or raise --memory_budget",
        path, request.format, Gb(static_cast<double>(base->stored_bytes)),
        Gb(static_cast<double>(usage.budget_bytes)),
        Gb(static_cast<double>(usage.committed_bytes))));
  }
  base->buffer_sizes = std::move(buffer_sizes);
  base->checkpoint = std::move(checkpoint);
  base->users.insert(session.id);
  base->started = absl::Now();
  bases_[base->id] = base;
  events_->Emit("base.loading",
                absl::StrFormat("base %d '%s': reading %d tensors (%s) from %s as %s into %s of "
                                "host memory",
                                base->id, base->name, base->tensors.size(),
                                Gb(static_cast<double>(base->source_bytes)), path, base->format,
                                Gb(static_cast<double>(base->stored_bytes))),
                {{"base", static_cast<double>(base->id)},
                 {"source_bytes", static_cast<double>(base->source_bytes)},
                 {"stored_bytes", static_cast<double>(base->stored_bytes)}},
                session.id, session.owner.uid);
  BaseSnapshot snapshot = SnapshotLocked(*base);
  // The memory is taken (fallocate of up to the whole base) and the files read on a thread of
  // the base's own, not under the store's lock nor in the caller's request.
  ++active_loaders_;
  std::thread([this, base] { RunLoad(base); }).detach();
  return snapshot;
}

void BaseStore::RunLoad(std::shared_ptr<Base> base) {
  absl::Status status = absl::OkStatus();
  for (size_t b = 0; b < base->buffer_sizes.size() && status.ok(); ++b) {
    if (base->buffer_sizes[b] == 0) continue;
    AllocationRequest alloc;
    alloc.job = base->job;
    alloc.session_id = base->owner;
    alloc.name = absl::StrCat("buffer-", b);
    alloc.bytes = base->buffer_sizes[b];
    alloc.tag = "base";
    alloc.sealable = true;
    absl::StatusOr<BufferRecord> record = arena_->Allocate(alloc);
    if (!record.ok()) {
      status = record.status();
    } else {
      base->buffers.push_back(*record);
    }
  }
  // Several tensors are read at once: quantizing is CPU work, and a fast disk serves several
  // reads. Each thread holds one window, so memory stays bounded by threads x window.
  const size_t count = base->tensors.size();
  const unsigned threads = static_cast<unsigned>(std::max<size_t>(
      1, std::min<size_t>(options_.load_threads != 0
                              ? options_.load_threads
                              : std::min(8u, std::max(1u, std::thread::hardware_concurrency())),
                          count)));
  std::atomic<size_t> next{0};
  absl::Mutex report_mu;  // orders the progress events and keeps the first error
  absl::Time last_report = absl::Now();
  auto work = [&] {
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        // Stopped at the next tensor when the daemon stops, or when every session that asked
        // for the base has gone (a client that gave up, or was killed): no CPU is spent on a
        // base nobody will map.
        const bool abandoned = base->users.empty() && base->mappers.empty();
        if (stopping_ || abandoned) {
          absl::MutexLock report(&report_mu);
          if (status.ok()) {
            status = absl::CancelledError(
                stopping_ ? "the daemon stopped while the base was loading"
                          : "every session that asked for it ended or detached while it "
                            "loaded: the load stopped");
          }
          return;
        }
      }
      {
        absl::MutexLock report(&report_mu);
        if (!status.ok()) return;
      }
      const size_t i = next.fetch_add(1);
      if (i >= count) return;
      BaseTensor& bt = base->tensors[i];
      const CheckpointTensor& ct = base->checkpoint->tensors()[i];
      absl::StatusOr<uint8_t*> data =
          arena_->BufferData(base->job, base->buffers[bt.buffer].buffer_id);
      StoredLayout layout;
      layout.as = bt.stored;
      layout.data_bytes = bt.data_bytes;
      layout.scale_bytes = bt.scale_bytes;
      if (bt.stored == StoredAs::kQuantized) {
        layout.quant = *kernels::LayoutFor(bt.format, ct.tensor->numel, bt.block);
      }
      uint64_t counted = 0;  // of this tensor's bytes, those already in read_bytes
      auto progress = [&](uint64_t bytes) {
        base->read_bytes.fetch_add(bytes - counted, std::memory_order_relaxed);
        counted = bytes;
        absl::MutexLock report(&report_mu);
        const absl::Time now = absl::Now();
        if (now - last_report < options_.progress_every) return;
        last_report = now;
        // Read under the lock, from a count that only grows: events never go backwards.
        const uint64_t read = base->read_bytes.load(std::memory_order_relaxed);
        const double seconds = absl::ToDoubleSeconds(now - base->started);
        events_->Emit("base.progress",
                      absl::StrFormat("base %d '%s': %.0f%% (%s of %s) at %.2f GB/s", base->id,
                                      base->name,
                                      100.0 * read / std::max<uint64_t>(1, base->read_total),
                                      Gb(static_cast<double>(read)),
                                      Gb(static_cast<double>(base->read_total)),
                                      read / 1e9 / std::max(seconds, 1e-9)),
                      {{"base", static_cast<double>(base->id)},
                       {"read_bytes", static_cast<double>(read)},
                       {"total_bytes", static_cast<double>(base->read_total)}},
                      "", base->uid);
      };
      absl::StatusOr<ReadResult> read =
          data.ok() ? ReadTensor(*ct.file, *ct.tensor, layout, *data + bt.data_offset,
                                 *data + bt.scale_offset, progress, options_.window_bytes)
                    : absl::StatusOr<ReadResult>(data.status());
      if (!read.ok()) {
        absl::MutexLock report(&report_mu);
        if (status.ok()) status = read.status();
        return;
      }
      bt.tensor_scale = read->tensor_scale;
    }
  };
  if (status.ok()) {
    std::vector<std::thread> helpers;
    for (unsigned t = 1; t < threads; ++t) helpers.emplace_back(work);
    work();
    for (std::thread& t : helpers) t.join();
  }
  if (status.ok()) {
    for (BufferRecord& record : base->buffers) {
      absl::StatusOr<BufferRecord> sealed = arena_->Seal(base->job, base->owner, record.buffer_id);
      if (!sealed.ok()) {
        status = sealed.status();
        break;
      }
      record = *sealed;
    }
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - base->started);
  if (!status.ok()) {
    // Its memory goes now, outside the store's lock (unmapping takes a while); the base is
    // still loading meanwhile, so no segment of it is handed out.
    arena_->ReleaseSession(base->job, base->owner);
  }
  absl::MutexLock lock(&mu_);
  base->load_seconds = seconds;
  base->checkpoint.reset();  // its files are closed
  if (status.ok()) {
    base->state = BaseState::kReady;
    events_->Emit("base.ready",
                  absl::StrFormat("base %d '%s' ready: %s read in %.1f s (%.2f GB/s), %s held as "
                                  "%s, shared by %d sessions",
                                  base->id, base->name, Gb(static_cast<double>(base->read_total)),
                                  seconds, base->read_total / 1e9 / std::max(seconds, 1e-9),
                                  Gb(static_cast<double>(base->stored_bytes)), base->format,
                                  base->users.size()),
                  {{"base", static_cast<double>(base->id)},
                   {"seconds", seconds},
                   {"stored_bytes", static_cast<double>(base->stored_bytes)}},
                  "", base->uid);
  } else {
    base->state = BaseState::kFailed;
    base->error = std::string(status.message());
    events_->Emit("base.failed",
                  absl::StrFormat("base %d '%s' failed to load: %s", base->id, base->name,
                                  status.message()),
                  {{"base", static_cast<double>(base->id)}}, "", base->uid);
    // The record stays to say why until its users leave.
    base->buffers.clear();
  }
  --active_loaders_;  // the last use of `this`: the destructor may go on from here
}

absl::StatusOr<BaseSnapshot> BaseStore::Get(uid_t uid, bool admin, uint64_t id) const {
  absl::MutexLock lock(&mu_);
  const auto it = bases_.find(id);
  if (it == bases_.end() || (!admin && it->second->uid != uid)) {
    return absl::NotFoundError(absl::StrFormat("no base %d", id));
  }
  return SnapshotLocked(*it->second);
}

absl::Status BaseStore::Detach(const Session& session, uint64_t id) {
  absl::MutexLock lock(&mu_);
  const auto it = bases_.find(id);
  if (it == bases_.end() || it->second->users.erase(session.id) == 0) {
    return absl::NotFoundError(absl::StrFormat("this session is not attached to base %d", id));
  }
  if (it->second->users.empty() && it->second->mappers.empty()) {
    it->second->idle_since = absl::Now();
  }
  return absl::OkStatus();
}

void BaseStore::OnSessionEnded(const Session& session) {
  absl::MutexLock lock(&mu_);
  for (auto& [id, base] : bases_) {
    const bool was_used = base->users.erase(session.id) + base->mappers.erase(session.id) > 0;
    if (was_used && base->users.empty() && base->mappers.empty()) base->idle_since = absl::Now();
  }
}

std::vector<BaseSnapshot> BaseStore::List(uid_t uid, bool admin) const {
  absl::MutexLock lock(&mu_);
  std::vector<BaseSnapshot> out;
  for (const auto& [id, base] : bases_) {
    if (admin || base->uid == uid) out.push_back(SnapshotLocked(*base));
  }
  return out;
}

absl::StatusOr<SegmentGrant> BaseStore::GrantSegment(const Session& session,
                                                     uint64_t segment_id) {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, base] : bases_) {
    if (base->state != BaseState::kReady || !base->users.count(session.id)) continue;
    for (const BufferRecord& record : base->buffers) {
      if (record.segment_id == segment_id) {
        // The session maps it from now on: the base stays until the session ends, detached
        // or not, since its pages stay in that process whatever it says.
        base->mappers.insert(session.id);
        return arena_->GrantSegment(base->job, segment_id);
      }
    }
  }
  return absl::NotFoundError(absl::StrFormat("no segment %d for this session", segment_id));
}

absl::StatusOr<std::unique_ptr<BaseStore::HostPin>> BaseStore::HostBytes(
    const Session& session, uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = bases_.find(id);
  if (it == bases_.end() || !it->second->users.count(session.id)) {
    return absl::NotFoundError(
        absl::StrFormat("this session is not attached to a base %d (load_base first)", id));
  }
  Base& base = *it->second;
  if (base.state != BaseState::kReady) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "base %d is %s: it can go to a GPU once it is ready", id, BaseStateName(base.state)));
  }
  std::vector<std::span<const uint8_t>> out;
  for (const BufferRecord& record : base.buffers) {
    ASSIGN_OR_RETURN(uint8_t * data, arena_->BufferData(base.job, record.buffer_id));
    out.emplace_back(data, record.bytes);
  }
  base.mappers.insert(session.id);
  // A mapper of its own: the bytes stay even if the session ends while they are read.
  std::string token = absl::StrCat("pin:", next_pin_++);
  base.mappers.insert(token);
  return std::make_unique<HostPin>(this, id, std::move(token), std::move(out));
}

void BaseStore::Unpin(uint64_t id, const std::string& token) {
  absl::MutexLock lock(&mu_);
  auto it = bases_.find(id);
  if (it == bases_.end()) return;
  Base& base = *it->second;
  if (base.mappers.erase(token) && base.users.empty() && base.mappers.empty()) {
    base.idle_since = absl::Now();
  }
}

void BaseStore::ExpireIdle(absl::Time now) {
  std::vector<std::shared_ptr<Base>> expired;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = bases_.begin(); it != bases_.end();) {
      Base& base = *it->second;
      const bool idle =
          base.users.empty() && base.mappers.empty() && base.idle_since.has_value();
      if (idle && base.state != BaseState::kLoading &&
          (base.state == BaseState::kFailed || now - *base.idle_since >= options_.keep_warm)) {
        expired.push_back(std::move(it->second));
        it = bases_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // Out of the map, nobody else reaches them; unmapping tens of GiB takes seconds, which the
  // other requests should not wait for.
  for (const auto& base : expired) Free(*base);
}

void BaseStore::Free(const Base& base) {
  const uint64_t released = arena_->ReleaseSession(base.job, base.owner);
  if (base.state == BaseState::kReady) {
    events_->Emit("base.freed",
                  absl::StrFormat("base %d '%s' freed: no user for %s; %s released", base.id,
                                  base.name, absl::FormatDuration(options_.keep_warm),
                                  Gb(static_cast<double>(released))),
                  {{"base", static_cast<double>(base.id)},
                   {"released_bytes", static_cast<double>(released)}},
                  "", base.uid);
  }
}

BaseSnapshot BaseStore::SnapshotLocked(const Base& base) const {
  BaseSnapshot s;
  s.id = base.id;
  s.uid = base.uid;
  s.name = base.name;
  s.source = base.source;
  s.format = base.format;
  s.block = base.block;
  s.state = base.state;
  s.error = base.error;
  s.stored_bytes = base.state == BaseState::kFailed ? 0 : base.stored_bytes;
  s.source_bytes = base.source_bytes;
  s.read_bytes = base.read_bytes.load(std::memory_order_relaxed);
  s.read_total = base.read_total;
  s.load_seconds = base.load_seconds;
  s.users.assign(base.users.begin(), base.users.end());
  s.idle_since = base.idle_since;
  if (base.state == BaseState::kReady) {
    s.buffers = base.buffers;
    s.tensors = base.tensors;
  }
  return s;
}

}  // namespace trainstream::daemon
