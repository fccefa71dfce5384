// SPDX-License-Identifier: Apache-2.0
#include "rpc/request_validation.h"

#include "gtest/gtest.h"

namespace trainstream::daemon {
namespace {

void ExpectInvalid(const absl::Status& status, const std::string& mention) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find(mention), std::string::npos) << status;
}

TEST(RequestValidationTest, SessionIds) {
  EXPECT_TRUE(ValidateSessionId("s-0123456789abcdef").ok());
  ExpectInvalid(ValidateSessionId(""), "empty");
  ExpectInvalid(ValidateSessionId("s-xyz"), "malformed");
  ExpectInvalid(ValidateSessionId("s-0123456789abcdeg"), "malformed");
}

TEST(RequestValidationTest, Names) {
  EXPECT_TRUE(ValidateBufferName("layer.0/weight:grad-1_a").ok());
  ExpectInvalid(ValidateBufferName(""), "empty");
  ExpectInvalid(ValidateBufferName(std::string(129, 'a')), "129");
  ExpectInvalid(ValidateBufferName("bad name"), "letters");
  ExpectInvalid(ValidateBufferName(std::string("nul\0byte", 8)), "letters");
  EXPECT_TRUE(ValidateJobId("").ok());
  ExpectInvalid(ValidateJobId("my job"), "job_id");
  EXPECT_TRUE(ValidateTag("").ok());
  ExpectInvalid(ValidateTag(std::string(65, 't')), "tag");
}

TEST(RequestValidationTest, SizesAlignmentsRanks) {
  ExpectInvalid(ValidateBufferSize(0), "at least one byte");
  ExpectInvalid(ValidateBufferSize(uint64_t{1} << 60), "16 TiB");
  EXPECT_TRUE(ValidateBufferSize(1).ok());
  EXPECT_TRUE(ValidateAlignment(0).ok());
  EXPECT_TRUE(ValidateAlignment(64).ok());
  ExpectInvalid(ValidateAlignment(48), "power of two");
  ExpectInvalid(ValidateAlignment(uint64_t{1} << 30), "power of two");
  EXPECT_TRUE(ValidateRank(3, 4).ok());
  ExpectInvalid(ValidateRank(4, 4), "rank 4");
  ExpectInvalid(ValidateRank(0, 100000), "world_size");
  ExpectInvalid(ValidateBufferId(0), "buffer_id");
}

TEST(RequestValidationTest, RangesCannotOverflow) {
  EXPECT_TRUE(ValidateRange(0, 100, 100).ok());
  EXPECT_TRUE(ValidateRange(100, 0, 100).ok());
  ExpectInvalid(ValidateRange(50, 51, 100), "past the end");
  ExpectInvalid(ValidateRange(101, 0, 100), "past the end");
  ExpectInvalid(ValidateRange(~uint64_t{0} - 10, 20, 100), "past the end");
}

}  // namespace
}  // namespace trainstream::daemon
