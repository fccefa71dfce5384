// SPDX-License-Identifier: Apache-2.0
// The daemon's state as Prometheus metric families: what one scrape read over the control plane,
// the families made of it, and their text exposition format (version 0.0.4). `tsctl metrics`
// prints the text; trainstreamd's --metrics_listen endpoint hands the families to prometheus-cpp.
#ifndef TRAINSTREAM_METRICS_METRIC_FAMILIES_H_
#define TRAINSTREAM_METRICS_METRIC_FAMILIES_H_

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "trainstream/v1/trainstream.grpc.pb.h"

namespace trainstream::metrics {

// What one scrape read from the daemon (as the caller may see it).
struct Scrape {
  v1::Status status;
  v1::MemoryReport memory;
  v1::ListOptimizersReply optimizers;
  v1::ListBasesReply bases;
  v1::ListGpuPoolsReply pools;
};

// Runs one unary call of `stub` with a fresh context; how deadlines and errors are put is the
// caller's (tsctl's channel explains a daemon that is not there).
using UnaryCall = std::function<absl::Status(
    const std::function<grpc::Status(grpc::ClientContext*)>&)>;

// Each read in turn; the first that fails ends the scrape with its status.
absl::Status ReadScrape(v1::TrainStream::StubInterface& stub, const UnaryCall& call,
                        Scrape* scrape);

struct MetricSample {
  std::vector<std::pair<std::string, std::string>> labels;
  double value = 0;
};

struct MetricFamily {
  std::string name;
  std::string type;  // "gauge" or "counter" (whose name ends in _total)
  std::string help;
  std::vector<MetricSample> samples;
};

// Every family of a daemon that answered, `trainstream_up 1` first.
std::vector<MetricFamily> FamiliesOf(const Scrape& scrape);
// A daemon that did not answer: `trainstream_up 0` alone.
std::vector<MetricFamily> DownFamilies();

// The text format: HELP and TYPE once a family, then its samples, label values escaped.
std::string RenderText(const std::vector<MetricFamily>& families);
// A daemon that answered, as text.
std::string RenderMetrics(const Scrape& scrape);
// A daemon that did not answer: why as a comment, then `trainstream_up 0`.
std::string RenderDown(const std::string& why);

}  // namespace trainstream::metrics

#endif  // TRAINSTREAM_METRICS_METRIC_FAMILIES_H_
