// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: any bytes as a .safetensors file. The header parser must accept or refuse
// them with a status (never crash, hang or read outside the file), and every tensor it accepts
// must read back in each form the daemon stores (as is, bf16, each quantized format) into
// exactly the bytes its layout said.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpu/quantize.h"
#include "fuzz_file.h"
#include "safetensors/safetensors_file.h"
#include "safetensors/tensor_reader.h"

namespace {

using trainstream::daemon::ReadTensor;
using trainstream::daemon::SafetensorsFile;
using trainstream::daemon::StoredAs;
using trainstream::daemon::StoredLayout;
using trainstream::daemon::StoredLayoutFor;
using trainstream::kernels::QuantFormat;

// A tensor's stored bytes come from the file, so they are at most its size; this only keeps
// one execution's buffers small.
constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 20;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static trainstream::fuzz::FuzzFile file;
  const std::string& path = file.Write(data, size);
  absl::StatusOr<SafetensorsFile> opened = SafetensorsFile::Open(path, uint64_t{1} << 20);
  if (!opened.ok()) return 0;
  int tried = 0;
  for (const auto& tensor : opened->tensors()) {
    if (opened->Find(tensor.name) != &tensor) __builtin_trap();  // the index must agree
    if (tensor.offset + tensor.bytes > opened->file_bytes()) __builtin_trap();
    if (++tried > 8) break;
    const struct {
      StoredAs as;
      QuantFormat format;
    } forms[] = {{StoredAs::kAsIs, QuantFormat::kInt8},
                 {StoredAs::kBFloat16, QuantFormat::kInt8},
                 {StoredAs::kQuantized, QuantFormat::kInt8},
                 {StoredAs::kQuantized, QuantFormat::kNf4},
                 {StoredAs::kQuantized, QuantFormat::kFp8},
                 {StoredAs::kQuantized, QuantFormat::kNvfp4}};
    for (const auto& form : forms) {
      absl::StatusOr<StoredLayout> layout = StoredLayoutFor(tensor, form.as, form.format);
      if (!layout.ok()) continue;
      if (layout->data_bytes > kMaxTensorBytes || layout->scale_bytes > kMaxTensorBytes) continue;
      std::vector<uint8_t> out(layout->data_bytes), scales(layout->scale_bytes);
      // Small windows: the reader's chunking is exercised too.
      (void)ReadTensor(*opened, tensor, *layout, out.data(), scales.data(), {}, 4096);
    }
  }
  return 0;
}
