// SPDX-License-Identifier: Apache-2.0
// Internal: the gRPC channel and stub to a daemon's control socket. Shared by the client
// library and tsctl; generated code is included only here and in daemon/rpc.
#ifndef TRAINSTREAM_CLIENT_SRC_CONTROL_CHANNEL_H_
#define TRAINSTREAM_CLIENT_SRC_CONTROL_CHANNEL_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "trainstream/v1/trainstream.grpc.pb.h"

namespace trainstream::client {

// Deadline of the calls whose work grows with the model (see CallWithTimeout).
inline constexpr absl::Duration kLongCallTimeout = absl::Minutes(30);

// Thread-safe (gRPC stubs are).
class ControlChannel {
 public:
  ControlChannel(std::string socket_path, absl::Duration timeout);

  v1::TrainStream::Stub& stub() { return *stub_; }
  const std::string& socket_path() const { return socket_path_; }

  // Runs one unary call with the deadline set; a daemon that is not there reads as
  // UNAVAILABLE with the socket path in the message.
  absl::Status Call(const std::function<grpc::Status(grpc::ClientContext*)>& rpc) const;
  // For calls whose work grows with the request (allocating and zeroing a large model's
  // optimizer state, writing or reading a checkpoint): a deadline of `timeout` instead. A daemon
  // that dies still ends the call at once (its socket closes).
  absl::Status CallWithTimeout(const std::function<grpc::Status(grpc::ClientContext*)>& rpc,
                               absl::Duration timeout) const;

  // As Call(), but with a caller-chosen context (streams).
  void PrepareContext(grpc::ClientContext* context) const;
  absl::Status Explain(const grpc::Status& status) const;
  absl::Status Explain(const grpc::Status& status, absl::Duration timeout) const;

 private:
  std::string socket_path_;
  absl::Duration timeout_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::TrainStream::Stub> stub_;
};

// The canonical JSON of a message (field names as in the .proto, defaults printed).
std::string ToJson(const google::protobuf::Message& message);

}  // namespace trainstream::client

#endif  // TRAINSTREAM_CLIENT_SRC_CONTROL_CHANNEL_H_
