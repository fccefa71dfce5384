// SPDX-License-Identifier: Apache-2.0
#ifndef TRAINSTREAM_DAEMON_RPC_TRAINSTREAM_SERVICE_H_
#define TRAINSTREAM_DAEMON_RPC_TRAINSTREAM_SERVICE_H_

#include <atomic>
#include <optional>
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
#include "sessions/granted_files.h"
#include "sessions/session_registry.h"
#include "sessions/transfer_totals.h"
#include "status_conversion.h"
#include "trainstream/v1/trainstream.grpc.pb.h"

namespace trainstream::daemon {

// Events one session may report per minute (ReportEvent).
inline constexpr int kReportedEventsPerMinute = 600;

// Facts about the daemon that GetStatus reports.
struct DaemonFacts {
  std::string version;
  std::string socket_path;
  std::string data_socket_path;
  std::string metrics_url;  // the Prometheus endpoint's, when one listens
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

// Each RPC's handler, Serve<Name>, returns an absl::Status like the rest of the daemon; the one
// conversion to a gRPC status is here, at the edge, instead of one at every early return.
#define TRAINSTREAM_RPC(Name, Request, Reply)                                                  \
  grpc::Status Name(grpc::ServerContext* context, const Request* request, Reply* reply)       \
      override {                                                                               \
    return ToGrpcStatus(Serve##Name(context, request, reply));                                 \
  }                                                                                            \
  absl::Status Serve##Name(grpc::ServerContext* context, const Request* request, Reply* reply)

// The control plane for one uid (see UserServers): validates every request and acts on the
// registry, arena and event log as that uid. The caller's pid comes from the kernel
// credentials recorded for its connection. Thread-safe (gRPC calls it from its pool). Refusals
// are events.
class TrainStreamService final : public v1::TrainStream::Service {
 public:
  TrainStreamService(DaemonFacts facts, PeerCredentials identity, SessionRegistry* sessions,
                     Arena* arena, EventLog* events, const ConnectionCredentials* credentials,
                     OptimizerRegistry* optimizers, BaseStore* bases,
                     GrantedFiles* granted_files, TransferTotals* transfers,
                     GpuPoolAccess gpu_pools = {});

  // Ends open event streams promptly at shutdown.
  void Shutdown() { shutting_down_ = true; }

  TRAINSTREAM_RPC(OpenSession, v1::OpenSessionRequest, v1::OpenSessionReply);
  TRAINSTREAM_RPC(Heartbeat, v1::HeartbeatRequest, v1::HeartbeatReply);
  TRAINSTREAM_RPC(CloseSession, v1::CloseSessionRequest, v1::CloseSessionReply);
  TRAINSTREAM_RPC(AllocateBuffer, v1::AllocateBufferRequest, v1::Buffer);
  TRAINSTREAM_RPC(LookupBuffer, v1::LookupBufferRequest, v1::Buffer);
  TRAINSTREAM_RPC(FreeBuffer, v1::FreeBufferRequest, v1::FreeBufferReply);
  TRAINSTREAM_RPC(SealBuffer, v1::SealBufferRequest, v1::Buffer);
  TRAINSTREAM_RPC(GetStatus, v1::GetStatusRequest, v1::Status);
  TRAINSTREAM_RPC(Drain, v1::DrainRequest, v1::DrainReply);
  TRAINSTREAM_RPC(ListSessions, v1::ListSessionsRequest, v1::ListSessionsReply);
  TRAINSTREAM_RPC(GetMemory, v1::GetMemoryRequest, v1::MemoryReport);
  TRAINSTREAM_RPC(StreamEvents, v1::StreamEventsRequest, grpc::ServerWriter<v1::Event>);
  // plan_host_memory_rpc.cc
  TRAINSTREAM_RPC(PlanHostMemory, v1::PlanHostMemoryRequest, v1::HostPlan);
  // estimate_host_memory_rpc.cc
  TRAINSTREAM_RPC(EstimateHostMemory, v1::EstimateHostMemoryRequest, v1::HostMemoryEstimate);
  // report_event_rpc.cc
  TRAINSTREAM_RPC(ReportEvent, v1::ReportEventRequest, v1::ReportEventReply);

  // The host optimizer (optimizer_rpcs.cc).
  TRAINSTREAM_RPC(CreateOptimizer, v1::CreateOptimizerRequest, v1::OptimizerInfo);
  TRAINSTREAM_RPC(RegisterParameters, v1::RegisterParametersRequest, v1::RegisterParametersReply);
  TRAINSTREAM_RPC(SetHyperParameters, v1::SetHyperParametersRequest, v1::OptimizerInfo);
  TRAINSTREAM_RPC(GetOptimizer, v1::GetOptimizerRequest, v1::OptimizerInfo);
  TRAINSTREAM_RPC(SetOptimizerStep, v1::SetOptimizerStepRequest, v1::OptimizerInfo);
  TRAINSTREAM_RPC(SaveCheckpoint, v1::CheckpointRequest, v1::CheckpointReply);
  TRAINSTREAM_RPC(LoadCheckpoint, v1::CheckpointRequest, v1::CheckpointReply);
  TRAINSTREAM_RPC(ListOptimizers, v1::ListOptimizersRequest, v1::ListOptimizersReply);

  // Shared frozen bases (base_rpcs.cc).
  TRAINSTREAM_RPC(LoadBase, v1::LoadBaseRequest, v1::BaseInfo);
  TRAINSTREAM_RPC(GetBase, v1::GetBaseRequest, v1::BaseInfo);
  TRAINSTREAM_RPC(DetachBase, v1::DetachBaseRequest, v1::DetachBaseReply);
  TRAINSTREAM_RPC(ListBases, v1::ListBasesRequest, v1::ListBasesReply);

  // GPU pools (gpu_pool_rpcs.cc).
  TRAINSTREAM_RPC(PlaceBaseOnGpu, v1::PlaceBaseOnGpuRequest, v1::GpuPoolInfo);
  TRAINSTREAM_RPC(ReleaseGpuPool, v1::ReleaseGpuPoolRequest, v1::ReleaseGpuPoolReply);
  TRAINSTREAM_RPC(ListGpuPools, v1::ListGpuPoolsRequest, v1::ListGpuPoolsReply);

 private:
  absl::StatusOr<PeerCredentials> Caller(grpc::ServerContext* context) const;
  // The caller's session, checked and owned by the caller.
  absl::StatusOr<std::shared_ptr<const Session>> CallersSession(grpc::ServerContext* context,
                                                                const std::string& session_id);
  // The caller's session and its job's optimizer.
  absl::StatusOr<std::pair<std::shared_ptr<const Session>, std::shared_ptr<JobOptimizer>>>
  CallersOptimizer(grpc::ServerContext* context, const std::string& session_id);
  // A checkpoint path this caller may have the daemon write or read itself (no file grant).
  absl::Status CheckCheckpointPath(const PeerCredentials& caller, const std::string& path) const;
  // The one file of a checkpoint request's grant, named as the request's path, with the access
  // the request needs.
  absl::StatusOr<FileGrant> CheckpointFile(const Session& session,
                                           const v1::CheckpointRequest& request, bool write);
  // The caller's session and optimizer for a checkpoint request, with the file it handed over
  // or a path it may have the daemon open. The grant is taken before anything else can fail,
  // so that a refused request leaves no descriptor behind.
  struct CheckpointCall {
    std::shared_ptr<const Session> session;
    std::shared_ptr<JobOptimizer> optimizer;
    std::optional<FileGrant> file;
  };
  absl::StatusOr<CheckpointCall> CheckpointTarget(grpc::ServerContext* context,
                                                  const v1::CheckpointRequest& request,
                                                  bool write);

  const DaemonFacts facts_;
  const PeerCredentials identity_;
  SessionRegistry* const sessions_;
  Arena* const arena_;
  EventLog* const events_;
  const ConnectionCredentials* const credentials_;
  OptimizerRegistry* const optimizers_;
  BaseStore* const bases_;
  GrantedFiles* const granted_files_;  // files clients handed over on the data socket
  TransferTotals* const transfers_;
  const GpuPoolAccess gpu_pools_;
  ReportedEventLimiter reported_events_{kReportedEventsPerMinute};
  std::atomic<bool> shutting_down_{false};
};

}  // namespace trainstream::daemon

#undef TRAINSTREAM_RPC

#endif  // TRAINSTREAM_DAEMON_RPC_TRAINSTREAM_SERVICE_H_
