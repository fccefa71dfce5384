// SPDX-License-Identifier: Apache-2.0
#include "metrics_format.h"

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"

namespace trainstream::tsctl {
namespace {

using Labels = std::vector<std::pair<std::string, std::string>>;

// A label value as the format escapes it: backslash, double quote and newline.
std::string Escape(const std::string& value) {
  return absl::StrReplaceAll(value, {{"\\", "\\\\"}, {"\"", "\\\""}, {"\n", "\\n"}});
}

std::string Number(double value) { return absl::StrFormat("%.17g", value); }

// One metric family: HELP and TYPE once, then its samples.
class Family {
 public:
  Family(std::string* out, const std::string& name, const std::string& type,
         const std::string& help)
      : out_(out), name_(name) {
    absl::StrAppend(out_, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
  }
  void Add(double value, const Labels& labels = {}) {
    std::string sample = name_;
    if (!labels.empty()) {
      sample += "{";
      for (size_t i = 0; i < labels.size(); ++i) {
        absl::StrAppend(&sample, i ? "," : "", labels[i].first, "=\"", Escape(labels[i].second),
                        "\"");
      }
      sample += "}";
    }
    absl::StrAppend(out_, sample, " ", Number(value), "\n");
  }

 private:
  std::string* out_;
  std::string name_;
};

}  // namespace

std::string RenderDown(const std::string& why) {
  std::string out;
  absl::StrAppend(&out, "# trainstreamd did not answer: ",
                  absl::StrReplaceAll(why, {{"\n", " "}}), "\n");
  Family(&out, "trainstream_up", "gauge", "1 when trainstreamd answered this scrape.").Add(0);
  return out;
}

std::string RenderMetrics(const Scrape& s) {
  std::string out;
  Family(&out, "trainstream_up", "gauge", "1 when trainstreamd answered this scrape.").Add(1);
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

}  // namespace trainstream::tsctl
