// SPDX-License-Identifier: Apache-2.0
#include "arena/arena.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <tuple>

#include "absl/strings/str_format.h"
#include "trainstream/status_macros.h"

namespace trainstream::daemon {
namespace {

std::string Mib(uint64_t bytes) {
  return absl::StrFormat("%.1f MiB", static_cast<double>(bytes) / (1 << 20));
}

uint64_t RoundUp(uint64_t value, uint64_t unit) { return (value + unit - 1) / unit * unit; }

}  // namespace

// How long a reservation or plan waits for segments being unmapped before it is refused: well
// inside a client's 10 s request deadline.
const absl::Duration Arena::kRetiringWait = absl::Seconds(5);

absl::StatusOr<std::unique_ptr<Arena>> Arena::Create(const Options& options) {
  if (options.budget_bytes == 0) {
    return absl::InvalidArgumentError("the host memory budget must be above zero");
  }
  if (options.segment_bytes == 0 || options.segment_granularity == 0 ||
      options.segment_bytes % options.segment_granularity != 0) {
    return absl::InvalidArgumentError("segment size must be a multiple of its granularity");
  }
  if (options.segment_granularity % 4096 != 0) {
    return absl::InvalidArgumentError("segment granularity must be a multiple of 4 KiB pages");
  }
  return std::unique_ptr<Arena>(new Arena(options));
}

uint64_t Arena::OwnSegmentBytes(uint64_t bytes) const {
  return RoundUp(bytes, options_.segment_granularity);
}

uint64_t Arena::ReservationFor(const std::vector<PlannedBuffer>& buffers) const {
  // A segment with less free than the smallest buffer that shares one is full for good: it
  // leaves the search, which keeps the first-fit pass short for jobs of many buffers.
  uint64_t smallest = options_.segment_bytes;
  for (const PlannedBuffer& b : buffers) {
    if (!NeedsOwnSegment(b.bytes, /*sealable=*/false)) smallest = std::min(smallest, b.bytes);
  }
  uint64_t reserved = 0;
  std::vector<OffsetAllocator> open;  // the job's shared segments that may take more, in order
  for (const PlannedBuffer& buffer : buffers) {
    // Named copies, not structured bindings: clang 14 can't capture a binding in the lambda.
    const uint64_t bytes = buffer.bytes;
    const uint64_t alignment = buffer.alignment;
    if (NeedsOwnSegment(bytes, /*sealable=*/false)) {
      reserved += OwnSegmentBytes(bytes);
      continue;
    }
    auto fits = std::find_if(open.begin(), open.end(), [&](OffsetAllocator& segment) {
      return segment.free_bytes() >= bytes && segment.Allocate(bytes, alignment).has_value();
    });
    if (fits == open.end()) {
      fits = open.emplace(open.end(), options_.segment_bytes);
      fits->Allocate(bytes, alignment);
      reserved += options_.segment_bytes;
    }
    if (fits->free_bytes() < smallest) open.erase(fits);
  }
  return reserved;
}

absl::StatusOr<uint64_t> Arena::ReserveSegmentLocked(const JobKey& job, uint64_t bytes,
                                                     const std::string& for_name) {
  // Other jobs' plans count as held; this job's own plan covers this segment if it can.
  const uint64_t others_planned = OutstandingPlansLocked(&job);
  const uint64_t used_after = UsedLocked(job) + bytes;
  const auto own_plan = plans_.find(job);
  const uint64_t own_outstanding =
      own_plan != plans_.end() && own_plan->second > used_after ? own_plan->second - used_after : 0;
  auto fits = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return reserved_ + retiring_ + bytes + others_planned + own_outstanding <=
           options_.budget_bytes;
  };
  auto fits_or_nothing_retiring = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return fits() || retiring_ == 0;
  };
  if (!fits() && retiring_ > 0) {
    // Memory being unmapped right now is the machine's within moments: wait for it rather
    // than refuse.
    mu_.AwaitWithTimeout(absl::Condition(&fits_or_nothing_retiring), kRetiringWait);
  }
  const uint64_t held = reserved_ + retiring_;
  if (!fits()) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "host memory budget exhausted: buffer '%s' needs a %s segment, but %s of the "
        "daemon's %s budget is already reserved%s%s; free buffers or raise --memory_budget",
        for_name, Mib(bytes), Mib(held), Mib(options_.budget_bytes),
        retiring_ > 0 ? absl::StrFormat(" (%s of it being released now)", Mib(retiring_)) : "",
        others_planned > 0 ? absl::StrFormat(" and %s more is planned by other jobs",
                                             Mib(others_planned))
                           : ""));
  }
  uint64_t uid_reserved = reserved_by_uid_.contains(job.uid) ? reserved_by_uid_[job.uid] : 0;
  if (options_.uid_quota_bytes != 0 && uid_reserved + bytes > options_.uid_quota_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "per-user quota exhausted: buffer '%s' needs a %s segment, but uid %d already holds "
        "%s of its %s quota; free buffers or raise --uid_quota",
        for_name, Mib(bytes), job.uid, Mib(uid_reserved), Mib(options_.uid_quota_bytes)));
  }
  reserved_ += bytes;
  reserved_by_uid_[job.uid] += bytes;
  reserved_by_job_[job] += bytes;
  return next_segment_id_++;
}

void Arena::UnreserveLocked(const JobKey& job, uint64_t bytes) {
  reserved_ -= bytes;
  if ((reserved_by_uid_[job.uid] -= bytes) == 0) reserved_by_uid_.erase(job.uid);
  if ((reserved_by_job_[job] -= bytes) == 0) reserved_by_job_.erase(job);
}

absl::StatusOr<Arena::SegmentEntry*> Arena::AddSegment(
    const JobKey& job, const std::string& session_id, uint64_t bytes, bool dedicated,
    const std::string& for_name, std::vector<std::unique_ptr<Segment>>& retired) {
  // The lock may be released below (waiting for memory being unmapped, or making a large
  // segment): a release of this session meanwhile must find out about this allocation.
  ++allocating_[session_id];
  auto session_ended_meanwhile = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (--allocating_[session_id] == 0) {
      allocating_.erase(session_id);
      return ended_while_allocating_.erase(session_id) > 0;
    }
    return ended_while_allocating_.contains(session_id);
  };
  absl::StatusOr<uint64_t> id = ReserveSegmentLocked(job, bytes, for_name);
  if (!id.ok()) {
    session_ended_meanwhile();
    return id.status();
  }
  absl::StatusOr<std::unique_ptr<Segment>> segment;
  if (dedicated) {
    // Filling a large segment's pages takes seconds at tens of GiB, and every status request
    // needs the lock: it is made with the lock released. Shared segments are small and made
    // under it, so that a job's concurrent small buffers still share one.
    mu_.Unlock();
    segment = Segment::Create(*id, bytes);
    mu_.Lock();
  } else {
    segment = Segment::Create(*id, bytes);
  }
  const bool session_ended = session_ended_meanwhile();
  if (!segment.ok() || session_ended) {
    UnreserveLocked(job, bytes);
    if (session_ended && !reserved_by_job_.contains(job)) plans_.erase(job);
    if (!segment.ok()) return segment.status();
    // The session's release ran meanwhile and could not see this segment: it goes now.
    retiring_ += bytes;
    retired.push_back(*std::move(segment));
    return absl::FailedPreconditionError(absl::StrFormat(
        "the session ended while buffer '%s' was being allocated", for_name));
  }
  auto [it, inserted] = segments_.emplace(
      *id, SegmentEntry{*std::move(segment), OffsetAllocator(bytes), job, dedicated, 0});
  return &it->second;
}

absl::StatusOr<BufferRecord> Arena::Allocate(const AllocationRequest& request) {
  const uint64_t alignment = request.alignment == 0 ? 4096 : request.alignment;
  if ((alignment & (alignment - 1)) != 0 || alignment > options_.segment_granularity) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "alignment %d is not a power of two between 1 and %d", alignment,
        options_.segment_granularity));
  }
  if (request.bytes == 0) return absl::InvalidArgumentError("a buffer needs at least one byte");
  if (request.bytes > options_.budget_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "buffer '%s' asks for %s, more than the daemon's whole %s budget", request.name,
        Mib(request.bytes), Mib(options_.budget_bytes)));
  }
  std::vector<std::unique_ptr<Segment>> retired;
  absl::StatusOr<BufferRecord> record = AllocateWithRetired(request, alignment, retired);
  DestroyRetired(std::move(retired));
  return record;
}

absl::StatusOr<BufferRecord> Arena::AllocateWithRetired(
    const AllocationRequest& request, uint64_t alignment,
    std::vector<std::unique_ptr<Segment>>& retired) {
  absl::MutexLock lock(&mu_);
  auto name_taken = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = names_.find(request.job);
    return it != names_.end() && it->second.contains(request.name);
  };
  auto already_exists = [&] {
    return absl::AlreadyExistsError(
        absl::StrFormat("job already has a buffer named '%s'", request.name));
  };
  if (name_taken()) return already_exists();
  const bool dedicated = NeedsOwnSegment(request.bytes, request.sealable);
  SegmentEntry* entry = nullptr;
  std::optional<uint64_t> offset;
  if (!dedicated) {
    for (auto& [id, candidate] : segments_) {
      if (candidate.dedicated || !(candidate.job == request.job)) continue;
      offset = candidate.allocator.Allocate(request.bytes, alignment);
      if (offset) {
        entry = &candidate;
        break;
      }
    }
  }
  if (entry == nullptr) {
    uint64_t bytes = dedicated ? OwnSegmentBytes(request.bytes) : options_.segment_bytes;
    ASSIGN_OR_RETURN(entry, AddSegment(request.job, request.session_id, bytes, dedicated,
                                       request.name, retired));
    offset = entry->allocator.Allocate(request.bytes, alignment);
    if (name_taken()) {
      // Another request took the name while the segment was being made: it holds nothing.
      const uint64_t id = entry->segment->id();
      retiring_ += bytes;
      retired.push_back(std::move(entry->segment));
      segments_.erase(id);
      UnreserveLocked(request.job, bytes);
      return already_exists();
    }
  }
  ++entry->buffers;
  BufferRecord record;
  record.buffer_id = next_buffer_id_++;
  record.name = request.name;
  record.session_id = request.session_id;
  record.segment_id = entry->segment->id();
  record.offset = *offset;
  record.bytes = request.bytes;
  record.tag = request.tag.empty() ? "untagged" : request.tag;
  record.sealable = dedicated && request.sealable;
  names_[request.job][request.name] = record.buffer_id;
  buffer_jobs_[record.buffer_id] = request.job;
  buffers_[record.buffer_id] = record;
  CountBufferLocked(record, request.job.uid, /*added=*/true);
  return record;
}

void Arena::CountBufferLocked(const BufferRecord& record, uid_t uid, bool added) {
  for (auto* rows : {&buffers_by_session_, &buffers_by_tag_}) {
    const std::string& key = rows == &buffers_by_session_ ? record.session_id : record.tag;
    UsageRow& row = (*rows)[key];
    row.key = key;
    if (added) {
      row.bytes += record.bytes;
      ++row.buffers;
    } else {
      row.bytes -= record.bytes;
      if (--row.buffers == 0) rows->erase(key);
    }
  }
  uint32_t& count = buffer_count_by_uid_[uid];
  if (added) {
    ++count;
  } else if (--count == 0) {
    buffer_count_by_uid_.erase(uid);
  }
}

absl::StatusOr<BufferRecord> Arena::Lookup(const JobKey& job, const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto job_names = names_.find(job);
  if (job_names == names_.end() || !job_names->second.contains(name)) {
    return absl::NotFoundError(absl::StrFormat("no buffer named '%s' in this job", name));
  }
  return buffers_.at(job_names->second.at(name));
}

absl::StatusOr<const BufferRecord*> Arena::FindOwnedLocked(const JobKey& job,
                                                           const std::string& session_id,
                                                           uint64_t buffer_id) const {
  auto job_it = buffer_jobs_.find(buffer_id);
  if (job_it == buffer_jobs_.end() || !(job_it->second == job)) {
    return absl::NotFoundError(absl::StrFormat("no buffer %d in this job", buffer_id));
  }
  const BufferRecord& record = buffers_.at(buffer_id);
  if (record.session_id != session_id) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "buffer '%s' belongs to another session of the job; only its owner may change it",
        record.name));
  }
  return &record;
}

void Arena::ReleaseBufferLocked(uint64_t buffer_id,
                                std::vector<std::unique_ptr<Segment>>& retired) {
  BufferRecord record = buffers_.at(buffer_id);
  JobKey job = buffer_jobs_.at(buffer_id);
  CountBufferLocked(record, job.uid, /*added=*/false);
  buffers_.erase(buffer_id);
  buffer_jobs_.erase(buffer_id);
  auto names = names_.find(job);
  names->second.erase(record.name);
  if (names->second.empty()) names_.erase(names);
  SegmentEntry& entry = segments_.at(record.segment_id);
  entry.allocator.Release(record.offset, record.bytes);
  if (--entry.buffers == 0) {
    // Empty segments go back to the machine at once: other jobs may be waiting for the memory.
    const uint64_t bytes = entry.segment->bytes();
    UnreserveLocked(job, bytes);
    retiring_ += bytes;
    retired.push_back(std::move(entry.segment));
    segments_.erase(record.segment_id);
  }
}

void Arena::DestroyRetired(std::vector<std::unique_ptr<Segment>> retired) {
  if (retired.empty()) return;
  uint64_t bytes = 0;
  for (const auto& segment : retired) bytes += segment->bytes();
  retired.clear();  // unmapped and closed: the pages are the machine's again
  absl::MutexLock lock(&mu_);
  retiring_ -= bytes;
}

absl::Status Arena::Free(const JobKey& job, const std::string& session_id, uint64_t buffer_id) {
  std::vector<std::unique_ptr<Segment>> retired;
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(FindOwnedLocked(job, session_id, buffer_id).status());
    ReleaseBufferLocked(buffer_id, retired);
  }
  DestroyRetired(std::move(retired));
  return absl::OkStatus();
}

absl::StatusOr<BufferRecord> Arena::Seal(const JobKey& job, const std::string& session_id,
                                         uint64_t buffer_id) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(const BufferRecord* record, FindOwnedLocked(job, session_id, buffer_id));
  if (!record->sealable) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "buffer '%s' was not allocated sealable; allocate it with sealable=true to share it "
        "read-only",
        record->name));
  }
  RETURN_IF_ERROR(segments_.at(record->segment_id).segment->Seal());
  BufferRecord& mutable_record = buffers_.at(buffer_id);
  mutable_record.read_only = true;
  return mutable_record;
}

uint64_t Arena::ReleaseSession(const JobKey& job, const std::string& session_id) {
  std::vector<std::unique_ptr<Segment>> retired;
  uint64_t released = 0;
  {
    absl::MutexLock lock(&mu_);
    std::vector<uint64_t> owned;
    for (const auto& [id, record] : buffers_) {
      if (record.session_id == session_id && buffer_jobs_.at(id) == job) owned.push_back(id);
    }
    for (uint64_t id : owned) {
      released += buffers_.at(id).bytes;
      ReleaseBufferLocked(id, retired);
    }
    // An allocation of this session still being made is dropped when it finishes.
    if (allocating_.contains(session_id)) ended_while_allocating_.insert(session_id);
    // A job that holds nothing any more has ended: its plan goes with it.
    if (!reserved_by_job_.contains(job)) plans_.erase(job);
  }
  DestroyRetired(std::move(retired));
  return released;
}

absl::StatusOr<SegmentGrant> Arena::GrantSegment(const JobKey& job, uint64_t segment_id) const {
  absl::MutexLock lock(&mu_);
  auto it = segments_.find(segment_id);
  if (it == segments_.end() || !(it->second.job == job)) {
    return absl::NotFoundError(absl::StrFormat("no segment %d in this job", segment_id));
  }
  SegmentGrant grant;
  grant.fd.Reset(::fcntl(it->second.segment->fd(), F_DUPFD_CLOEXEC, 0));
  if (!grant.fd.valid()) return ErrnoStatus(errno, "duplicating a segment descriptor");
  grant.bytes = it->second.segment->bytes();
  grant.read_only = it->second.segment->sealed();
  return grant;
}

absl::StatusOr<uint8_t*> Arena::BufferData(const JobKey& job, uint64_t buffer_id) const {
  absl::MutexLock lock(&mu_);
  auto job_it = buffer_jobs_.find(buffer_id);
  if (job_it == buffer_jobs_.end() || !(job_it->second == job)) {
    return absl::NotFoundError(absl::StrFormat("no buffer %d in this job", buffer_id));
  }
  const BufferRecord& record = buffers_.at(buffer_id);
  return segments_.at(record.segment_id).segment->data() + record.offset;
}

uint64_t Arena::reserved_bytes() const {
  absl::MutexLock lock(&mu_);
  return reserved_ + retiring_;  // released segments are the daemon's until unmapped
}

ArenaUsage Arena::Totals() const {
  absl::MutexLock lock(&mu_);
  return TotalsLocked();
}

ArenaUsage Arena::TotalsLocked() const {
  ArenaUsage usage;
  usage.budget_bytes = options_.budget_bytes;
  usage.uid_quota_bytes = options_.uid_quota_bytes;
  usage.reserved_bytes = reserved_ + retiring_;
  usage.committed_bytes = reserved_ + retiring_ + OutstandingPlansLocked(nullptr);
  usage.segments = segments_.size();
  return usage;
}

ArenaUsage Arena::Usage() const {
  absl::MutexLock lock(&mu_);
  ArenaUsage usage = TotalsLocked();
  for (const auto& [job, planned] : plans_) {
    usage.plans.push_back(HostPlanRow{job, planned, UsedLocked(job)});
  }
  std::sort(usage.plans.begin(), usage.plans.end(), [](const auto& a, const auto& b) {
    return std::tie(a.job.uid, a.job.job_id) < std::tie(b.job.uid, b.job.job_id);
  });
  std::map<std::string, UsageRow> by_uid;
  for (const auto& [uid, bytes] : reserved_by_uid_) {
    by_uid[std::to_string(uid)] = UsageRow{std::to_string(uid), bytes, 0};
  }
  for (const auto& [uid, count] : buffer_count_by_uid_) {
    UsageRow& row = by_uid[std::to_string(uid)];
    row.key = std::to_string(uid);
    row.buffers = count;
  }
  for (auto& [key, row] : by_uid) usage.by_uid.push_back(row);
  for (const auto& [key, row] : buffers_by_session_) usage.by_session.push_back(row);
  for (const auto& [key, row] : buffers_by_tag_) usage.by_tag.push_back(row);
  return usage;
}

}  // namespace trainstream::daemon
