// SPDX-License-Identifier: Apache-2.0
#include "rpc/user_servers.h"

#include <chrono>

#include "absl/strings/str_format.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"

namespace trainstream::daemon {
namespace {

// The health service answers for our service by name and for the server as a whole (""), which
// is what Kubernetes' gRPC probes and grpc_health_probe ask unless told otherwise: a drain must
// show in both.
constexpr const char* kHealthServiceNames[] = {"", "trainstream.v1.TrainStream"};

void SetHealth(grpc::Server& server, bool serving) {
  for (const char* name : kHealthServiceNames) {
    server.GetHealthCheckService()->SetServingStatus(name, serving);
  }
}

}  // namespace

grpc::Server* UserServers::ServerFor(const PeerCredentials& peer) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return nullptr;
  if (auto it = servers_.find(peer.uid); it != servers_.end()) return it->second.server.get();
  PeerCredentials identity = peer;
  identity.pid = 0;  // the pid is per connection; the service looks it up per request
  Entry entry = Build(identity);
  if (!entry.server) return nullptr;
  grpc::Server* server = entry.server.get();
  servers_[peer.uid] = std::move(entry);
  return server;
}

std::shared_ptr<grpc::Channel> UserServers::DaemonChannel() {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return nullptr;
  if (!daemon_itself_.server) {
    PeerCredentials identity = OwnCredentials();
    identity.admin = true;
    daemon_itself_ = Build(identity);
    if (!daemon_itself_.server) return nullptr;
  }
  return daemon_itself_.server->InProcessChannel(grpc::ChannelArguments());
}

UserServers::Entry UserServers::Build(const PeerCredentials& identity) {
  Entry entry;
  entry.service = std::make_unique<TrainStreamService>(shared_.facts, identity, shared_.sessions,
                                                       shared_.arena, shared_.events,
                                                       shared_.credentials, shared_.optimizers,
                                                       shared_.bases, shared_.granted_files,
                                                       shared_.transfers, shared_.gpu_pools);
  grpc::EnableDefaultHealthCheckService(true);
  // Reflection: generic clients (grpcurl, grpcio-reflection) learn the API from the server.
  // It describes the schema alone, the same for every uid.
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.RegisterService(entry.service.get());
  entry.server = builder.BuildAndStart();
  if (!entry.server) {
    shared_.events->Emit(
        "rpc.refused", absl::StrFormat("could not start a gRPC server for uid %d", identity.uid),
        {}, "", identity.uid);
    return {};
  }
  SetHealth(*entry.server, serving_);
  return entry;
}

void UserServers::SetServing(bool serving) {
  absl::MutexLock lock(&mu_);
  serving_ = serving;
  for (auto& [uid, entry] : servers_) SetHealth(*entry.server, serving);
}

void UserServers::Shutdown() {
  std::map<uid_t, Entry> servers;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    servers.swap(servers_);
    // Under a uid no connection can have (servers are keyed by uid): shut down with the rest.
    if (daemon_itself_.server) servers.emplace(static_cast<uid_t>(-1), std::move(daemon_itself_));
  }
  for (auto& [uid, entry] : servers) entry.service->Shutdown();
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(2);
  for (auto& [uid, entry] : servers) entry.server->Shutdown(deadline);
}

}  // namespace trainstream::daemon
