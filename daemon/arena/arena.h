// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_ARENA_ARENA_H_
#define TRAINSTREAM_DAEMON_ARENA_ARENA_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "arena/offset_allocator.h"
#include "arena/segment.h"
#include "ipc/unique_fd.h"

namespace trainstream::daemon {

// The jobs a buffer's name and segments belong to: one uid's sessions with one job id.
struct JobKey {
  uid_t uid = 0;
  std::string job_id;
  friend bool operator==(const JobKey&, const JobKey&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const JobKey& k) {
    return H::combine(std::move(h), k.uid, k.job_id);
  }
};

struct AllocationRequest {
  JobKey job;
  std::string session_id;  // the owner: freed with it
  std::string name;
  uint64_t bytes = 0;
  uint64_t alignment = 4096;
  std::string tag;
  bool sealable = false;
};

struct BufferRecord {
  uint64_t buffer_id = 0;
  std::string name;
  std::string session_id;
  uint64_t segment_id = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  std::string tag;
  bool read_only = false;
  bool sealable = false;
};

// A segment handed to a client: a duplicate of its fd (the caller owns it) and its size.
struct SegmentGrant {
  ipc::UniqueFd fd;
  uint64_t bytes = 0;
  bool read_only = false;
};

struct UsageRow {
  std::string key;
  uint64_t bytes = 0;
  uint32_t buffers = 0;
};

// A job's declared host-memory plan (admission) beside what it holds.
struct HostPlanRow {
  JobKey job;
  uint64_t planned_bytes = 0;
  uint64_t used_bytes = 0;
};

// The outcome of Arena::Plan, in bytes.
struct PlanOutcome {
  uint64_t planned = 0;
  uint64_t used = 0;       // segments the job holds now
  uint64_t budget = 0;
  uint64_t committed = 0;  // held or planned by every job, this plan included
};

struct ArenaUsage {
  uint64_t budget_bytes = 0;
  uint64_t committed_bytes = 0;      // held, plus planned and not yet held
  std::vector<HostPlanRow> plans;
  uint64_t uid_quota_bytes = 0;
  uint64_t reserved_bytes = 0;       // segments held, those being unmapped included
  uint64_t segments = 0;
  std::vector<UsageRow> by_uid;      // reserved segment bytes per uid
  std::vector<UsageRow> by_session;  // buffer bytes per owning session
  std::vector<UsageRow> by_tag;      // buffer bytes per tag
};

// The daemon's host memory: segments (see Segment) carved into named, aligned buffers.
// Small buffers of one job share segments; a buffer of half a segment or more, or one that may
// be sealed, gets a segment of its own. A segment never holds two jobs' buffers, since mapping
// it exposes all of it. Reservations are checked against the machine budget and the per-uid
// quota before any memory is touched. Thread-safe.
class Arena {
 public:
  struct Options {
    uint64_t budget_bytes = uint64_t{8} << 30;
    uint64_t uid_quota_bytes = 0;                 // 0: none
    uint64_t segment_bytes = uint64_t{64} << 20;  // shared-segment size for small buffers
    uint64_t segment_granularity = uint64_t{2} << 20;
  };
  static absl::StatusOr<std::unique_ptr<Arena>> Create(const Options& options);

  // ALREADY_EXISTS for a name the job already uses; RESOURCE_EXHAUSTED past the budget or
  // quota, with the numbers; INVALID_ARGUMENT for a bad alignment or size.
  absl::StatusOr<BufferRecord> Allocate(const AllocationRequest& request);
  // NOT_FOUND unless the job has a buffer of that name.
  absl::StatusOr<BufferRecord> Lookup(const JobKey& job, const std::string& name) const;
  // Only the owning session may free or seal; another session of the job gets
  // PERMISSION_DENIED, anyone else NOT_FOUND.
  absl::Status Free(const JobKey& job, const std::string& session_id, uint64_t buffer_id);
  absl::StatusOr<BufferRecord> Seal(const JobKey& job, const std::string& session_id,
                                    uint64_t buffer_id);
  // Frees everything `session_id` owns; returns the buffer bytes released.
  uint64_t ReleaseSession(const JobKey& job, const std::string& session_id);
  // A duplicate fd of one of the job's segments. NOT_FOUND for any other segment.
  absl::StatusOr<SegmentGrant> GrantSegment(const JobKey& job, uint64_t segment_id) const;
  // The daemon's own view of a buffer's bytes (read-only once sealed). Valid until freed.
  absl::StatusOr<uint8_t*> BufferData(const JobKey& job, uint64_t buffer_id) const;

  // Admission: records that `job` will hold up to `bytes` of host memory in all (0 drops its
  // plan). The machine then keeps that much for it: other jobs' allocations and plans cannot
  // take it, and its own allocations within the plan cannot be refused for lack of budget. A
  // plan that does not fit next to what the other jobs hold or planned is RESOURCE_EXHAUSTED,
  // naming those jobs and the numbers; with `wait` above zero, it waits that long for room
  // first. The plan ends with the job's last buffer released by ReleaseSession.
  absl::StatusOr<PlanOutcome> Plan(const JobKey& job, uint64_t bytes, absl::Duration wait);

  ArenaUsage Usage() const;
  // Usage()'s totals alone (budget, quota, reserved, committed, segments), without its rows:
  // no walk over the buffers under the lock that allocation needs (GetStatus once took 4 ms
  // with 40,000 buffers, 0.2 ms with none).
  ArenaUsage Totals() const;
  uint64_t reserved_bytes() const;

  // One buffer of a job's plan: its size and alignment as its AllocationRequest will give them.
  struct PlannedBuffer {
    uint64_t bytes = 0;
    uint64_t alignment = 4096;
  };
  // The host memory a job that allocates these buffers, in this order, into no segments of its
  // own yet, would reserve: each placed by the rules and the allocator Allocate uses, so that a
  // plan made from it (PlanHostMemory) matches what the job takes. Allocates nothing.
  uint64_t ReservationFor(const std::vector<PlannedBuffer>& buffers) const;
  const Options& options() const { return options_; }

 private:
  // A buffer of half a segment or more, or one that may be sealed, gets a segment of its own.
  bool NeedsOwnSegment(uint64_t bytes, bool sealable) const {
    return sealable || bytes >= options_.segment_bytes / 2;
  }
  // The size of the segment of its own such a buffer gets.
  uint64_t OwnSegmentBytes(uint64_t bytes) const;

  struct SegmentEntry {
    std::unique_ptr<Segment> segment;
    OffsetAllocator allocator;
    JobKey job;
    bool dedicated = false;
    uint32_t buffers = 0;
  };
  explicit Arena(const Options& options) : options_(options) {}
  // Checks a new segment of `bytes` for `job` against the budget and quota and counts it as
  // reserved; returns its id.
  absl::StatusOr<uint64_t> ReserveSegmentLocked(const JobKey& job, uint64_t bytes,
                                                const std::string& for_name)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnreserveLocked(const JobKey& job, uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reserves and makes a new segment for `session_id` of `job`. A dedicated segment is made
  // with mu_ released (held again on return); when the session was released meanwhile, the
  // segment goes to `retired` and the result is FAILED_PRECONDITION.
  absl::StatusOr<SegmentEntry*> AddSegment(const JobKey& job, const std::string& session_id,
                                           uint64_t bytes, bool dedicated,
                                           const std::string& for_name,
                                           std::vector<std::unique_ptr<Segment>>& retired)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops a buffer; an emptied segment moves to `retired`, to be unmapped by DestroyRetired
  // once the lock is released.
  void ReleaseBufferLocked(uint64_t buffer_id, std::vector<std::unique_ptr<Segment>>& retired)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Usage()'s running rows: `record` of `uid` added or released.
  void CountBufferLocked(const BufferRecord& record, uid_t uid, bool added)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<BufferRecord> AllocateWithRetired(const AllocationRequest& request,
                                                   uint64_t alignment,
                                                   std::vector<std::unique_ptr<Segment>>& retired)
      ABSL_LOCKS_EXCLUDED(mu_);
  void DestroyRetired(std::vector<std::unique_ptr<Segment>> retired) ABSL_LOCKS_EXCLUDED(mu_);
  // Bytes planned and not yet held, over every job but `except` (none: all jobs).
  uint64_t OutstandingPlansLocked(const JobKey* except) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  ArenaUsage TotalsLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  uint64_t UsedLocked(const JobKey& job) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::StatusOr<const BufferRecord*> FindOwnedLocked(const JobKey& job,
                                                      const std::string& session_id,
                                                      uint64_t buffer_id) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable absl::Mutex mu_;
  uint64_t next_segment_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_buffer_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t reserved_ ABSL_GUARDED_BY(mu_) = 0;
  // Segments released and still being unmapped: their pages are the machine's only once gone,
  // so they count against the budget until then.
  uint64_t retiring_ ABSL_GUARDED_BY(mu_) = 0;
  static const absl::Duration kRetiringWait;
  // Sessions with segments being made with the lock released, how many; and those released
  // meanwhile, whose segments are dropped once made.
  absl::flat_hash_map<std::string, int> allocating_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> ended_while_allocating_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uid_t, uint64_t> reserved_by_uid_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<JobKey, uint64_t> reserved_by_job_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<JobKey, uint64_t> plans_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, SegmentEntry> segments_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, BufferRecord> buffers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, JobKey> buffer_jobs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<JobKey, std::map<std::string, uint64_t>> names_ ABSL_GUARDED_BY(mu_);
  // Usage()'s rows kept as buffers come and go, so that a report costs the rows, not a pass
  // over every buffer (40,000 buffers took ListSessions 18 ms). Sorted by key, as reported.
  std::map<std::string, UsageRow> buffers_by_session_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, UsageRow> buffers_by_tag_ ABSL_GUARDED_BY(mu_);
  std::map<uid_t, uint32_t> buffer_count_by_uid_ ABSL_GUARDED_BY(mu_);
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_ARENA_ARENA_H_
