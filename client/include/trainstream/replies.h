// SPDX-License-Identifier: Apache-2.0
// What the daemon answers to inspection, admission, shared bases, GPU pools and the optimizer's
// figures, as plain structs: every 64-bit count a uint64_t, every list a vector, every enum
// by its name in the API. No gRPC or protobuf type appears here; the fields follow the API's
// messages (proto/trainstream/v1/trainstream.proto), which say what each one means.
#ifndef TRAINSTREAM_REPLIES_H_
#define TRAINSTREAM_REPLIES_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace trainstream::client {

// A buffer in the daemon's shared memory (AllocateBuffer, LookupBuffer, a base's buffers).
struct BufferInfo {
  uint64_t buffer_id = 0;
  std::string name;
  uint64_t segment_id = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  std::string tag;
  bool read_only = false;
  std::string owner_session_id;
};

struct GpuInfo {
  uint32_t index = 0;
  std::string uuid;
  std::string name;
  uint64_t total_bytes = 0;
};

struct EventCount {
  std::string kind;
  uint64_t count = 0;
};

struct JobTransfers {
  std::string job_id;
  uint32_t uid = 0;
  uint64_t h2d_bytes = 0;
  uint64_t d2h_bytes = 0;
};

// GetStatus.
struct DaemonStatus {
  std::string version;
  uint32_t pid = 0;
  double uptime_s = 0;
  std::string socket_path;
  bool draining = false;
  uint32_t sessions = 0;
  uint64_t budget_bytes = 0;
  uint64_t reserved_bytes = 0;
  uint32_t threads = 0;
  std::vector<GpuInfo> gpus;
  std::string gpu_note;
  std::vector<EventCount> events;
  std::vector<JobTransfers> transfers;
  std::string metrics_url;
};

// ListSessions, one row.
struct SessionInfo {
  std::string session_id;
  uint32_t uid = 0;
  uint32_t pid = 0;
  std::string job_id;
  uint32_t rank = 0;
  uint32_t world_size = 0;
  uint64_t buffer_bytes = 0;
  uint32_t buffers = 0;
  double age_s = 0;
  double lease_left_s = 0;
  bool attached = false;
};

struct UsageRow {
  std::string key;
  uint64_t bytes = 0;
  uint32_t buffers = 0;
};

struct JobPlan {
  uint32_t uid = 0;
  std::string job_id;
  uint64_t planned_bytes = 0;
  uint64_t used_bytes = 0;
};

// GetMemory.
struct MemoryReport {
  uint64_t budget_bytes = 0;
  uint64_t reserved_bytes = 0;
  uint64_t uid_quota_bytes = 0;
  uint64_t segments = 0;
  std::vector<UsageRow> by_uid;
  std::vector<UsageRow> by_session;
  std::vector<UsageRow> by_tag;
  uint64_t committed_bytes = 0;
  std::vector<JobPlan> plans;
};

// One entry of the daemon's event log.
struct Event {
  uint64_t seq = 0;
  double time_unix_s = 0;
  std::string session_id;
  std::string kind;
  std::string message;
  std::map<std::string, double> numbers;
  uint32_t uid = 0;
};

// PlanHostMemory.
struct HostPlan {
  std::string job_id;
  uint64_t planned_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t budget_bytes = 0;
  uint64_t committed_bytes = 0;
};

struct BaseTensor {
  std::string name;
  std::vector<uint64_t> shape;
  std::string source_dtype;
  std::string stored;
  uint32_t block = 0;
  float tensor_scale = 0;
  uint32_t buffer = 0;
  uint64_t data_offset = 0;
  uint64_t data_bytes = 0;
  uint64_t scale_offset = 0;
  uint64_t scale_bytes = 0;
};

// LoadBase, GetBase, ListBases.
struct BaseInfo {
  uint64_t base_id = 0;
  uint32_t uid = 0;
  std::string name;
  std::string source;
  std::string format;
  uint32_t block = 0;
  std::string state;
  std::string error;
  uint64_t stored_bytes = 0;
  uint64_t source_bytes = 0;
  uint64_t read_bytes = 0;
  uint64_t read_total = 0;
  double load_seconds = 0;
  uint32_t users = 0;
  double idle_s = 0;
  std::vector<BufferInfo> buffers;
  std::vector<BaseTensor> tensors;
};

// PlaceBaseOnGpu, ListGpuPools.
struct GpuPoolInfo {
  uint64_t pool_id = 0;
  std::string gpu_uuid;
  uint64_t bytes = 0;
  std::string kind;
  std::string purpose;
  uint32_t uid = 0;
  std::vector<std::string> importers;
  uint64_t base_id = 0;
  std::vector<uint64_t> buffer_offsets;
  double fill_seconds = 0;
};

struct GpuPools {
  std::vector<GpuPoolInfo> pools;
  std::string note;
};

// One group's hyper-parameters.
struct OptimizerGroup {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

// The job's optimizer as the daemon runs it (OptimizerSpec); enums by their API names
// ("ADAMW", "FLOAT32", "NONFINITE_SKIP_STEP", ...).
struct OptimizerSpec {
  std::string kind;
  std::string moment_dtype;
  double max_grad_norm = 0;
  bool report_grad_norm = false;
  std::string nonfinite;
  uint32_t accumulation_steps = 0;
  std::vector<OptimizerGroup> groups;
  uint32_t machines = 0;
  uint32_t threads = 0;
  uint64_t chunk_elements = 0;
  bool defer_updates = false;
  bool eager_updates = false;
};

// The figures of the job's last step.
struct StepStats {
  uint64_t step = 0;
  double grad_norm = 0;
  double clip_coef = 1;
  bool skipped = false;
  uint64_t nonfinite = 0;
  double seconds = 0;
  double update_seconds = 0;
  double gbps = 0;
  uint32_t speculated_tensors = 0;
  bool rolled_back = false;
};

// GetOptimizer. `state` is "ready", "stepping", "finished" or "failed: <why>".
struct OptimizerInfo {
  std::string job_id;
  std::optional<OptimizerSpec> spec;
  uint64_t step = 0;
  uint32_t world_size = 0;
  uint32_t ranks_attached = 0;
  uint64_t params = 0;
  uint32_t tensors = 0;
  uint64_t state_bytes = 0;
  std::optional<StepStats> last_step;  // none before the job's first step's figures
  std::string isa;
  uint32_t threads = 0;
  std::string state;
  std::vector<uint64_t> param_steps;
  uint64_t speculated_steps = 0;
  uint64_t rolled_back_steps = 0;
};

}  // namespace trainstream::client

#endif  // TRAINSTREAM_REPLIES_H_
