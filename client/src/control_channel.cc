// SPDX-License-Identifier: Apache-2.0
#include "control_channel.h"

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"
#include "status_conversion.h"

namespace trainstream::client {

ControlChannel::ControlChannel(std::string socket_path, absl::Duration timeout)
    : socket_path_(std::move(socket_path)), timeout_(timeout) {
  grpc::ChannelArguments args;
  // Reconnect quickly after a daemon restart rather than backing off for minutes.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // A connection of its own: channels to one target share their subchannels process-wide by
  // default, and a new channel to a daemon restarted on the same path then inherited the
  // connection to the one that had stopped; its first call failed with "Broken pipe".
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  channel_ = grpc::CreateCustomChannel(absl::StrCat("unix:", socket_path_),
                                       grpc::InsecureChannelCredentials(), args);
  stub_ = v1::TrainStream::NewStub(channel_);
}

void ControlChannel::PrepareContext(grpc::ClientContext* context) const {
  context->set_deadline(std::chrono::system_clock::now() +
                        absl::ToChronoMilliseconds(timeout_));
}

absl::Status ControlChannel::Explain(const grpc::Status& status) const {
  return Explain(status, timeout_);
}

absl::Status ControlChannel::Explain(const grpc::Status& status, absl::Duration timeout) const {
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    return absl::UnavailableError(absl::StrCat(
        "no trainstreamd answers on ", socket_path_, " (", status.error_message(),
        "); start one with `trainstreamd`, or set TRAINSTREAM_SOCKET"));
  }
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return absl::DeadlineExceededError(absl::StrCat(
        "trainstreamd on ", socket_path_, " did not answer within ",
        absl::FormatDuration(timeout)));
  }
  return FromGrpcStatus(status);
}

absl::Status ControlChannel::Call(
    const std::function<grpc::Status(grpc::ClientContext*)>& rpc) const {
  grpc::ClientContext context;
  PrepareContext(&context);
  return Explain(rpc(&context));
}

absl::Status ControlChannel::CallWithTimeout(
    const std::function<grpc::Status(grpc::ClientContext*)>& rpc, absl::Duration timeout) const {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
  return Explain(rpc(&context), timeout);
}

std::string ToJson(const google::protobuf::Message& message) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(message, &out, options);
  return out;
}

}  // namespace trainstream::client
