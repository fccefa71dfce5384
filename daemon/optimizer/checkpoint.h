// SPDX-License-Identifier: Apache-2.0
// Optimizer checkpoints as safetensors files: the master weights and moments as named tensors
// ("<index>.master", "<index>.exp_avg", "<index>.exp_avg_sq"), the settings, parameter list and
// step counts as JSON under "__metadata__". Any safetensors reader can open them.
#ifndef TRAINSTREAM_DAEMON_OPTIMIZER_CHECKPOINT_H_
#define TRAINSTREAM_DAEMON_OPTIMIZER_CHECKPOINT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "optimizer/optimizer_settings.h"
#include "safetensors/file_source.h"

namespace trainstream::daemon {

struct CheckpointArray {
  std::string name;
  kernels::ScalarType type = kernels::ScalarType::kFloat32;
  uint64_t numel = 0;
  void* data = nullptr;  // read from when writing, filled when reading
};

struct CheckpointParameter {
  ParameterDescription desc;
  uint64_t step = 0;
};

struct CheckpointContents {
  std::string job_id;
  uint64_t iteration = 0;
  OptimizerSettings settings;
  std::vector<CheckpointParameter> params;
  std::vector<CheckpointArray> arrays;
};

// Writes to a temporary file beside `path`, fsyncs it, renames it over `path` and fsyncs the
// directory: a crash at any point leaves the previous file whole. Returns the bytes written.
absl::StatusOr<uint64_t> WriteCheckpoint(const std::string& path,
                                         const CheckpointContents& contents);

// Writes the checkpoint into `fd` (a regular file open for writing, which a client opened with
// its own rights) from its start, truncating what was there, and fsyncs it; the client renames
// it into place. `name` is the file's name in errors.
absl::StatusOr<uint64_t> WriteCheckpointToFile(int fd, const std::string& name,
                                               const CheckpointContents& contents);

// Reads `path` into the arrays of `expected` after checking that its parameters, dtypes and
// sizes match; returns the file's iteration and per-parameter steps. Errors name the file and
// the tensor or field at fault.
absl::StatusOr<CheckpointContents> ReadCheckpoint(const std::string& path,
                                                  const CheckpointContents& expected,
                                                  const FileSource& source = Filesystem());

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_OPTIMIZER_CHECKPOINT_H_
