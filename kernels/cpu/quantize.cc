// SPDX-License-Identifier: Apache-2.0
#include "cpu/quantize.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_format.h"
#include "cpu/numeric.h"

namespace trainstream::kernels {
namespace {

// The NormalFloat-4 table: quantiles of a unit normal scaled to [-1, 1], as bitsandbytes
// defines them (codes 0..15 in order).
constexpr float kNf4[16] = {-1.0f,
                            -0.6961928009986877f,
                            -0.5250730514526367f,
                            -0.39491748809814453f,
                            -0.28444138169288635f,
                            -0.18477343022823334f,
                            -0.09105003625154495f,
                            0.0f,
                            0.07958029955625534f,
                            0.16093020141124725f,
                            0.24611230194568634f,
                            0.33791524171829224f,
                            0.44070982933044434f,
                            0.5626170039176941f,
                            0.7229568362236023f,
                            1.0f};

// bitsandbytes' decision points between neighbouring codes (its dQuantizeNF4 tree); a value
// above threshold k takes code k + 1.
constexpr float kNf4Above[15] = {-0.8480964004993439f,  -0.6106329262256622f,
                                 -0.4599952697753906f,  -0.33967943489551544f,
                                 -0.23460740596055984f, -0.13791173323988914f,
                                 -0.045525018125772476f, 0.03979014977812767f,
                                 0.1202552504837513f,   0.2035212516784668f,
                                 0.2920137718319893f,   0.3893125355243683f,
                                 0.5016634166240692f,   0.6427869200706482f,
                                 0.8614784181118011f};

constexpr float kE2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
constexpr float kE4m3Max = 448.0f;
constexpr float kE2m1Max = 6.0f;

bool IsNibbleFormat(QuantFormat f) { return f == QuantFormat::kNf4 || f == QuantFormat::kNvfp4; }
uint64_t ScaleSize(QuantFormat f) { return f == QuantFormat::kNvfp4 ? 1 : 4; }

float LoadScale(const uint8_t* scales, uint64_t block) {
  float s;
  std::memcpy(&s, scales + 4 * block, 4);
  return s;
}
void StoreScale(uint8_t* scales, uint64_t block, float s) {
  std::memcpy(scales + 4 * block, &s, 4);
}

uint8_t GetNibble(const uint8_t* data, uint64_t index, bool first_high) {
  const uint8_t byte = data[index / 2];
  const bool high = ((index & 1) == 0) == first_high;
  return high ? static_cast<uint8_t>(byte >> 4) : static_cast<uint8_t>(byte & 0x0f);
}

}  // namespace

const char* QuantFormatName(QuantFormat format) {
  switch (format) {
    case QuantFormat::kInt8: return "int8";
    case QuantFormat::kNf4: return "nf4";
    case QuantFormat::kFp8: return "fp8";
    case QuantFormat::kNvfp4: return "nvfp4";
  }
  return "unknown";
}

absl::StatusOr<QuantFormat> ParseQuantFormat(std::string_view name) {
  for (QuantFormat f : {QuantFormat::kInt8, QuantFormat::kNf4, QuantFormat::kFp8,
                        QuantFormat::kNvfp4}) {
    if (name == QuantFormatName(f)) return f;
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "unknown quantization format '%s': one of int8, nf4, fp8, nvfp4", std::string(name)));
}

int DefaultBlockSize(QuantFormat format) {
  switch (format) {
    case QuantFormat::kFp8: return 32;
    case QuantFormat::kNvfp4: return 16;
    default: return 64;
  }
}

absl::StatusOr<QuantLayout> LayoutFor(QuantFormat format, uint64_t numel, int block) {
  if (block == 0) block = DefaultBlockSize(format);
  if (format == QuantFormat::kNvfp4 && block != 16) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "nvfp4 has a scale per 16 values by definition; block size %d is not possible", block));
  }
  if (block < 2 || block % 2 != 0 || block > (1 << 20)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "quantization block size %d: must be an even number of values from 2 to 1048576",
        block));
  }
  QuantLayout layout{format, block, numel, 0, 0};
  layout.data_bytes = IsNibbleFormat(format) ? (numel + 1) / 2 : numel;
  layout.scale_bytes = layout.blocks() * ScaleSize(format);
  return layout;
}

ChunkOffsets ChunkAt(const QuantLayout& layout, uint64_t first) {
  return {IsNibbleFormat(layout.format) ? first / 2 : first,
          first / layout.block * ScaleSize(layout.format)};
}

float NvFp4TensorScale(float amax) {
  const float scale = amax / (kE2m1Max * kE4m3Max);
  return scale > 0.0f && std::isfinite(scale) ? scale : 1.0f;
}

uint8_t FloatToE4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const float a = std::fabs(f);
  if (a >= kE4m3Max) return sign | 0x7e;
  if (a < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9; 8 steps carry into 2^-6
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
  }
  // Keep 3 of float32's 23 mantissa bits, rounding to nearest even; a carry moves the
  // exponent up as it should. Exponents 121..135 (2^-6..2^8) become e4m3's 1..15.
  uint32_t bits = FloatToBits(a);
  bits += 0x7ffffu + ((bits >> 20) & 1u);
  const uint32_t rounded = (bits >> 20) - (120u << 3);
  return sign | static_cast<uint8_t>(std::min<uint32_t>(rounded, 0x7e));
}

namespace {

// E4m3ToFloat by table: the quantizers read it once a block.
float E4m3Value(uint8_t bits) {
  static const std::array<float, 256> kValues = [] {
    std::array<float, 256> values{};
    for (int i = 0; i < 256; ++i) values[i] = E4m3ToFloat(static_cast<uint8_t>(i));
    return values;
  }();
  return kValues[bits];
}

}  // namespace

float E4m3ToFloat(uint8_t bits) {
  const int e = (bits >> 3) & 0xf;
  const int m = bits & 0x7;
  float magnitude;
  if (e == 0xf && m == 0x7) {
    magnitude = std::nanf("");
  } else if (e == 0) {
    magnitude = std::ldexp(static_cast<float>(m), -9);
  } else {
    magnitude = std::ldexp(static_cast<float>(8 + m), e - 10);
  }
  return (bits & 0x80) ? -magnitude : magnitude;
}

uint8_t FloatToE2m1(float f) {
  const uint8_t sign = std::signbit(f) ? 0x8 : 0x0;
  const float a = std::fabs(f);
  // Ties go to the even code: 0.25 to 0, 0.75 to 1.0, 1.25 to 1.0, 1.75 to 2, 2.5 to 2,
  // 3.5 to 4, 5 to 4.
  uint8_t code;
  if (a <= 0.25f) code = 0;
  else if (a < 0.75f) code = 1;
  else if (a <= 1.25f) code = 2;
  else if (a < 1.75f) code = 3;
  else if (a <= 2.5f) code = 4;
  else if (a < 3.5f) code = 5;
  else if (a <= 5.0f) code = 6;
  else code = 7;
  return sign | code;
}

float E2m1ToFloat(uint8_t code) {
  const float magnitude = kE2m1[code & 0x7];
  return (code & 0x8) ? -magnitude : magnitude;
}

// Codes of up to kRun values at a time, with loops of fixed length the compiler turns into
// vector instructions; the results are those of Nf4Code and FloatToE2m1, value for value.
constexpr int kRun = 64;

// NF4 codes of `x[i] * inverse`: the count of decision points below each (see Nf4Code).
void Nf4Codes(const float* x, int m, float inverse, int32_t* codes) {
  float v[kRun];
  for (int i = 0; i < kRun; ++i) v[i] = i < m ? x[i] * inverse : 0.0f;
  for (int i = 0; i < kRun; ++i) codes[i] = 0;
  for (float above : kNf4Above) {
    for (int i = 0; i < kRun; ++i) codes[i] += above < v[i] ? 1 : 0;
  }
}

// e2m1 codes of `x[i] / scale`, ties to even as FloatToE2m1; `Run` values at a time (nvfp4's
// blocks are 16 values: a longer run would compute codes for nothing).
template <int Run>
void E2m1Codes(const float* x, int m, float scale, int32_t* codes) {
  for (int i = 0; i < Run; ++i) {
    const float q = i < m ? x[i] / scale : 0.0f;
    const float a = std::fabs(q);
    const int32_t magnitude = (a > 0.25f ? 1 : 0) + (a >= 0.75f ? 1 : 0) + (a > 1.25f ? 1 : 0) +
                              (a >= 1.75f ? 1 : 0) + (a > 2.5f ? 1 : 0) + (a >= 3.5f ? 1 : 0) +
                              (a > 5.0f ? 1 : 0);
    codes[i] = magnitude | static_cast<int32_t>((FloatToBits(q) >> 28) & 0x8u);
  }
}

// e4m3 codes of `x[i] / scale`, as FloatToE4m3 gives them for finite values (a block's
// absmax makes every |x / scale| at most 448): both of its roundings computed, one kept.
void E4m3Codes(const float* x, int m, float scale, uint8_t* out) {
  constexpr float kRound = 12582912.0f;  // 1.5 x 2^23: adding and taking it away rounds to even
  int32_t codes[kRun];
  for (int i = 0; i < kRun; ++i) {
    const float q = i < m ? x[i] / scale : 0.0f;
    const uint32_t bits = FloatToBits(q);
    const float a = std::fabs(q);
    const int32_t subnormal = static_cast<int32_t>((a * 512.0f + kRound) - kRound);
    uint32_t magnitude = bits & 0x7fffffffu;
    magnitude += 0x7ffffu + ((magnitude >> 20) & 1u);
    const int32_t normal =
        std::min(static_cast<int32_t>(magnitude >> 20) - (120 << 3), int32_t{0x7e});
    codes[i] = (a < 0.015625f ? subnormal : normal) | static_cast<int32_t>((bits >> 24) & 0x80u);
  }
  for (int i = 0; i < m; ++i) out[i] = static_cast<uint8_t>(codes[i]);
}

// Two codes a byte, `first_high` putting the first of each pair in the high nibble; an odd
// count's last byte is completed with `pad`.
void PackNibbles(const int32_t* codes, int m, bool first_high, int32_t pad, uint8_t* out) {
  for (int i = 0; i < m; i += 2) {
    const uint32_t a = static_cast<uint32_t>(codes[i]) & 0xf;
    const uint32_t b = static_cast<uint32_t>(i + 1 < m ? codes[i + 1] : pad) & 0xf;
    out[i / 2] = static_cast<uint8_t>(first_high ? (a << 4) | b : (b << 4) | a);
  }
}

uint8_t Nf4Code(float normalized) {
  // The number of decision points strictly below the value (bitsandbytes' tree: above a point
  // means the code past it), found by bisection.
  return static_cast<uint8_t>(std::lower_bound(kNf4Above, kNf4Above + 15, normalized) - kNf4Above);
}

float Nf4Value(uint8_t code) { return kNf4[code & 0xf]; }

absl::Status Quantize(const QuantLayout& layout, uint64_t first, const float* values,
                      uint64_t n, float tensor_scale, uint8_t* data, uint8_t* scales) {
  const uint64_t block = layout.block;
  if (first % block != 0 || first + n > layout.numel ||
      (first + n != layout.numel && n % block != 0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "quantize: chunk [%d, %d) of a %d-value tensor is not made of whole %d-value blocks",
        first, first + n, layout.numel, block));
  }
  for (uint64_t i = 0; i < n; ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "quantize: value %d is %f; a frozen weight must be finite", first + i, values[i]));
    }
  }
  for (uint64_t start = 0; start < n; start += block) {
    const uint64_t count = std::min<uint64_t>(block, n - start);
    const float* x = values + start;
    const uint64_t b = (first + start) / block;
    const uint64_t e0 = first + start;  // the block's first element in the tensor
    float absmax = 0.0f;
    for (uint64_t i = 0; i < count; ++i) absmax = std::max(absmax, std::fabs(x[i]));
    switch (layout.format) {
      case QuantFormat::kInt8: {
        const float scale = absmax / 127.0f;
        StoreScale(scales, b, scale);
        // Round to nearest even by adding and taking away 1.5 x 2^23 (exact for |q| < 2^22,
        // and |q| <= 127 here): nearbyint's result, in instructions that vectorize.
        constexpr float kRound = 12582912.0f;
        for (uint64_t i = 0; i < count; ++i) {
          const float q = scale > 0.0f ? (x[i] / scale + kRound) - kRound : 0.0f;
          data[e0 + i] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f)));
        }
        break;
      }
      case QuantFormat::kNf4: {
        StoreScale(scales, b, absmax);
        // As bitsandbytes does: a multiply by the reciprocal picks the codes, and an all-zero
        // block is all code 0. An odd tensor's last byte is padded with the code of a zero
        // value. Blocks and runs hold even counts of values, so each run starts on a byte.
        const float inverse = 1.0f / absmax;
        const int32_t pad = absmax > 0.0f ? Nf4Code(0.0f) : 0;
        int32_t codes[kRun];
        for (uint64_t i0 = 0; i0 < count; i0 += kRun) {
          const int m = static_cast<int>(std::min<uint64_t>(kRun, count - i0));
          if (absmax > 0.0f) {
            Nf4Codes(x + i0, m, inverse, codes);
          } else {
            std::fill(codes, codes + kRun, 0);
          }
          PackNibbles(codes, m, /*first_high=*/true, pad, data + (e0 + i0) / 2);
        }
        break;
      }
      case QuantFormat::kFp8: {
        const float scale = absmax / kE4m3Max;
        StoreScale(scales, b, scale);
        for (uint64_t i0 = 0; i0 < count; i0 += kRun) {
          const int m = static_cast<int>(std::min<uint64_t>(kRun, count - i0));
          if (scale > 0.0f) {
            E4m3Codes(x + i0, m, scale, data + e0 + i0);
          } else {
            std::fill(data + e0 + i0, data + e0 + i0 + m, uint8_t{0});
          }
        }
        break;
      }
      case QuantFormat::kNvfp4: {
        const uint8_t scale_bits = FloatToE4m3(absmax / kE2m1Max / tensor_scale);
        scales[b] = scale_bits;
        const float scale = E4m3Value(scale_bits) * tensor_scale;
        constexpr int kNvfp4Run = 16;  // its block: LayoutFor allows no other
        int32_t codes[kNvfp4Run];
        for (uint64_t i0 = 0; i0 < count; i0 += kNvfp4Run) {
          const int m = static_cast<int>(std::min<uint64_t>(kNvfp4Run, count - i0));
          if (scale > 0.0f) {
            E2m1Codes<kNvfp4Run>(x + i0, m, scale, codes);
          } else {
            std::fill(codes, codes + kNvfp4Run, 0);
          }
          PackNibbles(codes, m, /*first_high=*/false, /*pad=*/0, data + (e0 + i0) / 2);
        }
        break;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Dequantize(const QuantLayout& layout, uint64_t first, uint64_t n,
                        const uint8_t* data, const uint8_t* scales, float tensor_scale,
                        float* values) {
  if (first + n > layout.numel) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "dequantize: values [%d, %d) of a %d-value tensor", first, first + n, layout.numel));
  }
  const uint64_t block = layout.block;
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t e = first + i;
    const uint64_t b = e / block;
    switch (layout.format) {
      case QuantFormat::kInt8:
        values[i] = static_cast<float>(static_cast<int8_t>(data[e])) * LoadScale(scales, b);
        break;
      case QuantFormat::kNf4:
        values[i] = Nf4Value(GetNibble(data, e, true)) * LoadScale(scales, b);
        break;
      case QuantFormat::kFp8:
        values[i] = E4m3ToFloat(data[e]) * LoadScale(scales, b);
        break;
      case QuantFormat::kNvfp4:
        values[i] = E2m1ToFloat(GetNibble(data, e, false)) *
                    (E4m3ToFloat(scales[b]) * tensor_scale);
        break;
    }
  }
  return absl::OkStatus();
}

}  // namespace trainstream::kernels
