// SPDX-License-Identifier: Apache-2.0
// Dequantization of a block-quantized tensor on the GPU, into bf16 or fp32, element for
// element equal to the CPU reference (cpu/quantize.h) followed by round-to-nearest-even.
#ifndef TRAINSTREAM_KERNELS_CUDA_DEQUANTIZE_H_
#define TRAINSTREAM_KERNELS_CUDA_DEQUANTIZE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "cpu/quantize.h"

namespace trainstream::kernels {

enum class DeviceOutput : uint8_t { kFloat32 = 0, kBFloat16 = 1 };

// `data`, `scales` and `out` are device pointers (fp32 `scales` 4-byte aligned, `out` 16-byte
// aligned for the vector stores; `data` is read with vector loads when aligned for them); the
// kernel is queued on `stream` (a cudaStream_t) and not waited for. INVALID_ARGUMENT for
// misaligned pointers; the CUDA error otherwise.
absl::Status DequantizeOnDevice(const QuantLayout& layout, const uint8_t* data,
                                const uint8_t* scales, float tensor_scale, void* out,
                                DeviceOutput output, void* stream);

}  // namespace trainstream::kernels

#endif  // TRAINSTREAM_KERNELS_CUDA_DEQUANTIZE_H_
