// SPDX-License-Identifier: Apache-2.0
#include "daemon.h"

#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "arena/arena.h"
#include "bases/base_gpu_pools.h"
#include "bases/base_store.h"
#include "dataplane/data_channel_server.h"
#include "doorbell/doorbell_dispatcher.h"
#include "events/event_log.h"
#include "events/logger.h"
#include "gpu/driver_vram_api.h"
#include "gpu/gpu_pools.h"
#include "gpu/gpu_probe.h"
#include "metrics/metrics_endpoint.h"
#include "optimizer/optimizer_registry.h"
#include "rpc/connection_credentials.h"
#include "rpc/control_listener.h"
#include "rpc/trainstream_service.h"
#include "rpc/user_servers.h"
#include "sessions/granted_files.h"
#include "sessions/session_registry.h"
#include "sessions/transfer_totals.h"
#include "trainstream/status_macros.h"
#include "trainstream/version.h"

namespace trainstream::daemon {
Daemon::Daemon(const DaemonOptions& options) : options_(options) {}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Create(const DaemonOptions& options,
                                                      ipc::UniqueFd control_listener,
                                                      ipc::UniqueFd data_listener) {
  auto daemon = std::unique_ptr<Daemon>(new Daemon(options));
  RETURN_IF_ERROR(daemon->Start(std::move(control_listener), std::move(data_listener)));
  return daemon;
}

absl::Status Daemon::Start(ipc::UniqueFd control_listener, ipc::UniqueFd data_listener) {
  ASSIGN_OR_RETURN(LogLevel level, ParseLogLevel(options_.log_level));
  SetLogLevel(level);
  events_ = std::make_unique<EventLog>(options_.event_ring_size);
  Arena::Options arena_options;
  arena_options.budget_bytes = options_.budget_bytes;
  arena_options.uid_quota_bytes = options_.uid_quota_bytes;
  arena_options.segment_bytes = options_.shared_segment_bytes;
  arena_options.segment_granularity = options_.segment_granularity;
  ASSIGN_OR_RETURN(arena_, Arena::Create(arena_options));
  credentials_ = std::make_unique<ConnectionCredentials>();
  granted_files_ = std::make_unique<GrantedFiles>();
  transfers_ = std::make_unique<TransferTotals>();

  // Everything a session held goes when it ends, whatever ended it.
  sessions_ = std::make_unique<SessionRegistry>(
      SessionRegistry::Options{options_.lease, 256}, [this](const Session& s, SessionEnd why) {
        if (doorbells_) doorbells_->Remove(s.id);
        if (data_server_) data_server_->Disconnect(s.id);
        if (optimizers_) optimizers_->OnSessionEnded(s, why == SessionEnd::kClosed);
        if (bases_) bases_->OnSessionEnded(s);
        if (granted_files_) granted_files_->SessionEnded(s.id);
        if (transfers_) transfers_->SessionEnded(s);
        if (gpu_pools_) gpu_pools_->SessionEnded(s.id);
        uint64_t released = arena_->ReleaseSession(s.job, s.id);
        events_->Emit(why == SessionEnd::kClosed ? "session.closed" : "session.reclaimed",
                      absl::StrFormat("session of %s ended (%s); released %d buffer bytes",
                                      OwnerName(s), SessionEndName(why), released),
                      {{"released_bytes", static_cast<double>(released)},
                       {"age_s", absl::ToDoubleSeconds(absl::Now() - s.opened)}},
                      s.id, s.owner.uid);
      });
  ASSIGN_OR_RETURN(doorbells_,
                   DoorbellDispatcher::Create([this](const std::string& id, const std::string& why) {
                     // The owner's event: another user must not learn the session's id. One
                     // whose owner is gone already is the administrators' (root's) alone.
                     PeerCredentials daemon_itself = OwnCredentials();
                     daemon_itself.admin = true;
                     absl::StatusOr<std::shared_ptr<const Session>> session =
                         sessions_->Get(daemon_itself, id);
                     events_->Emit("doorbell.protocol_error", why, {}, id,
                                   session.ok() ? (*session)->owner.uid : uid_t{0});
                     sessions_->End(id, SessionEnd::kProtocolError).IgnoreError();
                   }));
  OptimizerRegistry::Options optimizer_options;
  optimizer_options.threads = options_.threads;
  optimizer_options.retention = options_.optimizer_retention;
  optimizer_options.pin_threads = options_.optimizer_pin_threads;
  optimizers_ = std::make_unique<OptimizerRegistry>(optimizer_options, arena_.get(),
                                                    doorbells_.get(), events_.get());
  BaseStore::Options base_options;
  base_options.keep_warm = options_.base_keep_warm;
  base_options.session_alive = [this](const Session& s) {
    return sessions_->Get(s.owner, s.id).ok();
  };
  bases_ = std::make_unique<BaseStore>(base_options, arena_.get(), events_.get());
  // The driver is opened now, but a GPU context is made only with the first pool.
  vram_ = LoadDriverVramApi();
  gpu_pools_ = std::make_unique<GpuPools>(*vram_, *events_,
                                          options_.gpu_pool_export == "legacy_ipc");
  base_pools_ = std::make_unique<BaseGpuPools>(
      *bases_, *gpu_pools_, *events_,
      [this](const Session& s) { return sessions_->Get(s.owner, s.id).ok(); });
  doorbells_->SetHandler(ipc::DoorbellKind::kGradientReady,
                         [this](const Session& session, const ipc::DoorbellMessage& message,
                                DoorbellChannel&) {
                           optimizers_->OnGradientReady(session, message);
                         });
  doorbells_->SetHandler(ipc::DoorbellKind::kNormContribution,
                         [this](const Session& session, const ipc::DoorbellMessage& message,
                                DoorbellChannel&) {
                           optimizers_->OnNormContribution(session, message);
                         });
  doorbells_->SetHandler(ipc::DoorbellKind::kReduced,
                         [this](const Session& session, const ipc::DoorbellMessage& message,
                                DoorbellChannel&) { optimizers_->OnReduced(session, message); });
  ASSIGN_OR_RETURN(data_server_,
                   DataChannelServer::Create({options_.data_socket_path, options_.socket_mode,
                                              options_.admin_group,
                                              options_.max_connections_per_uid},
                                             sessions_.get(), arena_.get(), doorbells_.get(),
                                             events_.get(), bases_.get(), granted_files_.get(),
                                             gpu_pools_.get(), std::move(data_listener)));

  DaemonFacts facts;
  facts.version = kTrainStreamVersion;
  facts.socket_path = options_.socket_path;
  facts.data_socket_path = options_.data_socket_path;
  facts.threads = options_.threads;
  facts.started = absl::Now();
  facts.gpus = ProbeInstalledGpus();
  if (facts.gpus.gpus.empty()) {
    events_->Emit("gpu.none", facts.gpus.note);
  } else {
    for (const GpuDescription& gpu : facts.gpus.gpus) {
      events_->Emit("gpu.found", absl::StrFormat("GPU %d: %s (%s)", gpu.index, gpu.name, gpu.uuid),
                    {{"index", gpu.index}, {"total_bytes", static_cast<double>(gpu.total_bytes)}});
    }
  }
  // Bound before the service is built, which reports its address, and before the sockets: a
  // daemon asked for an endpoint it cannot bind serves no one.
  if (options_.metrics_listen) {
    ASSIGN_OR_RETURN(metrics_, MetricsEndpoint::Listen(*options_.metrics_listen));
    facts.metrics_url = metrics_->url();
  }
  const std::string no_pools_note = facts.gpus.gpus.empty() ? facts.gpus.note : "";
  servers_ = std::make_unique<UserServers>(UserServers::Shared{
      std::move(facts), sessions_.get(), arena_.get(), events_.get(), credentials_.get(),
      optimizers_.get(), bases_.get(), granted_files_.get(), transfers_.get(),
      GpuPoolAccess{gpu_pools_.get(), base_pools_.get(), no_pools_note}});
  if (metrics_) RETURN_IF_ERROR(metrics_->Serve(servers_->DaemonChannel()));
  ASSIGN_OR_RETURN(listener_,
                   ControlListener::Create(
                       options_.socket_path, options_.socket_mode, options_.admin_group,
                       [this](const PeerCredentials& peer) { return servers_->ServerFor(peer); },
                       credentials_.get(), options_.max_connections_per_uid, events_.get(),
                       std::move(control_listener)));
  housekeeping_ = std::thread([this] { Housekeeping(); });
  started_ = true;
  events_->Emit("daemon.start",
                absl::StrFormat("trainstreamd %s serving %s", kTrainStreamVersion,
                                options_.socket_path),
                {{"budget_bytes", static_cast<double>(options_.budget_bytes)},
                 {"uid_quota_bytes", static_cast<double>(options_.uid_quota_bytes)},
                 {"threads", options_.threads},
                 {"lease_ms", static_cast<double>(absl::ToInt64Milliseconds(options_.lease))}});
  if (metrics_) {
    events_->Emit("daemon.metrics",
                  absl::StrCat("serving Prometheus metrics at ", metrics_->url()));
  }
  return absl::OkStatus();
}

void Daemon::Housekeeping() {
  while (!stopping_.WaitForNotificationWithTimeout(absl::Milliseconds(200))) {
    sessions_->ExpireLeases(absl::Now());
    optimizers_->ExpireIdle(absl::Now());
    bases_->ExpireIdle(absl::Now());
    gpu_pools_->Sweep();
  }
}

void Daemon::Shutdown() {
  std::call_once(shutdown_once_, [this] {
    sessions_->StartDraining();
    servers_->SetServing(false);
    const size_t open = sessions_->size();
    events_->Emit("daemon.draining",
                  absl::StrFormat("refusing new sessions; waiting up to %s for %d open ones",
                                  absl::FormatDuration(options_.drain_timeout), open),
                  {{"sessions", static_cast<double>(open)}});
    const absl::Time deadline = absl::Now() + options_.drain_timeout;
    while (sessions_->size() > 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));
    const size_t left = sessions_->size();
    sessions_->EndAll(SessionEnd::kShutdown);
    stopping_.Notify();
    housekeeping_.join();
    listener_->Stop();
    // A scrape under way finishes first. civetweb's listener sees the stop at its next poll:
    // with an endpoint, the way out takes about a second more.
    metrics_.reset();
    servers_->Shutdown();
    data_server_->Stop();
    doorbells_->Stop();
    events_->Emit("daemon.stop", "stopped", {{"sessions_ended_at_deadline", static_cast<double>(left)}});
    stopped_.Notify();
  });
}

void Daemon::Wait() { stopped_.WaitForNotification(); }

bool Daemon::WaitFor(absl::Duration timeout) {
  return stopped_.WaitForNotificationWithTimeout(timeout);
}

Daemon::~Daemon() {
  // A daemon that failed to start is torn down by its members' destructors alone.
  if (started_) Shutdown();
}

}  // namespace trainstream::daemon
