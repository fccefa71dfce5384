// SPDX-License-Identifier: Apache-2.0
// tsctl metrics: the daemon's state for Prometheus, printed, or written for node_exporter's
// textfile collector (atomically: a scrape never reads half a file), once or every interval.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "commands.h"
#include "metric_families.h"

namespace trainstream::tsctl {
namespace {

absl::Status WriteAtomically(const std::string& path, const std::string& text) {
  const std::string temporary = absl::StrCat(path, ".tmp");
  {
    std::ofstream file(temporary, std::ios::trunc);
    file << text;
    file.close();
    if (!file) return absl::UnavailableError(absl::StrCat("could not write ", temporary));
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("could not rename ", temporary, " to ", path));
  }
  return absl::OkStatus();
}

// No daemon answered, or it went away mid-call (a call under way at its shutdown ends
// CANCELLED): up 0, not an error of the scrape itself.
bool NoDaemon(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status) ||
         absl::IsCancelled(status);
}

}  // namespace

absl::Status RunMetrics(const Invocation& invocation) {
  if (invocation.json) {
    return UsageError("metrics: Prometheus' text format has no JSON form; leave out --json");
  }
  std::string textfile;
  double interval_s = 0;
  for (const std::string& arg : invocation.args) {
    if (absl::StartsWith(arg, "--textfile=")) {
      textfile = arg.substr(11);
    } else if (absl::StartsWith(arg, "--interval=")) {
      if (!absl::SimpleAtod(arg.substr(11), &interval_s) || !(interval_s >= 1)) {
        return UsageError(absl::StrCat("metrics: ", arg, ": the interval is seconds, >= 1"));
      }
    } else {
      return UsageError(absl::StrCat("metrics: unknown argument '", arg, "'"));
    }
  }
  if (textfile.empty() && interval_s > 0) {
    return UsageError("metrics: --interval writes a --textfile= again and again; name one");
  }
  if (!textfile.empty() && !absl::EndsWith(textfile, ".prom")) {
    return UsageError("metrics: node_exporter's textfile collector reads only *.prom files");
  }
  while (true) {
    metrics::Scrape scrape;
    client::ControlChannel& channel = *invocation.channel;
    const absl::Status scraped = metrics::ReadScrape(
        channel.stub(), [&](const auto& rpc) { return channel.Call(rpc); }, &scrape);
    if (!scraped.ok() && !NoDaemon(scraped)) return scraped;  // refused, not missing
    const std::string text =
        scraped.ok() ? metrics::RenderMetrics(scrape) : metrics::RenderDown(std::string(scraped.message()));
    if (textfile.empty()) {
      std::cout << text << std::flush;
    } else if (absl::Status written = WriteAtomically(textfile, text); !written.ok()) {
      return written;
    }
    // Once: a daemon that did not answer is exit code 3, after `trainstream_up 0` is out.
    if (interval_s <= 0) return scraped;
    absl::SleepFor(absl::Seconds(interval_s));
  }
}

}  // namespace trainstream::tsctl
