// SPDX-License-Identifier: Apache-2.0
#include "trainstream/host_optimizer.h"

#include <bit>
#include <cmath>
#include <set>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "device_return.h"
#include "gradient_sender.h"
#include "session_impl.h"

namespace trainstream::client {
namespace {

v1::DType ToProto(DType type) { return static_cast<v1::DType>(static_cast<int>(type)); }

void ToProto(const OptimizerGroup& g, v1::ParamGroup* out) {
  out->set_lr(g.lr);
  out->set_beta1(g.beta1);
  out->set_beta2(g.beta2);
  out->set_eps(g.eps);
  out->set_weight_decay(g.weight_decay);
}

void ToProto(const OptimizerOptions& options, v1::OptimizerSpec* spec) {
  spec->set_kind(options.adamw ? v1::ADAMW : v1::ADAM);
  spec->set_moment_dtype(ToProto(options.moment_dtype));
  spec->set_max_grad_norm(options.max_grad_norm);
  spec->set_report_grad_norm(options.report_grad_norm);
  spec->set_nonfinite(static_cast<v1::NonFinitePolicy>(static_cast<int>(options.nonfinite)));
  spec->set_accumulation_steps(options.accumulation_steps);
  spec->set_machines(options.machines);
  spec->set_threads(options.threads);
  spec->set_chunk_elements(options.chunk_elements);
  spec->set_defer_updates(options.defer_updates);
  spec->set_eager_updates(options.eager_updates);
  for (const OptimizerGroup& g : options.groups) ToProto(g, spec->add_groups());
}

void ToProto(const ParameterInfo& p, v1::ParameterSpec* out) {
  out->set_name(p.name);
  out->set_numel(p.numel);
  out->set_param_dtype(ToProto(p.param_dtype));
  out->set_grad_dtype(ToProto(p.grad_dtype));
  out->set_group(p.group);
}

constexpr uint32_t Kind(ipc::DoorbellKind kind) { return static_cast<uint32_t>(kind); }

}  // namespace

absl::StatusOr<HostMemoryEstimate> HostOptimizer::EstimateHostMemory(
    Session& session, const OptimizerOptions& options, const std::vector<ParameterInfo>& params,
    uint32_t ranks, const std::vector<uint64_t>& other_buffers) {
  Session::Impl& impl = *session.impl_;
  RETURN_IF_ERROR(impl.CheckUsable());
  v1::EstimateHostMemoryRequest request;
  request.set_session_id(impl.id());
  ToProto(options, request.mutable_spec());
  for (const ParameterInfo& p : params) ToProto(p, request.add_params());
  request.set_ranks(ranks);
  for (uint64_t bytes : other_buffers) request.add_other_buffers(bytes);
  v1::HostMemoryEstimate reply;
  RETURN_IF_ERROR(impl.channel().Call([&](grpc::ClientContext* c) {
    return impl.channel().stub().EstimateHostMemory(c, request, &reply);
  }));
  return HostMemoryEstimate{reply.bytes(),   reply.optimizer_bytes(), reply.buffer_bytes(),
                            reply.buffers(), reply.segment_bytes(),   reply.segment_granularity()};
}

namespace {

// The job's optimizer as the daemon sees it now, asked by session `session_id`.
absl::StatusOr<v1::OptimizerInfo> OptimizerInfoOf(ControlChannel& channel,
                                                  const std::string& session_id) {
  v1::GetOptimizerRequest request;
  request.set_session_id(session_id);
  v1::OptimizerInfo reply;
  RETURN_IF_ERROR(channel.Call(
      [&](grpc::ClientContext* c) { return channel.stub().GetOptimizer(c, request, &reply); }));
  return reply;
}

}  // namespace

absl::StatusOr<std::unique_ptr<HostOptimizer>> HostOptimizer::Create(
    Session& session, const OptimizerOptions& options, const std::vector<ParameterInfo>& params) {
  Session::Impl& impl = *session.impl_;
  RETURN_IF_ERROR(impl.CheckUsable());
  v1::CreateOptimizerRequest create;
  create.set_session_id(impl.id());
  ToProto(options, create.mutable_spec());
  v1::OptimizerInfo info;
  RETURN_IF_ERROR(impl.channel().Call([&](grpc::ClientContext* c) {
    return impl.channel().stub().CreateOptimizer(c, create, &info);
  }));

  auto optimizer = std::unique_ptr<HostOptimizer>(new HostOptimizer(session));
  ASSIGN_OR_RETURN(Registered reply, optimizer->Register(params));
  optimizer->initialize_ = reply.initialize;
  optimizer->attached_at_ = reply.step;
  return optimizer;
}

absl::StatusOr<HostOptimizer::Registered> HostOptimizer::Register(
    const std::vector<ParameterInfo>& params) {
  Session::Impl& impl = *session_.impl_;
  v1::RegisterParametersRequest reg;
  reg.set_session_id(impl.id());
  for (const ParameterInfo& p : params) ToProto(p, reg.add_params());
  v1::RegisterParametersReply reply;
  RETURN_IF_ERROR(impl.channel().CallWithTimeout(
      [&](grpc::ClientContext* c) {
        return impl.channel().stub().RegisterParameters(c, reg, &reply);
      },
      kLongCallTimeout));
  // Map the buffers of parameters this process has not seen yet (all of them the first time).
  for (const v1::ParameterBuffers& b : reply.params()) {
    if (b.index() < params_.size()) continue;
    ParameterBuffers mapped;
    mapped.index = b.index();
    ASSIGN_OR_RETURN(mapped.master, impl.MapBuffer(FromProto(b.master())));
    ASSIGN_OR_RETURN(mapped.exp_avg, impl.MapBuffer(FromProto(b.exp_avg())));
    ASSIGN_OR_RETURN(mapped.exp_avg_sq, impl.MapBuffer(FromProto(b.exp_avg_sq())));
    if (b.has_param()) {
      ASSIGN_OR_RETURN(mapped.param, impl.MapBuffer(FromProto(b.param())));
    }
    ASSIGN_OR_RETURN(mapped.grad, impl.MapBuffer(FromProto(b.grad())));
    if (b.has_reduce()) {
      ASSIGN_OR_RETURN(mapped.reduce, impl.MapBuffer(FromProto(b.reduce())));
    }
    params_.push_back(std::move(mapped));
  }
  return Registered{reply.initialize(), reply.step(), reply.first_added()};
}

absl::StatusOr<uint32_t> HostOptimizer::AddParameters(const std::vector<ParameterInfo>& all) {
  if (all.size() <= params_.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%d parameters given; the optimizer already has %d: pass the whole list, new ones last",
        all.size(), params_.size()));
  }
  // The sender's thread reads params_ (through PostGradient): nothing may be in flight while
  // it grows.
  RETURN_IF_ERROR(DrainGradients());
  ASSIGN_OR_RETURN(Registered reply, Register(all));
  return reply.first_added;
}

absl::Status HostOptimizer::AddDeviceTargets(std::vector<DeviceTarget> targets) {
  if (device_return_ == nullptr) return absl::FailedPreconditionError("no device returns");
  const size_t have = device_return_->size();
  if (have + targets.size() != params_.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%d device targets given; parameters %d to %d have none", targets.size(),
                        have, params_.size() - 1));
  }
  std::vector<std::shared_ptr<HostBuffer>> sources;
  for (size_t i = have; i < params_.size(); ++i) {
    sources.push_back(params_[i].param ? params_[i].param : params_[i].master);
  }
  return device_return_->Extend(std::move(sources), std::move(targets));
}

absl::Status HostOptimizer::PostGradient(uint32_t index, uint64_t iteration, uint32_t micro,
                                         bool no_gradient) {
  if (index >= params_.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "parameter index %d is out of range: the optimizer has %d", index, params_.size()));
  }
  return session_.Ring({Kind(ipc::DoorbellKind::kGradientReady), index, iteration, micro,
                        no_gradient ? ipc::kFlagNoGradient : 0u});
}

absl::Status HostOptimizer::PostNormContribution(uint64_t iteration, double sum_squares) {
  if (!(sum_squares >= 0) || !std::isfinite(sum_squares)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a gradient norm contribution must be a finite sum of squares >= 0, got %g", sum_squares));
  }
  return session_.Ring({Kind(ipc::DoorbellKind::kNormContribution), 0, iteration,
                        std::bit_cast<uint64_t>(sum_squares), 0u});
}

absl::Status HostOptimizer::SendGradient(uint32_t index, uint64_t iteration, uint32_t micro,
                                         int device, const void* device_src, uint64_t bytes,
                                         void* stream) {
  return SendGradients(iteration, device, {{index, micro, device_src, bytes}}, stream);
}

absl::Status HostOptimizer::SendGradients(uint64_t iteration, int device,
                                          const std::vector<GradientCopy>& copies, void* stream) {
  std::vector<GradientSender::Copy> sends;
  sends.reserve(copies.size());
  for (const GradientCopy& c : copies) {
    if (c.index >= params_.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "parameter index %d is out of range: the optimizer has %d", c.index, params_.size()));
    }
    sends.push_back({params_[c.index].grad.get(), c.index, c.micro, c.device_src, c.bytes});
  }
  GradientSender* sender = nullptr;
  {
    absl::MutexLock lock(&sender_mu_);
    if (sender_ == nullptr) {
      ASSIGN_OR_RETURN(sender_,
                       GradientSender::Create(device, [this](uint32_t i, uint64_t it, uint32_t m) {
                         return PostGradient(i, it, m);
                       }));
    }
    sender = sender_.get();  // lives as long as this object
  }
  return sender->Send(iteration, sends, stream);
}

absl::Status HostOptimizer::DrainGradients() {
  GradientSender* sender = nullptr;
  {
    absl::MutexLock lock(&sender_mu_);
    sender = sender_.get();
  }
  return sender == nullptr ? absl::OkStatus() : sender->Drain();
}

absl::Status HostOptimizer::ExplainFailure() {
  // The daemon keeps the reason in the job's state ("failed: <why>"): read from the reply's
  // field, never from its JSON text.
  Session::Impl& impl = *session_.impl_;
  absl::StatusOr<v1::OptimizerInfo> info = OptimizerInfoOf(impl.channel(), impl.id());
  if (!info.ok() || info->state().empty()) {
    return absl::FailedPreconditionError("the job's optimizer failed");
  }
  return absl::FailedPreconditionError(info->state());
}

HostOptimizer::HostOptimizer(Session& session) : session_(session) {}

HostOptimizer::~HostOptimizer() {
  {
    // Its thread posts through this object: it goes (drained) first.
    absl::MutexLock lock(&sender_mu_);
    sender_.reset();
  }
  // The pump copies returned updates through device_return_: it stops before that goes.
  if (device_return_ != nullptr) session_.impl_->ClearDispatcher(this);
}

absl::StatusOr<Notice> HostOptimizer::NextNotice(int timeout_ms) {
  // A failed copy back fails every wait until SetStep or Load starts over: at once, and for
  // the notice just taken too (it is dispatched before it is queued, so its copy's failure is
  // known by the time it is read).
  auto failed_return = [this]() -> absl::Status {
    absl::MutexLock lock(&return_mu_);
    return return_error_;
  };
  RETURN_IF_ERROR(failed_return());
  absl::StatusOr<Notice> next = session_.Wait(timeout_ms);
  RETURN_IF_ERROR(failed_return());
  ASSIGN_OR_RETURN(Notice notice, std::move(next));
  if (notice.kind == Kind(ipc::DoorbellKind::kError)) return ExplainFailure();
  return notice;
}

void HostOptimizer::ReturnUpdate(const Notice& notice) {
  if (notice.kind != Kind(ipc::DoorbellKind::kUpdateDone) ||
      (notice.flags & (ipc::kFlagSkipped | ipc::kFlagNoGradient))) {
    return;
  }
  // An asynchronous copy on the return stream: the pump is held only while it is queued (or
  // while SynchronizeDeviceReturns holds the stream), and the daemon's ring keeps many steps
  // of notices meanwhile.
  absl::Status copied = device_return_->Copy(static_cast<uint32_t>(notice.id));
  if (!copied.ok()) {
    // Kept for the waits (until SetStep or Load starts over); later notices and copies still
    // flow.
    absl::MutexLock lock(&return_mu_);
    if (return_error_.ok()) return_error_ = std::move(copied);
  }
}

absl::Status HostOptimizer::ReturnUpdatesToDevice(int device, std::vector<DeviceTarget> targets) {
  if (device_return_ != nullptr) {
    return absl::FailedPreconditionError("updates already return to the device");
  }
  std::vector<std::shared_ptr<HostBuffer>> sources;
  for (const ParameterBuffers& b : params_) sources.push_back(b.param ? b.param : b.master);
  ASSIGN_OR_RETURN(device_return_,
                   DeviceReturn::Create(device, std::move(sources), std::move(targets)));
  absl::Status dispatching =
      session_.impl_->SetDispatcher(this, [this](const Notice& notice) { ReturnUpdate(notice); });
  if (!dispatching.ok()) device_return_.reset();
  return dispatching;
}

absl::Status HostOptimizer::RetargetDevice(uint32_t index, DeviceTarget target) {
  if (device_return_ == nullptr) return absl::FailedPreconditionError("no device returns");
  return device_return_->Retarget(index, target);
}

absl::Status HostOptimizer::WaitForParameters(const std::vector<uint32_t>& indices, void* stream) {
  if (device_return_ == nullptr) return absl::FailedPreconditionError("no device returns");
  return device_return_->WaitOnStream(indices, stream);
}

absl::Status HostOptimizer::SynchronizeDeviceReturns() {
  if (device_return_ == nullptr) return absl::OkStatus();
  return device_return_->Synchronize();
}

absl::Status HostOptimizer::WaitGradientConsumed(uint32_t index, uint64_t iteration,
                                                 int timeout_ms) {
  return WaitForNotice(Kind(ipc::DoorbellKind::kGradConsumed), index, iteration, timeout_ms,
                       "the daemon did not take parameter %d's gradient in time (has every rank "
                       "posted it?)");
}

absl::StatusOr<bool> HostOptimizer::WaitReduceReady(uint32_t index, uint64_t iteration,
                                                    int timeout_ms) {
  uint64_t had_gradient = 0;
  RETURN_IF_ERROR(WaitForNotice(Kind(ipc::DoorbellKind::kReduceReady), index, iteration, timeout_ms,
                                "parameter %d's machine-summed gradient did not arrive in time "
                                "(has every rank of this machine posted it?)",
                                &had_gradient));
  return had_gradient != 0;
}

absl::Status HostOptimizer::PostReduced(uint32_t index, uint64_t iteration, bool any_gradient) {
  if (index >= params_.size() || params_[index].reduce == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "parameter %d has no reduce buffer here (only a multi-machine job's rank 0 has them)",
        index));
  }
  return session_.Ring(
      {Kind(ipc::DoorbellKind::kReduced), index, iteration, any_gradient ? 1u : 0u, 0u});
}

absl::Status HostOptimizer::WaitForNotice(uint32_t kind, uint32_t index, uint64_t iteration,
                                          int timeout_ms, const absl::FormatSpec<uint32_t>& late,
                                          uint64_t* value) {
  for (auto it = held_.begin(); it != held_.end(); ++it) {
    if (it->kind == kind && it->id == index && it->step == iteration) {
      if (value != nullptr) *value = it->value;
      held_.erase(it);
      return absl::OkStatus();
    }
  }
  const absl::Time deadline = absl::Now() + absl::Milliseconds(timeout_ms);
  while (true) {
    const int left = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (left <= 0) return absl::DeadlineExceededError(absl::StrFormat(late, index));
    absl::StatusOr<Notice> next = NextNotice(left);
    if (next.status().code() == absl::StatusCode::kDeadlineExceeded) continue;  // explained above
    ASSIGN_OR_RETURN(Notice notice, std::move(next));
    if (notice.kind == kind && notice.id == index && notice.step == iteration) {
      if (value != nullptr) *value = notice.value;
      return absl::OkStatus();
    }
    held_.push_back(notice);
  }
}

absl::StatusOr<IterationResult> HostOptimizer::WaitIteration(uint64_t iteration, int timeout_ms) {
  IterationResult result;
  result.iteration = iteration;
  result.updated.assign(params_.size(), false);
  std::set<uint64_t> pending;
  for (size_t i = 0; i < params_.size(); ++i) pending.insert(i);
  auto take = [&](const Notice& n) {
    if (n.kind != Kind(ipc::DoorbellKind::kUpdateDone) || n.step != iteration) return false;
    if (!pending.erase(n.id)) return true;  // a duplicate: ignore
    if (n.flags & ipc::kFlagSkipped) result.skipped = true;
    result.updated[n.id] = !(n.flags & (ipc::kFlagSkipped | ipc::kFlagNoGradient));
    return true;
  };
  std::vector<Notice> keep;
  for (const Notice& n : held_) {
    if (!take(n)) keep.push_back(n);
  }
  held_ = std::move(keep);
  const absl::Time deadline = absl::Now() + absl::Milliseconds(timeout_ms);
  while (!pending.empty()) {
    const int left = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (left <= 0) {
      std::vector<std::string> names;
      for (uint64_t i : pending) {
        if (names.size() == 5) {
          names.push_back("...");
          break;
        }
        names.push_back(std::to_string(i));
      }
      return absl::DeadlineExceededError(absl::StrFormat(
          "iteration %d: no update yet for %d parameter(s) (indices %s); was every gradient "
          "posted by every rank?",
          iteration, pending.size(), absl::StrJoin(names, ", ")));
    }
    absl::StatusOr<Notice> next = NextNotice(left);
    if (next.status().code() == absl::StatusCode::kDeadlineExceeded) continue;  // explained above
    ASSIGN_OR_RETURN(Notice notice, std::move(next));
    if (!take(notice)) held_.push_back(notice);
  }
  return result;
}

absl::Status HostOptimizer::SetGroups(const std::vector<OptimizerGroup>& groups,
                                      double max_grad_norm) {
  Session::Impl& impl = *session_.impl_;
  v1::SetHyperParametersRequest request;
  request.set_session_id(impl.id());
  for (const OptimizerGroup& g : groups) ToProto(g, request.add_groups());
  request.set_max_grad_norm(max_grad_norm);
  v1::OptimizerInfo reply;
  return impl.channel().Call([&](grpc::ClientContext* c) {
    return impl.channel().stub().SetHyperParameters(c, request, &reply);
  });
}

void HostOptimizer::ForgetNotices() {
  held_.clear();
  absl::MutexLock lock(&return_mu_);
  return_error_ = absl::OkStatus();
}

absl::Status HostOptimizer::SetStep(uint64_t iteration, const std::vector<uint64_t>& steps) {
  Session::Impl& impl = *session_.impl_;
  v1::SetOptimizerStepRequest request;
  request.set_session_id(impl.id());
  request.set_step(iteration);
  for (uint64_t s : steps) request.add_param_steps(s);
  v1::OptimizerInfo reply;
  ForgetNotices();
  return impl.channel().Call([&](grpc::ClientContext* c) {
    return impl.channel().stub().SetOptimizerStep(c, request, &reply);
  });
}

absl::StatusOr<uint64_t> HostOptimizer::Save(const std::string& path) {
  Session::Impl& impl = *session_.impl_;
  // This process creates the file, with its own rights, and the daemon writes it: the
  // checkpoint is the caller's, wherever the caller may write, whichever user the daemon is.
  std::string temporary;
  ASSIGN_OR_RETURN(CallerFile file, CreateCheckpointTemporary(path, &temporary));
  auto written = [&]() -> absl::StatusOr<uint64_t> {
    std::vector<CallerFile> files;
    files.push_back(CallerFile{file.name, std::move(file.fd)});
    ASSIGN_OR_RETURN(const uint64_t grant, impl.GrantFiles(files));
    files.clear();  // the daemon holds its own descriptor now
    v1::CheckpointRequest request;
    request.set_session_id(impl.id());
    request.set_path(file.name);
    request.set_file_grant(grant);
    v1::CheckpointReply reply;
    RETURN_IF_ERROR(impl.channel().CallWithTimeout(
        [&](grpc::ClientContext* c) {
          return impl.channel().stub().SaveCheckpoint(c, request, &reply);
        },
        kLongCallTimeout));
    return reply.bytes();
  }();
  if (!written.ok()) {
    ::unlink(temporary.c_str());
    return written;
  }
  RETURN_IF_ERROR(CommitCheckpoint(temporary, file.name));
  return written;
}

absl::Status HostOptimizer::Load(const std::string& path) {
  Session::Impl& impl = *session_.impl_;
  std::vector<CallerFile> files;
  ASSIGN_OR_RETURN(CallerFile file, OpenForReading(path));
  files.push_back(std::move(file));
  ASSIGN_OR_RETURN(const uint64_t grant, impl.GrantFiles(files));
  v1::CheckpointRequest request;
  request.set_session_id(impl.id());
  request.set_path(files.front().name);
  request.set_file_grant(grant);
  v1::CheckpointReply reply;
  ForgetNotices();
  return impl.channel().CallWithTimeout(
      [&](grpc::ClientContext* c) {
        return impl.channel().stub().LoadCheckpoint(c, request, &reply);
      },
      kLongCallTimeout);
}

absl::StatusOr<OptimizerInfo> HostOptimizer::Info() {
  Session::Impl& impl = *session_.impl_;
  ASSIGN_OR_RETURN(v1::OptimizerInfo reply, OptimizerInfoOf(impl.channel(), impl.id()));
  return FromProto(reply);
}

}  // namespace trainstream::client
