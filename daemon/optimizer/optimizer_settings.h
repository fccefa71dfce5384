// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_OPTIMIZER_OPTIMIZER_SETTINGS_H_
#define TRAINSTREAM_DAEMON_OPTIMIZER_OPTIMIZER_SETTINGS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cpu/adamw.h"

namespace trainstream::daemon {

struct GroupHyperParameters {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  friend bool operator==(const GroupHyperParameters&, const GroupHyperParameters&) = default;
};

// kGuard: as kIgnore, updates start as gradients land, but each chunk's gradient is checked
// before it is applied; from the first non-finite value on, nothing more of the step is applied.
enum class NonFinitePolicy { kError, kSkipStep, kIgnore, kGuard };

// A job's optimizer, as its first rank created it. Later ranks must ask for the same.
struct OptimizerSettings {
  bool decoupled_weight_decay = true;  // AdamW; false: Adam
  kernels::ScalarType moment_type = kernels::ScalarType::kFloat32;
  double max_grad_norm = 0;  // > 0: clip
  bool report_grad_norm = false;
  NonFinitePolicy nonfinite = NonFinitePolicy::kIgnore;
  uint32_t accumulation_steps = 1;
  uint32_t machines = 1;  // > 1: gradients are all-reduced across machines by their rank 0s
  std::vector<GroupHyperParameters> groups;
  uint32_t threads = 0;         // > 0: at most this many of the pool's workers at once
  uint64_t chunk_elements = 0;  // > 0: elements per task (else kDefaultChunkElements)
  // eager=False: updates wait for every gradient of the step, never speculating.
  bool defer_updates = false;
  // eager=True: where the step's statistics decide its updates, every step speculates (see
  // JobOptimizer), not only those after a step that needed no scaling.
  bool eager_updates = false;
  friend bool operator==(const OptimizerSettings&, const OptimizerSettings&) = default;

  // The step's gradient statistics decide how its updates apply: clipping scales them, and
  // 'skip' and 'error' drop them all on a non-finite value.
  bool decides() const {
    return max_grad_norm > 0 || nonfinite == NonFinitePolicy::kSkipStep ||
           nonfinite == NonFinitePolicy::kError;
  }
  // The step's norm and non-finite count are gathered from every gradient.
  bool gathers_stats() const { return decides() || report_grad_norm; }
  // Whether a step's statistics can undo updates made before they were known: a decision, or
  // 'guard' with the norm gathered (the whole step is then skipped, as when deciding).
  bool may_roll_back() const {
    return decides() || (report_grad_norm && nonfinite == NonFinitePolicy::kGuard);
  }
  // Gradients are summed into an fp32 buffer per parameter before the update (micro-steps, or
  // the machine's ranks ahead of the cross-machine all-reduce).
  bool reduces_into_buffer() const { return accumulation_steps > 1 || machines > 1; }
};

struct ParameterDescription {
  std::string name;
  uint64_t numel = 0;
  kernels::ScalarType param_type = kernels::ScalarType::kFloat32;
  kernels::ScalarType grad_type = kernels::ScalarType::kFloat32;
  uint32_t group = 0;
  friend bool operator==(const ParameterDescription&, const ParameterDescription&) = default;
};

// One parameter's host buffers, in bytes, as the job's optimizer allocates them. Allocation and
// estimates (EstimateHostMemory) read the same numbers, so a plan cannot drift from the state.
struct ParameterBufferBytes {
  uint64_t master = 0;  // fp32
  uint64_t moment = 0;  // each of exp_avg and exp_avg_sq
  uint64_t param = 0;   // the parameter in its own dtype; 0: none (fp32 reads the master)
  uint64_t accum = 0;   // the fp32 summing buffer; 0: none
  uint64_t grad = 0;    // each rank's gradient slot
};
ParameterBufferBytes BufferBytesFor(const OptimizerSettings& settings,
                                    const ParameterDescription& param);

// Every host buffer of a job whose `ranks` ranks on this machine register `params`, in the order
// the optimizer allocates them: each parameter's state, then each rank's gradient slots.
std::vector<uint64_t> JobBufferBytes(const OptimizerSettings& settings,
                                     const std::vector<ParameterDescription>& params,
                                     uint32_t ranks);
// The alignment the optimizer asks the arena for, for each of those buffers.
inline constexpr uint64_t kOptimizerBufferAlignment = 64;

// INVALID_ARGUMENT naming the field for hyper-parameters torch would also refuse.
absl::Status ValidateSettings(const OptimizerSettings& settings);
absl::Status ValidateGroups(const std::vector<GroupHyperParameters>& groups);

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_OPTIMIZER_OPTIMIZER_SETTINGS_H_
