// SPDX-License-Identifier: Apache-2.0
// The daemon's state in Prometheus' text exposition format (version 0.0.4): what `tsctl metrics`
// prints and writes for node_exporter's textfile collector.
#ifndef TRAINSTREAM_TSCTL_METRICS_FORMAT_H_
#define TRAINSTREAM_TSCTL_METRICS_FORMAT_H_

#include <string>

#include "trainstream/v1/trainstream.pb.h"

namespace trainstream::tsctl {

// What one scrape read from the daemon (as the caller may see it).
struct Scrape {
  v1::Status status;
  v1::MemoryReport memory;
  v1::ListOptimizersReply optimizers;
  v1::ListBasesReply bases;
  v1::ListGpuPoolsReply pools;
};

// Every metric of a daemon that answered, `trainstream_up 1` first.
std::string RenderMetrics(const Scrape& scrape);
// A daemon that did not answer: `trainstream_up 0`, and why as a comment.
std::string RenderDown(const std::string& why);

}  // namespace trainstream::tsctl

#endif  // TRAINSTREAM_TSCTL_METRICS_FORMAT_H_
