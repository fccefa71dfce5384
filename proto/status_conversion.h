// SPDX-License-Identifier: Apache-2.0
// absl::Status <-> grpc::Status, written once for both ends. The canonical codes are the gRPC
// codes, so the mapping is one-to-one.
#ifndef TRAINSTREAM_PROTO_STATUS_CONVERSION_H_
#define TRAINSTREAM_PROTO_STATUS_CONVERSION_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace trainstream {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace trainstream

#endif  // TRAINSTREAM_PROTO_STATUS_CONVERSION_H_
