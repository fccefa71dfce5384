// SPDX-License-Identifier: Apache-2.0
#include "cpu/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/numeric.h"
#include "gtest/gtest.h"

namespace trainstream::kernels {
namespace {

struct Quantized {
  QuantLayout layout;
  float tensor_scale = 1.0f;
  std::vector<uint8_t> data, scales;
};

Quantized QuantizeAll(QuantFormat format, const std::vector<float>& x, int block = 0,
                      uint64_t chunk = 0) {
  Quantized q;
  q.layout = LayoutFor(format, x.size(), block).value();
  q.data.assign(q.layout.data_bytes, 0);
  q.scales.assign(q.layout.scale_bytes, 0);
  if (format == QuantFormat::kNvfp4) {
    float amax = 0;
    for (float v : x) amax = std::max(amax, std::fabs(v));
    q.tensor_scale = NvFp4TensorScale(amax);
  }
  if (chunk == 0) chunk = x.size();
  for (uint64_t first = 0; first < x.size(); first += chunk) {
    const uint64_t n = std::min<uint64_t>(chunk, x.size() - first);
    EXPECT_TRUE(Quantize(q.layout, first, x.data() + first, n, q.tensor_scale, q.data.data(),
                         q.scales.data())
                    .ok());
  }
  return q;
}

std::vector<float> DequantizeAll(const Quantized& q) {
  std::vector<float> out(q.layout.numel);
  EXPECT_TRUE(Dequantize(q.layout, 0, out.size(), q.data.data(), q.scales.data(),
                         q.tensor_scale, out.data())
                  .ok());
  return out;
}

std::vector<float> Normal(size_t n, uint32_t seed, float stddev = 0.02f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> x(n);
  for (float& v : x) v = dist(rng);
  return x;
}

TEST(E4m3, EveryCodeRoundTripsAndTiesGoToEven) {
  for (int c = 0; c < 256; ++c) {
    const float f = E4m3ToFloat(static_cast<uint8_t>(c));
    if (std::isnan(f)) {
      EXPECT_EQ(c & 0x7f, 0x7f);
      continue;
    }
    EXPECT_EQ(FloatToE4m3(f), c) << "code " << c << " = " << f;
  }
  EXPECT_EQ(E4m3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(E4m3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(FloatToE4m3(1.0625f), FloatToE4m3(1.0f));     // tie: mantissa 0 is even
  EXPECT_EQ(FloatToE4m3(1.1875f), FloatToE4m3(1.25f));    // tie: 1.125 (odd) or 1.25 (even)
  EXPECT_EQ(FloatToE4m3(1.0626f), FloatToE4m3(1.125f));
  EXPECT_EQ(FloatToE4m3(std::ldexp(1.0f, -10)), 0);       // half the smallest subnormal
  EXPECT_EQ(FloatToE4m3(3 * std::ldexp(1.0f, -10)), 2);   // 1.5 steps: to 2 (even)
  EXPECT_EQ(FloatToE4m3(1e6f), 0x7e);                     // saturates
  EXPECT_EQ(FloatToE4m3(-1e6f), 0xfe);
  EXPECT_EQ(FloatToE4m3(464.0f), 0x7e);
  EXPECT_EQ(FloatToE4m3(std::nanf("")), 0x7f);
}

TEST(E2m1, EveryCodeRoundTripsAndTiesGoToEven) {
  for (int c = 0; c < 16; ++c) {
    if (c == 8) continue;  // -0 reads back as 0 and is written with its sign
    EXPECT_EQ(FloatToE2m1(E2m1ToFloat(static_cast<uint8_t>(c))), c);
  }
  const struct { float in, out; } ties[] = {{0.25f, 0.0f}, {0.75f, 1.0f}, {1.25f, 1.0f},
                                            {1.75f, 2.0f}, {2.5f, 2.0f},  {3.5f, 4.0f},
                                            {5.0f, 4.0f},  {100.0f, 6.0f}, {-2.6f, -3.0f}};
  for (const auto& t : ties) EXPECT_EQ(E2m1ToFloat(FloatToE2m1(t.in)), t.out) << t.in;
}

TEST(Nf4, CodesFollowTheTableAndItsMidpoints) {
  for (uint8_t c = 0; c < 16; ++c) EXPECT_EQ(Nf4Code(Nf4Value(c)), c);
  for (uint8_t c = 0; c < 15; ++c) {
    const float mid = (Nf4Value(c) + Nf4Value(c + 1)) / 2;
    // The decision points are the midpoints (to float rounding); a value at one stays below.
    EXPECT_EQ(Nf4Code(std::nextafter(mid, -2.0f) - 1e-6f), c);
    EXPECT_EQ(Nf4Code(mid + 1e-6f), c + 1);
  }
}

TEST(Nf4, PacksTwoCodesPerByteFirstInTheHighNibble) {
  // absmax 1: the values are their own normalized values.
  const std::vector<float> x = {-1.0f, 1.0f, 0.0f, 0.5626170039176941f};
  const Quantized q = QuantizeAll(QuantFormat::kNf4, x, 4);
  ASSERT_EQ(q.data.size(), 2u);
  EXPECT_EQ(q.data[0], 0x0f);  // codes 0 then 15
  EXPECT_EQ(q.data[1], 0x7d);  // codes 7 then 13
  float absmax;
  std::memcpy(&absmax, q.scales.data(), 4);
  EXPECT_EQ(absmax, 1.0f);
}

TEST(Nf4, ZeroBlocksAndOddTailsAreWrittenAsBitsandbytesWritesThem) {
  // An all-zero block: code 0 everywhere, absmax 0 (reads back as -0.0, equal to 0).
  const Quantized zeros = QuantizeAll(QuantFormat::kNf4, std::vector<float>(4, 0.0f), 4);
  EXPECT_EQ(zeros.data, (std::vector<uint8_t>{0x00, 0x00}));
  // Three values: the fourth nibble is the code of a zero value (7).
  const Quantized odd = QuantizeAll(QuantFormat::kNf4, {1.0f, -1.0f, 1.0f}, 4);
  EXPECT_EQ(odd.data, (std::vector<uint8_t>{0xf0, 0xf7}));
}

// Vectors bitsandbytes itself wrote (testdata/make_nf4_vectors.py): the same inputs must give
// the same packed bytes and absmax, bit for bit.
TEST(Nf4, MatchesBitsandbytesOnItsOwnVectors) {
  std::ifstream in(TRAINSTREAM_KERNELS_TESTDATA "/nf4_bitsandbytes.txt");
  ASSERT_TRUE(in) << "missing " << TRAINSTREAM_KERNELS_TESTDATA << "/nf4_bitsandbytes.txt";
  auto words = [](const std::string& line) {
    std::vector<std::string> out;
    std::istringstream ss(line);
    for (std::string w; ss >> w;) out.push_back(w);
    return out;
  };
  auto float_of = [](const std::string& hex) {
    return BitsToFloat(static_cast<uint32_t>(std::stoul(hex, nullptr, 16)));
  };
  int cases = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("case ", 0) != 0) continue;
    int block = 0;
    size_t n = 0;
    ASSERT_EQ(std::sscanf(line.c_str(), "case %d %zu", &block, &n), 2);
    std::string values_line, packed_line, absmax_line;
    std::getline(in, values_line);
    std::getline(in, packed_line);
    std::getline(in, absmax_line);
    std::vector<float> x;
    for (const std::string& w : words(values_line)) x.push_back(float_of(w));
    ASSERT_EQ(x.size(), n);
    std::vector<uint8_t> packed;
    for (size_t i = 0; i + 1 < packed_line.size(); i += 2) {
      packed.push_back(static_cast<uint8_t>(std::stoul(packed_line.substr(i, 2), nullptr, 16)));
    }
    std::vector<float> absmax;
    for (const std::string& w : words(absmax_line)) absmax.push_back(float_of(w));
    const Quantized q = QuantizeAll(QuantFormat::kNf4, x, block);
    EXPECT_EQ(q.data, packed) << "block " << block << ", " << n << " values";
    ASSERT_EQ(q.scales.size(), absmax.size() * 4);
    for (size_t b = 0; b < absmax.size(); ++b) {
      float ours;
      std::memcpy(&ours, q.scales.data() + 4 * b, 4);
      EXPECT_EQ(FloatToBits(ours), FloatToBits(absmax[b])) << "block " << b;
    }
    ++cases;
  }
  EXPECT_EQ(cases, 4);
}

TEST(Nvfp4, PacksTwoValuesPerByteFirstInTheLowNibble) {
  std::vector<float> x(16, 0.0f);
  x[0] = 6.0f;   // the block's largest: code 7
  x[1] = -1.0f;  // code 0xa
  const Quantized q = QuantizeAll(QuantFormat::kNvfp4, x);
  EXPECT_EQ(q.data[0], 0xa7);
  const std::vector<float> back = DequantizeAll(q);
  EXPECT_FLOAT_EQ(back[0], 6.0f);
  EXPECT_FLOAT_EQ(back[1], -1.0f);
}

// Quantize codes many values at a time; every code must be the scalar definition's
// (FloatToE2m1, Nf4Code, round-to-nearest-even for int8), ties and odd tails included, for
// blocks longer than a run and blocks that are not a multiple of one.
TEST(Quantize, CodesEqualTheScalarDefinitionsValueForValue) {
  for (int block : {0, 6, 200}) {
    for (QuantFormat format : {QuantFormat::kInt8, QuantFormat::kNf4, QuantFormat::kFp8,
                               QuantFormat::kNvfp4}) {
      if (format == QuantFormat::kNvfp4 && block != 0) continue;
      std::vector<float> x = Normal(4001, 11);  // odd: a half-filled last byte
      for (int i = 0; i < 64; ++i) x[i] = 0.25f * static_cast<float>(i - 32);  // ties
      for (int i = 64; i < 128; ++i) x[i] = static_cast<float>(i - 96) + 0.5f;
      // Tiny values: fp8's subnormal codes, and zeros of both signs.
      for (int i = 128; i < 192; ++i) x[i] = std::ldexp(static_cast<float>(i - 160), -14);
      x[192] = -0.0f;
      const Quantized q = QuantizeAll(format, x, block);
      const int used = q.layout.block;
      for (uint64_t e = 0; e < x.size(); ++e) {
        const uint64_t b = e / used;
        uint32_t got, want;
        if (format == QuantFormat::kInt8) {
          float scale;
          std::memcpy(&scale, q.scales.data() + 4 * b, 4);
          got = q.data[e];
          want = static_cast<uint8_t>(static_cast<int8_t>(
              scale > 0 ? std::clamp(std::nearbyint(x[e] / scale), -127.0f, 127.0f) : 0.0f));
        } else if (format == QuantFormat::kNf4) {
          float absmax;
          std::memcpy(&absmax, q.scales.data() + 4 * b, 4);
          got = e % 2 == 0 ? q.data[e / 2] >> 4 : q.data[e / 2] & 0xf;
          want = absmax > 0 ? Nf4Code(x[e] * (1.0f / absmax)) : 0;
        } else if (format == QuantFormat::kFp8) {
          float scale;
          std::memcpy(&scale, q.scales.data() + 4 * b, 4);
          got = q.data[e];
          want = scale > 0 ? FloatToE4m3(x[e] / scale) : 0;
        } else {
          const float scale = E4m3ToFloat(q.scales[b]) * q.tensor_scale;
          got = e % 2 == 0 ? q.data[e / 2] & 0xf : q.data[e / 2] >> 4;
          want = scale > 0 ? FloatToE2m1(x[e] / scale) : 0;
        }
        ASSERT_EQ(got, want) << QuantFormatName(format) << " block " << used << " value " << e
                             << " = " << x[e];
      }
    }
  }
  // NVFP4 ties exactly: a largest value of 5.25 makes the tensor scale 2^-9 and the block's
  // 0.875, so each value below is a tie of the e2m1 grid times 0.875, held exactly.
  const std::vector<float> ties = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  std::vector<float> x = {5.25f};
  for (float t : ties) {
    x.push_back(t * 0.875f);
    x.push_back(-t * 0.875f);
  }
  x.push_back(0.0f);
  const Quantized q = QuantizeAll(QuantFormat::kNvfp4, x);
  ASSERT_EQ(q.tensor_scale, 1.0f / 512);
  ASSERT_EQ(E4m3ToFloat(q.scales[0]) * q.tensor_scale, 0.875f);
  for (size_t e = 0; e < x.size(); ++e) {
    const uint32_t got = e % 2 == 0 ? q.data[e / 2] & 0xf : q.data[e / 2] >> 4;
    EXPECT_EQ(got, FloatToE2m1(x[e] / 0.875f)) << x[e];
  }
}

TEST(Layout, BytesPerValueAndBlockChecks) {
  EXPECT_EQ(LayoutFor(QuantFormat::kInt8, 6400).value().total_bytes(), 6400u + 100 * 4);
  EXPECT_EQ(LayoutFor(QuantFormat::kNf4, 6400).value().total_bytes(), 3200u + 100 * 4);
  EXPECT_EQ(LayoutFor(QuantFormat::kFp8, 6400).value().total_bytes(), 6400u + 200 * 4);
  EXPECT_EQ(LayoutFor(QuantFormat::kNvfp4, 6400).value().total_bytes(), 3200u + 400);
  EXPECT_EQ(LayoutFor(QuantFormat::kNf4, 7).value().data_bytes, 4u);  // a half byte left over
  EXPECT_FALSE(LayoutFor(QuantFormat::kInt8, 10, 3).ok());
  EXPECT_FALSE(LayoutFor(QuantFormat::kNvfp4, 10, 32).ok());
  EXPECT_FALSE(ParseQuantFormat("fp4").ok());
  EXPECT_EQ(ParseQuantFormat("nf4").value(), QuantFormat::kNf4);
}

// The error each format allows for one value, from its grid and its block's scale.
float Allowed(const Quantized& q, const std::vector<float>& x, uint64_t i) {
  const uint64_t b = i / q.layout.block;
  float absmax = 0;
  for (uint64_t j = b * q.layout.block; j < std::min<uint64_t>(x.size(), (b + 1) * q.layout.block);
       ++j) {
    absmax = std::max(absmax, std::fabs(x[j]));
  }
  const float a = std::fabs(x[i]);
  const float slack = 1e-6f * absmax;
  switch (q.layout.format) {
    case QuantFormat::kInt8:
      return absmax / 127.0f / 2 + slack;  // half a step
    case QuantFormat::kNf4:
      return absmax * (1.0f - 0.6961928009986877f) / 2 + slack;  // half the widest gap (-1 to -0.70)
    case QuantFormat::kFp8:
      // Half an ulp of a 3-bit mantissa, or half the smallest subnormal step.
      return std::max(a / 16, absmax / 448 * std::ldexp(1.0f, -10)) + slack;
    case QuantFormat::kNvfp4: {
      const float scale = E4m3ToFloat(q.scales[b]) * q.tensor_scale;
      // A quarter of the value (the widest relative gap, 4 to 6), a quarter step near zero,
      // and what the block scale's own rounding clips off the top.
      return std::max(a / 4, scale / 4) + std::max(0.0f, a - 6 * scale) + slack;
    }
  }
  return 0;
}

class RoundTrip : public ::testing::TestWithParam<std::tuple<QuantFormat, int>> {};

TEST_P(RoundTrip, EveryValueWithinItsFormatsBound) {
  const auto [format, block] = GetParam();
  for (size_t n : {size_t{1}, size_t{63}, size_t{4097}}) {
    std::vector<float> x = Normal(n, static_cast<uint32_t>(n) * 7 + block);
    if (n > 100) x[n / 2] = 0.5f;  // an outlier, as LLM weights have
    const Quantized q = QuantizeAll(format, x, block);
    const std::vector<float> back = DequantizeAll(q);
    double error = 0, norm = 0;
    for (size_t i = 0; i < n; ++i) {
      ASSERT_LE(std::fabs(back[i] - x[i]), Allowed(q, x, i))
          << QuantFormatName(format) << " value " << i << " of " << n << ": " << x[i]
          << " came back " << back[i];
      error += std::fabs(back[i] - x[i]);
      norm += std::fabs(x[i]);
    }
    if (n > 100) {
      // Mean relative error, against what each format is known to cost on normal weights.
      const double limit = format == QuantFormat::kInt8   ? 0.02
                           : format == QuantFormat::kFp8  ? 0.04
                                                          : 0.15;
      EXPECT_LT(error / norm, limit) << QuantFormatName(format);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, RoundTrip,
    ::testing::Values(std::make_tuple(QuantFormat::kInt8, 64),
                      std::make_tuple(QuantFormat::kInt8, 128),
                      std::make_tuple(QuantFormat::kNf4, 64), std::make_tuple(QuantFormat::kNf4, 32),
                      std::make_tuple(QuantFormat::kFp8, 32), std::make_tuple(QuantFormat::kFp8, 128),
                      std::make_tuple(QuantFormat::kNvfp4, 16)));

TEST(Quantize, ChunksGiveTheSameBytesAsTheWholeTensor) {
  const std::vector<float> x = Normal(1000, 3);
  for (QuantFormat f : {QuantFormat::kInt8, QuantFormat::kNf4, QuantFormat::kFp8,
                        QuantFormat::kNvfp4}) {
    const Quantized whole = QuantizeAll(f, x);
    const Quantized chunked = QuantizeAll(f, x, 0, 4 * DefaultBlockSize(f));
    EXPECT_EQ(whole.data, chunked.data) << QuantFormatName(f);
    EXPECT_EQ(whole.scales, chunked.scales) << QuantFormatName(f);
  }
}

TEST(Quantize, RefusesNonFiniteValuesAndPartialBlocks) {
  std::vector<float> x(64, 1.0f);
  x[5] = std::numeric_limits<float>::infinity();
  const QuantLayout layout = LayoutFor(QuantFormat::kInt8, 64).value();
  std::vector<uint8_t> data(64), scales(4);
  const absl::Status inf = Quantize(layout, 0, x.data(), 64, 1, data.data(), scales.data());
  EXPECT_EQ(inf.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(inf.message().find("value 5"), std::string::npos) << inf;
  x[5] = 1.0f;
  EXPECT_FALSE(Quantize(layout, 0, x.data(), 30, 1, data.data(), scales.data()).ok());
  EXPECT_FALSE(Quantize(layout, 32, x.data(), 32, 1, data.data(), scales.data()).ok());
}

TEST(Quantize, AnAllZeroBlockStaysZero) {
  for (QuantFormat f : {QuantFormat::kInt8, QuantFormat::kNf4, QuantFormat::kFp8,
                        QuantFormat::kNvfp4}) {
    const std::vector<float> back = DequantizeAll(QuantizeAll(f, std::vector<float>(64, 0.0f)));
    for (float v : back) EXPECT_EQ(v, 0.0f) << QuantFormatName(f);
  }
}

}  // namespace
}  // namespace trainstream::kernels
