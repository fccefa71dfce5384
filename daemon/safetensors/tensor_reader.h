// SPDX-License-Identifier: Apache-2.0
// Reads one checkpoint tensor into the form a base stores it in (bf16, one of the quantized
// formats, or its bytes as they are), a window at a time: memory stays bounded by the window
// whatever the tensor's size, and progress is reported after each window.
#ifndef TRAINSTREAM_DAEMON_SAFETENSORS_TENSOR_READER_H_
#define TRAINSTREAM_DAEMON_SAFETENSORS_TENSOR_READER_H_

#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"
#include "cpu/quantize.h"
#include "safetensors/safetensors_file.h"

namespace trainstream::daemon {

enum class StoredAs : uint8_t {
  kAsIs = 0,       // the file's bytes (integer tensors, or a float kept in its own dtype)
  kBFloat16 = 1,   // converted from F32, F16, F64 or BF16
  kQuantized = 2,  // quantized from any of those
};

struct StoredLayout {
  StoredAs as = StoredAs::kAsIs;
  kernels::QuantLayout quant{};  // kQuantized only
  uint64_t data_bytes = 0;
  uint64_t scale_bytes = 0;
};

// How `tensor` is stored as `as` (with `format` and `block` when quantized). INVALID_ARGUMENT,
// naming the tensor, when its dtype can't be converted that way.
absl::StatusOr<StoredLayout> StoredLayoutFor(const SafetensorsTensor& tensor, StoredAs as,
                                             kernels::QuantFormat format = kernels::QuantFormat::kInt8,
                                             int block = 0);

struct ReadResult {
  float tensor_scale = 1.0f;  // nvfp4's per-tensor scale; 1 otherwise
  double max_abs = 0.0;       // nvfp4: the tensor's largest magnitude; 0 otherwise
};

// Reads `tensor` from `file` into `data` (layout.data_bytes) and `scales`
// (layout.scale_bytes), `window_bytes` of the file at a time; `progress(bytes)` is called after
// each window with the file bytes read so far. nvfp4 reads the tensor twice (its scale comes
// from the whole tensor's largest value), and its progress counts both passes.
absl::StatusOr<ReadResult> ReadTensor(const SafetensorsFile& file, const SafetensorsTensor& tensor,
                                      const StoredLayout& layout, uint8_t* data, uint8_t* scales,
                                      const std::function<void(uint64_t)>& progress = {},
                                      uint64_t window_bytes = uint64_t{16} << 20);

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_SAFETENSORS_TENSOR_READER_H_
