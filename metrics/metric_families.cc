// SPDX-License-Identifier: Apache-2.0
#include "metric_families.h"

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"

namespace trainstream::metrics {
namespace {

using Labels = std::vector<std::pair<std::string, std::string>>;

// A label value as the text format escapes it: backslash, double quote and newline.
std::string Escape(const std::string& value) {
  return absl::StrReplaceAll(value, {{"\\", "\\\\"}, {"\"", "\\\""}, {"\n", "\\n"}});
}

std::string Number(double value) { return absl::StrFormat("%.17g", value); }

// One metric family being filled: its name, type and help once, then its samples.
class Family {
 public:
  Family(std::vector<MetricFamily>* out, const std::string& name, const std::string& type,
         const std::string& help)
      : out_(out), index_(out->size()) {
    out->push_back(MetricFamily{name, type, help, {}});
  }
  void Add(double value, const Labels& labels = {}) {
    (*out_)[index_].samples.push_back(MetricSample{labels, value});
  }

 private:
  std::vector<MetricFamily>* out_;
  size_t index_;
};

void AddUp(std::vector<MetricFamily>* out, double up) {
  Family(out, "trainstream_up", "gauge", "1 when trainstreamd answered this scrape.").Add(up);
}

}  // namespace

absl::Status ReadScrape(v1::TrainStream::StubInterface& stub, const UnaryCall& call, Scrape* s) {
  using Rpc = std::function<grpc::Status(grpc::ClientContext*)>;
  const Rpc reads[] = {
      [&](grpc::ClientContext* c) { return stub.GetStatus(c, {}, &s->status); },
      [&](grpc::ClientContext* c) { return stub.GetMemory(c, {}, &s->memory); },
      [&](grpc::ClientContext* c) { return stub.ListOptimizers(c, {}, &s->optimizers); },
      [&](grpc::ClientContext* c) { return stub.ListBases(c, {}, &s->bases); },
      [&](grpc::ClientContext* c) { return stub.ListGpuPools(c, {}, &s->pools); },
  };
  for (const Rpc& read : reads) {
    if (absl::Status status = call(read); !status.ok()) return status;
  }
  return absl::OkStatus();
}

std::string RenderText(const std::vector<MetricFamily>& families) {
  std::string out;
  for (const MetricFamily& f : families) {
    absl::StrAppend(&out, "# HELP ", f.name, " ", f.help, "\n# TYPE ", f.name, " ", f.type, "\n");
    for (const MetricSample& sample : f.samples) {
      out += f.name;
      if (!sample.labels.empty()) {
        out += "{";
        for (size_t i = 0; i < sample.labels.size(); ++i) {
          absl::StrAppend(&out, i ? "," : "", sample.labels[i].first, "=\"",
                          Escape(sample.labels[i].second), "\"");
        }
        out += "}";
      }
      absl::StrAppend(&out, " ", Number(sample.value), "\n");
    }
  }
  return out;
}

std::vector<MetricFamily> DownFamilies() {
  std::vector<MetricFamily> out;
  AddUp(&out, 0);
  return out;
}

std::string RenderDown(const std::string& why) {
  return absl::StrCat("# trainstreamd did not answer: ", absl::StrReplaceAll(why, {{"\n", " "}}),
                      "\n", RenderText(DownFamilies()));
}

std::string RenderMetrics(const Scrape& scrape) { return RenderText(FamiliesOf(scrape)); }

std::vector<MetricFamily> FamiliesOf(const Scrape& s) {
  std::vector<MetricFamily> out;
  AddUp(&out, 1);
  Family(&out, "trainstream_info", "gauge", "The daemon's release, as a label.")
      .Add(1, {{"version", s.status.version()}});
  Family(&out, "trainstream_uptime_seconds", "gauge", "Seconds since the daemon started.")
      .Add(s.status.uptime_s());
  Family(&out, "trainstream_draining", "gauge",
         "1 while the daemon refuses new sessions on its way out.")
      .Add(s.status.draining() ? 1 : 0);
  Family(&out, "trainstream_sessions", "gauge", "Open sessions the caller may see.")
      .Add(s.status.sessions());
  Family(&out, "trainstream_optimizer_threads", "gauge", "The host optimizer's worker threads.")
      .Add(s.status.threads());
  {
    Family f(&out, "trainstream_events_total", "counter",
             "Events the daemon emitted since it started, by kind (clients' own as client.*).");
    for (const v1::EventCount& row : s.status.events()) {
      f.Add(static_cast<double>(row.count()), {{"kind", row.kind()}});
    }
  }
  Family(&out, "trainstream_memory_budget_bytes", "gauge",
         "Host memory all of the daemon's segments together may reserve.")
      .Add(static_cast<double>(s.memory.budget_bytes()));
  Family(&out, "trainstream_memory_reserved_bytes", "gauge",
         "Host memory the daemon's segments reserve now, machine-wide.")
      .Add(static_cast<double>(s.memory.reserved_bytes()));
  Family(&out, "trainstream_memory_committed_bytes", "gauge",
         "Reserved host memory plus what jobs planned and have not reserved yet.")
      .Add(static_cast<double>(s.memory.committed_bytes()));
  Family(&out, "trainstream_memory_uid_quota_bytes", "gauge",
         "The most one user's segments may reserve (0: no quota).")
      .Add(static_cast<double>(s.memory.uid_quota_bytes()));
  Family(&out, "trainstream_memory_segments", "gauge", "The daemon's shared-memory segments.")
      .Add(static_cast<double>(s.memory.segments()));
  {
    Family f(&out, "trainstream_memory_uid_bytes", "gauge", "Segment bytes reserved, by uid.");
    for (const v1::UsageRow& row : s.memory.by_uid()) {
      f.Add(static_cast<double>(row.bytes()), {{"uid", row.key()}});
    }
  }
  {
    Family f(&out, "trainstream_memory_tag_bytes", "gauge", "Buffer bytes, by buffer tag.");
    for (const v1::UsageRow& row : s.memory.by_tag()) {
      f.Add(static_cast<double>(row.bytes()), {{"tag", row.key()}});
    }
  }
  {
    Family planned(&out, "trainstream_job_planned_bytes", "gauge",
                   "Host memory a job declared at admission.");
    for (const v1::JobPlan& plan : s.memory.plans()) {
      planned.Add(static_cast<double>(plan.planned_bytes()),
                  {{"job", plan.job_id()}, {"uid", absl::StrCat(plan.uid())}});
    }
  }
  {
    Family to_device(&out, "trainstream_job_h2d_bytes_total", "counter",
                     "Bytes a job's processes copied from host memory to their GPUs, as they "
                     "report them.");
    for (const v1::JobTransfers& job : s.status.transfers()) {
      to_device.Add(static_cast<double>(job.h2d_bytes()),
                    {{"job", job.job_id()}, {"uid", absl::StrCat(job.uid())}});
    }
  }
  {
    Family to_host(&out, "trainstream_job_d2h_bytes_total", "counter",
                   "Bytes a job's processes copied from their GPUs to host memory, as they "
                   "report them.");
    for (const v1::JobTransfers& job : s.status.transfers()) {
      to_host.Add(static_cast<double>(job.d2h_bytes()),
                  {{"job", job.job_id()}, {"uid", absl::StrCat(job.uid())}});
    }
  }
  {
    Family step(&out, "trainstream_optimizer_steps_total", "counter",
                "Steps a job's optimizer took.");
    for (const v1::OptimizerInfo& o : s.optimizers.optimizers()) {
      step.Add(static_cast<double>(o.step()), {{"job", o.job_id()}});
    }
  }
  {
    Family f(&out, "trainstream_optimizer_state_bytes", "gauge",
             "A job's optimizer state in host memory (masters, moments, slots).");
    for (const v1::OptimizerInfo& o : s.optimizers.optimizers()) {
      f.Add(static_cast<double>(o.state_bytes()), {{"job", o.job_id()}});
    }
  }
  {
    Family f(&out, "trainstream_optimizer_last_step_seconds", "gauge",
             "A job's last step, from its first gradient to its last update.");
    for (const v1::OptimizerInfo& o : s.optimizers.optimizers()) {
      if (o.last_step().step() > 0) f.Add(o.last_step().seconds(), {{"job", o.job_id()}});
    }
  }
  {
    Family f(&out, "trainstream_optimizer_last_step_gbps", "gauge",
             "Bytes the last update pass moved over its wall time, GB/s.");
    for (const v1::OptimizerInfo& o : s.optimizers.optimizers()) {
      if (o.last_step().step() > 0) f.Add(o.last_step().gbps(), {{"job", o.job_id()}});
    }
  }
  {
    Family f(&out, "trainstream_optimizer_failed", "gauge", "1 for a job whose optimizer failed.");
    for (const v1::OptimizerInfo& o : s.optimizers.optimizers()) {
      f.Add(o.state().rfind("failed", 0) == 0 ? 1 : 0, {{"job", o.job_id()}});
    }
  }
  {
    Family stored(&out, "trainstream_base_stored_bytes", "gauge",
                  "Host bytes a shared frozen base takes.");
    for (const v1::BaseInfo& b : s.bases.bases()) {
      stored.Add(static_cast<double>(b.stored_bytes()),
                 {{"base", b.name()}, {"format", b.format()}, {"state", b.state()}});
    }
  }
  {
    Family users(&out, "trainstream_base_users", "gauge", "Sessions attached to a shared base.");
    for (const v1::BaseInfo& b : s.bases.bases()) {
      users.Add(b.users(), {{"base", b.name()}, {"format", b.format()}});
    }
  }
  {
    Family f(&out, "trainstream_gpu_pool_bytes", "gauge", "VRAM a GPU pool holds.");
    for (const v1::GpuPoolInfo& p : s.pools.pools()) {
      f.Add(static_cast<double>(p.bytes()),
            {{"pool", absl::StrCat(p.pool_id())}, {"gpu", p.gpu_uuid()}, {"kind", p.kind()}});
    }
  }
  {
    Family f(&out, "trainstream_gpu_pool_importers", "gauge",
             "Sessions that mapped a GPU pool into their process.");
    for (const v1::GpuPoolInfo& p : s.pools.pools()) {
      f.Add(p.importers_size(), {{"pool", absl::StrCat(p.pool_id())}});
    }
  }
  return out;
}

}  // namespace trainstream::metrics
