// SPDX-License-Identifier: Apache-2.0
// Block quantization of frozen weights: the CPU reference the daemon quantizes with while it
// reads a checkpoint, and the reference the CUDA dequantization kernels are checked against.
//
// Every format cuts a tensor (flattened) into blocks and keeps one scale per block:
//   int8   1 signed byte a value, fp32 scale = absmax / 127 (block: any even size, default 64)
//   nf4    4-bit codes into the NormalFloat table, fp32 absmax, two codes a byte, first value
//          in the high nibble: the layout bitsandbytes writes (its blockwise, non-nested form)
//   fp8    float8 e4m3 values, fp32 scale = absmax / 448 (block 32)
//   nvfp4  e2m1 values, two a byte, first value in the low nibble (torch.float4_e2m1fn_x2),
//          an e4m3 scale per 16 values and one fp32 scale for the tensor
// A tensor can be quantized in chunks (a reader's window): each chunk but the last holds whole
// blocks, and its output starts at ChunkOffsets() of its first element.
#ifndef TRAINSTREAM_KERNELS_CPU_QUANTIZE_H_
#define TRAINSTREAM_KERNELS_CPU_QUANTIZE_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace trainstream::kernels {

enum class QuantFormat : uint8_t { kInt8 = 1, kNf4 = 2, kFp8 = 3, kNvfp4 = 4 };
const char* QuantFormatName(QuantFormat format);
absl::StatusOr<QuantFormat> ParseQuantFormat(std::string_view name);

// The block size a format uses when none is asked for, and whether it takes another.
int DefaultBlockSize(QuantFormat format);

// Where a quantized tensor's bytes go: the values, then one scale per block (4 bytes for fp32
// scales, 1 for nvfp4's e4m3 ones). nvfp4's tensor scale travels beside, not in these.
struct QuantLayout {
  QuantFormat format;
  int block = 0;
  uint64_t numel = 0;
  uint64_t data_bytes = 0;
  uint64_t scale_bytes = 0;
  uint64_t blocks() const { return (numel + block - 1) / block; }
  uint64_t total_bytes() const { return data_bytes + scale_bytes; }
};
// `block` 0 takes the format's default. Fails on a block the format can't use.
absl::StatusOr<QuantLayout> LayoutFor(QuantFormat format, uint64_t numel, int block = 0);

// The offsets into the data and the scales where the chunk starting at element `first` (a
// multiple of the block) writes.
struct ChunkOffsets {
  uint64_t data = 0;
  uint64_t scale = 0;
};
ChunkOffsets ChunkAt(const QuantLayout& layout, uint64_t first);

// nvfp4's per-tensor scale from the tensor's largest magnitude: blocks' e4m3 scales then span
// their whole range (amax / (6 * 448)); 1 for an all-zero tensor.
float NvFp4TensorScale(float amax);

// Quantizes `n` values (a chunk of the tensor `layout` describes, starting at element `first`)
// into `data` and `scales`, which point at the whole tensor's buffers. Non-finite inputs fail:
// a checkpoint holding them is broken, and a scale made from them would spoil the block.
absl::Status Quantize(const QuantLayout& layout, uint64_t first, const float* values,
                      uint64_t n, float tensor_scale, uint8_t* data, uint8_t* scales);
// The reverse, into fp32.
absl::Status Dequantize(const QuantLayout& layout, uint64_t first, uint64_t n,
                        const uint8_t* data, const uint8_t* scales, float tensor_scale,
                        float* values);

// Element conversions, exposed for tests and for the CUDA kernels' checks.
uint8_t FloatToE4m3(float f);  // round to nearest even, saturating at +-448; NaN to 0x7f
float E4m3ToFloat(uint8_t bits);
uint8_t FloatToE2m1(float f);  // round to nearest even on the grid, saturating at +-6
float E2m1ToFloat(uint8_t code);
uint8_t Nf4Code(float normalized);  // normalized = value / absmax, in [-1, 1]
float Nf4Value(uint8_t code);

}  // namespace trainstream::kernels

#endif  // TRAINSTREAM_KERNELS_CPU_QUANTIZE_H_
