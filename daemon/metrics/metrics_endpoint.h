// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_METRICS_METRICS_ENDPOINT_H_
#define TRAINSTREAM_DAEMON_METRICS_METRICS_ENDPOINT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "config/daemon_options.h"
#include "grpcpp/grpcpp.h"

namespace trainstream::daemon {

// trainstreamd's Prometheus endpoint (--metrics_listen): GET /metrics answers with the daemon's
// state, read at each scrape through the daemon's own in-process view of its control plane (as
// an administrator sees it) and made into the same families `tsctl metrics` prints. Served by
// prometheus-cpp's exposer (civetweb underneath) on threads of its own. In two steps, so that
// the daemon knows its address before it builds the service that reports it: Listen binds,
// Serve starts answering. Stops serving when destroyed.
class MetricsEndpoint {
 public:
  // Fails with the reason when the address cannot be bound, or when this build has no
  // prometheus-cpp.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Listen(const ListenAddress& address);
  virtual ~MetricsEndpoint() = default;

  // Answers scrapes from now on, reading the daemon through `daemon_channel`.
  virtual absl::Status Serve(std::shared_ptr<grpc::Channel> daemon_channel) = 0;

  // Where it listens, with the port it got: "http://127.0.0.1:9478/metrics".
  virtual std::string url() const = 0;
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_METRICS_METRICS_ENDPOINT_H_
