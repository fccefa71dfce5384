// SPDX-License-Identifier: Apache-2.0
#include "events/event_log.h"

#include <map>
#include <optional>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace trainstream::daemon {
namespace {

auto All = [](const Event&) { return true; };

TEST(EventLogTest, KeepsTheNewestWithinCapacity) {
  EventLog log(3);
  for (int i = 0; i < 5; ++i) log.Emit("test.kind", "event " + std::to_string(i), {{"i", i}});
  std::vector<Event> events = log.Since(0, All);
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events.front().seq, 3u);
  EXPECT_EQ(events.back().message, "event 4");
  EXPECT_EQ(events.back().numbers.at(0).second, 4);
  EXPECT_EQ(log.Since(4, All).size(), 1u);
}

TEST(EventLogTest, FilterHidesOtherUsersEvents) {
  EventLog log(10);
  log.Emit("session.open", "mine", {}, "s1", 1000);
  log.Emit("session.open", "theirs", {}, "s2", 1001);
  log.Emit("gpu.none", "machine-wide");
  auto visible = [](const Event& e) { return !e.uid.has_value() || *e.uid == 1000; };
  std::vector<Event> events = log.Since(0, visible);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].message, "mine");
  EXPECT_EQ(events[1].message, "machine-wide");
}

TEST(EventLogTest, CountsEveryEventByKindPastTheRingAndAsTheViewerMaySee) {
  EventLog log(2);
  for (int i = 0; i < 5; ++i) log.Emit("session.closed", "x", {}, "s", uid_t{1000});
  log.Emit("session.closed", "x", {}, "t", uid_t{1001});
  log.Emit("gpu.none", "machine-wide");
  log.Emit("client.step_time", "a client's own kind", {}, "s", uid_t{1000});
  log.Emit("client.loss", "another", {}, "s", uid_t{1000});
  const auto everyone = log.CountsByKind([](std::optional<uid_t>) { return true; });
  EXPECT_EQ(everyone, (std::map<std::string, uint64_t>{
                          {"session.closed", 6}, {"gpu.none", 1}, {"client.*", 2}}));
  const auto user_1001 = log.CountsByKind(
      [](std::optional<uid_t> owner) { return !owner || *owner == 1001; });
  EXPECT_EQ(user_1001, (std::map<std::string, uint64_t>{{"session.closed", 1}, {"gpu.none", 1}}));
}

TEST(EventLogTest, WaiterWakesOnNewEvent) {
  EventLog log(10);
  EXPECT_FALSE(log.WaitForNewer(0, absl::Milliseconds(10)));
  std::thread writer([&] {
    absl::SleepFor(absl::Milliseconds(20));
    log.Emit("test.kind", "late");
  });
  EXPECT_TRUE(log.WaitForNewer(0, absl::Seconds(5)));
  writer.join();
}

TEST(EventLogTest, FailuresLogAsErrorsAndRefusalsAsWarnings) {
  EXPECT_EQ(LogLevelOfEvent("optimizer.failed"), LogLevel::kError);
  EXPECT_EQ(LogLevelOfEvent("base.failed"), LogLevel::kError);
  EXPECT_EQ(LogLevelOfEvent("optimizer.notify_failed"), LogLevel::kError);
  EXPECT_EQ(LogLevelOfEvent("doorbell.protocol_error"), LogLevel::kError);
  EXPECT_EQ(LogLevelOfEvent("daemon.descriptors_exhausted"), LogLevel::kError);
  EXPECT_EQ(LogLevelOfEvent("session.refused"), LogLevel::kWarning);
  EXPECT_EQ(LogLevelOfEvent("optimizer.step_skipped"), LogLevel::kWarning);
  EXPECT_EQ(LogLevelOfEvent("pool.fallback"), LogLevel::kWarning);
  EXPECT_EQ(LogLevelOfEvent("session.open"), LogLevel::kInfo);
  EXPECT_EQ(LogLevelOfEvent("daemon.start"), LogLevel::kInfo);
}

TEST(LoggerTest, JournalLinesCarryTheSyslogPriority) {
  EXPECT_EQ(FormatLogLine(LogLevel::kError, "job 'a' failed", true),
            "<3>trainstreamd error: job 'a' failed\n");
  EXPECT_EQ(FormatLogLine(LogLevel::kWarning, "x", true), "<4>trainstreamd warning: x\n");
  EXPECT_EQ(FormatLogLine(LogLevel::kInfo, "x", true), "<6>trainstreamd info: x\n");
  EXPECT_EQ(FormatLogLine(LogLevel::kDebug, "x", true), "<7>trainstreamd debug: x\n");
  EXPECT_EQ(FormatLogLine(LogLevel::kInfo, "x", false), "trainstreamd info: x\n");
}

}  // namespace
}  // namespace trainstream::daemon
