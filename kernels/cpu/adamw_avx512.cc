// SPDX-License-Identifier: Apache-2.0
// AVX-512 lanes (16 floats), built with -mavx512f -mavx512bw -mavx512vl -ffp-contract=off. Runs
// only when BestIsa() found those instructions.
#include <immintrin.h>

#include "adamw_simd.h"

namespace trainstream::kernels::internal {
namespace {

struct Avx512 {
  static constexpr size_t kWidth = 16;
  using F = __m512;
  using I = __m512i;
  using D = __m512d;
  static F Zero() { return _mm512_setzero_ps(); }
  static F Set(float x) { return _mm512_set1_ps(x); }
  static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F MulAdd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F Div(F a, F b) { return _mm512_div_ps(a, b); }
  static F Sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F LoadF32(const float* p) { return _mm512_loadu_ps(p); }
  static F LoadBF16(const uint16_t* p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static F LoadF16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void StoreF32(float* p, F v) { _mm512_storeu_ps(p, v); }
  static void StoreU16(uint16_t* p, __m512i v32) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(v32));
  }
  static __m512i Nearest(__m512i bits) {
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  }
  static void StoreBF16(uint16_t* p, F v) {
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    __m512i rounded = Nearest(_mm512_castps_si512(v));
    StoreU16(p, _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0)));
  }
  static void StoreBF16Stochastic(uint16_t* p, F v, __m512i random) {
    __m512i stochastic = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_castps_si512(v), _mm512_and_si512(random, _mm512_set1_epi32(0xffff))),
        16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    StoreU16(p, _mm512_mask_mov_epi32(stochastic, nan, _mm512_set1_epi32(0x7fc0)));
  }
  // The high 16 bits of every lane of a, then of b: 32 values, one permute, one store.
  static void StoreHighHalves(uint16_t* p, __m512i a, __m512i b) {
    const __m512i odd_words = _mm512_setr_epi32(
        0x00030001, 0x00070005, 0x000b0009, 0x000f000d, 0x00130011, 0x00170015, 0x001b0019,
        0x001f001d, 0x00230021, 0x00270025, 0x002b0029, 0x002f002d, 0x00330031, 0x00370035,
        0x003b0039, 0x003f003d);
    _mm512_storeu_si512(p, _mm512_permutex2var_epi16(a, odd_words, b));
  }
  // Nearest-even in the high half (the low half is dropped by the pack); NaN as 0x7fc0.
  static __m512i NearestHigh(F v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                 _mm512_set1_epi32(0x7fc00000));
  }
  static void StoreBF16Pair(uint16_t* p, F a, F b) {
    StoreHighHalves(p, NearestHigh(a), NearestHigh(b));
  }
  static __m512i StochasticHigh(F v, __m512i random) {
    __m512i sum = _mm512_add_epi32(_mm512_castps_si512(v),
                                   _mm512_and_si512(random, _mm512_set1_epi32(0xffff)));
    return _mm512_mask_mov_epi32(sum, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                 _mm512_set1_epi32(0x7fc00000));
  }
  static void StoreBF16StochasticPair(uint16_t* p, F a, F b, __m512i random_a, __m512i random_b) {
    StoreHighHalves(p, StochasticHigh(a, random_a), StochasticHigh(b, random_b));
  }
  static void StoreF16(uint16_t* p, F v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static __m512i High16(__m512i x) { return _mm512_srli_epi32(x, 16); }
  static __m512i Random(uint32_t seed, uint32_t index) {
    __m512i x = _mm512_xor_si512(
        _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(index)),
                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
        _mm512_set1_epi32(static_cast<int>(seed)));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x85ebca6bu)));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0xc2b2ae35u)));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  }
  static uint32_t NonFiniteLanes(F g) {
    __m512i exponent = _mm512_and_si512(_mm512_castps_si512(g), _mm512_set1_epi32(0x7f800000));
    return static_cast<uint32_t>(
        _mm_popcnt_u32(_mm512_cmpeq_epi32_mask(exponent, _mm512_set1_epi32(0x7f800000))));
  }
  static D ZeroD() { return _mm512_setzero_pd(); }
  static I ZeroI() { return _mm512_setzero_si512(); }
  static F FiniteMask(F g) {
    __m512i exponent = _mm512_and_si512(_mm512_castps_si512(g), _mm512_set1_epi32(0x7f800000));
    __mmask16 special = _mm512_cmpeq_epi32_mask(exponent, _mm512_set1_epi32(0x7f800000));
    return _mm512_castsi512_ps(_mm512_maskz_mov_epi32(~special, _mm512_set1_epi32(-1)));
  }
  static I CountNonFinite(I count, F finite) {
    __m512i nonfinite = _mm512_xor_si512(_mm512_castps_si512(finite), _mm512_set1_epi32(-1));
    return _mm512_sub_epi32(count, nonfinite);
  }
  static F KeepFinite(F g, F finite) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(g), _mm512_castps_si512(finite)));
  }
  static D AddSquares(D sum, F g) {
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(g));
    __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(g), 1)));
    sum = _mm512_add_pd(sum, _mm512_mul_pd(lo, lo));
    return _mm512_add_pd(sum, _mm512_mul_pd(hi, hi));
  }
  static double HorizontalSum(D v) { return _mm512_reduce_add_pd(v); }
  static uint64_t HorizontalCount(I v) {
    alignas(64) uint32_t lanes[16];
    _mm512_store_si512(lanes, v);
    uint64_t total = 0;
    for (uint32_t lane : lanes) total += lane;
    return total;
  }
};

}  // namespace

uint64_t AdamWAvx512(const AdamWTensor& t, size_t begin, size_t end, const AdamWStep& s) {
  return AdamWVector<Avx512>(t, begin, end, s);
}

GradientStats StatsAvx512(const void* const* grads, int n, ScalarType type, size_t b, size_t e) {
  return StatsVector<Avx512>(grads, n, type, b, e);
}

}  // namespace trainstream::kernels::internal
