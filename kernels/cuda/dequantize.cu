// SPDX-License-Identifier: Apache-2.0
#include "cuda/dequantize.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_format.h"

namespace trainstream::kernels {
namespace {

// Each thread turns 8 values: 4 bytes of 4-bit codes or 8 of 8-bit ones in, 16 or 32 bytes out.
constexpr int kValuesPerThread = 8;
constexpr int kThreads = 256;

__device__ __constant__ float kNf4Table[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};
__device__ __constant__ float kE2m1Table[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,
                                                4.0f,  6.0f,  -0.0f, -0.5f, -1.0f, -1.5f,
                                                -2.0f, -3.0f, -4.0f, -6.0f};

__device__ __forceinline__ float E4m3(uint8_t bits) {
  // Exact: every e4m3 value is a half value.
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(bits, __NV_E4M3)));
}

__device__ __forceinline__ float FloatScale(const uint8_t* scales, uint64_t block) {
  return reinterpret_cast<const float*>(scales)[block];
}

template <QuantFormat kFormat>
__device__ __forceinline__ float Decode(const uint8_t* data, const uint8_t* scales,
                                        uint64_t e, uint64_t b, float tensor_scale) {
  if constexpr (kFormat == QuantFormat::kInt8) {
    return static_cast<float>(static_cast<int8_t>(data[e])) * FloatScale(scales, b);
  } else if constexpr (kFormat == QuantFormat::kNf4) {
    const uint8_t byte = data[e / 2];
    return kNf4Table[(e & 1) ? (byte & 0xf) : (byte >> 4)] * FloatScale(scales, b);
  } else if constexpr (kFormat == QuantFormat::kFp8) {
    return E4m3(data[e]) * FloatScale(scales, b);
  } else {
    const uint8_t byte = data[e / 2];
    return kE2m1Table[(e & 1) ? (byte >> 4) : (byte & 0xf)] * (E4m3(scales[b]) * tensor_scale);
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

template <QuantFormat kFormat, typename Out>
__global__ void DequantizeKernel(const uint8_t* __restrict__ data,
                                 const uint8_t* __restrict__ scales, uint64_t numel,
                                 uint32_t block, float tensor_scale, Out* __restrict__ out) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t unit = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       unit * kValuesPerThread < numel; unit += stride) {
    const uint64_t e0 = unit * kValuesPerThread;
    __align__(16) Out values[kValuesPerThread];  // stored as uint4 below
    const bool whole = e0 + kValuesPerThread <= numel;
    // With blocks a multiple of 8 values, the thread's 8 share one scale: one division.
    const bool one_block = block % kValuesPerThread == 0;
    const uint64_t b0 = e0 / block;
#pragma unroll
    for (int j = 0; j < kValuesPerThread; ++j) {
      const uint64_t e = e0 + j;
      if (e < numel) {
        values[j] = Convert<Out>(
            Decode<kFormat>(data, scales, e, one_block ? b0 : e / block, tensor_scale));
      }
    }
    if (whole) {
      // 16 (bf16) or 32 (fp32) bytes at once: out is 16-byte aligned and e0 a multiple of 8.
      const uint4* src = reinterpret_cast<const uint4*>(values);
      uint4* dst = reinterpret_cast<uint4*>(out + e0);
#pragma unroll
      for (size_t k = 0; k < sizeof(values) / sizeof(uint4); ++k) dst[k] = src[k];
    } else {
      for (int j = 0; j < kValuesPerThread && e0 + j < numel; ++j) out[e0 + j] = values[j];
    }
  }
}

template <QuantFormat kFormat>
cudaError_t Launch(const QuantLayout& layout, const uint8_t* data, const uint8_t* scales,
                   float tensor_scale, void* out, DeviceOutput output, cudaStream_t stream) {
  const uint64_t units = (layout.numel + kValuesPerThread - 1) / kValuesPerThread;
  const unsigned grid = static_cast<unsigned>(
      std::min<uint64_t>((units + kThreads - 1) / kThreads, uint64_t{1} << 20));
  if (output == DeviceOutput::kBFloat16) {
    DequantizeKernel<kFormat><<<grid, kThreads, 0, stream>>>(
        data, scales, layout.numel, layout.block, tensor_scale,
        static_cast<__nv_bfloat16*>(out));
  } else {
    DequantizeKernel<kFormat><<<grid, kThreads, 0, stream>>>(
        data, scales, layout.numel, layout.block, tensor_scale, static_cast<float*>(out));
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
