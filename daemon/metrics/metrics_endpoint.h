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
// state, read at each scrape through `daemon_channel` (the daemon's own in-process view of its
// control plane, as an administrator sees it) and made into the same families `tsctl metrics`
// prints. Served by prometheus-cpp's exposer (civetweb underneath) on threads of its own.
// Stops serving when destroyed.
class MetricsEndpoint {
 public:
  // Fails with the reason when the address cannot be bound, or when this build has no
  // prometheus-cpp.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(
      const ListenAddress& address, std::shared_ptr<grpc::Channel> daemon_channel);
  virtual ~MetricsEndpoint() = default;

  // Where it listens, with the port it got ("127.0.0.1:9478").
  virtual std::string address() const = 0;
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_METRICS_METRICS_ENDPOINT_H_
