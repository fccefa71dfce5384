// SPDX-License-Identifier: Apache-2.0
// Writes the fuzz targets' seed corpus under the folder it is given: small files each reader
// accepts (the fuzzer mutates from there), and a few hand-made inputs for the others.
//   fuzz_write_seeds tests/fuzz/corpus
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint_fixture.h"
#include "optimizer/checkpoint.h"
#include "safetensors/test_checkpoints.h"

namespace fs = std::filesystem;
using trainstream::daemon::test_checkpoints::Bytes;
using trainstream::daemon::test_checkpoints::Entry;
using trainstream::daemon::test_checkpoints::FloatEntry;
using trainstream::daemon::test_checkpoints::Normal;
using trainstream::daemon::test_checkpoints::WriteFile;

namespace {

void WriteBytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const fs::path root = fs::absolute(argv[1]);  // WriteCheckpoint takes absolute paths
  for (const char* target : {"safetensors_fuzz", "checkpoint_fuzz", "request_validation_fuzz",
                             "doorbell_fuzz"}) {
    fs::create_directories(root / target);
  }
  const fs::path st = root / "safetensors_fuzz";
  std::vector<float> exact;
  WriteFile((st / "floats.safetensors").string(),
            {FloatEntry("a.weight", "BF16", Normal(6, 1), &exact),
             FloatEntry("b.weight", "F32", Normal(8, 2), &exact),
             FloatEntry("c.weight", "F16", Normal(4, 3), &exact)});
  WriteFile((st / "ints.safetensors").string(),
            {{"ids", "I64", {2}, Bytes(std::vector<int64_t>{7, 8})},
             {"mask", "U8", {3}, {1, 0, 1}}});
  WriteFile((st / "nested_metadata.safetensors").string(), {},
            R"({"__metadata__":{"format":"pt","note":"[[{}]]"},"x":{"dtype":"F32","shape":[0],)"
            R"("data_offsets":[0,0]}})");
  trainstream::fuzz::CheckpointFixture job;
  absl::StatusOr<uint64_t> written = trainstream::daemon::WriteCheckpoint(
      (root / "checkpoint_fuzz" / "job.safetensors").string(), job.contents);
  if (!written.ok()) {
    std::fprintf(stderr, "%s\n", std::string(written.status().message()).c_str());
    return 1;
  }
  WriteBytes(root / "request_validation_fuzz" / "name",
             std::string("\x0a" "layer.0/w:1\x00\x00\x00\x00\x00\x00\x10\x00", 20));
  WriteBytes(root / "request_validation_fuzz" / "session",
             std::string("\x12s-0123456789abcdef", 19));
  // Sends from the client, a corrupt head, receives on the daemon's side.
  WriteBytes(root / "doorbell_fuzz" / "round_trip", std::string("\x01\x01\x08\x00\x02\x10", 6));
  WriteBytes(root / "doorbell_fuzz" / "corrupt_index",
             std::string("\x01\x01\x08\x00\x00\x00\x08\xff\xff\xff\xff"
                         "\x00\x00\x00\x00\x02\x10", 17));
  std::printf("seeds written under %s (checkpoint: %llu bytes)\n", root.c_str(),
              static_cast<unsigned long long>(*written));
  return 0;
}
