// SPDX-License-Identifier: Apache-2.0
// Small safetensors checkpoints written by tests: whole, or with a header of the test's own.
#ifndef TRAINSTREAM_DAEMON_SAFETENSORS_TEST_CHECKPOINTS_H_
#define TRAINSTREAM_DAEMON_SAFETENSORS_TEST_CHECKPOINTS_H_

#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cpu/numeric.h"

namespace trainstream::daemon::test_checkpoints {

struct Entry {
  std::string name, dtype;
  std::vector<uint64_t> shape;
  std::vector<uint8_t> bytes;
};

// Writes `entries` as a safetensors file; `header_override` replaces the JSON header.
inline void WriteFile(const std::string& path, const std::vector<Entry>& entries,
               const std::string& header_override = "", uint64_t cut_bytes = 0) {
  std::vector<std::string> parts = {R"("__metadata__":{"format":"pt"})"};
  uint64_t offset = 0;
  for (const Entry& e : entries) {
    parts.push_back(absl::StrCat("\"", e.name, "\":{\"dtype\":\"", e.dtype, "\",\"shape\":[",
                                 absl::StrJoin(e.shape, ","), "],\"data_offsets\":[", offset,
                                 ",", offset + e.bytes.size(), "]}"));
    offset += e.bytes.size();
  }
  std::string header = header_override.empty() ? "{" + absl::StrJoin(parts, ",") + "}"
                                               : header_override;
  std::string blob;
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) blob.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  blob += header;
  for (const Entry& e : entries) blob.append(e.bytes.begin(), e.bytes.end());
  blob.resize(blob.size() - cut_bytes);
  std::ofstream(path, std::ios::binary) << blob;
}

template <typename T>
std::vector<uint8_t> Bytes(const std::vector<T>& v) {
  std::vector<uint8_t> out(v.size() * sizeof(T));
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

inline std::vector<float> Normal(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  std::vector<float> x(n);
  for (float& v : x) v = dist(rng);
  return x;
}

// `values` in `dtype`, and the floats they read back as.
inline Entry FloatEntry(const std::string& name, const std::string& dtype, const std::vector<float>& x,
                 std::vector<float>* exact) {
  Entry e{name, dtype, {x.size()}, {}};
  exact->clear();
  if (dtype == "F32") {
    e.bytes = Bytes(x);
    *exact = x;
  } else if (dtype == "F64") {
    std::vector<double> d(x.begin(), x.end());
    e.bytes = Bytes(d);
    *exact = x;
  } else {
    std::vector<uint16_t> h;
    for (float v : x) {
      h.push_back(dtype == "BF16" ? kernels::FloatToBFloat16(v) : kernels::FloatToHalf(v));
      exact->push_back(dtype == "BF16" ? kernels::BFloat16ToFloat(h.back())
                                       : kernels::HalfToFloat(h.back()));
    }
    e.bytes = Bytes(h);
  }
  return e;
}

}  // namespace trainstream::daemon::test_checkpoints

#endif  // TRAINSTREAM_DAEMON_SAFETENSORS_TEST_CHECKPOINTS_H_
