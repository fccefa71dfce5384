// SPDX-License-Identifier: Apache-2.0
#include "cuda/adamw_mapped.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "absl/strings/str_format.h"
#include "cpu/numeric.h"

namespace trainstream::kernels {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float Load(const void* base, ScalarType type, size_t i) {
  switch (type) {
    case ScalarType::kFloat32: return static_cast<const float*>(base)[i];
    case ScalarType::kBFloat16: return BFloat16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case ScalarType::kFloat16:
      return __half2float(__ushort_as_half(static_cast<const uint16_t*>(base)[i]));
  }
  return 0.0f;
}

__device__ __forceinline__ void StoreNearest(void* base, ScalarType type, size_t i, float v) {
  switch (type) {
    case ScalarType::kFloat32: static_cast<float*>(base)[i] = v; break;
    case ScalarType::kBFloat16: static_cast<uint16_t*>(base)[i] = FloatToBFloat16(v); break;
    case ScalarType::kFloat16:
      static_cast<uint16_t*>(base)[i] = __half_as_ushort(__float2half_rn(v));
      break;
  }
}

// The scalar reference's loop body on one element's gradient `g` and weight `p` as read, with
// every rounding spelled out (_rn intrinsics) so that nvcc contracts nothing the host path does
// not. `m` and `v` come in as read and go out as to be stored; returns the new weight.
__device__ __forceinline__ float Step(const AdamWConstants& c, float g, float p, float& m,
                                      float& v, unsigned long long& bad) {
  g = __fadd_rn(0.0f, g);  // the host sums from 0 too
  bad += !isfinite(g);
  g = __fmul_rn(g, c.grad_scale);
  if (c.l2 != 0.0f) g = __fmaf_rn(c.l2, p, g);
  p = __fmul_rn(p, c.decay);
  m = __fmaf_rn(c.one_minus_beta1, __fsub_rn(g, m), m);
  v = __fmaf_rn(c.one_minus_beta2, __fmul_rn(g, g), __fmul_rn(v, c.beta2));
  const float denom = __fmaf_rn(__fsqrt_rn(v), c.inv_bc2, c.eps);
  return __fmaf_rn(c.step_size, __fdiv_rn(m, denom), p);
}

__device__ __forceinline__ float LoadWeight(const MappedAdamWTensor& t, size_t i) {
  return t.master != nullptr ? t.master[i] : Load(t.param, t.param_type, i);
}

__device__ __forceinline__ void StoreWeight(const MappedAdamWTensor& t, size_t i, float p) {
  if (t.master != nullptr) t.master[i] = p;
  StoreNearest(t.param, t.param_type, i, p);
}

// bf16 moments are rounded stochastically, from element i's bits of the step's seed.
__device__ __forceinline__ void RoundMoments(const AdamWConstants& c, size_t i, float m, float v,
                                             uint16_t& m_out, uint16_t& v_out) {
  const uint32_t random = MixBits(c.seed, static_cast<uint32_t>(i));
  m_out = FloatToBFloat16Stochastic(m, random & 0xffffu);
  v_out = FloatToBFloat16Stochastic(v, random >> 16);
}

// Elements [first, t.numel), one a thread at a time.
__device__ __forceinline__ void UpdateScalars(const MappedAdamWTensor& t, const AdamWConstants& c,
                                              size_t first, unsigned long long& bad) {
  for (size_t i = first + blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
       i < t.numel; i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float m = Load(t.exp_avg, t.moment_type, i);
    float v = Load(t.exp_avg_sq, t.moment_type, i);
    const float p = Step(c, Load(t.grad, t.grad_type, i), LoadWeight(t, i), m, v, bad);
    StoreWeight(t, i, p);
    if (t.moment_type == ScalarType::kBFloat16) {
      RoundMoments(c, i, m, v, static_cast<uint16_t*>(t.exp_avg)[i],
                   static_cast<uint16_t*>(t.exp_avg_sq)[i]);
    } else {
      static_cast<float*>(t.exp_avg)[i] = m;
      static_cast<float*>(t.exp_avg_sq)[i] = v;
    }
  }
}

__global__ void AdamWMappedKernel(MappedAdamWTensor t, AdamWConstants c,
                                  unsigned long long* nonfinite, const float* skip_if) {
  if (skip_if != nullptr && *skip_if != 0.0f) return;
  unsigned long long bad = 0;
  UpdateScalars(t, c, 0, bad);
  if (nonfinite != nullptr && bad != 0) atomicAdd(nonfinite, bad);
}

// The same update with each thread reading and writing its moments 16 bytes at a time (4 fp32
// or 8 bf16 elements; both moments 16-byte aligned): when they cross PCIe, what bounds the
// kernel is the bytes each thread has in flight, one round trip an iteration, and one block an
// SM with two-byte loads left bf16 moments no faster than fp32 (2026-12-06, the 1.6B GPT:
// 498 against 555 ms). Every load of an iteration comes before its first store, so that they
// are all in flight at once (the pointers may alias, as far as the compiler knows). The
// elements past the last whole vector go one a thread.
template <typename Moment>
__global__ void AdamWMappedVectorKernel(MappedAdamWTensor t, AdamWConstants c,
                                        unsigned long long* nonfinite, const float* skip_if) {
  if (skip_if != nullptr && *skip_if != 0.0f) return;
  constexpr int kVec = static_cast<int>(sizeof(uint4) / sizeof(Moment));
  union Vector {
    uint4 raw;
    Moment e[kVec];
  };
  const size_t vectors = t.numel / kVec;
  unsigned long long bad = 0;
  for (size_t k = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; k < vectors;
       k += static_cast<size_t>(gridDim.x) * blockDim.x) {
    Vector m_io, v_io;
    m_io.raw = static_cast<const uint4*>(t.exp_avg)[k];
    v_io.raw = static_cast<const uint4*>(t.exp_avg_sq)[k];
    float g[kVec], p[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      g[j] = Load(t.grad, t.grad_type, k * kVec + j);
      p[j] = LoadWeight(t, k * kVec + j);
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const size_t i = k * kVec + j;
      if constexpr (sizeof(Moment) == 4) {
        p[j] = Step(c, g[j], p[j], m_io.e[j], v_io.e[j], bad);
      } else {
        float m = BFloat16ToFloat(m_io.e[j]), v = BFloat16ToFloat(v_io.e[j]);
        p[j] = Step(c, g[j], p[j], m, v, bad);
        RoundMoments(c, i, m, v, m_io.e[j], v_io.e[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) StoreWeight(t, k * kVec + j, p[j]);
    static_cast<uint4*>(t.exp_avg)[k] = m_io.raw;
    static_cast<uint4*>(t.exp_avg_sq)[k] = v_io.raw;
  }
  UpdateScalars(t, c, vectors * kVec, bad);
  if (nonfinite != nullptr && bad != 0) atomicAdd(nonfinite, bad);
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % sizeof(uint4) == 0; }

// The device address of `p`: itself for device memory and, under unified addressing, for
// mapped host memory; the runtime says for registered memory the device can't use as is.
absl::Status DevicePointer(void** p, const char* what) {
  if (*p == nullptr) return absl::OkStatus();
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, *p) != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(
        absl::StrFormat("%s is neither device memory nor page-locked host memory", what));
  }
  if (attributes.type == cudaMemoryTypeHost) {
    if (attributes.devicePointer == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s is page-locked host memory not mapped for the GPU", what));
    }
    *p = attributes.devicePointer;
  } else if (attributes.type == cudaMemoryTypeUnregistered) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s is pageable host memory: register it with CUDA (the daemon's segments are) first",
        what));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AdamWMappedOnDevice(const MappedAdamWTensor& tensor, const AdamWStep& step,
                                 unsigned long long* nonfinite, void* stream,
                                 const float* skip_if) {
  MappedAdamWTensor t = tensor;
  if (t.exp_avg == nullptr || t.exp_avg_sq == nullptr || t.grad == nullptr ||
      t.param == nullptr) {
    return absl::InvalidArgumentError("AdamW on the GPU needs both moments, a gradient and the "
                                      "parameter");
  }
  if (t.master == nullptr && t.param_type != ScalarType::kFloat32) {
    return absl::InvalidArgumentError(
        "a parameter that is not fp32 needs fp32 master weights beside it");
  }
  if (t.moment_type == ScalarType::kFloat16) {
    return absl::InvalidArgumentError("moments are fp32 or bf16");
  }
  if (t.numel == 0) return absl::OkStatus();
  void* master = t.master;
  const void* grad = t.grad;
  for (auto [pointer, what] : {std::pair<void**, const char*>{&master, "the master weights"},
                               {&t.exp_avg, "the first moment"},
                               {&t.exp_avg_sq, "the second moment"},
                               {const_cast<void**>(&grad), "the gradient"},
                               {&t.param, "the parameter"}}) {
    if (absl::Status s = DevicePointer(pointer, what); !s.ok()) return s;
  }
  t.master = static_cast<float*>(master);
  t.grad = grad;
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  // One block an SM: the state crosses PCIe, so what bounds the kernel is the loads in flight
  // (a block an SM keeps several hundred KB of them, many times what fills the link), not
  // threads. It runs beside backward, and eight blocks an SM, as it once had, took every thread
  // slot of the GPU for its whole run, so backward's kernels waited for it (GPT 124M: a 66 ms
  // step, against 32 ms of compute and 26 ms of this kernel, 2026-12-05).
  // Whole vectors where both moments allow them; the scalar loop where either is misaligned.
  const bool vectors = Aligned16(t.exp_avg) && Aligned16(t.exp_avg_sq);
  const size_t per_thread =
      vectors ? sizeof(uint4) / (t.moment_type == ScalarType::kBFloat16 ? 2 : 4) : 1;
  const size_t wanted = (t.numel / per_thread + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(
      std::clamp<size_t>(wanted, 1, static_cast<size_t>(sms > 0 ? sms : 1)));
  const auto on = static_cast<cudaStream_t>(stream);
  if (!vectors) {
    AdamWMappedKernel<<<blocks, kThreads, 0, on>>>(t, Constants(step), nonfinite, skip_if);
  } else if (t.moment_type == ScalarType::kBFloat16) {
    AdamWMappedVectorKernel<uint16_t><<<blocks, kThreads, 0, on>>>(t, Constants(step),
                                                                     nonfinite, skip_if);
  } else {
    AdamWMappedVectorKernel<float><<<blocks, kThreads, 0, on>>>(t, Constants(step), nonfinite,
                                                                  skip_if);
  }
  const cudaError_t launched = cudaGetLastError();
  if (launched != cudaSuccess) {
    return absl::InternalError(
        absl::StrFormat("AdamW kernel launch: %s", cudaGetErrorString(launched)));
  }
  return absl::OkStatus();
}

}  // namespace trainstream::kernels
