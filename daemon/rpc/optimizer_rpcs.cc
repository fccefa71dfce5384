// SPDX-License-Identifier: Apache-2.0
// The optimizer half of TrainStreamService: validation and conversion around OptimizerRegistry.
#include <unistd.h>

#include "absl/strings/str_format.h"
#include "rpc/optimizer_conversion.h"
#include "rpc/request_validation.h"
#include "rpc/trainstream_service.h"
#include "trainstream/status_macros.h"

namespace trainstream::daemon {

absl::StatusOr<std::pair<std::shared_ptr<const Session>, std::shared_ptr<JobOptimizer>>>
TrainStreamService::CallersOptimizer(grpc::ServerContext* context, const std::string& session_id) {
  ASSIGN_OR_RETURN(std::shared_ptr<const Session> session, CallersSession(context, session_id));
  ASSIGN_OR_RETURN(std::shared_ptr<JobOptimizer> optimizer, optimizers_->ForSession(*session));
  return std::make_pair(std::move(session), std::move(optimizer));
}

absl::Status TrainStreamService::CheckCheckpointPath(const PeerCredentials& caller,
                                                     const std::string& path) const {
  if (path.empty() || path[0] != '/' || path.size() > 4096) {
    return absl::InvalidArgumentError("checkpoint path must be an absolute path");
  }
  // The daemon opens the file with its own identity, so it does so only for its own user.
  if (::geteuid() != caller.uid) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "this trainstreamd runs as uid %d and opens checkpoint paths only for that user; hand "
        "the file over instead (DataRequest.grant_files and file_grant, as trainstream's "
        "client does)",
        ::geteuid()));
  }
  return absl::OkStatus();
}

absl::StatusOr<TrainStreamService::CheckpointCall> TrainStreamService::CheckpointTarget(
    grpc::ServerContext* context, const v1::CheckpointRequest& request, bool write) {
  CheckpointCall call;
  ASSIGN_OR_RETURN(call.session, CallersSession(context, request.session_id()));
  if (request.file_grant() != 0) {
    ASSIGN_OR_RETURN(call.file, CheckpointFile(*call.session, request, write));
  } else {
    RETURN_IF_ERROR(CheckCheckpointPath(call.session->owner, request.path()));
  }
  ASSIGN_OR_RETURN(call.optimizer, optimizers_->ForSession(*call.session));
  return call;
}

absl::StatusOr<FileGrant> TrainStreamService::CheckpointFile(
    const Session& session, const v1::CheckpointRequest& request, bool write) {
  ASSIGN_OR_RETURN(FileGrant grant, granted_files_->Take(session.id, request.file_grant()));
  const std::map<std::string, GrantedFile>& files = grant.files();
  const auto it = files.find(request.path());
  if (files.size() != 1 || it == files.end()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a checkpoint's grant holds its one file, named as the request's path %s (this one "
        "holds %d files)",
        request.path(), files.size()));
  }
  if (write ? !it->second.writable : !it->second.readable) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s was handed over for %s only; the checkpoint is to be %s", request.path(),
        write ? "reading" : "writing", write ? "written" : "read"));
  }
  return grant;
}

absl::Status TrainStreamService::ServeCreateOptimizer(grpc::ServerContext* context,
                                                      const v1::CreateOptimizerRequest* request,
                                                      v1::OptimizerInfo* reply) {
  absl::StatusOr<std::shared_ptr<const Session>> session =
      CallersSession(context, request->session_id());
  if (!session.ok()) return session.status();
  absl::StatusOr<OptimizerSettings> settings = FromProto(request->spec());
  if (!settings.ok()) return settings.status();
  absl::StatusOr<std::shared_ptr<JobOptimizer>> optimizer =
      optimizers_->CreateOrJoin(**session, *settings);
  if (!optimizer.ok()) {
    events_->Emit("optimizer.refused", std::string(optimizer.status().message()), {},
                  (*session)->id, (*session)->owner.uid);
    return optimizer.status();
  }
  ToProto((*optimizer)->Report(), static_cast<uint32_t>(optimizers_->threads()), reply);
  return absl::OkStatus();
}

absl::Status TrainStreamService::ServeRegisterParameters(
    grpc::ServerContext* context, const v1::RegisterParametersRequest* request,
    v1::RegisterParametersReply* reply) {
  auto found = CallersOptimizer(context, request->session_id());
  if (!found.ok()) return found.status();
  auto& [session, optimizer] = *found;
  absl::StatusOr<std::vector<ParameterDescription>> params = FromProto(request->params());
  if (!params.ok()) return params.status();
  absl::StatusOr<RegistrationResult> result =
      optimizer->Register(session->id, session->rank, *params);
  if (!result.ok()) {
    events_->Emit("optimizer.refused", std::string(result.status().message()), {}, session->id,
                  session->owner.uid);
    return result.status();
  }
  for (const ParameterSlots& slots : result->params) {
    v1::ParameterBuffers* out = reply->add_params();
    out->set_index(slots.index);
    ToProto(slots.master, out->mutable_master());
    ToProto(slots.exp_avg, out->mutable_exp_avg());
    ToProto(slots.exp_avg_sq, out->mutable_exp_avg_sq());
    if (slots.param) ToProto(*slots.param, out->mutable_param());
    ToProto(slots.grad, out->mutable_grad());
    if (slots.reduce) ToProto(*slots.reduce, out->mutable_reduce());
  }
  reply->set_initialize(result->initialize);
  reply->set_first_added(result->initialize ? 0 : result->first_added);
  reply->set_step(result->iteration);
  OptimizerReport report = optimizer->Report();
  events_->Emit("optimizer.registered",
                absl::StrFormat("rank %d registered %d tensors (%d elements)", session->rank,
                                report.tensors, report.elements),
                {{"rank", session->rank},
                 {"tensors", report.tensors},
                 {"elements", static_cast<double>(report.elements)},
                 {"state_bytes", static_cast<double>(report.state_bytes)}},
                session->id, session->owner.uid);
  return absl::OkStatus();
}

absl::Status TrainStreamService::ServeSetHyperParameters(
    grpc::ServerContext* context, const v1::SetHyperParametersRequest* request,
    v1::OptimizerInfo* reply) {
  auto found = CallersOptimizer(context, request->session_id());
  if (!found.ok()) return found.status();
  auto& optimizer = found->second;
  absl::Status set = optimizer->SetGroups(FromProto(request->groups()), request->max_grad_norm());
  if (!set.ok()) return set;
  ToProto(optimizer->Report(), static_cast<uint32_t>(optimizers_->threads()), reply);
  return absl::OkStatus();
}

absl::Status TrainStreamService::ServeGetOptimizer(grpc::ServerContext* context,
                                                   const v1::GetOptimizerRequest* request,
                                                   v1::OptimizerInfo* reply) {
  auto found = CallersOptimizer(context, request->session_id());
  if (!found.ok()) return found.status();
  ToProto(found->second->Report(), static_cast<uint32_t>(optimizers_->threads()), reply);
  return absl::OkStatus();
}

absl::Status TrainStreamService::ServeSetOptimizerStep(grpc::ServerContext* context,
                                                       const v1::SetOptimizerStepRequest* request,
                                                       v1::OptimizerInfo* reply) {
  auto found = CallersOptimizer(context, request->session_id());
  if (!found.ok()) return found.status();
  std::vector<uint64_t> steps(request->param_steps().begin(), request->param_steps().end());
  absl::Status set = found->second->SetSteps(request->step(), steps);
  if (!set.ok()) return set;
  ToProto(found->second->Report(), static_cast<uint32_t>(optimizers_->threads()), reply);
  return absl::OkStatus();
}

absl::Status TrainStreamService::ServeSaveCheckpoint(grpc::ServerContext* context,
                                                     const v1::CheckpointRequest* request,
                                                     v1::CheckpointReply* reply) {
  absl::StatusOr<CheckpointCall> call = CheckpointTarget(context, *request, /*write=*/true);
  if (!call.ok()) return call.status();
  const std::shared_ptr<const Session>& session = call->session;
  const absl::Time start = absl::Now();
  absl::StatusOr<uint64_t> bytes =
      call->file ? call->optimizer->SaveTo(call->file->files().at(request->path()).fd.get(),
                                           request->path())
                 : call->optimizer->Save(request->path());
  if (!bytes.ok()) return bytes.status();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  reply->set_bytes(*bytes);
  reply->set_seconds(seconds);
  reply->set_step(call->optimizer->Report().iteration);
  events_->Emit("optimizer.checkpoint_saved",
                absl::StrFormat("optimizer state written to %s", request->path()),
                {{"bytes", static_cast<double>(*bytes)},
                 {"seconds", seconds},
                 {"step", static_cast<double>(reply->step())}},
                session->id, session->owner.uid);
  return absl::OkStatus();
}

absl::Status TrainStreamService::ServeLoadCheckpoint(grpc::ServerContext* context,
                                                     const v1::CheckpointRequest* request,
                                                     v1::CheckpointReply* reply) {
  absl::StatusOr<CheckpointCall> call = CheckpointTarget(context, *request, /*write=*/false);
  if (!call.ok()) return call.status();
  const std::shared_ptr<const Session>& session = call->session;
  const absl::Time start = absl::Now();
  absl::Status loaded = call->file ? call->optimizer->Load(request->path(), *call->file)
                                   : call->optimizer->Load(request->path());
  if (!loaded.ok()) return loaded;
  reply->set_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  reply->set_step(call->optimizer->Report().iteration);
  events_->Emit("optimizer.checkpoint_loaded",
                absl::StrFormat("optimizer state restored from %s", request->path()),
                {{"step", static_cast<double>(reply->step())}}, session->id, session->owner.uid);
  return absl::OkStatus();
}

absl::Status TrainStreamService::ServeListOptimizers(grpc::ServerContext* context,
                                                     const v1::ListOptimizersRequest* request,
                                                     v1::ListOptimizersReply* reply) {
  absl::StatusOr<PeerCredentials> caller = Caller(context);
  if (!caller.ok()) return caller.status();
  for (const OptimizerReport& report : optimizers_->List(*caller)) {
    ToProto(report, static_cast<uint32_t>(optimizers_->threads()), reply->add_optimizers());
  }
  return absl::OkStatus();
}

}  // namespace trainstream::daemon
