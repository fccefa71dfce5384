// SPDX-License-Identifier: Apache-2.0
#include "table_format.h"

#include "gtest/gtest.h"

namespace trainstream::tsctl {
namespace {

TEST(HumanBytesTest, PicksBinaryUnits) {
  EXPECT_EQ(HumanBytes(0), "0 B");
  EXPECT_EQ(HumanBytes(1023), "1023 B");
  EXPECT_EQ(HumanBytes(1024), "1 KiB");
  EXPECT_EQ(HumanBytes(1536), "1.5 KiB");
  EXPECT_EQ(HumanBytes(uint64_t{3} << 29), "1.5 GiB");
  EXPECT_EQ(HumanBytes(uint64_t{1} << 40), "1 TiB");
}

TEST(HumanBytesTest, CarriesWhenRoundingReachesTheNextUnit) {
  EXPECT_EQ(HumanBytes(1024 * 1024 - 1), "1 MiB");
}

TEST(HumanDurationTest, ScalesUnits) {
  EXPECT_EQ(HumanDuration(-1), "0.0s");
  EXPECT_EQ(HumanDuration(4.25), "4.2s");
  EXPECT_EQ(HumanDuration(75), "1m15s");
  EXPECT_EQ(HumanDuration(7300), "2h01m");
  EXPECT_EQ(HumanDuration(200000), "2d07h");
}

TEST(TableTest, AlignsColumnsWithoutTrailingSpaces) {
  Table table({{"NAME"}, {"BYTES", Align::kRight}, {"NOTE"}});
  table.AddRow({"a", "1 KiB", "x"});
  table.AddRow({"longer", "12 B"});
  EXPECT_EQ(table.Render(),
            "NAME    BYTES  NOTE\n"
            "a       1 KiB  x\n"
            "longer   12 B\n");
}

TEST(RenderFieldsTest, AlignsValues) {
  EXPECT_EQ(RenderFields({{"pid", "7"}, {"version", "0.1.0"}}),
            "pid:      7\n"
            "version:  0.1.0\n");
}

}  // namespace
}  // namespace trainstream::tsctl
