// SPDX-License-Identifier: Apache-2.0
// A job's optimizer in the daemon, as one rank drives it: gradients posted or sent from the
// device, iterations waited for, updates returned to the device, checkpoints.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings.h"
#include "released.h"
#include "trainstream/client.h"
#include "trainstream/host_optimizer.h"

namespace trainstream::python {

namespace py = pybind11;
using trainstream::client::HostOptimizer;
using trainstream::client::Session;

namespace {

// The parameter list the Python side passes: (name, numel, param dtype, grad dtype, group).
std::vector<trainstream::client::ParameterInfo> ParameterInfos(const py::list& params) {
  namespace tc = trainstream::client;
  std::vector<tc::ParameterInfo> infos;
  for (py::handle p : params) {
    py::tuple t = p.cast<py::tuple>();
    infos.push_back({t[0].cast<std::string>(), t[1].cast<uint64_t>(),
                     static_cast<tc::DType>(t[2].cast<int>()),
                     static_cast<tc::DType>(t[3].cast<int>()), t[4].cast<uint32_t>()});
  }
  return infos;
}

// The optimizer spec the Python side passes (host_optimizer.py builds it).
trainstream::client::OptimizerOptions OptimizerOptionsFrom(const py::dict& spec) {
  namespace tc = trainstream::client;
  tc::OptimizerOptions options;
  options.adamw = spec["kind"].cast<std::string>() == "adamw";
  options.moment_dtype = static_cast<tc::DType>(spec["moment_dtype"].cast<int>());
  options.max_grad_norm = spec["max_grad_norm"].cast<double>();
  options.report_grad_norm = spec["report_grad_norm"].cast<bool>();
  options.nonfinite = static_cast<tc::NonFinite>(spec["nonfinite"].cast<int>());
  options.accumulation_steps = spec["accumulation_steps"].cast<uint32_t>();
  options.machines = spec["machines"].cast<uint32_t>();
  options.threads = spec["threads"].cast<uint32_t>();
  options.chunk_elements = spec["chunk_elements"].cast<uint64_t>();
  options.defer_updates = spec["defer_updates"].cast<bool>();
  options.eager_updates = spec["eager_updates"].cast<bool>();
  options.groups.clear();
  for (py::handle g : spec["groups"].cast<py::list>()) {
    py::dict d = g.cast<py::dict>();
    options.groups.push_back({d["lr"].cast<double>(), d["beta1"].cast<double>(),
                              d["beta2"].cast<double>(), d["eps"].cast<double>(),
                              d["weight_decay"].cast<double>()});
  }
  return options;
}

}  // namespace

void BindHostOptimizer(py::module_& m) {
  namespace tc = trainstream::client;
  m.def(
      "estimate_host_memory",
      [](Session& session, py::dict spec, py::list params, uint32_t ranks,
         std::vector<uint64_t> other_buffers) {
        tc::OptimizerOptions options = OptimizerOptionsFrom(spec);
        std::vector<tc::ParameterInfo> infos = ParameterInfos(params);
        return Released([&] {
          return HostOptimizer::EstimateHostMemory(session, options, infos, ranks, other_buffers);
        });
      },
      py::arg("session"), py::arg("spec"), py::arg("params"), py::arg("ranks") = 1,
      py::arg("other_buffers") = std::vector<uint64_t>{});
  py::class_<HostOptimizer>(m, "HostOptimizer")
      .def(py::init([](Session& session, py::dict spec, py::list params) {
             tc::OptimizerOptions options = OptimizerOptionsFrom(spec);
             std::vector<tc::ParameterInfo> infos = ParameterInfos(params);
             return Released([&] { return HostOptimizer::Create(session, options, infos); });
           }),
           py::keep_alive<1, 2>())
      .def_property_readonly("initialize", &HostOptimizer::initialize)
      .def_property_readonly("attached_at_iteration", &HostOptimizer::attached_at_iteration)
      .def("buffers",
           [](const HostOptimizer& o, uint32_t i) {
             const tc::ParameterBuffers& b = o.params().at(i);
             return py::make_tuple(b.master, b.exp_avg, b.exp_avg_sq, b.param, b.grad, b.reduce);
           })
      .def("post",
           [](HostOptimizer& o, uint32_t index, uint64_t iteration, uint32_t micro,
              bool no_gradient) {
             Released([&] { return o.PostGradient(index, iteration, micro, no_gradient); });
           })
      .def("post_norm_contribution",
           [](HostOptimizer& o, uint64_t iteration, double sum_squares) {
             Released([&] { return o.PostNormContribution(iteration, sum_squares); });
           })
      .def("send_gradient",
           [](HostOptimizer& o, uint32_t index, uint64_t iteration, uint32_t micro, int device,
              uintptr_t device_src, uint64_t bytes, uintptr_t stream) {
             Released([&] {
               return o.SendGradient(index, iteration, micro, device,
                                     reinterpret_cast<const void*>(device_src), bytes,
                                     reinterpret_cast<void*>(stream));
             });
           })
      .def("send_gradients",
           [](HostOptimizer& o, uint64_t iteration, int device, uintptr_t stream,
              const std::vector<std::tuple<uint32_t, uint32_t, uintptr_t, uint64_t>>& copies) {
             std::vector<HostOptimizer::GradientCopy> batch;
             batch.reserve(copies.size());
             for (const auto& [index, micro, src, bytes] : copies) {
               batch.push_back({index, micro, reinterpret_cast<const void*>(src), bytes});
             }
             Released([&] {
               return o.SendGradients(iteration, device, batch, reinterpret_cast<void*>(stream));
             });
           })
      .def("drain_gradients",
           [](HostOptimizer& o) { Released([&] { return o.DrainGradients(); }); })
      .def("wait_consumed",
           [](HostOptimizer& o, uint32_t index, uint64_t iteration, int timeout_ms) {
             Released([&] { return o.WaitGradientConsumed(index, iteration, timeout_ms); });
           })
      .def("add_parameters",
           [](HostOptimizer& o, py::list params) {
             std::vector<tc::ParameterInfo> infos = ParameterInfos(params);
             return Released([&] { return o.AddParameters(infos); });
           })
      .def("add_device_targets",
           [](HostOptimizer& o, std::vector<std::pair<uintptr_t, uint64_t>> targets) {
             std::vector<tc::DeviceTarget> ts;
             for (const auto& [ptr, bytes] : targets) ts.push_back({ptr, bytes});
             Released([&] { return o.AddDeviceTargets(std::move(ts)); });
           })
      .def("wait_reduce_ready",
           [](HostOptimizer& o, uint32_t index, uint64_t iteration, int timeout_ms) {
             return Released([&] { return o.WaitReduceReady(index, iteration, timeout_ms); });
           })
      .def("post_reduced",
           [](HostOptimizer& o, uint32_t index, uint64_t iteration, bool any_gradient) {
             Released([&] { return o.PostReduced(index, iteration, any_gradient); });
           })
      .def("wait_iteration",
           [](HostOptimizer& o, uint64_t iteration, int timeout_ms) {
             auto r = Released([&] { return o.WaitIteration(iteration, timeout_ms); });
             return py::make_tuple(r.skipped, r.updated);
           })
      .def("set_groups",
           [](HostOptimizer& o, py::list groups, double max_grad_norm) {
             std::vector<tc::OptimizerGroup> gs;
             for (py::handle g : groups) {
               py::dict d = g.cast<py::dict>();
               gs.push_back({d["lr"].cast<double>(), d["beta1"].cast<double>(),
                             d["beta2"].cast<double>(), d["eps"].cast<double>(),
                             d["weight_decay"].cast<double>()});
             }
             Released([&] { return o.SetGroups(gs, max_grad_norm); });
           })
      .def("set_step",
           [](HostOptimizer& o, uint64_t iteration, std::vector<uint64_t> steps) {
             Released([&] { return o.SetStep(iteration, steps); });
           })
      .def("save", [](HostOptimizer& o,
                      const std::string& path) { return Released([&] { return o.Save(path); }); })
      .def("load", [](HostOptimizer& o,
                      const std::string& path) { Released([&] { return o.Load(path); }); })
      .def("info", [](HostOptimizer& o) { return Released([&] { return o.Info(); }); })
      .def("return_updates_to_device",
           [](HostOptimizer& o, int device, std::vector<std::pair<uintptr_t, uint64_t>> targets) {
             std::vector<tc::DeviceTarget> ts;
             for (const auto& [ptr, bytes] : targets) ts.push_back({ptr, bytes});
             Released([&] { return o.ReturnUpdatesToDevice(device, std::move(ts)); });
           })
      .def("retarget_device",
           [](HostOptimizer& o, uint32_t index, uintptr_t ptr, uint64_t bytes) {
             Released([&] { return o.RetargetDevice(index, {ptr, bytes}); });
           })
      .def(
          "wait_for_parameters",
          [](HostOptimizer& o, std::vector<uint32_t> indices, uintptr_t stream) {
            Released([&] { return o.WaitForParameters(indices, reinterpret_cast<void*>(stream)); });
          })
      .def("synchronize_device_returns",
           [](HostOptimizer& o) { Released([&] { return o.SynchronizeDeviceReturns(); }); });
}

}  // namespace trainstream::python
