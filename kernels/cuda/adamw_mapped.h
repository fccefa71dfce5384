// SPDX-License-Identifier: Apache-2.0
// AdamW on the GPU over optimizer state the GPU reads and writes where it lies: the fp32 master
// weights and the moments may be in host memory that is page-locked and mapped into the GPU's
// address space (the daemon's segments, registered by the client), read and written over PCIe
// by the kernel itself (zero-copy), or in VRAM. The gradient and the model-dtype parameter are in
// VRAM. Element for element the same arithmetic as the host path's scalar reference
// (cpu/adamw_scalar.cc: the same constants, the same fused multiply-adds, IEEE division and
// square root, the same stochastic rounding of bf16 moments), so the two agree bit for bit and
// a checkpoint does not care which updated a parameter.
#ifndef TRAINSTREAM_KERNELS_CUDA_ADAMW_MAPPED_H_
#define TRAINSTREAM_KERNELS_CUDA_ADAMW_MAPPED_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "cpu/adamw.h"

namespace trainstream::kernels {

// Pointers the GPU can use: device memory, or page-locked host memory mapped for the device
// (under unified addressing a registered host pointer is its own device pointer; the kernel
// asks the runtime for it).
struct MappedAdamWTensor {
  float* master = nullptr;      // fp32 master weights; null: `param` is fp32 and is the master
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  ScalarType moment_type = ScalarType::kFloat32;  // kFloat32 or kBFloat16 (stochastic rounding)
  const void* grad = nullptr;   // one gradient (the ranks' sum where there are several)
  ScalarType grad_type = ScalarType::kFloat32;
  void* param = nullptr;        // the model's parameter, updated in place
  ScalarType param_type = ScalarType::kFloat32;
  size_t numel = 0;
};

// Queues the update of all `t.numel` elements on `stream` (a cudaStream_t) and returns without
// waiting. `nonfinite` (a device uint64, optional) is incremented by the number of gradient
// elements that were NaN or infinite (they are applied all the same, as torch does).
// `skip_if` (a device float, optional; nonfinite="guard"'s flag) leaves everything as it is
// when it holds anything but zero as the kernel starts.
// INVALID_ARGUMENT for a missing pointer, an fp32 master missing for a non-fp32 parameter, or
// bf16 moments' misuse; the CUDA error otherwise.
absl::Status AdamWMappedOnDevice(const MappedAdamWTensor& t, const AdamWStep& step,
                                 unsigned long long* nonfinite, void* stream,
                                 const float* skip_if = nullptr);

}  // namespace trainstream::kernels

#endif  // TRAINSTREAM_KERNELS_CUDA_ADAMW_MAPPED_H_
