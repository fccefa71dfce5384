// SPDX-License-Identifier: Apache-2.0
#include "replies.h"

#include <string>

namespace trainstream::client {
namespace {

// A repeated field as a vector, each element converted by `convert`.
template <typename Repeated, typename Convert>
auto ListOf(const Repeated& items, Convert convert) {
  std::vector<decltype(convert(*items.begin()))> out;
  out.reserve(items.size());
  for (const auto& item : items) out.push_back(convert(item));
  return out;
}

template <typename Repeated>
auto ValuesOf(const Repeated& items) {
  return std::vector<typename Repeated::value_type>(items.begin(), items.end());
}

UsageRow RowOf(const v1::UsageRow& r) { return UsageRow{r.key(), r.bytes(), r.buffers()}; }

SessionInfo SessionOf(const v1::SessionInfo& s) {
  return SessionInfo{s.session_id(), s.uid(),          s.pid(),          s.job_id(),
                     s.rank(),       s.world_size(),   s.buffer_bytes(), s.buffers(),
                     s.age_s(),      s.lease_left_s(), s.attached()};
}

BaseTensor TensorOf(const v1::BaseTensor& t) {
  return BaseTensor{t.name(),       ValuesOf(t.shape()), t.source_dtype(), t.stored(),
                    t.block(),      t.tensor_scale(),    t.buffer(),       t.data_offset(),
                    t.data_bytes(), t.scale_offset(),    t.scale_bytes()};
}

OptimizerSpec SpecOf(const v1::OptimizerSpec& s) {
  OptimizerSpec out;
  out.kind = v1::OptimizerKind_Name(s.kind());
  out.moment_dtype = v1::DType_Name(s.moment_dtype());
  out.max_grad_norm = s.max_grad_norm();
  out.report_grad_norm = s.report_grad_norm();
  out.nonfinite = v1::NonFinitePolicy_Name(s.nonfinite());
  out.accumulation_steps = s.accumulation_steps();
  out.groups = ListOf(s.groups(), [](const v1::ParamGroup& g) {
    return OptimizerGroup{g.lr(), g.beta1(), g.beta2(), g.eps(), g.weight_decay()};
  });
  out.machines = s.machines();
  out.threads = s.threads();
  out.chunk_elements = s.chunk_elements();
  out.defer_updates = s.defer_updates();
  out.eager_updates = s.eager_updates();
  return out;
}

StepStats StepOf(const v1::StepStats& s) {
  return StepStats{s.step(),           s.grad_norm(), s.clip_coef(),
                   s.skipped(),        s.nonfinite(), s.seconds(),
                   s.update_seconds(), s.gbps(),      s.speculated_tensors(),
                   s.rolled_back()};
}

}  // namespace

BufferInfo FromProto(const v1::Buffer& b) {
  return BufferInfo{b.buffer_id(), b.name(), b.segment_id(), b.offset(),
                    b.bytes(),     b.tag(),  b.read_only(),  b.owner_session_id()};
}

DaemonStatus FromProto(const v1::Status& s) {
  DaemonStatus out;
  out.version = s.version();
  out.pid = s.pid();
  out.uptime_s = s.uptime_s();
  out.socket_path = s.socket_path();
  out.draining = s.draining();
  out.sessions = s.sessions();
  out.budget_bytes = s.budget_bytes();
  out.reserved_bytes = s.reserved_bytes();
  out.threads = s.threads();
  out.gpus = ListOf(s.gpus(), [](const v1::GpuInfo& g) {
    return GpuInfo{g.index(), g.uuid(), g.name(), g.total_bytes()};
  });
  out.gpu_note = s.gpu_note();
  out.events = ListOf(s.events(), [](const v1::EventCount& e) {
    return EventCount{e.kind(), e.count()};
  });
  out.transfers = ListOf(s.transfers(), [](const v1::JobTransfers& t) {
    return JobTransfers{t.job_id(), t.uid(), t.h2d_bytes(), t.d2h_bytes()};
  });
  out.metrics_url = s.metrics_url();
  return out;
}

std::vector<SessionInfo> FromProto(const v1::ListSessionsReply& reply) {
  return ListOf(reply.sessions(), SessionOf);
}

MemoryReport FromProto(const v1::MemoryReport& m) {
  MemoryReport out;
  out.budget_bytes = m.budget_bytes();
  out.reserved_bytes = m.reserved_bytes();
  out.uid_quota_bytes = m.uid_quota_bytes();
  out.segments = m.segments();
  out.by_uid = ListOf(m.by_uid(), RowOf);
  out.by_session = ListOf(m.by_session(), RowOf);
  out.by_tag = ListOf(m.by_tag(), RowOf);
  out.committed_bytes = m.committed_bytes();
  out.plans = ListOf(m.plans(), [](const v1::JobPlan& p) {
    return JobPlan{p.uid(), p.job_id(), p.planned_bytes(), p.used_bytes()};
  });
  return out;
}

Event FromProto(const v1::Event& e) {
  return Event{
      e.seq(),        e.time_unix_s(),
      e.session_id(), e.kind(),
      e.message(),    std::map<std::string, double>(e.numbers().begin(), e.numbers().end()),
      e.uid()};
}

HostPlan FromProto(const v1::HostPlan& p) {
  return HostPlan{p.job_id(), p.planned_bytes(), p.used_bytes(), p.budget_bytes(),
                  p.committed_bytes()};
}

BaseInfo FromProto(const v1::BaseInfo& b) {
  BaseInfo out;
  out.base_id = b.base_id();
  out.uid = b.uid();
  out.name = b.name();
  out.source = b.source();
  out.format = b.format();
  out.block = b.block();
  out.state = b.state();
  out.error = b.error();
  out.stored_bytes = b.stored_bytes();
  out.source_bytes = b.source_bytes();
  out.read_bytes = b.read_bytes();
  out.read_total = b.read_total();
  out.load_seconds = b.load_seconds();
  out.users = b.users();
  out.idle_s = b.idle_s();
  out.buffers = ListOf(b.buffers(), [](const v1::Buffer& buffer) { return FromProto(buffer); });
  out.tensors = ListOf(b.tensors(), TensorOf);
  return out;
}

std::vector<BaseInfo> FromProto(const v1::ListBasesReply& reply) {
  return ListOf(reply.bases(), [](const v1::BaseInfo& b) { return FromProto(b); });
}

GpuPoolInfo FromProto(const v1::GpuPoolInfo& p) {
  return GpuPoolInfo{p.pool_id(),
                     p.gpu_uuid(),
                     p.bytes(),
                     p.kind(),
                     p.purpose(),
                     p.uid(),
                     ValuesOf(p.importers()),
                     p.base_id(),
                     ValuesOf(p.buffer_offsets()),
                     p.fill_seconds()};
}

GpuPools FromProto(const v1::ListGpuPoolsReply& reply) {
  return GpuPools{ListOf(reply.pools(), [](const v1::GpuPoolInfo& p) { return FromProto(p); }),
                  reply.note()};
}

OptimizerInfo FromProto(const v1::OptimizerInfo& info) {
  OptimizerInfo out;
  out.job_id = info.job_id();
  if (info.has_spec()) out.spec = SpecOf(info.spec());
  out.step = info.step();
  out.world_size = info.world_size();
  out.ranks_attached = info.ranks_attached();
  out.params = info.params();
  out.tensors = info.tensors();
  out.state_bytes = info.state_bytes();
  if (info.has_last_step()) out.last_step = StepOf(info.last_step());
  out.isa = info.isa();
  out.threads = info.threads();
  out.state = info.state();
  out.param_steps = ValuesOf(info.param_steps());
  out.speculated_steps = info.speculated_steps();
  out.rolled_back_steps = info.rolled_back_steps();
  return out;
}

}  // namespace trainstream::client
