// SPDX-License-Identifier: Apache-2.0
#include "cuda/dequantize.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_format.h"

namespace trainstream::kernels {
namespace {

// Each thread turns 16 values: 8 bytes of 4-bit codes or 16 of 8-bit ones in (one vector load
// when the data is aligned for it), 32 or 64 bytes out.
constexpr int kValuesPerThread = 16;
constexpr int kThreads = 256;

// The code tables are copied into shared memory by each block: a warp's lanes look up different
// codes, which constant memory would serve one address at a time.
__device__ __constant__ float kNf4Table[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};
__device__ __constant__ float kE2m1Table[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,
                                                4.0f,  6.0f,  -0.0f, -0.5f, -1.0f, -1.5f,
                                                -2.0f, -3.0f, -4.0f, -6.0f};

template <QuantFormat kFormat>
constexpr bool kFourBit = kFormat == QuantFormat::kNf4 || kFormat == QuantFormat::kNvfp4;

__device__ __forceinline__ float E4m3(uint8_t bits) {
  // Exact: every e4m3 value is a half value.
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(bits, __NV_E4M3)));
}

// The scale of block `b`: fp32 for int8, NF4 and FP8; an e4m3 byte times the tensor scale for
// NVFP4.
template <QuantFormat kFormat>
__device__ __forceinline__ float BlockScale(const uint8_t* scales, uint64_t b,
                                            float tensor_scale) {
  if constexpr (kFormat == QuantFormat::kNvfp4) {
    return E4m3(scales[b]) * tensor_scale;
  } else {
    return reinterpret_cast<const float*>(scales)[b];
  }
}

// Value `j` of a unit (before its scale) from the unit's stored bytes. NF4 puts the first
// value of a byte in the high nibble (as bitsandbytes does), NVFP4 in the low one.
template <QuantFormat kFormat>
__device__ __forceinline__ float Code(const uint8_t* bytes, int j, const float* table) {
  if constexpr (kFormat == QuantFormat::kInt8) {
    return static_cast<float>(static_cast<int8_t>(bytes[j]));
  } else if constexpr (kFormat == QuantFormat::kFp8) {
    return E4m3(bytes[j]);
  } else if constexpr (kFormat == QuantFormat::kNf4) {
    const uint8_t byte = bytes[j / 2];
    return table[(j & 1) ? (byte & 0xf) : (byte >> 4)];
  } else {
    const uint8_t byte = bytes[j / 2];
    return table[(j & 1) ? (byte >> 4) : (byte & 0xf)];
  }
}

template <typename Out>
__device__ __forceinline__ Out Convert(float v);
template <>
__device__ __forceinline__ float Convert<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 Convert<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// kVectorLoads: `data` is aligned so that a unit's stored bytes are one 8- or 16-byte load.
template <QuantFormat kFormat, typename Out, bool kVectorLoads>
__global__ void DequantizeKernel(const uint8_t* __restrict__ data,
                                 const uint8_t* __restrict__ scales, uint64_t numel,
                                 uint32_t block, float tensor_scale, Out* __restrict__ out) {
  constexpr int kUnitBytes = kFourBit<kFormat> ? kValuesPerThread / 2 : kValuesPerThread;
  __shared__ float table[16];
  if constexpr (kFourBit<kFormat>) {
    if (threadIdx.x < 16) {
      table[threadIdx.x] =
          kFormat == QuantFormat::kNf4 ? kNf4Table[threadIdx.x] : kE2m1Table[threadIdx.x];
    }
    __syncthreads();
  }
  // With blocks a multiple of the unit, a unit's values share one scale: one division.
  const bool one_block = block % kValuesPerThread == 0;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t unit = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       unit * kValuesPerThread < numel; unit += stride) {
    const uint64_t e0 = unit * kValuesPerThread;
    const bool whole = e0 + kValuesPerThread <= numel;
    __align__(16) uint8_t bytes[kUnitBytes];
    const uint8_t* src = data + unit * kUnitBytes;
    if (kVectorLoads && whole) {
      if constexpr (kUnitBytes == 16) {
        *reinterpret_cast<uint4*>(bytes) = *reinterpret_cast<const uint4*>(src);
      } else {
        *reinterpret_cast<uint2*>(bytes) = *reinterpret_cast<const uint2*>(src);
      }
    } else {
      const uint64_t stored = kFourBit<kFormat> ? (numel + 1) / 2 : numel;
#pragma unroll
      for (int k = 0; k < kUnitBytes; ++k) {
        bytes[k] = unit * kUnitBytes + k < stored ? src[k] : 0;
      }
    }
    const float unit_scale = one_block ? BlockScale<kFormat>(scales, e0 / block, tensor_scale)
                                       : 0.0f;
    __align__(16) Out values[kValuesPerThread];  // stored as uint4 below
#pragma unroll
    for (int j = 0; j < kValuesPerThread; ++j) {
      const uint64_t e = e0 + j;
      if (e < numel) {
        const float scale =
            one_block ? unit_scale : BlockScale<kFormat>(scales, e / block, tensor_scale);
        values[j] = Convert<Out>(Code<kFormat>(bytes, j, table) * scale);
      }
    }
    if (whole) {
      // 32 (bf16) or 64 (fp32) bytes: out is 16-byte aligned and e0 a multiple of 16.
      const uint4* from = reinterpret_cast<const uint4*>(values);
      uint4* to = reinterpret_cast<uint4*>(out + e0);
#pragma unroll
      for (size_t k = 0; k < sizeof(values) / sizeof(uint4); ++k) to[k] = from[k];
    } else {
      for (int j = 0; j < kValuesPerThread && e0 + j < numel; ++j) out[e0 + j] = values[j];
    }
  }
}

template <QuantFormat kFormat, typename Out>
void LaunchFor(const QuantLayout& layout, const uint8_t* data, const uint8_t* scales,
               float tensor_scale, Out* out, unsigned grid, cudaStream_t stream) {
  constexpr uintptr_t kUnitBytes = kFourBit<kFormat> ? kValuesPerThread / 2 : kValuesPerThread;
  if (reinterpret_cast<uintptr_t>(data) % kUnitBytes == 0) {
    DequantizeKernel<kFormat, Out, true><<<grid, kThreads, 0, stream>>>(
        data, scales, layout.numel, layout.block, tensor_scale, out);
  } else {
    DequantizeKernel<kFormat, Out, false><<<grid, kThreads, 0, stream>>>(
        data, scales, layout.numel, layout.block, tensor_scale, out);
  }
}

template <QuantFormat kFormat>
cudaError_t Launch(const QuantLayout& layout, const uint8_t* data, const uint8_t* scales,
                   float tensor_scale, void* out, DeviceOutput output, cudaStream_t stream) {
  const uint64_t units = (layout.numel + kValuesPerThread - 1) / kValuesPerThread;
  const unsigned grid = static_cast<unsigned>(
      std::min<uint64_t>((units + kThreads - 1) / kThreads, uint64_t{1} << 20));
  if (output == DeviceOutput::kBFloat16) {
    LaunchFor<kFormat>(layout, data, scales, tensor_scale, static_cast<__nv_bfloat16*>(out),
                       grid, stream);
  } else {
    LaunchFor<kFormat>(layout, data, scales, tensor_scale, static_cast<float*>(out), grid,
                       stream);
  }
  return cudaGetLastError();
}

}  // namespace

absl::Status DequantizeOnDevice(const QuantLayout& layout, const uint8_t* data,
                                const uint8_t* scales, float tensor_scale, void* out,
                                DeviceOutput output, void* stream) {
  if (layout.numel == 0) return absl::OkStatus();
  if (reinterpret_cast<uintptr_t>(out) % 16 != 0 ||
      (layout.format != QuantFormat::kNvfp4 && reinterpret_cast<uintptr_t>(scales) % 4 != 0)) {
    return absl::InvalidArgumentError(
        "dequantize: the output must be 16-byte aligned and fp32 scales 4-byte aligned");
  }
  auto s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaSuccess;
  switch (layout.format) {
    case QuantFormat::kInt8:
      err = Launch<QuantFormat::kInt8>(layout, data, scales, tensor_scale, out, output, s);
      break;
    case QuantFormat::kNf4:
      err = Launch<QuantFormat::kNf4>(layout, data, scales, tensor_scale, out, output, s);
      break;
    case QuantFormat::kFp8:
      err = Launch<QuantFormat::kFp8>(layout, data, scales, tensor_scale, out, output, s);
      break;
    case QuantFormat::kNvfp4:
      err = Launch<QuantFormat::kNvfp4>(layout, data, scales, tensor_scale, out, output, s);
      break;
  }
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrFormat("dequantize (%s, %d values): %s",
                                               QuantFormatName(layout.format), layout.numel,
                                               cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

}  // namespace trainstream::kernels
