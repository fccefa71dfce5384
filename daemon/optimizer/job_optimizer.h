// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_OPTIMIZER_JOB_OPTIMIZER_H_
#define TRAINSTREAM_DAEMON_OPTIMIZER_JOB_OPTIMIZER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "arena/arena.h"
#include "doorbell/doorbell_dispatcher.h"
#include "events/event_log.h"
#include "ipc/doorbell_ring.h"
#include "optimizer/checkpoint.h"
#include "optimizer/optimizer_settings.h"
#include "optimizer/thread_pool.h"

namespace trainstream::daemon {

// The buffers a rank uses for one parameter.
struct ParameterSlots {
  uint32_t index = 0;
  BufferRecord master;
  BufferRecord exp_avg;
  BufferRecord exp_avg_sq;
  std::optional<BufferRecord> param;   // absent for float32 parameters: the master is the param
  BufferRecord grad;                   // the calling rank's gradient slot
  std::optional<BufferRecord> reduce;  // multi-machine jobs, rank 0: the machine's summed gradient
};

struct RegistrationResult {
  std::vector<ParameterSlots> params;
  bool initialize = false;  // the caller created the state and writes the initial master
  uint64_t iteration = 0;
  uint32_t first_added = 0;  // parameters from here on are new (the caller initialises them)
};

struct StepReport {
  uint64_t iteration = 0;
  double grad_norm = 0;
  double clip_coef = 1;
  bool skipped = false;
  uint64_t nonfinite = 0;
  double seconds = 0;
  double update_seconds = 0;
  double gbps = 0;
  uint32_t speculated_tensors = 0;  // updated before the step's norm was known
  bool rolled_back = false;         // and restored, then redone or skipped, by the decision
};

struct OptimizerReport {
  std::string job_id;
  OptimizerSettings settings;
  uint64_t iteration = 0;
  uint32_t world_size = 1;
  uint32_t ranks_attached = 0;
  uint64_t elements = 0;
  uint32_t tensors = 0;
  uint64_t state_bytes = 0;
  StepReport last_step;
  std::string state;
  std::vector<uint64_t> param_steps;
  uint64_t speculated_steps = 0;
  uint64_t rolled_back_steps = 0;
};

// One job's optimizer state and its step machine. Each rank posts a gradient per parameter per
// (micro-)step on its doorbell; when every rank's gradient for a parameter is in, the update
// (summing the ranks' slots in the same pass) runs on the thread pool while backward goes on,
// and every rank is told when that parameter's new value is in place. With clipping, norm
// reporting or non-finite checks, the gradients' statistics are gathered as they land. Where
// they decide the updates (clipping, 'skip', 'error'), updates speculate: each tensor's state is
// copied aside and updated unclipped as its gradient lands, and the decision, once the last
// statistics are in, either publishes them or restores the copies and redoes the updates with
// the clipped gradient (or leaves them restored, for a skipped step), so the result is the one
// of updating after the last gradient, bit for bit. A tensor without room for its copy waits
// for the decision. By default a step speculates only when the step before it needed no
// scaling (a run that clips every step never speculates); eager_updates speculates on every
// step, defer_updates on none. With the norm only reported, updates start at once and nothing
// is copied. A rank that posts out of turn, or leaves
// mid-job, fails the job with a message to every rank rather than leaving them waiting.
// After a failure, each tensor is either stepped for the failed iteration or untouched, never
// part-way: an update once started runs to its end (a failure stops none), and Register, Load
// and SetSteps wait for the failed iteration's tasks. When the ranks come back they redo that
// iteration, and a tensor already stepped for it keeps that step: its new gradient is dropped,
// and its kUpdateDone points at the value already in place. So every tensor steps once per
// iteration, as in a run without the failure, but such a tensor's step used the gradient of the
// failed attempt, not the redone one (identical when the ranks' gradients are reproducible).
// A rank that closes its session between iterations is done, not failed: the ranks of a job
// that ends close one after another. The job fails only if another rank steps on without it;
// once every rank has closed its session so, with no failure, the job is "finished".
// The lock is never held through a checkpoint's file I/O: the doorbell thread, which serves
// every job, takes it for each message. While a checkpoint is written from or read into the
// state, the job's doorbell messages (and its sessions' ends) wait in order in the job's own
// queue, and run when the I/O is over, on the thread that did it.
// Thread-safe; update tasks keep the object alive (shared_from_this). Its definitions are split by
// responsibility: job_optimizer.cc (creation, registration), job_optimizer_step.cc (gradients in,
// iterations, failures), job_optimizer_update.cc (statistics, decisions, AdamW passes),
// job_optimizer_speculation.cc (copies aside, commits and rollbacks) and job_optimizer_state.cc
// (report, checkpoints).
class JobOptimizer : public std::enable_shared_from_this<JobOptimizer> {
 public:
  struct Deps {
    Arena* arena = nullptr;
    ThreadPool* pool = nullptr;
    DoorbellDispatcher* doorbells = nullptr;
    EventLog* events = nullptr;
    // At most this many bytes of copies aside for speculative updates per job (pageable memory,
    // made once per tensor and kept); a copy is also refused when it would leave less than a
    // tenth of the memory available (the machine's, or the daemon's cgroup limit).
    uint64_t speculation_bytes = ~uint64_t{0};
  };
  static absl::StatusOr<std::shared_ptr<JobOptimizer>> Create(const JobKey& job,
                                                              const OptimizerSettings& settings,
                                                              uint32_t world_size, Deps deps);
  ~JobOptimizer();

  // FAILED_PRECONDITION when `settings` differ from the job's (ranks that don't agree).
  absl::Status CheckSame(const OptimizerSettings& settings, uint32_t world_size) const;

  // A rank's parameter list: the first creates the state, the others must send the same list
  // (or extend it, between steps). A refused registration changes nothing: no parameter added,
  // no slot allocated, the rank not attached.
  absl::StatusOr<RegistrationResult> Register(const std::string& session_id, uint32_t rank,
                                              const std::vector<ParameterDescription>& params);

  // Doorbell kGradientReady from `session_id`.
  void OnGradientReady(const std::string& session_id, const ipc::DoorbellMessage& message);
  // Doorbell kReduced from the machine's rank 0 (multi-machine jobs).
  void OnReduced(const std::string& session_id, const ipc::DoorbellMessage& message);
  // Doorbell kNormContribution: the sum of squares of gradients a rank updates on its GPU,
  // part of the step's global norm.
  void OnNormContribution(const std::string& session_id, const ipc::DoorbellMessage& message);

  // A session of the job ended (`clean`: closed by its client): a rank that dies while others
  // are attached, or leaves mid-iteration, fails the job; one that closes its session between
  // iterations fails it only when another rank posts a gradient without it.
  void OnSessionEnded(const std::string& session_id, bool clean);

  // New hyper-parameters (a scheduler's lr, ...). Between iterations they apply at once.
  // Mid-iteration (a gradient of it posted) they are kept and take effect when that iteration
  // ends (completes, or is given up after a failure), so that one iteration's tensors all step
  // with the same values; an optimizer.groups_deferred event says so. The Python client pushes
  // them before an iteration's first gradient; a change made between backward and step()
  // reaches the daemon mid-iteration and so applies from the next one. INVALID_ARGUMENT for
  // bad values or a group that a parameter is in left out; FAILED_PRECONDITION for clipping
  // switched on or off.
  absl::Status SetGroups(const std::vector<GroupHyperParameters>& groups, double max_grad_norm);
  // After importing state: the completed iterations and each parameter's step count.
  absl::Status SetSteps(uint64_t iteration, const std::vector<uint64_t>& param_steps);

  // Checkpoints (see checkpoint.h). FAILED_PRECONDITION while a step is in progress. A second
  // checkpoint of the job waits for the one in flight; the job's messages wait for either.
  absl::StatusOr<uint64_t> Save(const std::string& path);
  // Into a file the client opened and handed over (`name` for errors).
  absl::StatusOr<uint64_t> SaveTo(int fd, const std::string& name);
  // What Save and SaveTo do, with `write` (checkpoint.h's writers, or a test's) given the state
  // in place and called without the job's lock; returns what `write` returns.
  using CheckpointWriter = std::function<absl::StatusOr<uint64_t>(const CheckpointContents&)>;
  absl::StatusOr<uint64_t> SaveWith(const CheckpointWriter& write);
  absl::Status Load(const std::string& path, const FileSource& source = Filesystem());

  OptimizerReport Report() const;
  bool has_sessions() const;
  absl::Time last_activity() const;
  // Whether no session has used the job for `retention` (at `now`). Never waits: a job whose
  // lock is held is busy, not idle, and so is one writing or reading a checkpoint. The registry
  // asks this under its own lock, which the doorbell thread needs for every job's gradients.
  bool IdleFor(absl::Duration retention, absl::Time now) const;

 private:
  enum class Phase {
    kWaiting,
    kAccumulating,
    kCrossMachine,  // the machine's sum is out for the all-reduce across machines
    kStatsPending,
    kStatsDone,
    kSpeculating,  // statistics, copy aside and unclipped update, in one pass
    kSpeculated,   // updated, not yet published: the step's decision commits or undoes it
    kUpdating,
    kDone
  };
  // The AdamW passes over a tensor (StartPassLocked).
  enum class Pass {
    kUpdate,     // the update, published when done
    kSpeculate,  // statistics, then the copy aside (if the tensor has one), then the update
    kRedo,       // the copy put back, then the update with the decided scale
  };
  struct Parameter {
    ParameterDescription desc;
    BufferRecord master, exp_avg, exp_avg_sq;
    std::optional<BufferRecord> param, accum;
    std::map<uint32_t, BufferRecord> grads;  // by rank
    float* master_ptr = nullptr;
    void* exp_avg_ptr = nullptr;
    void* exp_avg_sq_ptr = nullptr;
    void* param_ptr = nullptr;
    float* accum_ptr = nullptr;
    std::map<uint32_t, void*> grad_ptrs;
    uint64_t param_step = 0;
    // The iteration (1-based) this tensor's last completed update belongs to: equal to
    // iteration_ + 1 only when a failed iteration is being redone and this tensor had been
    // stepped for it.
    uint64_t updated_in = 0;
    bool update_failed = false;  // a chunk of this iteration's update was refused by the kernel
    // Progress through the current iteration.
    Phase phase = Phase::kWaiting;
    uint32_t micro = 0;
    std::set<uint32_t> arrived;     // ranks
    std::set<uint32_t> absent;      // ranks that had no gradient
    bool any_gradient = false;      // over the micro-steps of this iteration
    bool machine_gradient = false;  // multi-machine jobs: some rank here had one this iteration
    kernels::GradientStats stats;
    // Each chunk's sum of squares, added in chunk order once the last is in: the norm must not
    // depend on which worker finished first, or clipping would differ in its last bits from run
    // to run (and a speculated step from its redo).
    std::vector<double> chunk_sum_squares;
    size_t chunks_left = 0;
    // Speculation (job_optimizer_speculation.cc): room for the master, moments and parameter
    // slot as they were before a speculative update, made once and kept for the job's life;
    // `backed_up`: this iteration's update is speculative and its copy aside is in `backup`.
    std::unique_ptr<std::byte[]> backup;
    bool backed_up = false;
    bool restoring = false;  // the copy aside is being put back (RestoreLocked)
  };

  // A doorbell message, or a session's end, that came while a checkpoint's I/O was in flight.
  struct Deferred {
    enum class Kind { kGradientReady, kReduced, kNormContribution, kSessionEnded };
    Kind kind;
    std::string session_id;
    ipc::DoorbellMessage message{};
    bool clean = false;  // kSessionEnded
  };

  JobOptimizer(const JobKey& job, const OptimizerSettings& settings, uint32_t world_size,
               Deps deps);

  // What the public handlers do, with the lock held and no checkpoint I/O in flight
  // (job_optimizer_step.cc).
  void GradientReadyLocked(const std::string& session_id, const ipc::DoorbellMessage& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReducedLocked(const std::string& session_id, const ipc::DoorbellMessage& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NormContributionLocked(const std::string& session_id, const ipc::DoorbellMessage& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SessionEndedLocked(const std::string& session_id, bool clean)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Checkpoint I/O without the lock (job_optimizer_state.cc). Deferring: true when `deferred`
  // must wait for the I/O in flight (it is queued then, or, past a bound that no rank keeping
  // to the protocol reaches, dropped with the job failed).
  bool DeferLocked(Deferred deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits (releasing mu_) until no checkpoint I/O is in flight and, after a failure, the failed
  // iteration's tasks are done (none may run after the progress is reset or the state restored).
  void AwaitQuietLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool QuietLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !file_io_ && (failure_.empty() || tasks_in_flight_ == 0);
  }
  // The I/O is over: runs what waited for it, in the order it came.
  void EndFileIoLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A step is under way, or a message that may start one waits for the I/O in flight.
  bool StepPendingLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return InProgressLocked() || !deferred_.empty();
  }

  // Registration (job_optimizer.cc).
  absl::Status AllocateParameterLocked(Parameter& p, uint32_t index)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<BufferRecord> AllocateLocked(const std::string& name, uint64_t bytes,
                                              const std::string& tag)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<uint8_t*> Data(const BufferRecord& record) const;
  void ClearInParallel(uint8_t* data, uint64_t bytes);
  // Register's refusals: a bad rank or list, a rank attached by another session, a list that
  // disagrees with the job's.
  absl::Status CheckRegistrationLocked(const std::string& session_id, uint32_t rank,
                                       const std::vector<ParameterDescription>& params) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A registration whose list extends the job's: allocates the new parameters' state (all or
  // none of them).
  absl::Status AddParametersLocked(const std::vector<ParameterDescription>& params)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The gradient slots `rank` lacks, all or none of them.
  absl::Status AllocateGradientsLocked(uint32_t rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees every buffer a parameter holds (a parameter whose allocation failed part-way).
  void ReleaseParameterLocked(Parameter& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The ranks' side of the step machine (job_optimizer_step.cc).
  void AfterGradientsInLocked(uint32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks `index` done for this iteration without an update (no gradient anywhere).
  void LeaveWithoutGradientLocked(uint32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartAccumulateLocked(uint32_t index, bool final_micro) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeFinishIterationLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets the iteration's progress (it ended, or is given up) and applies a deferred SetGroups.
  void ResetProgressLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool InProgressLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailLocked(const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells the ranks of the failure once every speculated tensor has its copy aside back.
  void AnnounceFailureIfUndoneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SendToRank(uint32_t rank, const ipc::DoorbellMessage& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SendToAll(const ipc::DoorbellMessage& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every task goes to the pool through here, counted in tasks_in_flight_ until it has run.
  void SubmitLocked(std::function<void()> task) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The rank of the session that rang; a session of no rank of the job is answered kError.
  std::optional<uint32_t> RankOfSenderLocked(const std::string& session_id,
                                             const ipc::DoorbellMessage& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunOnPoolLocked(std::function<void()> task) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  size_t ChunkElementsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The updates (job_optimizer_update.cc).
  std::vector<const void*> GradientsLocked(const Parameter& p) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A statistics pass over `chunks` chunks starts, a chunk's statistics come in, and (when the
  // last has) the tensor's sum of squares is added up in chunk order.
  static void StartChunkStats(Parameter& p, size_t chunks);
  static void AddChunkStats(Parameter& p, size_t chunk, const kernels::GradientStats& stats);
  static void EndChunkStats(Parameter& p);
  float MeanScaleLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reads tensor `index`'s gradients in chunks on the pool into its `stats` (cleared first);
  // `scanned` runs under the lock once the last chunk has been counted.
  void ScanGradientsLocked(uint32_t index, std::function<void(JobOptimizer&, Parameter&)> scanned)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The tensor's gradients are final for this iteration: update it, speculate, or gather its
  // statistics for the decision.
  void GradientsFinalLocked(uint32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether this iteration's statistics are gathered (they decide, are reported, or updates wait
  // for the last gradient anyway: eager=False).
  bool GathersStatsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return settings_.gathers_stats() || settings_.defer_updates;
  }
  void StartStatsLocked(uint32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeDecideLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartUpdateLocked(uint32_t index, float grad_scale) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One AdamW pass over a tensor on the pool, in chunks (see Pass).
  void StartPassLocked(uint32_t index, float grad_scale, Pass pass)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PassDoneLocked(uint32_t index, Pass pass) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A tensor's update ran to its end, or a speculated one was decided right: it is the
  // tensor's step for this iteration and, unless the job failed, the ranks are told.
  void PublishLocked(uint32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // kGuard: the tensor's gradients are read once (in chunks, on the pool) before anything of it
  // is written; once any tensor's held a non-finite value, no later one is updated.
  void CheckThenUpdateLocked(uint32_t index, float grad_scale) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyUpdateLocked(uint32_t index, float grad_scale) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    StartPassLocked(index, grad_scale, Pass::kUpdate);
  }
  // A redone iteration's tensor that was stepped for it before the failure: done, as it is.
  void KeepEarlierUpdateLocked(uint32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool SteppedThisIterationLocked(const Parameter& p) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return p.updated_in == iteration_ + 1;
  }

  // Speculation (job_optimizer_speculation.cc).
  // Whether this iteration speculates (decided at its first gradient; see the class comment).
  bool SpeculatesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The tensor's room for its copy aside: made if the budget and the machine allow.
  bool EnsureBackupLocked(Parameter& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Puts a speculated tensor's copy back on the pool; then, unless the job failed, the tensor is
  // done for this iteration, skipped.
  void RestoreLocked(uint32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job failed: every speculated update not yet decided is undone (a tensor is stepped for
  // a failed iteration, or untouched).
  void RollBackOnFailureLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The decision's bookkeeping: counts, the report, the next step's policy, and an event when
  // speculated updates were undone.
  void NoteDecisionLocked(bool scaled, float coef, double norm) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Checkpoints (job_optimizer_state.cc): the state as checkpoint arrays over the live buffers.
  CheckpointContents ContentsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const JobKey job_;
  const std::string owner_;  // arena owner of the job's optimizer buffers
  const uint32_t world_size_;
  const Deps deps_;
  mutable absl::Mutex mu_;
  OptimizerSettings settings_ ABSL_GUARDED_BY(mu_);
  std::vector<Parameter> params_ ABSL_GUARDED_BY(mu_);
  // SetGroups mid-iteration: what settings_ takes when the iteration ends (ResetProgressLocked).
  struct Retune {
    std::vector<GroupHyperParameters> groups;
    double max_grad_norm = 0;
  };
  std::optional<Retune> next_groups_ ABSL_GUARDED_BY(mu_);
  bool registered_ ABSL_GUARDED_BY(mu_) = false;
  std::map<uint32_t, std::string> rank_sessions_ ABSL_GUARDED_BY(mu_);
  // Ranks that closed their sessions between iterations while others stayed attached, and have
  // not registered again: a gradient posted without them fails the job.
  std::set<uint32_t> departed_ ABSL_GUARDED_BY(mu_);
  // Every rank closed its session between iterations, with no failure, and none has registered
  // since (Report's "finished").
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t iteration_ ABSL_GUARDED_BY(mu_) = 0;  // completed iterations
  std::string failure_ ABSL_GUARDED_BY(mu_);
  bool failure_unannounced_ ABSL_GUARDED_BY(mu_) = false;  // the ranks not yet told of it
  size_t undo_pending_ ABSL_GUARDED_BY(mu_) = 0;     // tensors of the failure still to restore
  size_t tasks_in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // queued or running on the pool
  size_t tasks_running_ ABSL_GUARDED_BY(mu_) = 0;    // handed to the pool (settings_.threads)
  std::deque<std::function<void()>> waiting_tasks_ ABSL_GUARDED_BY(mu_);  // over that limit
  // Progress of the iteration in flight.
  absl::Time iteration_start_ ABSL_GUARDED_BY(mu_);
  bool iteration_started_ ABSL_GUARDED_BY(mu_) = false;
  size_t params_done_ ABSL_GUARDED_BY(mu_) = 0;
  size_t params_with_stats_ ABSL_GUARDED_BY(mu_) = 0;
  // This step's kNormContribution sums (gradients updated on the ranks' GPUs).
  double contributed_sum_squares_ ABSL_GUARDED_BY(mu_) = 0;
  size_t params_updated_ ABSL_GUARDED_BY(mu_) = 0;  // stepped (not skipped, not without gradient)
  absl::Time updates_start_ ABSL_GUARDED_BY(mu_);
  double update_busy_s_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t update_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t update_nonfinite_ ABSL_GUARDED_BY(mu_) = 0;
  // kGuard: a tensor of this iteration held a non-finite gradient value (which, and how many
  // tensors had been updated by then).
  bool guard_tripped_ ABSL_GUARDED_BY(mu_) = false;
  std::string guard_first_ ABSL_GUARDED_BY(mu_);
  size_t guard_tensors_before_ ABSL_GUARDED_BY(mu_) = 0;
  // Speculation: this iteration's choice, whether the last decided step was scaled or skipped
  // (the default policy speculates only after one that was not), the totals, and the bytes of
  // copies aside made.
  bool speculating_ ABSL_GUARDED_BY(mu_) = false;
  bool last_step_scaled_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t speculated_steps_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t rolled_back_steps_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t backup_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // The memory left for copies, read at the iteration's first copy made (EnsureBackupLocked),
  // and the bytes of copies made since.
  bool memory_seen_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t seen_total_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t seen_available_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t copied_since_seen_ ABSL_GUARDED_BY(mu_) = 0;
  bool backup_refusal_said_ ABSL_GUARDED_BY(mu_) = false;
  StepReport pending_report_ ABSL_GUARDED_BY(mu_);
  StepReport last_report_ ABSL_GUARDED_BY(mu_);
  absl::Time last_activity_ ABSL_GUARDED_BY(mu_);
  // A checkpoint is being written from, or read into, the state with mu_ released: no update
  // may run, and the job's messages wait in deferred_ until it is over.
  bool file_io_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<Deferred> deferred_ ABSL_GUARDED_BY(mu_);
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_OPTIMIZER_JOB_OPTIMIZER_H_
