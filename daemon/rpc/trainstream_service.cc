// SPDX-License-Identifier: Apache-2.0
#include "rpc/trainstream_service.h"

#include <signal.h>
#include <unistd.h>

#include "absl/strings/str_format.h"
#include "rpc/optimizer_conversion.h"
#include "rpc/request_validation.h"
#include "trainstream/status_macros.h"

namespace trainstream::daemon {
namespace {

void FillRows(const std::vector<UsageRow>& rows,
              google::protobuf::RepeatedPtrField<v1::UsageRow>* out) {
  for (const UsageRow& row : rows) {
    v1::UsageRow* r = out->Add();
    r->set_key(row.key);
    r->set_bytes(row.bytes);
    r->set_buffers(row.buffers);
  }
}

}  // namespace

TrainStreamService::TrainStreamService(DaemonFacts facts, PeerCredentials identity,
                                       SessionRegistry* sessions, Arena* arena, EventLog* events,
                                       const ConnectionCredentials* credentials,
                                       OptimizerRegistry* optimizers, BaseStore* bases,
                                       GrantedFiles* granted_files, TransferTotals* transfers,
                                       GpuPoolAccess gpu_pools)
    : facts_(std::move(facts)),
      identity_(identity),
      sessions_(sessions),
      arena_(arena),
      events_(events),
      credentials_(credentials),
      optimizers_(optimizers),
      bases_(bases),
      granted_files_(granted_files),
      transfers_(transfers),
      gpu_pools_(std::move(gpu_pools)) {}

absl::StatusOr<PeerCredentials> TrainStreamService::Caller(grpc::ServerContext* context) const {
  // The uid is the server's; the per-connection record only supplies the pid, and only when it
  // agrees on the uid (a reused descriptor number could otherwise lend another process's pid).
  PeerCredentials caller = identity_;
  std::optional<PeerCredentials> peer = credentials_->Find(context->peer());
  if (peer && peer->uid == identity_.uid) caller.pid = peer->pid;
  return caller;
}

absl::StatusOr<std::shared_ptr<const Session>> TrainStreamService::CallersSession(
    grpc::ServerContext* context, const std::string& session_id) {
  RETURN_IF_ERROR(ValidateSessionId(session_id));
  ASSIGN_OR_RETURN(PeerCredentials caller, Caller(context));
  return sessions_->Get(caller, session_id);
}

absl::Status TrainStreamService::ServeOpenSession(grpc::ServerContext* context,
                                                  const v1::OpenSessionRequest* request,
                                                  v1::OpenSessionReply* reply) {
  absl::StatusOr<PeerCredentials> caller = Caller(context);
  if (!caller.ok()) return caller.status();
  absl::Status valid = ValidateJobId(request->job_id());
  if (valid.ok()) valid = ValidateRank(request->rank(), request->world_size());
  if (!valid.ok()) return valid;
  OpenSessionParams params;
  params.job_id = request->job_id().empty() ? "default" : request->job_id();
  params.rank = request->rank();
  params.world_size = request->world_size();
  params.claimed_pid = static_cast<pid_t>(request->pid());
  // Only connections the daemon accepted itself carry the kernel's credentials. Among those,
  // pid 0 is the kernel's word for a peer outside this daemon's PID namespace (the daemon in a
  // container of its own, a DaemonSet's pod, and its clients in theirs): served, known by the
  // uid and the connection as every client is. The record must agree on the uid, as in Caller().
  const std::optional<PeerCredentials> recorded = credentials_->Find(context->peer());
  if (!recorded || recorded->uid != identity_.uid) {
    return absl::UnavailableError(
        "the connection's credentials are not known yet; retry the call");
  }
  absl::StatusOr<std::shared_ptr<const Session>> session = sessions_->Open(*caller, params);
  if (!session.ok()) {
    events_->Emit("session.refused", std::string(session.status().message()),
                  {{"pid", caller->pid}}, "", caller->uid);
    return session.status();
  }
  const Session& s = **session;
  events_->Emit("session.open",
                absl::StrFormat("%s opened rank %d/%d of job '%s'", OwnerName(s), s.rank,
                                s.world_size, s.job.job_id),
                {{"pid", s.owner.pid}, {"rank", s.rank}, {"world_size", s.world_size}}, s.id,
                s.owner.uid);
  reply->set_session_id(s.id);
  reply->set_attach_token(s.attach_token);
  reply->set_data_socket_path(facts_.data_socket_path);
  reply->set_lease_ms(static_cast<uint32_t>(
      absl::ToInt64Milliseconds(sessions_->Heartbeat(*caller, s.id).value_or(absl::ZeroDuration()))));
  reply->set_daemon_version(facts_.version);
  return absl::OkStatus();
}

absl::Status TrainStreamService::ServeHeartbeat(grpc::ServerContext* context,
                                                const v1::HeartbeatRequest* request,
                                                v1::HeartbeatReply* reply) {
  absl::Status valid = ValidateSessionId(request->session_id());
  if (!valid.ok()) return valid;
  absl::StatusOr<PeerCredentials> caller = Caller(context);
  if (!caller.ok()) return caller.status();
  absl::StatusOr<absl::Duration> lease = sessions_->Heartbeat(*caller, request->session_id());
  if (!lease.ok()) return lease.status();
  if (request->has_transfers()) {
    ASSIGN_OR_RETURN(std::shared_ptr<const Session> session,
                     sessions_->Get(*caller, request->session_id()));
    RETURN_IF_ERROR(transfers_->Report(*session, request->transfers().h2d_bytes(),
                                       request->transfers().d2h_bytes()));
    // A session that ended while it reported has had its end handled already: its job's row
    // would stay for good.
    if (!sessions_->Get(*caller, request->session_id()).ok()) transfers_->SessionEnded(*session);
  }
  reply->set_lease_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(*lease)));
  return absl::OkStatus();
}

absl::Status TrainStreamService::ServeCloseSession(grpc::ServerContext* context,
                                                   const v1::CloseSessionRequest* request,
                                                   v1::CloseSessionReply* reply) {
  absl::Status valid = ValidateSessionId(request->session_id());
  if (!valid.ok()) return valid;
  absl::StatusOr<PeerCredentials> caller = Caller(context);
  if (!caller.ok()) return caller.status();
  // The caller's own session only: its job is what end_job ends.
  absl::StatusOr<std::shared_ptr<const Session>> session =
      request->end_job() ? CallersSession(context, request->session_id())
                         : absl::StatusOr<std::shared_ptr<const Session>>(nullptr);
  if (!session.ok()) return session.status();
  absl::Status closed = sessions_->Close(*caller, request->session_id());
  if (closed.ok() && *session != nullptr && optimizers_->EndIfIdle((*session)->job)) {
    const Session& s = **session;
    events_->Emit("optimizer.ended",
                  absl::StrFormat("job '%s' ended with its last session: its optimizer state "
                                  "is freed, not kept for a restart",
                                  s.job.job_id),
                  {}, s.id, s.owner.uid);
  }
  return closed;
}

absl::Status TrainStreamService::ServeAllocateBuffer(grpc::ServerContext* context,
                                                     const v1::AllocateBufferRequest* request,
                                                     v1::Buffer* reply) {
  for (absl::Status valid :
       {ValidateBufferName(request->name()), ValidateBufferSize(request->bytes()),
        ValidateAlignment(request->alignment()), ValidateTag(request->tag())}) {
    if (!valid.ok()) return valid;
  }
  absl::StatusOr<std::shared_ptr<const Session>> session =
      CallersSession(context, request->session_id());
  if (!session.ok()) return session.status();
  AllocationRequest allocation;
  allocation.job = (*session)->job;
  allocation.session_id = (*session)->id;
  allocation.name = request->name();
  allocation.bytes = request->bytes();
  allocation.alignment = request->alignment() == 0 ? 4096 : request->alignment();
  allocation.tag = request->tag();
  allocation.sealable = request->sealable();
  absl::StatusOr<BufferRecord> record = arena_->Allocate(allocation);
  if (!record.ok()) {
    if (record.status().code() == absl::StatusCode::kResourceExhausted) {
      events_->Emit("arena.refused", std::string(record.status().message()),
                    {{"bytes", static_cast<double>(request->bytes())},
                     {"reserved_bytes", static_cast<double>(arena_->reserved_bytes())}},
                    (*session)->id, (*session)->owner.uid);
    }
    return record.status();
  }
  ToProto(*record, reply);
  return absl::OkStatus();
}

absl::Status TrainStreamService::ServeLookupBuffer(grpc::ServerContext* context,
                                                   const v1::LookupBufferRequest* request,
                                                   v1::Buffer* reply) {
  absl::Status valid = ValidateBufferName(request->name());
  if (!valid.ok()) return valid;
  absl::StatusOr<std::shared_ptr<const Session>> session =
      CallersSession(context, request->session_id());
  if (!session.ok()) return session.status();
  absl::StatusOr<BufferRecord> record = arena_->Lookup((*session)->job, request->name());
  if (!record.ok()) return record.status();
  ToProto(*record, reply);
  return absl::OkStatus();
}

absl::Status TrainStreamService::ServeFreeBuffer(grpc::ServerContext* context,
                                                 const v1::FreeBufferRequest* request,
                                                 v1::FreeBufferReply* reply) {
  absl::Status valid = ValidateBufferId(request->buffer_id());
  if (!valid.ok()) return valid;
  absl::StatusOr<std::shared_ptr<const Session>> session =
      CallersSession(context, request->session_id());
  if (!session.ok()) return session.status();
  return arena_->Free((*session)->job, (*session)->id, request->buffer_id());
}

absl::Status TrainStreamService::ServeSealBuffer(grpc::ServerContext* context,
                                                 const v1::SealBufferRequest* request,
                                                 v1::Buffer* reply) {
  absl::Status valid = ValidateBufferId(request->buffer_id());
  if (!valid.ok()) return valid;
  absl::StatusOr<std::shared_ptr<const Session>> session =
      CallersSession(context, request->session_id());
  if (!session.ok()) return session.status();
  absl::StatusOr<BufferRecord> record =
      arena_->Seal((*session)->job, (*session)->id, request->buffer_id());
  if (!record.ok()) return record.status();
  events_->Emit("arena.sealed", absl::StrFormat("buffer '%s' is now read-only", record->name),
                {{"bytes", static_cast<double>(record->bytes)}}, (*session)->id,
                (*session)->owner.uid);
  ToProto(*record, reply);
  return absl::OkStatus();
}

absl::Status TrainStreamService::ServeDrain(grpc::ServerContext* context,
                                            const v1::DrainRequest* /*request*/,
                                            v1::DrainReply* reply) {
  absl::StatusOr<PeerCredentials> caller = Caller(context);
  if (!caller.ok()) return caller.status();
  if (caller->uid != 0 && caller->uid != ::geteuid() && !caller->admin) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "a drain stops the daemon for every user: root, its own user (uid %d) and its admin "
        "group may ask for one, uid %d may not",
        ::geteuid(), caller->uid));
  }
  reply->set_sessions(static_cast<uint32_t>(sessions_->size()));
  events_->Emit("daemon.drain_requested",
                absl::StrFormat("uid %d asked for a drain; %d sessions are open", caller->uid,
                                reply->sessions()),
                {{"sessions", static_cast<double>(reply->sessions())}}, "", caller->uid);
  // The drain a stop signal starts, by the same path: main()'s signal thread tells the service
  // manager STOPPING and drains, as it does for `systemctl stop`.
  ::kill(::getpid(), SIGTERM);
  return absl::OkStatus();
}

absl::Status TrainStreamService::ServeGetStatus(grpc::ServerContext* context,
                                                const v1::GetStatusRequest* request,
                                                v1::Status* reply) {
  absl::StatusOr<PeerCredentials> caller = Caller(context);
  if (!caller.ok()) return caller.status();
  reply->set_version(facts_.version);
  reply->set_pid(static_cast<uint32_t>(::getpid()));
  reply->set_uptime_s(absl::ToDoubleSeconds(absl::Now() - facts_.started));
  reply->set_socket_path(facts_.socket_path);
  reply->set_draining(sessions_->draining());
  reply->set_sessions(static_cast<uint32_t>(sessions_->List(*caller).size()));
  ArenaUsage usage = arena_->Totals();
  reply->set_budget_bytes(usage.budget_bytes);
  reply->set_reserved_bytes(usage.reserved_bytes);
  reply->set_threads(facts_.threads);
  for (const GpuDescription& gpu : facts_.gpus.gpus) {
    v1::GpuInfo* info = reply->add_gpus();
    info->set_index(static_cast<uint32_t>(gpu.index));
    info->set_uuid(gpu.uuid);
    info->set_name(gpu.name);
    info->set_total_bytes(gpu.total_bytes);
  }
  reply->set_gpu_note(facts_.gpus.note);
  reply->set_metrics_url(facts_.metrics_url);
  const PeerCredentials viewer = *caller;
  for (const auto& [kind, count] : events_->CountsByKind([&](std::optional<uid_t> owner) {
         return viewer.admin || !owner.has_value() || *owner == viewer.uid;
       })) {
    v1::EventCount* row = reply->add_events();
    row->set_kind(kind);
    row->set_count(count);
  }
  for (const TransferTotals::JobRow& job : transfers_->List(viewer)) {
    v1::JobTransfers* row = reply->add_transfers();
    row->set_job_id(job.job.job_id);
    row->set_uid(job.job.uid);
    row->set_h2d_bytes(job.h2d_bytes);
    row->set_d2h_bytes(job.d2h_bytes);
  }
  return absl::OkStatus();
}

absl::Status TrainStreamService::ServeListSessions(grpc::ServerContext* context,
                                                   const v1::ListSessionsRequest* request,
                                                   v1::ListSessionsReply* reply) {
  absl::StatusOr<PeerCredentials> caller = Caller(context);
  if (!caller.ok()) return caller.status();
  ArenaUsage usage = arena_->Usage();
  const absl::Time now = absl::Now();
  for (const SessionSnapshot& snapshot : sessions_->List(*caller)) {
    const Session& s = *snapshot.session;
    v1::SessionInfo* info = reply->add_sessions();
    info->set_session_id(s.id);
    info->set_uid(s.owner.uid);
    info->set_pid(static_cast<uint32_t>(s.owner.pid));
    info->set_job_id(s.job.job_id);
    info->set_rank(s.rank);
    info->set_world_size(s.world_size);
    for (const UsageRow& row : usage.by_session) {
      if (row.key == s.id) {
        info->set_buffer_bytes(row.bytes);
        info->set_buffers(row.buffers);
      }
    }
    info->set_age_s(absl::ToDoubleSeconds(now - s.opened));
    info->set_lease_left_s(absl::ToDoubleSeconds(snapshot.lease_left));
    info->set_attached(snapshot.attached);
  }
  return absl::OkStatus();
}

absl::Status TrainStreamService::ServeGetMemory(grpc::ServerContext* context,
                                                const v1::GetMemoryRequest* request,
                                                v1::MemoryReport* reply) {
  absl::StatusOr<PeerCredentials> caller = Caller(context);
  if (!caller.ok()) return caller.status();
  ArenaUsage usage = arena_->Usage();
  reply->set_budget_bytes(usage.budget_bytes);
  reply->set_reserved_bytes(usage.reserved_bytes);
  reply->set_uid_quota_bytes(usage.uid_quota_bytes);
  reply->set_segments(usage.segments);
  if (!caller->admin) {
    // Others' figures stay private: keep only the caller's uid and sessions.
    std::vector<UsageRow> mine;
    for (const UsageRow& row : usage.by_uid) {
      if (row.key == std::to_string(caller->uid)) mine.push_back(row);
    }
    usage.by_uid = mine;
    std::vector<UsageRow> sessions;
    for (const SessionSnapshot& s : sessions_->List(*caller)) {
      for (const UsageRow& row : usage.by_session) {
        if (row.key == s.session->id) sessions.push_back(row);
      }
    }
    usage.by_session = sessions;
    usage.by_tag.clear();  // tags are not attributed per uid; only admins see the totals
  }
  reply->set_committed_bytes(usage.committed_bytes);
  for (const HostPlanRow& plan : usage.plans) {
    if (!caller->admin && plan.job.uid != caller->uid) continue;  // others' jobs stay private
    v1::JobPlan* row = reply->add_plans();
    row->set_uid(plan.job.uid);
    row->set_job_id(plan.job.job_id);
    row->set_planned_bytes(plan.planned_bytes);
    row->set_used_bytes(plan.used_bytes);
  }
  FillRows(usage.by_uid, reply->mutable_by_uid());
  FillRows(usage.by_session, reply->mutable_by_session());
  FillRows(usage.by_tag, reply->mutable_by_tag());
  return absl::OkStatus();
}

absl::Status TrainStreamService::ServeStreamEvents(grpc::ServerContext* context,
                                                   const v1::StreamEventsRequest* request,
                                                   grpc::ServerWriter<v1::Event>* writer) {
  absl::StatusOr<PeerCredentials> caller = Caller(context);
  if (!caller.ok()) return caller.status();
  const PeerCredentials viewer = *caller;
  auto visible = [viewer](const Event& e) {
    return viewer.admin || !e.uid.has_value() || *e.uid == viewer.uid;
  };
  uint64_t last = request->since_seq();
  while (true) {
    // Everything up to `examined` has been looked at, written or not visible to this caller.
    const uint64_t examined = events_->last_seq();
    for (const Event& e : events_->Since(last, visible)) {
      v1::Event out;
      out.set_seq(e.seq);
      out.set_time_unix_s(e.time_unix_s);
      out.set_session_id(e.session_id);
      out.set_kind(e.kind);
      out.set_message(e.message);
      out.set_uid(e.uid.value_or(0));
      for (const auto& [key, value] : e.numbers) (*out.mutable_numbers())[key] = value;
      if (!writer->Write(out)) return absl::OkStatus();
      last = e.seq;
    }
    last = std::max(last, examined);
    if (!request->follow()) return absl::OkStatus();
    while (!events_->WaitForNewer(last, absl::Milliseconds(200))) {
      if (context->IsCancelled() || shutting_down_) return absl::OkStatus();
    }
  }
}

}  // namespace trainstream::daemon
