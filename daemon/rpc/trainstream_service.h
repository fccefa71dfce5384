// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_RPC_TRAINSTREAM_SERVICE_H_
#define TRAINSTREAM_DAEMON_RPC_TRAINSTREAM_SERVICE_H_

#include <atomic>
#include <string>

#include "absl/time/time.h"
#include "arena/arena.h"
#include "bases/base_gpu_pools.h"
#include "bases/base_store.h"
#include "events/event_log.h"
#include "gpu/gpu_probe.h"
#include "optimizer/optimizer_registry.h"
#include "rpc/connection_credentials.h"
#include "rpc/reported_event_limiter.h"
#include "sessions/session_registry.h"
#include "trainstream/v1/trainstream.grpc.pb.h"

namespace trainstream::daemon {

// Events one session may report per minute (ReportEvent).
inline constexpr int kReportedEventsPerMinute = 600;

// Facts about the daemon that GetStatus reports.
struct DaemonFacts {
  std::string version;
  std::string socket_path;
  std::string data_socket_path;
  uint32_t threads = 0;
  absl::Time started;
  GpuInventory gpus;
};

// The daemon's GPU pools, as the control plane reaches them.
struct GpuPoolAccess {
  GpuPools* pools = nullptr;
  BaseGpuPools* bases = nullptr;
  std::string note;  // why no pool can be made on this machine, when none can
};

// The control plane for one uid (see UserServers): validates every request and acts on the
// registry, arena and event log as that uid. The caller's pid comes from the kernel
// credentials recorded for its connection. Thread-safe (gRPC calls it from its pool). Refusals
// are events.
class TrainStreamService final : public v1::TrainStream::Service {
 public:
  TrainStreamService(DaemonFacts facts, PeerCredentials identity, SessionRegistry* sessions,
                     Arena* arena, EventLog* events, const ConnectionCredentials* credentials,
                     OptimizerRegistry* optimizers, BaseStore* bases,
                     GpuPoolAccess gpu_pools = {});

  // Ends open event streams promptly at shutdown.
  void Shutdown() { shutting_down_ = true; }

  grpc::Status OpenSession(grpc::ServerContext*, const v1::OpenSessionRequest*,
                           v1::OpenSessionReply*) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest*,
                         v1::HeartbeatReply*) override;
  grpc::Status CloseSession(grpc::ServerContext*, const v1::CloseSessionRequest*,
                            v1::CloseSessionReply*) override;
  grpc::Status AllocateBuffer(grpc::ServerContext*, const v1::AllocateBufferRequest*,
                              v1::Buffer*) override;
  grpc::Status LookupBuffer(grpc::ServerContext*, const v1::LookupBufferRequest*,
                            v1::Buffer*) override;
  grpc::Status FreeBuffer(grpc::ServerContext*, const v1::FreeBufferRequest*,
                          v1::FreeBufferReply*) override;
  grpc::Status SealBuffer(grpc::ServerContext*, const v1::SealBufferRequest*,
                          v1::Buffer*) override;
  grpc::Status GetStatus(grpc::ServerContext*, const v1::GetStatusRequest*,
                         v1::Status*) override;
  grpc::Status ListSessions(grpc::ServerContext*, const v1::ListSessionsRequest*,
                            v1::ListSessionsReply*) override;
  grpc::Status GetMemory(grpc::ServerContext*, const v1::GetMemoryRequest*,
                         v1::MemoryReport*) override;
  grpc::Status StreamEvents(grpc::ServerContext*, const v1::StreamEventsRequest*,
                            grpc::ServerWriter<v1::Event>*) override;
  // plan_host_memory_rpc.cc
  grpc::Status PlanHostMemory(grpc::ServerContext*, const v1::PlanHostMemoryRequest*,
                              v1::HostPlan*) override;
  // estimate_host_memory_rpc.cc
  grpc::Status EstimateHostMemory(grpc::ServerContext*, const v1::EstimateHostMemoryRequest*,
                                  v1::HostMemoryEstimate*) override;
  // report_event_rpc.cc
  grpc::Status ReportEvent(grpc::ServerContext*, const v1::ReportEventRequest*,
                           v1::ReportEventReply*) override;

  // The host optimizer (optimizer_rpcs.cc).
  grpc::Status CreateOptimizer(grpc::ServerContext*, const v1::CreateOptimizerRequest*,
                               v1::OptimizerInfo*) override;
  grpc::Status RegisterParameters(grpc::ServerContext*, const v1::RegisterParametersRequest*,
                                  v1::RegisterParametersReply*) override;
  grpc::Status SetHyperParameters(grpc::ServerContext*, const v1::SetHyperParametersRequest*,
                                  v1::OptimizerInfo*) override;
  grpc::Status GetOptimizer(grpc::ServerContext*, const v1::GetOptimizerRequest*,
                            v1::OptimizerInfo*) override;
  grpc::Status SetOptimizerStep(grpc::ServerContext*, const v1::SetOptimizerStepRequest*,
                                v1::OptimizerInfo*) override;
  grpc::Status SaveCheckpoint(grpc::ServerContext*, const v1::CheckpointRequest*,
                              v1::CheckpointReply*) override;
  grpc::Status LoadCheckpoint(grpc::ServerContext*, const v1::CheckpointRequest*,
                              v1::CheckpointReply*) override;
  grpc::Status ListOptimizers(grpc::ServerContext*, const v1::ListOptimizersRequest*,
                              v1::ListOptimizersReply*) override;

  // Shared frozen bases (base_rpcs.cc).
  grpc::Status LoadBase(grpc::ServerContext*, const v1::LoadBaseRequest*,
                        v1::BaseInfo*) override;
  grpc::Status GetBase(grpc::ServerContext*, const v1::GetBaseRequest*, v1::BaseInfo*) override;
  grpc::Status DetachBase(grpc::ServerContext*, const v1::DetachBaseRequest*,
                          v1::DetachBaseReply*) override;
  grpc::Status ListBases(grpc::ServerContext*, const v1::ListBasesRequest*,
                         v1::ListBasesReply*) override;

  // GPU pools (gpu_pool_rpcs.cc).
  grpc::Status PlaceBaseOnGpu(grpc::ServerContext*, const v1::PlaceBaseOnGpuRequest*,
                              v1::GpuPoolInfo*) override;
  grpc::Status ReleaseGpuPool(grpc::ServerContext*, const v1::ReleaseGpuPoolRequest*,
                              v1::ReleaseGpuPoolReply*) override;
  grpc::Status ListGpuPools(grpc::ServerContext*, const v1::ListGpuPoolsRequest*,
                            v1::ListGpuPoolsReply*) override;

 private:
  absl::StatusOr<PeerCredentials> Caller(grpc::ServerContext* context) const;
  // The caller's session, checked and owned by the caller.
  absl::StatusOr<std::shared_ptr<const Session>> CallersSession(grpc::ServerContext* context,
                                                                const std::string& session_id);
  // The caller's session and its job's optimizer.
  absl::StatusOr<std::pair<std::shared_ptr<const Session>, std::shared_ptr<JobOptimizer>>>
  CallersOptimizer(grpc::ServerContext* context, const std::string& session_id);
  // A checkpoint path this caller may have the daemon write or read.
  absl::Status CheckCheckpointPath(const PeerCredentials& caller, const std::string& path) const;
  // The caller's session and optimizer for a checkpoint request whose path it may use.
  absl::StatusOr<std::pair<std::shared_ptr<const Session>, std::shared_ptr<JobOptimizer>>>
  CheckpointTarget(grpc::ServerContext* context, const v1::CheckpointRequest& request);

  const DaemonFacts facts_;
  const PeerCredentials identity_;
  SessionRegistry* const sessions_;
  Arena* const arena_;
  EventLog* const events_;
  const ConnectionCredentials* const credentials_;
  OptimizerRegistry* const optimizers_;
  BaseStore* const bases_;
  const GpuPoolAccess gpu_pools_;
  ReportedEventLimiter reported_events_{kReportedEventsPerMinute};
  std::atomic<bool> shutting_down_{false};
};

}  // namespace trainstream::daemon

#endif  // TRAINSTREAM_DAEMON_RPC_TRAINSTREAM_SERVICE_H_
