// SPDX-License-Identifier: Apache-2.0
#include "cuda/adamw_mapped.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
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

// The scalar reference's loop body, with every rounding spelled out (_rn intrinsics) so that
// nvcc contracts nothing the host path does not.
__global__ void AdamWMappedKernel(MappedAdamWTensor t, AdamWConstants c,
                                  unsigned long long* nonfinite, const float* skip_if) {
  if (skip_if != nullptr && *skip_if != 0.0f) return;
  const bool stochastic = t.moment_type == ScalarType::kBFloat16;
  unsigned long long bad = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < t.numel;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float g = __fadd_rn(0.0f, Load(t.grad, t.grad_type, i));  // the host sums from 0 too
    bad += !isfinite(g);
    g = __fmul_rn(g, c.grad_scale);
    float p = t.master != nullptr ? t.master[i] : Load(t.param, t.param_type, i);
    if (c.l2 != 0.0f) g = __fmaf_rn(c.l2, p, g);
    p = __fmul_rn(p, c.decay);
    float m = Load(t.exp_avg, t.moment_type, i);
    float v = Load(t.exp_avg_sq, t.moment_type, i);
    m = __fmaf_rn(c.one_minus_beta1, __fsub_rn(g, m), m);
    v = __fmaf_rn(c.one_minus_beta2, __fmul_rn(g, g), __fmul_rn(v, c.beta2));
    const float denom = __fmaf_rn(__fsqrt_rn(v), c.inv_bc2, c.eps);
    p = __fmaf_rn(c.step_size, __fdiv_rn(m, denom), p);
    if (t.master != nullptr) t.master[i] = p;
    if (stochastic) {
      const uint32_t random = MixBits(c.seed, static_cast<uint32_t>(i));
      static_cast<uint16_t*>(t.exp_avg)[i] = FloatToBFloat16Stochastic(m, random & 0xffffu);
      static_cast<uint16_t*>(t.exp_avg_sq)[i] = FloatToBFloat16Stochastic(v, random >> 16);
    } else {
      static_cast<float*>(t.exp_avg)[i] = m;
      static_cast<float*>(t.exp_avg_sq)[i] = v;
    }
    StoreNearest(t.param, t.param_type, i, p);
  }
  if (nonfinite != nullptr && bad != 0) atomicAdd(nonfinite, bad);
}

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
  const size_t wanted = (t.numel + kThreads - 1) / kThreads;
  const unsigned blocks =
      static_cast<unsigned>(std::min<size_t>(wanted, static_cast<size_t>(sms > 0 ? sms : 1)));
  AdamWMappedKernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      t, Constants(step), nonfinite, skip_if);
  const cudaError_t launched = cudaGetLastError();
  if (launched != cudaSuccess) {
    return absl::InternalError(
        absl::StrFormat("AdamW kernel launch: %s", cudaGetErrorString(launched)));
  }
  return absl::OkStatus();
}

}  // namespace trainstream::kernels
