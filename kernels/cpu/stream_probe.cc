// SPDX-License-Identifier: Apache-2.0
#include "stream_probe.h"

#include <cstring>

namespace trainstream::kernels {
namespace {

// Compiled for each instruction set and chosen at load time (GCC function multiversioning), so
// the probe vectorises as well as the machine allows.
template <typename Moment>
__attribute__((always_inline)) inline void Stream(const uint16_t* __restrict grad,
                                                  float* __restrict master,
                                                  Moment* __restrict m, Moment* __restrict v,
                                                  uint16_t* __restrict out, size_t begin,
                                                  size_t end) {
  for (size_t i = begin; i < end; ++i) {
    uint32_t bits = static_cast<uint32_t>(grad[i]) << 16;
    float g;
    std::memcpy(&g, &bits, 4);
    float p = master[i] + g;
    master[i] = p;
    m[i] = static_cast<Moment>(m[i] + static_cast<Moment>(1));
    v[i] = static_cast<Moment>(v[i] + static_cast<Moment>(1));
    uint32_t pb;
    std::memcpy(&pb, &p, 4);
    out[i] = static_cast<uint16_t>(pb >> 16);
  }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void StreamF32(
    const uint16_t* grad, float* master, float* m, float* v, uint16_t* out, size_t b, size_t e) {
  Stream(grad, master, m, v, out, b, e);
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void StreamU16(
    const uint16_t* grad, float* master, uint16_t* m, uint16_t* v, uint16_t* out, size_t b,
    size_t e) {
  Stream(grad, master, m, v, out, b, e);
}

}  // namespace

void StreamProbe(const uint16_t* grad, float* master, void* m, void* v, bool moments_f32,
                 uint16_t* out, size_t begin, size_t end) {
  if (moments_f32) {
    StreamF32(grad, master, static_cast<float*>(m), static_cast<float*>(v), out, begin, end);
  } else {
    StreamU16(grad, master, static_cast<uint16_t*>(m), static_cast<uint16_t*>(v), out, begin, end);
  }
}

}  // namespace trainstream::kernels
