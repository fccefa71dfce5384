// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: the checks every request field passes, each against what it promises
// (request_validation.h). A check that accepts what its contract excludes traps.
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "rpc/request_validation.h"

namespace {

using namespace trainstream::daemon;  // NOLINT: the checks under test

bool NameCharacters(const std::string& s) {
  for (unsigned char c : s) {
    const bool alnum = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
    if (!(alnum || c == '_' || c == '.' || c == ':' || c == '/' || c == '-')) {
      return false;
    }
  }
  return true;
}

bool EventCharacters(const std::string& s) {
  for (unsigned char c : s) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '.')) return false;
  }
  return true;
}

void Check(bool promise) {
  if (!promise) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const std::string text = in.ConsumeRandomLengthString(2048);
  const uint64_t a = in.ConsumeIntegral<uint64_t>();
  const uint64_t b = in.ConsumeIntegral<uint64_t>();
  const uint64_t c = in.ConsumeIntegral<uint64_t>();
  const double x = in.ConsumeFloatingPoint<double>();

  if (ValidateBufferName(text).ok()) {
    Check(!text.empty() && text.size() <= kMaxNameLength && NameCharacters(text));
  }
  if (ValidateJobId(text).ok()) Check(text.size() <= kMaxNameLength && NameCharacters(text));
  if (ValidateTag(text).ok()) Check(text.size() <= 64 && NameCharacters(text));
  if (ValidateSessionId(text).ok()) {
    Check(text.size() == 18 && text.compare(0, 2, "s-") == 0 &&
          text.find_first_not_of("0123456789abcdefABCDEF", 2) == std::string::npos);
  }
  if (ValidateEventKind(text).ok()) {
    Check(!text.empty() && text.size() <= 64 && EventCharacters(text));
  }
  if (ValidateEventMessage(text).ok()) Check(text.size() <= kMaxEventMessageBytes);
  if (ValidateEventNumber(text, x).ok()) Check(std::isfinite(x) && EventCharacters(text));
  if (ValidateBufferSize(a).ok()) Check(a > 0 && a <= kMaxBufferBytes);
  // 0 asks for the default (4096).
  if (ValidateAlignment(a).ok()) Check(a == 0 || (a <= kMaxAlignment && (a & (a - 1)) == 0));
  const uint32_t rank = static_cast<uint32_t>(a), world = static_cast<uint32_t>(b);
  if (ValidateRank(rank, world).ok()) {  // a world_size of 0 is a world of one
    Check(world <= kMaxWorldSize && rank < (world == 0 ? 1 : world));
  }
  if (ValidateBufferId(a).ok()) Check(a != 0);
  if (ValidateRange(a, b, c).ok()) Check(a <= c && b <= c - a);
  return 0;
}
