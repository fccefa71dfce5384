// SPDX-License-Identifier: Apache-2.0
// Scalar conversions and the counter-based hash that every path shares, so that the vector
// paths can be checked element by element against the scalar one.
#ifndef TRAINSTREAM_KERNELS_CPU_NUMERIC_H_
#define TRAINSTREAM_KERNELS_CPU_NUMERIC_H_

#include <cmath>
#include <cstdint>
#include <cstring>

// The conversions below compile for the GPU too (kernels/cuda/adamw_mapped.cu): one definition
// of each rounding for both, so the two paths cannot drift apart.
#ifdef __CUDACC__
#define TRAINSTREAM_HOST_DEVICE __host__ __device__
#else
#define TRAINSTREAM_HOST_DEVICE
#endif

namespace trainstream::kernels {

TRAINSTREAM_HOST_DEVICE inline float BitsToFloat(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
TRAINSTREAM_HOST_DEVICE inline uint32_t FloatToBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

TRAINSTREAM_HOST_DEVICE inline float BFloat16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

// Round to nearest even, as c10::BFloat16 does; NaN stays a quiet NaN.
TRAINSTREAM_HOST_DEVICE inline uint16_t FloatToBFloat16(float f) {
  uint32_t bits = FloatToBits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Stochastic rounding: adds 16 random bits below the kept ones, then truncates, so the expected
// value equals the input. An infinity has no low bits for the addition to carry out of, so it
// stays infinite; NaN becomes the quiet NaN that nearest rounding gives.
TRAINSTREAM_HOST_DEVICE inline uint16_t FloatToBFloat16Stochastic(float f, uint32_t random) {
  uint32_t bits = FloatToBits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  bits += random & 0xffffu;
  return static_cast<uint16_t>(bits >> 16);
}

float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);

// murmur3's 32-bit finaliser over index ^ seed: the per-element random bits for stochastic
// rounding. The seed is already well mixed (Constants()), so the index needs no multiplication
// of its own; the finaliser is a bijection, so no two elements of a step share their bits.
// Every path computes exactly this.
TRAINSTREAM_HOST_DEVICE inline uint32_t MixBits(uint32_t seed, uint32_t index) {
  uint32_t x = index ^ seed;
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  x ^= x >> 16;
  return x;
}

}  // namespace trainstream::kernels

#endif  // TRAINSTREAM_KERNELS_CPU_NUMERIC_H_
