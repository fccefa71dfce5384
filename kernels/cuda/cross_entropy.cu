// SPDX-License-Identifier: Apache-2.0
#include "cuda/cross_entropy.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "absl/strings/str_format.h"

namespace trainstream::kernels {
namespace {

// One block a row: a row of a large vocabulary (152k bf16 logits are 297 KB) is read by 512
// threads, 16 bytes each at a time; 2,048 rows fill the GPU several times over.
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

template <typename T>
__device__ __forceinline__ float ToFloat(T v);
template <>
__device__ __forceinline__ float ToFloat(float v) {
  return v;
}
template <>
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float ToFloat(__half v) {
  return __half2float(v);
}

// Round to nearest even, as autograd's cast of an fp32 gradient to the logits' dtype does.
template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromFloat(float v) {
  return __float2half_rn(v);
}

// A running log-sum-exp: the largest value seen and the sum of exp(x - shift) over the values,
// where shift is the largest value, or 0 while every value is -inf (so that a row of -inf gives
// -inf, not NaN). A NaN logit never becomes the maximum (fmaxf drops it) but makes the sum NaN.
struct LogSumExp {
  float max = -INFINITY;
  float sum = 0.0f;
};

__device__ __forceinline__ float Shift(float max) { return max == -INFINITY ? 0.0f : max; }

__device__ __forceinline__ LogSumExp Merge(LogSumExp a, LogSumExp b) {
  const float m = fmaxf(a.max, b.max);
  const float shift = Shift(m);
  return {m, a.sum * expf(a.max - shift) + b.sum * expf(b.max - shift)};
}

template <int kCount>
__device__ __forceinline__ LogSumExp Add(LogSumExp acc, const float (&x)[kCount]) {
  float m = acc.max;
#pragma unroll
  for (int k = 0; k < kCount; ++k) m = fmaxf(m, x[k]);
  const float shift = Shift(m);
  float sum = acc.sum * expf(acc.max - shift);
#pragma unroll
  for (int k = 0; k < kCount; ++k) sum += expf(x[k] - shift);
  return {m, sum};
}

// The block's log-sum-exp, in every thread.
__device__ LogSumExp BlockReduce(LogSumExp acc) {
  __shared__ float maxes[kWarps], sums[kWarps];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    acc = Merge(acc, {__shfl_xor_sync(0xffffffffu, acc.max, offset),
                      __shfl_xor_sync(0xffffffffu, acc.sum, offset)});
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    maxes[warp] = acc.max;
    sums[warp] = acc.sum;
  }
  __syncthreads();
  LogSumExp total;
  for (int w = 0; w < kWarps; ++w) total = Merge(total, {maxes[w], sums[w]});
  return total;
}

// The values of one 16-byte load.
template <typename T>
struct Vector {
  static constexpr int kCount = 16 / sizeof(T);
  alignas(16) T values[kCount];
};

template <typename T, bool kVectors>
__global__ void __launch_bounds__(kThreads)
    ForwardKernel(const T* __restrict__ logits, int64_t vocab, const int64_t* __restrict__ targets,
                  int64_t ignore_index, float* __restrict__ lse, float* __restrict__ loss) {
  const int64_t r = blockIdx.x;
  const T* row = logits + r * vocab;
  LogSumExp acc;
  if constexpr (kVectors) {
    using V = Vector<T>;
    const auto* units = reinterpret_cast<const uint4*>(row);
    const int64_t count = vocab / V::kCount;
    for (int64_t u = threadIdx.x; u < count; u += kThreads) {
      V v;
      *reinterpret_cast<uint4*>(v.values) = __ldg(units + u);
      float x[V::kCount];
#pragma unroll
      for (int k = 0; k < V::kCount; ++k) x[k] = ToFloat(v.values[k]);
      acc = Add(acc, x);
    }
  } else {
    for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
      const float x[1] = {ToFloat(row[j])};
      acc = Add(acc, x);
    }
  }
  const LogSumExp total = BlockReduce(acc);
  if (threadIdx.x == 0) {
    const float row_lse = Shift(total.max) + logf(total.sum);
    lse[r] = row_lse;
    const int64_t t = targets[r];
    float value = 0.0f;
    if (t != ignore_index) value = (t >= 0 && t < vocab) ? row_lse - ToFloat(row[t]) : NAN;
    loss[r] = value;
  }
}

template <typename T, bool kVectors>
__global__ void __launch_bounds__(kThreads)
    BackwardKernel(const T* __restrict__ logits, int64_t vocab,
                   const int64_t* __restrict__ targets, int64_t ignore_index,
                   const float* __restrict__ lse, const float* __restrict__ scale,
                   T* __restrict__ grad) {
  const int64_t r = blockIdx.x;
  const T* row = logits + r * vocab;
  T* out = grad + r * vocab;
  const int64_t t = targets[r];
  const bool counted = t != ignore_index;
  const float row_lse = lse[r], s = scale[0];
  if constexpr (kVectors) {
    using V = Vector<T>;
    const auto* units = reinterpret_cast<const uint4*>(row);
    auto* out_units = reinterpret_cast<uint4*>(out);
    const int64_t count = vocab / V::kCount;
    for (int64_t u = threadIdx.x; u < count; u += kThreads) {
      V v;
      if (counted) {
        *reinterpret_cast<uint4*>(v.values) = __ldg(units + u);
#pragma unroll
        for (int k = 0; k < V::kCount; ++k) {
          const int64_t j = u * V::kCount + k;
          float g = expf(ToFloat(v.values[k]) - row_lse) * s;
          if (j == t) g -= s;
          v.values[k] = FromFloat<T>(g);
        }
      } else {
#pragma unroll
        for (int k = 0; k < V::kCount; ++k) v.values[k] = FromFloat<T>(0.0f);
      }
      out_units[u] = *reinterpret_cast<const uint4*>(v.values);
    }
  } else {
    for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
      float g = 0.0f;
      if (counted) {
        g = expf(ToFloat(row[j]) - row_lse) * s;
        if (j == t) g -= s;
      }
      out[j] = FromFloat<T>(g);
    }
  }
}

size_t ElementBytes(LogitType type) { return type == LogitType::kFloat32 ? 4 : 2; }

bool Aligned(const void* p, uintptr_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; }

absl::Status CheckRows(const CrossEntropyRows& rows, const void* out, const char* what) {
  if (rows.rows < 0 || rows.vocab <= 0 || rows.rows > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cross-entropy %s: %d rows of %d logits (rows from 0 to 2^31-1, a vocabulary of at "
        "least 1)",
        what, rows.rows, rows.vocab));
  }
  if (rows.rows > 0 && (rows.logits == nullptr || rows.targets == nullptr || out == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cross-entropy %s: a null device pointer", what));
  }
  if (!Aligned(rows.logits, ElementBytes(rows.type)) || !Aligned(rows.targets, 8)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cross-entropy %s: logits and targets must be aligned to their element size", what));
  }
  return absl::OkStatus();
}

// Whether the rows are read (and the gradient written) 16 bytes at a time.
bool UseVectors(const CrossEntropyRows& rows, const void* grad) {
  return Aligned(rows.logits, 16) && (grad == nullptr || Aligned(grad, 16)) &&
         (rows.vocab * ElementBytes(rows.type)) % 16 == 0;
}

template <typename T>
void LaunchForward(const CrossEntropyRows& rows, float* lse, float* loss, cudaStream_t stream) {
  const auto* logits = static_cast<const T*>(rows.logits);
  const unsigned grid = static_cast<unsigned>(rows.rows);
  if (UseVectors(rows, nullptr)) {
    ForwardKernel<T, true><<<grid, kThreads, 0, stream>>>(logits, rows.vocab, rows.targets,
                                                          rows.ignore_index, lse, loss);
  } else {
    ForwardKernel<T, false><<<grid, kThreads, 0, stream>>>(logits, rows.vocab, rows.targets,
                                                           rows.ignore_index, lse, loss);
  }
}

template <typename T>
void LaunchBackward(const CrossEntropyRows& rows, const float* lse, const float* scale,
                    void* grad, cudaStream_t stream) {
  const auto* logits = static_cast<const T*>(rows.logits);
  const unsigned grid = static_cast<unsigned>(rows.rows);
  if (UseVectors(rows, grad)) {
    BackwardKernel<T, true><<<grid, kThreads, 0, stream>>>(
        logits, rows.vocab, rows.targets, rows.ignore_index, lse, scale, static_cast<T*>(grad));
  } else {
    BackwardKernel<T, false><<<grid, kThreads, 0, stream>>>(
        logits, rows.vocab, rows.targets, rows.ignore_index, lse, scale, static_cast<T*>(grad));
  }
}

absl::Status LaunchStatus(const char* what, const CrossEntropyRows& rows) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrFormat("cross-entropy %s (%d rows of %d): %s", what,
                                             rows.rows, rows.vocab, cudaGetErrorString(err)));
}

}  // namespace

absl::StatusOr<LogitType> ParseLogitType(absl::string_view name) {
  if (name == "float32") return LogitType::kFloat32;
  if (name == "bfloat16") return LogitType::kBFloat16;
  if (name == "float16") return LogitType::kFloat16;
  return absl::InvalidArgumentError(absl::StrFormat(
      "cross-entropy: logits of '%s' (float32, bfloat16 or float16 are read)", name));
}

absl::Status CrossEntropyForwardOnDevice(const CrossEntropyRows& rows, float* lse, float* loss,
                                         void* stream) {
  if (absl::Status s = CheckRows(rows, lse, "forward"); !s.ok()) return s;
  if (rows.rows > 0 && (loss == nullptr || !Aligned(lse, 4) || !Aligned(loss, 4))) {
    return absl::InvalidArgumentError(
        "cross-entropy forward: lse and loss must be fp32 device buffers");
  }
  if (rows.rows == 0) return absl::OkStatus();
  auto s = static_cast<cudaStream_t>(stream);
  switch (rows.type) {
    case LogitType::kFloat32:
      LaunchForward<float>(rows, lse, loss, s);
      break;
    case LogitType::kBFloat16:
      LaunchForward<__nv_bfloat16>(rows, lse, loss, s);
      break;
    case LogitType::kFloat16:
      LaunchForward<__half>(rows, lse, loss, s);
      break;
  }
  return LaunchStatus("forward", rows);
}

absl::Status CrossEntropyBackwardOnDevice(const CrossEntropyRows& rows, const float* lse,
                                          const float* scale, void* grad, void* stream) {
  if (absl::Status s = CheckRows(rows, grad, "backward"); !s.ok()) return s;
  if (rows.rows > 0 &&
      (lse == nullptr || scale == nullptr || !Aligned(lse, 4) || !Aligned(scale, 4) ||
       !Aligned(grad, ElementBytes(rows.type)))) {
    return absl::InvalidArgumentError(
        "cross-entropy backward: lse and scale must be fp32 device buffers, the gradient "
        "aligned like the logits");
  }
  if (rows.rows == 0) return absl::OkStatus();
  auto s = static_cast<cudaStream_t>(stream);
  switch (rows.type) {
    case LogitType::kFloat32:
      LaunchBackward<float>(rows, lse, scale, grad, s);
      break;
    case LogitType::kBFloat16:
      LaunchBackward<__nv_bfloat16>(rows, lse, scale, grad, s);
      break;
    case LogitType::kFloat16:
      LaunchBackward<__half>(rows, lse, scale, grad, s);
      break;
  }
  return LaunchStatus("backward", rows);
}

}  // namespace trainstream::kernels
