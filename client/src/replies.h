// SPDX-License-Identifier: Apache-2.0
// The API's reply messages as the structs of include/trainstream/replies.h.
#ifndef TRAINSTREAM_CLIENT_SRC_REPLIES_H_
#define TRAINSTREAM_CLIENT_SRC_REPLIES_H_

#include <vector>

#include "trainstream/replies.h"
#include "trainstream/v1/trainstream.pb.h"

namespace trainstream::client {

BufferInfo FromProto(const v1::Buffer& b);
DaemonStatus FromProto(const v1::Status& s);
std::vector<SessionInfo> FromProto(const v1::ListSessionsReply& reply);
MemoryReport FromProto(const v1::MemoryReport& m);
Event FromProto(const v1::Event& e);
HostPlan FromProto(const v1::HostPlan& p);
BaseInfo FromProto(const v1::BaseInfo& b);
std::vector<BaseInfo> FromProto(const v1::ListBasesReply& reply);
GpuPoolInfo FromProto(const v1::GpuPoolInfo& p);
GpuPools FromProto(const v1::ListGpuPoolsReply& reply);
OptimizerInfo FromProto(const v1::OptimizerInfo& info);

}  // namespace trainstream::client

#endif  // TRAINSTREAM_CLIENT_SRC_REPLIES_H_
