// SPDX-License-Identifier: Apache-2.0
#include "metric_families.h"

#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace trainstream::metrics {
namespace {

Scrape Example() {
  Scrape s;
  s.status.set_version("0.1.0");
  s.status.set_uptime_s(12.5);
  s.status.set_sessions(3);
  s.status.set_threads(16);
  v1::EventCount* closed = s.status.add_events();
  closed->set_kind("session.closed");
  closed->set_count(4);
  v1::JobTransfers* moved = s.status.add_transfers();
  moved->set_job_id("torchrun-a");
  moved->set_uid(1000);
  moved->set_h2d_bytes(3000000000);
  moved->set_d2h_bytes(7);
  s.memory.set_budget_bytes(1000);
  s.memory.set_reserved_bytes(600);
  s.memory.set_committed_bytes(700);
  v1::UsageRow* uid = s.memory.add_by_uid();
  uid->set_key("1000");
  uid->set_bytes(600);
  v1::UsageRow* tag = s.memory.add_by_tag();
  tag->set_key("kv \"cache\"\nnew");  // a tag the format must escape
  tag->set_bytes(64);
  v1::OptimizerInfo* o = s.optimizers.add_optimizers();
  o->set_job_id("torchrun-a");
  o->set_step(7);
  o->set_state("failed: rank 1 left");
  o->mutable_last_step()->set_step(7);
  o->mutable_last_step()->set_seconds(0.25);
  v1::OptimizerInfo* idle = s.optimizers.add_optimizers();
  idle->set_job_id("new");
  idle->set_state("ready");
  return s;
}

TEST(MetricFamiliesTest, EveryFamilyHasHelpAndTypeOnceAndSamplesParse) {
  const std::string text = RenderMetrics(Example());
  std::set<std::string> typed;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (absl::StartsWith(line, "# TYPE ")) {
      std::vector<std::string> parts = absl::StrSplit(line, ' ');
      ASSERT_EQ(parts.size(), 4u) << line;
      EXPECT_TRUE(typed.insert(parts[2]).second) << "typed twice: " << parts[2];
      EXPECT_TRUE(parts[3] == "gauge" || parts[3] == "counter") << line;
      if (parts[3] == "counter") {
        EXPECT_TRUE(absl::EndsWith(parts[2], "_total")) << line;
      }
      continue;
    }
    if (absl::StartsWith(line, "#")) continue;
    // name{labels} value: the name belongs to a typed family, and the value is last.
    const std::string name(line.substr(0, line.find_first_of("{ ")));
    EXPECT_TRUE(typed.contains(name)) << "sample before its TYPE: " << line;
    EXPECT_NE(line.rfind(' '), absl::string_view::npos) << line;
  }
  EXPECT_TRUE(absl::StartsWith(text, "# HELP trainstream_up "));
  EXPECT_TRUE(absl::StrContains(text, "\ntrainstream_up 1\n"));
}

TEST(MetricFamiliesTest, ValuesAndLabelsSayWhatTheDaemonSaid) {
  const std::string text = RenderMetrics(Example());
  EXPECT_TRUE(absl::StrContains(text, "\ntrainstream_sessions 3\n"));
  EXPECT_TRUE(absl::StrContains(text, "\ntrainstream_memory_committed_bytes 700\n"));
  EXPECT_TRUE(absl::StrContains(text, "\ntrainstream_memory_uid_bytes{uid=\"1000\"} 600\n"));
  EXPECT_TRUE(absl::StrContains(
      text, "\ntrainstream_memory_tag_bytes{tag=\"kv \\\"cache\\\"\\nnew\"} 64\n"))
      << text;
  EXPECT_TRUE(absl::StrContains(text, "trainstream_optimizer_steps_total{job=\"torchrun-a\"} 7"));
  EXPECT_TRUE(absl::StrContains(text, "trainstream_optimizer_failed{job=\"torchrun-a\"} 1"));
  EXPECT_TRUE(absl::StrContains(text, "trainstream_optimizer_failed{job=\"new\"} 0"));
  EXPECT_TRUE(absl::StrContains(text, "trainstream_optimizer_last_step_seconds{job=\"torchrun-a\"}"
                                      " 0.25"));
  // A job that never stepped has no last step to report.
  EXPECT_FALSE(absl::StrContains(text, "last_step_seconds{job=\"new\"}"));
  EXPECT_TRUE(absl::StrContains(text, "trainstream_info{version=\"0.1.0\"} 1"));
  EXPECT_TRUE(absl::StrContains(text, "\ntrainstream_events_total{kind=\"session.closed\"} 4\n"));
  EXPECT_TRUE(absl::StrContains(
      text, "\ntrainstream_job_h2d_bytes_total{job=\"torchrun-a\",uid=\"1000\"} 3000000000\n"));
  EXPECT_TRUE(absl::StrContains(
      text, "\ntrainstream_job_d2h_bytes_total{job=\"torchrun-a\",uid=\"1000\"} 7\n"));
}

TEST(MetricFamiliesTest, ADaemonThatDidNotAnswerIsUpZeroWithWhy) {
  const std::string text = RenderDown("connect: No such file\nor directory");
  EXPECT_TRUE(absl::StrContains(text, "# trainstreamd did not answer: connect: No such file or "
                                      "directory\n"));
  EXPECT_TRUE(absl::EndsWith(text, "\ntrainstream_up 0\n")) << text;
}

}  // namespace
}  // namespace trainstream::metrics
