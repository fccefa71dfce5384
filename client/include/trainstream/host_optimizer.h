// SPDX-License-Identifier: Apache-2.0
// The daemon's host optimizer, seen from one rank: its parameters' shared buffers, posting
// gradients on the doorbell, waiting for updates, hyper-parameters, state and checkpoints.
#ifndef TRAINSTREAM_HOST_OPTIMIZER_H_
#define TRAINSTREAM_HOST_OPTIMIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "trainstream/client.h"

namespace trainstream::client {

class DeviceReturn;
class GradientSender;

// Where one parameter's updated value goes on the GPU: `bytes` at device address `device_ptr`.
struct DeviceTarget {
  uintptr_t device_ptr = 0;
  uint64_t bytes = 0;
};

enum class DType { kFloat32 = 1, kBFloat16 = 2, kFloat16 = 3 };

enum class NonFinite { kError = 1, kSkipStep = 2, kIgnore = 3 };

struct OptimizerOptions {
  bool adamw = true;  // false: Adam (L2 weight decay)
  DType moment_dtype = DType::kFloat32;
  double max_grad_norm = 0;  // > 0: clip the job's global norm
  bool report_grad_norm = false;
  NonFinite nonfinite = NonFinite::kIgnore;
  uint32_t accumulation_steps = 1;
  uint32_t machines = 1;  // > 1: rank 0 all-reduces each machine-summed gradient (see below)
  std::vector<OptimizerGroup> groups = {OptimizerGroup{}};
  uint32_t threads = 0;         // > 0: at most this many of the daemon's workers at once
  uint64_t chunk_elements = 0;  // > 0: elements per task of the daemon's pass
  bool defer_updates = false;   // updates wait for every gradient of the step
  // Where clipping or a check decides the step, updates speculate on every step (not only after
  // one that needed no clipping); not with defer_updates.
  bool eager_updates = false;
};

struct ParameterInfo {
  std::string name;
  uint64_t numel = 0;
  DType param_dtype = DType::kFloat32;
  DType grad_dtype = DType::kFloat32;
  uint32_t group = 0;
};

// What a job's host memory would be in the daemon, counted by the code that will allocate it.
struct HostMemoryEstimate {
  uint64_t bytes = 0;            // the segments the daemon would reserve for all the buffers
  uint64_t optimizer_bytes = 0;  // of which for the optimizer's own
  uint64_t buffer_bytes = 0;     // the buffers' sizes, summed
  uint64_t buffers = 0;
  uint64_t segment_bytes = 0;        // the daemon's shared-segment size
  uint64_t segment_granularity = 0;  // a large buffer's segment is rounded up to this
};

// One parameter's buffers, mapped into this process. `param` is null for float32 parameters,
// whose updated value is the master itself.
struct ParameterBuffers {
  uint32_t index = 0;
  std::shared_ptr<HostBuffer> master, exp_avg, exp_avg_sq, param, grad;
  std::shared_ptr<HostBuffer> reduce;  // multi-machine jobs, rank 0: fp32 machine-summed gradient
};

// What one iteration did, as seen by this rank.
struct IterationResult {
  uint64_t iteration = 0;
  bool skipped = false;       // non-finite gradients and nonfinite=kSkipStep
  std::vector<bool> updated;  // per parameter: false when no rank had a gradient
};

// Thread-safe except that one iteration's Post/Wait calls come from one thread at a time.
class HostOptimizer {
 public:
  // Creates the job's optimizer (or joins it: every rank of a job passes the same options and
  // parameters) and maps the parameters' buffers. When `initialize()` is true this rank must
  // write the initial fp32 master weights (and the `param` copies) before the first step.
  static absl::StatusOr<std::unique_ptr<HostOptimizer>> Create(
      Session& session, const OptimizerOptions& options, const std::vector<ParameterInfo>& params);
  // The host memory a job would hold with an optimizer created with `options` over `params`,
  // joined by `ranks` ranks on this machine, plus `other_buffers` of its own (AllocateBuffer's
  // default alignment): what to hand Session::PlanHostMemory. Allocates nothing.
  static absl::StatusOr<HostMemoryEstimate> EstimateHostMemory(
      Session& session, const OptimizerOptions& options, const std::vector<ParameterInfo>& params,
      uint32_t ranks, const std::vector<uint64_t>& other_buffers);
  ~HostOptimizer();
  HostOptimizer(const HostOptimizer&) = delete;
  HostOptimizer& operator=(const HostOptimizer&) = delete;

  const std::vector<ParameterBuffers>& params() const { return params_; }
  bool initialize() const { return initialize_; }
  // Completed iterations of the job when this rank attached.
  uint64_t attached_at_iteration() const { return attached_at_; }

  // Announces that this rank's gradient slot for `index` holds micro-step `micro` of iteration
  // `iteration` (1-based), or that this rank has no gradient for it.
  absl::Status PostGradient(uint32_t index, uint64_t iteration, uint32_t micro = 0,
                            bool no_gradient = false);
  // Adds `sum_squares` (gradients of `iteration` that this rank updates itself, on its GPU) to
  // the job's global gradient norm. Sent before those parameters are posted without a
  // gradient, so that the daemon has it when it decides the step's clipping.
  absl::Status PostNormContribution(uint64_t iteration, double sum_squares);
  // CUDA: copies parameter `index`'s gradient (`bytes` at `device_src` on CUDA device `device`)
  // into this rank's gradient slot on `stream` (a cudaStream_t) and posts it as PostGradient
  // does once the copy has landed, from a thread of this object: the caller never waits.
  // Failures of the copy or the post come back from DrainGradients.
  absl::Status SendGradient(uint32_t index, uint64_t iteration, uint32_t micro, int device,
                            const void* device_src, uint64_t bytes, void* stream);
  // One gradient of a batch for SendGradients.
  struct GradientCopy {
    uint32_t index;
    uint32_t micro;
    const void* device_src;
    uint64_t bytes;
  };
  // As SendGradient for each of `copies` (on `stream`, all of iteration `iteration`), posted
  // together once every copy has landed: a block's small gradients cost one call and one event
  // instead of one each.
  absl::Status SendGradients(uint64_t iteration, int device,
                             const std::vector<GradientCopy>& copies, void* stream);
  // Blocks until every gradient sent so far is posted; returns the first failure since the
  // last call.
  absl::Status DrainGradients();
  // Waits until `index`'s slot may be written again (after a non-final micro-step).
  absl::Status WaitGradientConsumed(uint32_t index, uint64_t iteration, int timeout_ms);
  // Waits until every parameter's update of `iteration` is in place. A failed job reads as
  // FAILED_PRECONDITION with the daemon's reason; a timeout names the parameters still waiting.
  absl::StatusOr<IterationResult> WaitIteration(uint64_t iteration, int timeout_ms);

  // Multi-machine jobs, rank 0: waits until `index`'s reduce buffer holds this machine's sum
  // for `iteration`; after all-reducing it with the other machines, PostReduced() lets the
  // daemon update the parameter.
  // Returns whether any rank of this machine had a gradient for it; PostReduced passes on
  // whether any machine had one (when none had, the daemon leaves the parameter alone).
  absl::StatusOr<bool> WaitReduceReady(uint32_t index, uint64_t iteration, int timeout_ms);
  absl::Status PostReduced(uint32_t index, uint64_t iteration, bool any_gradient);

  // From now on, each updated parameter (its model-dtype copy, or the master for float32) is
  // copied to `targets[i]` on CUDA device `device` the moment its update is announced, during
  // backward, instead of after the whole step: the session's thread that takes the daemon's
  // notices starts the copy before the waits above can see the notice. One optimizer of a
  // session may do this (FailedPrecondition for a second).
  absl::Status ReturnUpdatesToDevice(int device, std::vector<DeviceTarget> targets);
  // The device tensor of parameter `index` moved.
  absl::Status RetargetDevice(uint32_t index, DeviceTarget target);
  // Makes CUDA stream `stream` wait for the returning copies of `indices` still in flight (a
  // module's forward waits only for its own parameters).
  absl::Status WaitForParameters(const std::vector<uint32_t>& indices, void* stream);
  // Blocks until every returning copy has landed.
  absl::Status SynchronizeDeviceReturns();

  // Parameters added between steps (torch's add_param_group): `all` is the whole list, the
  // current parameters first; their groups must exist (SetGroups with the new group first).
  // Returns the index of the first parameter this rank must initialise (the new ones, or the
  // list's length when another rank of the job added them already).
  absl::StatusOr<uint32_t> AddParameters(const std::vector<ParameterInfo>& all);
  // Device targets of the parameters AddParameters() just added, in order.
  absl::Status AddDeviceTargets(std::vector<DeviceTarget> targets);

  absl::Status SetGroups(const std::vector<OptimizerGroup>& groups, double max_grad_norm);
  absl::Status SetStep(uint64_t iteration, const std::vector<uint64_t>& param_steps);
  // Checkpoint by the daemon (atomic rename); returns bytes written.
  absl::StatusOr<uint64_t> Save(const std::string& path);
  absl::Status Load(const std::string& path);
  // The job's optimizer figures.
  absl::StatusOr<OptimizerInfo> Info();

 private:
  explicit HostOptimizer(Session& session);
  struct Registered {
    bool initialize = false;
    uint64_t step = 0;
    uint32_t first_added = 0;
  };
  // RegisterParameters with `params`; maps the buffers of parameters not mapped yet.
  absl::StatusOr<Registered> Register(const std::vector<ParameterInfo>& params);
  absl::Status ExplainFailure();
  absl::StatusOr<Notice> NextNotice(int timeout_ms);
  // Waits for the notice (kind, index, iteration), holding others for later waits.
  absl::Status WaitForNotice(uint32_t kind, uint32_t index, uint64_t iteration, int timeout_ms,
                             const absl::FormatSpec<uint32_t>& late, uint64_t* value = nullptr);
  // The pump's dispatch of each notice, with device returns: an update that landed is copied
  // to the device before its notice is queued.
  void ReturnUpdate(const Notice& notice);
  // The job starts over (a new step count, a loaded checkpoint): notices and a failure seen
  // so far no longer apply.
  void ForgetNotices();

  Session& session_;
  std::vector<ParameterBuffers> params_;
  bool initialize_ = false;
  uint64_t attached_at_ = 0;
  // Notices that arrived for a later wait than the one that read them.
  std::vector<Notice> held_;

  // Gradients sent from device memory (made with the first SendGradient).
  absl::Mutex sender_mu_;
  std::unique_ptr<GradientSender> sender_ ABSL_GUARDED_BY(sender_mu_);

  // With device returns: the copies the session's pump starts, and the first that failed.
  std::unique_ptr<DeviceReturn> device_return_;
  absl::Mutex return_mu_;
  absl::Status return_error_ ABSL_GUARDED_BY(return_mu_);
};

}  // namespace trainstream::client

#endif  // TRAINSTREAM_HOST_OPTIMIZER_H_
