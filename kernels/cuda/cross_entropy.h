// SPDX-License-Identifier: Apache-2.0
// The causal-LM cross-entropy on the GPU, read straight from the logits in their own dtype:
// forward keeps one fp32 log-sum-exp a row, backward writes the gradient in the logits' dtype.
// Each reads the logits once; nothing of the size of the logits is allocated besides the
// gradient (transformers' loss upcasts them to fp32 and keeps a log-softmax of that size).
#ifndef TRAINSTREAM_KERNELS_CUDA_CROSS_ENTROPY_H_
#define TRAINSTREAM_KERNELS_CUDA_CROSS_ENTROPY_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace trainstream::kernels {

enum class LogitType : uint8_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// "float32", "bfloat16" or "float16"; INVALID_ARGUMENT otherwise.
absl::StatusOr<LogitType> ParseLogitType(absl::string_view name);

// `rows` rows of `vocab` logits, contiguous (row r starts at r * vocab), and one int64 target a
// row; a target equal to `ignore_index` does not count. All pointers are device pointers; the
// kernels are queued on `stream` (a cudaStream_t) and not waited for.
struct CrossEntropyRows {
  const void* logits = nullptr;
  LogitType type = LogitType::kBFloat16;
  int64_t rows = 0;
  int64_t vocab = 0;
  const int64_t* targets = nullptr;
  int64_t ignore_index = -100;
};

// lse[r] = log(sum_j exp(logits[r, j])) and loss[r] = lse[r] - logits[r, target[r]] (0 where the
// target does not count; NaN where it counts but lies outside [0, vocab), which a device-side
// assertion would otherwise make fatal to the process's CUDA context). fp32 throughout.
absl::Status CrossEntropyForwardOnDevice(const CrossEntropyRows& rows, float* lse, float* loss,
                                         void* stream);

// grad[r, j] = (exp(logits[r, j] - lse[r]) - [j == target[r]]) * scale[0], 0 on rows whose
// target does not count, computed in fp32 and rounded to the logits' type. `scale` is one fp32
// on the device (the loss's incoming gradient over its divisor: no host round trip).
absl::Status CrossEntropyBackwardOnDevice(const CrossEntropyRows& rows, const float* lse,
                                          const float* scale, void* grad, void* stream);

}  // namespace trainstream::kernels

#endif  // TRAINSTREAM_KERNELS_CUDA_CROSS_ENTROPY_H_
