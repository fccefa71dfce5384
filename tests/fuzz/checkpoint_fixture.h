// SPDX-License-Identifier: Apache-2.0
// The optimizer job the checkpoint fuzz target reads files into (two parameters, fp32 master
// weights and moments), shared with the seed writer so that the seed is a file it accepts.
#ifndef TRAINSTREAM_TESTS_FUZZ_CHECKPOINT_FIXTURE_H_
#define TRAINSTREAM_TESTS_FUZZ_CHECKPOINT_FIXTURE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "optimizer/checkpoint.h"

namespace trainstream::fuzz {

struct CheckpointFixture {
  std::vector<std::vector<float>> storage;
  daemon::CheckpointContents contents;

  CheckpointFixture() {
    contents.job_id = "fuzz";
    contents.iteration = 7;
    const uint64_t sizes[] = {3, 5};
    for (int i = 0; i < 2; ++i) {
      daemon::CheckpointParameter p;
      p.desc.name = absl::StrCat("layer.", i, ".weight");
      p.desc.numel = sizes[i];
      p.step = 7;
      contents.params.push_back(p);
    }
    storage.reserve(6);
    for (int i = 0; i < 2; ++i) {
      for (const char* kind : {"master", "exp_avg", "exp_avg_sq"}) {
        storage.emplace_back(sizes[i], 0.5f);
        contents.arrays.push_back({absl::StrCat(i, ".", kind), kernels::ScalarType::kFloat32,
                                   sizes[i], storage.back().data()});
      }
    }
  }
};

}  // namespace trainstream::fuzz

#endif  // TRAINSTREAM_TESTS_FUZZ_CHECKPOINT_FIXTURE_H_
