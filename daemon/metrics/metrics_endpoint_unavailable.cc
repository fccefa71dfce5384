// SPDX-License-Identifier: Apache-2.0
// MetricsEndpoint in a build without prometheus-cpp: --metrics_listen is refused with the fix.
#include "metrics/metrics_endpoint.h"

namespace trainstream::daemon {

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Listen(const ListenAddress&) {
  return absl::FailedPreconditionError(
      "metrics_listen: this trainstreamd was built without prometheus-cpp (Debian: "
      "prometheus-cpp-dev; then rebuild); `tsctl metrics --textfile=PATH.prom --interval=15` "
      "writes the same metrics for node_exporter's textfile collector");
}

}  // namespace trainstream::daemon
