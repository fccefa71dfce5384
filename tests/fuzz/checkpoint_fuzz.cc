// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: any bytes as an optimizer checkpoint read into a job of two parameters.
// The reader must refuse what does not match with a status; what it accepts holds counts that
// are whole and in range, and nothing it refuses may have touched the job's state.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "checkpoint_fixture.h"
#include "fuzz_file.h"
#include "optimizer/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static trainstream::fuzz::FuzzFile file;
  trainstream::fuzz::CheckpointFixture job;
  const std::string& path = file.Write(data, size);
  absl::StatusOr<trainstream::daemon::CheckpointContents> read =
      trainstream::daemon::ReadCheckpoint(path, job.contents);
  if (!read.ok()) {
    // Refused: the live state is as it was.
    for (const auto& values : job.storage) {
      for (float v : values) {
        if (v != 0.5f) __builtin_trap();
      }
    }
    return 0;
  }
  if (read->params.size() != job.contents.params.size()) __builtin_trap();
  if (read->iteration > (uint64_t{1} << 53)) __builtin_trap();
  for (const auto& p : read->params) {
    if (p.step > (uint64_t{1} << 53)) __builtin_trap();
  }
  return 0;
}
