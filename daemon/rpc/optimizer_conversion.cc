// SPDX-License-Identifier: Apache-2.0
#include "rpc/optimizer_conversion.h"

#include "absl/strings/str_format.h"
#include "rpc/request_validation.h"
#include "trainstream/status_macros.h"

namespace trainstream::daemon {

absl::StatusOr<kernels::ScalarType> FromProto(v1::DType dtype, const char* field) {
  switch (dtype) {
    case v1::FLOAT32: return kernels::ScalarType::kFloat32;
    case v1::BFLOAT16: return kernels::ScalarType::kBFloat16;
    case v1::FLOAT16: return kernels::ScalarType::kFloat16;
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("%s must be FLOAT32, BFLOAT16 or FLOAT16", field));
  }
}

v1::DType ToProto(kernels::ScalarType type) {
  switch (type) {
    case kernels::ScalarType::kFloat32: return v1::FLOAT32;
    case kernels::ScalarType::kBFloat16: return v1::BFLOAT16;
    case kernels::ScalarType::kFloat16: return v1::FLOAT16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

std::vector<GroupHyperParameters> FromProto(
    const google::protobuf::RepeatedPtrField<v1::ParamGroup>& groups) {
  std::vector<GroupHyperParameters> out;
  for (const v1::ParamGroup& g : groups) {
    out.push_back({g.lr(), g.beta1(), g.beta2(), g.eps(), g.weight_decay()});
  }
  return out;
}

absl::StatusOr<OptimizerSettings> FromProto(const v1::OptimizerSpec& spec) {
  OptimizerSettings s;
  s.decoupled_weight_decay = spec.kind() != v1::ADAM;
  if (spec.moment_dtype() != v1::DTYPE_UNSPECIFIED) {
    ASSIGN_OR_RETURN(s.moment_type, FromProto(spec.moment_dtype(), "moment_dtype"));
  }
  s.max_grad_norm = spec.max_grad_norm();
  s.report_grad_norm = spec.report_grad_norm();
  switch (spec.nonfinite()) {
    case v1::NONFINITE_SKIP_STEP: s.nonfinite = NonFinitePolicy::kSkipStep; break;
    case v1::NONFINITE_ERROR: s.nonfinite = NonFinitePolicy::kError; break;
    case v1::NONFINITE_GUARD: s.nonfinite = NonFinitePolicy::kGuard; break;
    default: s.nonfinite = NonFinitePolicy::kIgnore; break;
  }
  s.accumulation_steps = spec.accumulation_steps() == 0 ? 1 : spec.accumulation_steps();
  s.machines = spec.machines() == 0 ? 1 : spec.machines();
  s.groups = FromProto(spec.groups());
  s.threads = spec.threads();
  s.chunk_elements = spec.chunk_elements();
  s.defer_updates = spec.defer_updates();
  s.eager_updates = spec.eager_updates();
  RETURN_IF_ERROR(ValidateSettings(s));
  return s;
}

absl::StatusOr<std::vector<ParameterDescription>> FromProto(
    const google::protobuf::RepeatedPtrField<v1::ParameterSpec>& params) {
  std::vector<ParameterDescription> out;
  for (const v1::ParameterSpec& p : params) {
    ParameterDescription d;
    RETURN_IF_ERROR(ValidateBufferName(p.name()));
    d.name = p.name();
    if (p.numel() == 0 || p.numel() > kMaxBufferBytes / 4) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "parameter '%s' has %d elements; it needs between 1 and 2^42", p.name(), p.numel()));
    }
    d.numel = p.numel();
    ASSIGN_OR_RETURN(d.param_type, FromProto(p.param_dtype(), "param_dtype"));
    ASSIGN_OR_RETURN(d.grad_type, FromProto(p.grad_dtype(), "grad_dtype"));
    d.group = p.group();
    out.push_back(std::move(d));
  }
  return out;
}

void ToProto(const OptimizerSettings& s, v1::OptimizerSpec* out) {
  out->set_kind(s.decoupled_weight_decay ? v1::ADAMW : v1::ADAM);
  out->set_moment_dtype(ToProto(s.moment_type));
  out->set_max_grad_norm(s.max_grad_norm);
  out->set_report_grad_norm(s.report_grad_norm);
  out->set_nonfinite(s.nonfinite == NonFinitePolicy::kSkipStep ? v1::NONFINITE_SKIP_STEP
                     : s.nonfinite == NonFinitePolicy::kIgnore ? v1::NONFINITE_IGNORE
                     : s.nonfinite == NonFinitePolicy::kGuard  ? v1::NONFINITE_GUARD
                                                               : v1::NONFINITE_ERROR);
  out->set_accumulation_steps(s.accumulation_steps);
  out->set_machines(s.machines);
  out->set_threads(s.threads);
  out->set_chunk_elements(s.chunk_elements);
  out->set_defer_updates(s.defer_updates);
  out->set_eager_updates(s.eager_updates);
  for (const GroupHyperParameters& g : s.groups) {
    v1::ParamGroup* pg = out->add_groups();
    pg->set_lr(g.lr);
    pg->set_beta1(g.beta1);
    pg->set_beta2(g.beta2);
    pg->set_eps(g.eps);
    pg->set_weight_decay(g.weight_decay);
  }
}

void ToProto(const OptimizerReport& r, uint32_t threads, v1::OptimizerInfo* out) {
  out->set_job_id(r.job_id);
  ToProto(r.settings, out->mutable_spec());
  out->set_step(r.iteration);
  out->set_world_size(r.world_size);
  out->set_ranks_attached(r.ranks_attached);
  out->set_params(r.elements);
  out->set_tensors(r.tensors);
  out->set_state_bytes(r.state_bytes);
  v1::StepStats* s = out->mutable_last_step();
  s->set_step(r.last_step.iteration);
  s->set_grad_norm(r.last_step.grad_norm);
  s->set_clip_coef(r.last_step.clip_coef);
  s->set_skipped(r.last_step.skipped);
  s->set_nonfinite(r.last_step.nonfinite);
  s->set_seconds(r.last_step.seconds);
  s->set_update_seconds(r.last_step.update_seconds);
  s->set_gbps(r.last_step.gbps);
  s->set_speculated_tensors(r.last_step.speculated_tensors);
  s->set_rolled_back(r.last_step.rolled_back);
  out->set_speculated_steps(r.speculated_steps);
  out->set_rolled_back_steps(r.rolled_back_steps);
  out->set_isa(kernels::IsaName(kernels::BestIsa()));
  out->set_threads(threads);
  out->set_state(r.state);
  for (uint64_t step : r.param_steps) out->add_param_steps(step);
}

void ToProto(const BufferRecord& record, v1::Buffer* out) {
  out->set_buffer_id(record.buffer_id);
  out->set_name(record.name);
  out->set_segment_id(record.segment_id);
  out->set_offset(record.offset);
  out->set_bytes(record.bytes);
  out->set_tag(record.tag);
  out->set_read_only(record.read_only);
  out->set_owner_session_id(record.session_id);
}

}  // namespace trainstream::daemon
