// SPDX-License-Identifier: Apache-2.0
// Between the API's optimizer messages and the optimizer's own types, in one place.
#ifndef TRAINSTREAM_DAEMON_RPC_OPTIMIZER_CONVERSION_H_
#define TRAINSTREAM_DAEMON_RPC_OPTIMIZER_CONVERSION_H_

#include <vector>

#include "absl/status/statusor.h"
#include "optimizer/job_optimizer.h"
#include "optimizer/optimizer_settings.h"
#include "trainstream/v1/trainstream.pb.h"

namespace trainstream::daemon {

absl::StatusOr<kernels::ScalarType> FromProto(v1::DType dtype, const char* field);
v1::DType ToProto(kernels::ScalarType type);
absl::StatusOr<OptimizerSettings> FromProto(const v1::OptimizerSpec& spec);
std::vector<GroupHyperParameters> FromProto(
    const google::protobuf::RepeatedPtrField<v1::ParamGroup>& groups);
absl::StatusOr<std::vector<ParameterDescription>> FromProto(
    const google::protobuf::RepeatedPtrField<v1::ParameterSpec>& params);
void ToProto(const OptimizerSettings& settings, v1::OptimizerSpec* out);
void ToProto(const OptimizerReport& report, uint32_t threads, v1::OptimizerInfo* out);
void ToProto(const BufferRecord& record, v1::Buffer* out);

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_RPC_OPTIMIZER_CONVERSION_H_
