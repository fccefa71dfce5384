// SPDX-License-Identifier: Apache-2.0
// AVX2 lanes (8 floats), built with -mavx2 -mfma -mf16c -ffp-contract=off. Runs only when
// BestIsa() found those instructions.
#include <immintrin.h>

#include "adamw_simd.h"

namespace trainstream::kernels::internal {
namespace {

struct Avx2 {
  static constexpr size_t kWidth = 8;
  using F = __m256;
  using I = __m256i;
  using D = __m256d;
  static F Zero() { return _mm256_setzero_ps(); }
  static F Set(float x) { return _mm256_set1_ps(x); }
  static F Add(F a, F b) { return _mm256_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F MulAdd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F Div(F a, F b) { return _mm256_div_ps(a, b); }
  static F Sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F LoadF32(const float* p) { return _mm256_loadu_ps(p); }
  static F LoadBF16(const uint16_t* p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static F LoadF16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void StoreF32(float* p, F v) { _mm256_storeu_ps(p, v); }
  static void StoreU16(uint16_t* p, __m256i v32) {
    // Values are below 2^16, so the unsigned saturating pack keeps them; undo its lane split.
    __m256i packed = _mm256_packus_epi32(v32, v32);
    packed = _mm256_permute4x64_epi64(packed, 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static __m256i IsNan(F v) { return _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)); }
  static void StoreBF16(uint16_t* p, F v) {
    __m256i bits = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    rounded = _mm256_srli_epi32(rounded, 16);
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), IsNan(v));
    StoreU16(p, rounded);
  }
  static void StoreBF16Stochastic(uint16_t* p, F v, __m256i random) {
    __m256i stochastic = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_castps_si256(v), _mm256_and_si256(random, _mm256_set1_epi32(0xffff))),
        16);
    StoreU16(p, _mm256_blendv_epi8(stochastic, _mm256_set1_epi32(0x7fc0), IsNan(v)));
  }
  // The high 16 bits of every lane of a, then of b: 16 values in one store.
  static void StoreHighHalves(uint16_t* p, __m256i a, __m256i b) {
    __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(a, 16), _mm256_srli_epi32(b, 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xd8));
  }
  static __m256i NearestHigh(F v) {
    __m256i bits = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc00000), IsNan(v));
  }
  static void StoreBF16Pair(uint16_t* p, F a, F b) {
    StoreHighHalves(p, NearestHigh(a), NearestHigh(b));
  }
  static __m256i StochasticHigh(F v, __m256i random) {
    __m256i sum = _mm256_add_epi32(_mm256_castps_si256(v),
                                   _mm256_and_si256(random, _mm256_set1_epi32(0xffff)));
    return _mm256_blendv_epi8(sum, _mm256_set1_epi32(0x7fc00000), IsNan(v));
  }
  static void StoreBF16StochasticPair(uint16_t* p, F a, F b, __m256i random_a, __m256i random_b) {
    StoreHighHalves(p, StochasticHigh(a, random_a), StochasticHigh(b, random_b));
  }
  static void StoreF16(uint16_t* p, F v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static __m256i High16(__m256i x) { return _mm256_srli_epi32(x, 16); }
  static __m256i Random(uint32_t seed, uint32_t index) {
    __m256i x = _mm256_xor_si256(_mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(index)),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                                 _mm256_set1_epi32(static_cast<int>(seed)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x85ebca6bu)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 13));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0xc2b2ae35u)));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  }
  static uint32_t NonFiniteLanes(F g) {
    __m256i exponent = _mm256_and_si256(_mm256_castps_si256(g), _mm256_set1_epi32(0x7f800000));
    __m256i special = _mm256_cmpeq_epi32(exponent, _mm256_set1_epi32(0x7f800000));
    return static_cast<uint32_t>(_mm_popcnt_u32(
        static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(special)))));
  }
  // Gradient statistics.
  static D ZeroD() { return _mm256_setzero_pd(); }
  static I ZeroI() { return _mm256_setzero_si256(); }
  static F FiniteMask(F g) {
    __m256i exponent = _mm256_and_si256(_mm256_castps_si256(g), _mm256_set1_epi32(0x7f800000));
    __m256i special = _mm256_cmpeq_epi32(exponent, _mm256_set1_epi32(0x7f800000));
    return _mm256_castsi256_ps(_mm256_xor_si256(special, _mm256_set1_epi32(-1)));
  }
  static I CountNonFinite(I count, F finite) {
    // A non-finite lane is an all-zero mask: subtract (mask - 1) = -1 ... count it as +1.
    __m256i nonfinite = _mm256_xor_si256(_mm256_castps_si256(finite), _mm256_set1_epi32(-1));
    return _mm256_sub_epi32(count, nonfinite);
  }
  static F KeepFinite(F g, F finite) { return _mm256_and_ps(g, finite); }
  static D AddSquares(D sum, F g) {
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(g));
    __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(g, 1));
    sum = _mm256_add_pd(sum, _mm256_mul_pd(lo, lo));
    return _mm256_add_pd(sum, _mm256_mul_pd(hi, hi));
  }
  static double HorizontalSum(D v) {
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, v);
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  }
  static uint64_t HorizontalCount(I v) {
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
    uint64_t total = 0;
    for (uint32_t lane : lanes) total += lane;
    return total;
  }
};

}  // namespace

uint64_t AdamWAvx2(const AdamWTensor& t, size_t begin, size_t end, const AdamWStep& s) {
  return AdamWVector<Avx2>(t, begin, end, s);
}

GradientStats StatsAvx2(const void* const* grads, int n, ScalarType type, size_t b, size_t e) {
  return StatsVector<Avx2>(grads, n, type, b, e);
}

}  // namespace trainstream::kernels::internal
