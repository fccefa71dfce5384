// SPDX-License-Identifier: Apache-2.0
// Host AdamW/Adam: one pass per element that reads the gradient(s), the fp32 master weight and
// both moments once, and writes the master, the moments and the model-dtype parameter once.
#ifndef TRAINSTREAM_KERNELS_CPU_ADAMW_H_
#define TRAINSTREAM_KERNELS_CPU_ADAMW_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace trainstream::kernels {

enum class ScalarType : uint8_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
size_t ElementSize(ScalarType type);
const char* ScalarTypeName(ScalarType type);

// Instruction sets with a path of their own, best last.
enum class Isa : uint8_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
// The best path this CPU runs (AVX-512 needs F, BW, VL; AVX2 needs FMA and F16C).
Isa BestIsa();
bool IsaSupported(Isa isa);
const char* IsaName(Isa isa);

// One step's constants for one parameter group, in double precision as torch keeps its
// hyper-parameters (Python floats); the kernels derive each fp32 constant from them the way
// torch.optim.AdamW does (e.g. 1 - beta1 rounded once), so no constant drifts by an ulp.
struct AdamWStep {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled_weight_decay = true;  // AdamW; false is Adam (L2 folded into the gradient)
  double bias_correction1 = 1.0;       // 1 - beta1^t
  double bias_correction2_sqrt = 1.0;  // sqrt(1 - beta2^t)
  float grad_scale = 1.0f;             // multiplies the summed gradient (1/ranks, clipping)
  uint64_t rounding_seed = 0;          // stochastic rounding of bf16 moments
};

// The fp32 constants of one step, derived once from AdamWStep.
struct AdamWConstants {
  float decay, l2, step_size, one_minus_beta1, beta2, one_minus_beta2, inv_bc2, eps, grad_scale;
  uint32_t seed;
};
AdamWConstants Constants(const AdamWStep& step);

// Fills in the bias corrections of step `t` (1-based) the way torch.optim.AdamW computes them.
void SetStepNumber(AdamWStep* step, uint64_t t);

// The stochastic-rounding seed of tensor `index`'s step `t` (1-based): a function of the two
// alone, so a run restored from a checkpoint (in any job), and a tensor updated on the GPU
// instead of the host, rounds exactly as the uninterrupted host run would have.
uint64_t RoundingSeed(uint64_t index, uint64_t t);

// One tensor's state. `grads` holds `num_grads` arrays (one per rank) that are summed.
struct AdamWTensor {
  float* master = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  ScalarType moment_type = ScalarType::kFloat32;  // kFloat32, or kBFloat16 (stochastic rounding)
  const void* const* grads = nullptr;
  int num_grads = 1;
  ScalarType grad_type = ScalarType::kFloat32;
  void* param_out = nullptr;  // optional copy of the master in the model's dtype
  ScalarType param_type = ScalarType::kFloat32;
  size_t numel = 0;
};

// Updates elements [begin, end). Disjoint ranges of one tensor may run on different threads.
// The paths agree bit for bit. When `nonfinite` is given, adds the number of summed-gradient
// elements that were NaN or infinite (they are applied all the same, as torch does).
absl::Status AdamWUpdate(const AdamWTensor& tensor, size_t begin, size_t end,
                         const AdamWStep& step, Isa isa, uint64_t* nonfinite = nullptr);

// The summed gradient's sum of squares (in fp64) over [begin, end) and how many of its
// elements are not finite. Used for global-norm clipping and non-finite checks.
struct GradientStats {
  double sum_squares = 0;
  uint64_t nonfinite = 0;
};
GradientStats ComputeGradientStats(const void* const* grads, int num_grads, ScalarType grad_type,
                                   size_t begin, size_t end, Isa isa);

// accum[i] = (overwrite ? 0 : accum[i]) + sum over ranks of grads[r][i], for [begin, end): the
// micro-steps of gradient accumulation, summed in fp32.
void AccumulateGradients(float* accum, bool overwrite, const void* const* grads, int num_grads,
                         ScalarType grad_type, size_t begin, size_t end);

// dst[i] = src[i] rounded to nearest-even in `type`, for i in [0, numel).
void ConvertFromFloat(const float* src, void* dst, ScalarType type, size_t numel);

// Per-ISA entry points (adamw_scalar.cc, adamw_avx2.cc, adamw_avx512.cc); the range and types
// are already checked.
namespace internal {
uint64_t AdamWScalar(const AdamWTensor& t, size_t begin, size_t end, const AdamWStep& s);
uint64_t AdamWAvx2(const AdamWTensor& t, size_t begin, size_t end, const AdamWStep& s);
uint64_t AdamWAvx512(const AdamWTensor& t, size_t begin, size_t end, const AdamWStep& s);
GradientStats StatsScalar(const void* const* grads, int n, ScalarType type, size_t b, size_t e);
GradientStats StatsAvx2(const void* const* grads, int n, ScalarType type, size_t b, size_t e);
GradientStats StatsAvx512(const void* const* grads, int n, ScalarType type, size_t b, size_t e);
}  // namespace internal

}  // namespace trainstream::kernels

#endif  // TRAINSTREAM_KERNELS_CPU_ADAMW_H_
