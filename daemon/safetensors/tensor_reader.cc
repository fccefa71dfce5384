// SPDX-License-Identifier: Apache-2.0
#include "safetensors/tensor_reader.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cpu/numeric.h"

namespace trainstream::daemon {
namespace {

bool IsFloat(const std::string& dtype) {
  return dtype == "F32" || dtype == "F16" || dtype == "BF16" || dtype == "F64";
}

void ToFloat(const std::string& dtype, const uint8_t* in, uint64_t n, float* out) {
  if (dtype == "F32") {
    std::memcpy(out, in, n * 4);
  } else if (dtype == "BF16") {
    for (uint64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, in + 2 * i, 2);
      out[i] = kernels::BFloat16ToFloat(h);
    }
  } else if (dtype == "F16") {
    for (uint64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, in + 2 * i, 2);
      out[i] = kernels::HalfToFloat(h);
    }
  } else {  // F64
    for (uint64_t i = 0; i < n; ++i) {
      double d;
      std::memcpy(&d, in + 8 * i, 8);
      out[i] = static_cast<float>(d);
    }
  }
}

}  // namespace

absl::StatusOr<StoredLayout> StoredLayoutFor(const SafetensorsTensor& tensor, StoredAs as,
                                             kernels::QuantFormat format, int block) {
  StoredLayout layout;
  layout.as = as;
  if (as == StoredAs::kAsIs) {
    layout.data_bytes = tensor.bytes;
    return layout;
  }
  if (!IsFloat(tensor.dtype)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor '%s' is %s: only floating-point tensors are converted or quantized",
        tensor.name, tensor.dtype));
  }
  if (as == StoredAs::kBFloat16) {
    layout.data_bytes = tensor.numel * 2;
    return layout;
  }
  absl::StatusOr<kernels::QuantLayout> quant = kernels::LayoutFor(format, tensor.numel, block);
  if (!quant.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", tensor.name, "': ", quant.status().message()));
  }
  layout.quant = *quant;
  layout.data_bytes = quant->data_bytes;
  layout.scale_bytes = quant->scale_bytes;
  return layout;
}

absl::StatusOr<ReadResult> ReadTensor(const SafetensorsFile& file, const SafetensorsTensor& tensor,
                                      const StoredLayout& layout, uint8_t* data, uint8_t* scales,
                                      const std::function<void(uint64_t)>& progress,
                                      uint64_t window_bytes) {
  ReadResult result;
  uint64_t read_so_far = 0;
  auto advance = [&](uint64_t bytes) {
    read_so_far += bytes;
    if (progress) progress(read_so_far);
  };
  const uint64_t size = tensor.element_size;
  // Whole elements, and whole blocks when quantizing, in every window but the last.
  uint64_t window_elems = std::max<uint64_t>(1, window_bytes / size);
  if (layout.as == StoredAs::kQuantized) {
    const uint64_t block = layout.quant.block;
    window_elems = std::max<uint64_t>(block, window_elems / block * block);
  }
  if (layout.as == StoredAs::kAsIs ||
      (layout.as == StoredAs::kBFloat16 && tensor.dtype == "BF16")) {
    // No conversion: straight into place.
    for (uint64_t first = 0; first < tensor.numel; first += window_elems) {
      const uint64_t n = std::min(window_elems, tensor.numel - first);
      if (absl::Status s = file.Read(tensor.offset + first * size, data + first * size, n * size);
          !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("tensor '", tensor.name, "': ", s.message()));
      }
      advance(n * size);
    }
    return result;
  }
  // nvfp4's scale comes from the whole tensor's largest value: its values are read twice, the
  // second time from the page cache (memory stays bounded by the window). Progress counts both
  // passes, as the base store's total does.
  const bool two_passes = layout.as == StoredAs::kQuantized &&
                          layout.quant.format == kernels::QuantFormat::kNvfp4;
  std::vector<uint8_t> raw(window_elems * size);
  std::vector<float> values(window_elems);
  auto read_window = [&](uint64_t first, uint64_t n) -> absl::Status {
    if (absl::Status s = file.Read(tensor.offset + first * size, raw.data(), n * size); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("tensor '", tensor.name, "': ", s.message()));
    }
    advance(n * size);
    ToFloat(tensor.dtype, raw.data(), n, values.data());
    return absl::OkStatus();
  };
  if (layout.as == StoredAs::kBFloat16) {
    for (uint64_t first = 0; first < tensor.numel; first += window_elems) {
      const uint64_t n = std::min(window_elems, tensor.numel - first);
      if (absl::Status s = read_window(first, n); !s.ok()) return s;
      for (uint64_t i = 0; i < n; ++i) {
        const uint16_t h = kernels::FloatToBFloat16(values[i]);
        std::memcpy(data + 2 * (first + i), &h, 2);
      }
    }
    return result;
  }
  if (two_passes) {
    float max_abs = 0.0f;
    for (uint64_t first = 0; first < tensor.numel; first += window_elems) {
      const uint64_t n = std::min(window_elems, tensor.numel - first);
      if (absl::Status s = read_window(first, n); !s.ok()) return s;
      // In float, one accumulator: a loop the compiler vectorizes (a NaN is refused by
      // Quantize below, whatever the maximum says).
      for (uint64_t i = 0; i < n; ++i) max_abs = std::max(max_abs, std::fabs(values[i]));
    }
    result.max_abs = max_abs;
    result.tensor_scale = kernels::NvFp4TensorScale(max_abs);
  }
  for (uint64_t first = 0; first < tensor.numel; first += window_elems) {
    const uint64_t n = std::min(window_elems, tensor.numel - first);
    if (absl::Status s = read_window(first, n); !s.ok()) return s;
    if (absl::Status s = kernels::Quantize(layout.quant, first, values.data(), n,
                                           result.tensor_scale, data, scales);
        !s.ok()) {
      return absl::DataLossError(
          absl::StrFormat("%s: tensor '%s': %s", file.path(), tensor.name, s.message()));
    }
  }
  return result;
}

}  // namespace trainstream::daemon
