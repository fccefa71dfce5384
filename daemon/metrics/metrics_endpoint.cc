// SPDX-License-Identifier: Apache-2.0
#include "metrics/metrics_endpoint.h"

#include <chrono>
#include <exception>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "metric_families.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"
#include "prometheus/metric_family.h"
#include "status_conversion.h"
#include "trainstream/v1/trainstream.grpc.pb.h"

namespace trainstream::daemon {
namespace {

// A scrape that takes longer than this says the daemon is down rather than hang the scraper
// (Prometheus' own default timeout is 10 s).
constexpr auto kScrapeDeadline = std::chrono::seconds(5);

prometheus::MetricFamily ToPrometheus(const metrics::MetricFamily& family) {
  prometheus::MetricFamily out;
  out.name = family.name;
  out.help = family.help;
  const bool counter = family.type == "counter";
  out.type = counter ? prometheus::MetricType::Counter : prometheus::MetricType::Gauge;
  for (const metrics::MetricSample& sample : family.samples) {
    prometheus::ClientMetric metric;
    for (const auto& [name, value] : sample.labels) metric.label.push_back({name, value});
    if (counter) {
      metric.counter.value = sample.value;
    } else {
      metric.gauge.value = sample.value;
    }
    out.metric.push_back(std::move(metric));
  }
  return out;
}

// Reads the daemon at each scrape; prometheus-cpp calls Collect from its server threads.
class DaemonCollectable final : public prometheus::Collectable {
 public:
  explicit DaemonCollectable(std::shared_ptr<grpc::Channel> channel)
      : channel_(std::move(channel)), stub_(v1::TrainStream::NewStub(channel_)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    metrics::Scrape scrape;
    const absl::Status read = metrics::ReadScrape(
        *stub_,
        [](const std::function<grpc::Status(grpc::ClientContext*)>& rpc) {
          grpc::ClientContext context;
          context.set_deadline(std::chrono::system_clock::now() + kScrapeDeadline);
          return FromGrpcStatus(rpc(&context));
        },
        &scrape);
    std::vector<prometheus::MetricFamily> out;
    for (const metrics::MetricFamily& family :
         read.ok() ? metrics::FamiliesOf(scrape) : metrics::DownFamilies()) {
      out.push_back(ToPrometheus(family));
    }
    return out;
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::TrainStream::Stub> stub_;
};

class PrometheusEndpoint final : public MetricsEndpoint {
 public:
  PrometheusEndpoint(std::unique_ptr<prometheus::Exposer> exposer, std::string url)
      : exposer_(std::move(exposer)), url_(std::move(url)) {}
  ~PrometheusEndpoint() override {
    exposer_.reset();  // its threads stop before the collectable they call goes
  }
  absl::Status Serve(std::shared_ptr<grpc::Channel> daemon_channel) override {
    if (!daemon_channel) return absl::UnavailableError("the daemon is shutting down");
    collectable_ = std::make_shared<DaemonCollectable>(std::move(daemon_channel));
    exposer_->RegisterCollectable(collectable_);
    return absl::OkStatus();
  }
  std::string url() const override { return url_; }

 private:
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::shared_ptr<DaemonCollectable> collectable_;
  std::string url_;
};

// The host in URLs and in civetweb's listening_ports: IPv6 in brackets.
std::string HostPart(const std::string& host) {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]") : host;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Listen(
    const ListenAddress& address) {
  // civetweb's form: "PORT" for every interface, "HOST:PORT", "[V6]:PORT".
  const std::string spec = address.host.empty()
                               ? absl::StrCat(address.port)
                               : absl::StrCat(HostPart(address.host), ":", address.port);
  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    // Two threads: a scrape is a few microseconds of in-process calls, and one slow client
    // must not hold the only one.
    exposer = std::make_unique<prometheus::Exposer>(spec, 2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("metrics_listen ", spec, ": cannot listen there (",
                                               e.what(), ")"));
  }
  const std::vector<int> ports = exposer->GetListeningPorts();
  const int port = ports.empty() ? address.port : ports.front();
  const std::string url = absl::StrCat(
      "http://", address.host.empty() ? "0.0.0.0" : HostPart(address.host), ":", port, "/metrics");
  return std::make_unique<PrometheusEndpoint>(std::move(exposer), url);
}

}  // namespace trainstream::daemon
