// SPDX-License-Identifier: Apache-2.0
// The daemon as a session: opening one, its buffers (zero-copy through the buffer protocol), its
// inspection calls, bases and GPU pools. Blocking calls release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "released.h"
#include "trainstream/client.h"
#include "trainstream/cuda_transfer.h"

namespace trainstream::python {

namespace py = pybind11;
using trainstream::client::GpuPoolMapping;
using trainstream::client::HostBuffer;
using trainstream::client::Session;

namespace {

std::unique_ptr<Session> OpenSession(const std::string& socket_path, const std::string& job_id,
                                     uint32_t rank, uint32_t world_size, double rpc_timeout_s,
                                     bool register_with_cuda) {
  trainstream::client::SessionOptions options;
  options.socket_path = socket_path;
  options.job_id = job_id;
  options.rank = rank;
  options.world_size = world_size;
  options.rpc_timeout = absl::Seconds(rpc_timeout_s);
  options.register_with_cuda = register_with_cuda;
  absl::StatusOr<std::unique_ptr<Session>> session;
  {
    py::gil_scoped_release release;
    session = Session::Create(options);
  }
  return ValueOrThrow(std::move(session));
}

}  // namespace

void BindSession(py::module_& m) {
  m.def("default_socket_path", &trainstream::client::DefaultSocketPath);
  m.def("find_daemon_socket", [] { return Released(trainstream::client::FindDaemonSocket); });
  m.def("ping_daemon", [](const std::string& path) {
    return absl::ToDoubleSeconds(Released([&] { return trainstream::client::PingDaemon(path); }));
  });

  py::class_<HostBuffer, std::shared_ptr<HostBuffer>>(m, "HostBuffer", py::buffer_protocol())
      .def_property_readonly("buffer_id", [](const HostBuffer& b) { return b.info().buffer_id; })
      .def_property_readonly("name", [](const HostBuffer& b) { return b.info().name; })
      .def_property_readonly("nbytes", [](const HostBuffer& b) { return b.size(); })
      .def_property_readonly("tag", [](const HostBuffer& b) { return b.info().tag; })
      .def_property_readonly("segment_id", [](const HostBuffer& b) { return b.info().segment_id; })
      .def_property_readonly("offset", [](const HostBuffer& b) { return b.info().offset; })
      .def_property_readonly("read_only", [](const HostBuffer& b) { return !b.writable(); })
      .def_property_readonly("owner_session_id",
                             [](const HostBuffer& b) { return b.info().owner_session_id; })
      .def_property_readonly("cuda_registered", &HostBuffer::cuda_registered)
      .def_property_readonly("registration_piece_bytes", &HostBuffer::registration_piece_bytes)
      .def_property_readonly(
          "address", [](const HostBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_buffer([](HostBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {1}, !b.writable());
      })
      .def("copy_to_device",
           [](const HostBuffer& b, uint64_t offset, uintptr_t device_ptr, uint64_t nbytes,
              uintptr_t stream) {
             Released([&] {
               return trainstream::client::CopyToDevice(b, offset,
                                                        reinterpret_cast<void*>(device_ptr), nbytes,
                                                        reinterpret_cast<void*>(stream));
             });
           })
      .def("copy_to_host", [](const HostBuffer& b, uint64_t offset, uintptr_t device_ptr,
                              uint64_t nbytes, uintptr_t stream) {
        Released([&] {
          return trainstream::client::CopyToHost(b, offset,
                                                 reinterpret_cast<const void*>(device_ptr), nbytes,
                                                 reinterpret_cast<void*>(stream));
        });
      });

  py::class_<Session>(m, "Session")
      .def(py::init(&OpenSession), py::arg("socket_path"), py::arg("job_id"), py::arg("rank"),
           py::arg("world_size"), py::arg("rpc_timeout_s"), py::arg("register_with_cuda"))
      .def_property_readonly("id", &Session::id)
      .def_property_readonly("socket_path", &Session::socket_path)
      .def(
          "close", [](Session& s, bool end_job) { Released([&] { return s.Close(end_job); }); },
          py::arg("end_job") = false)
      .def("allocate",
           [](Session& s, const std::string& name, uint64_t nbytes, const std::string& tag,
              uint64_t alignment, bool sealable) {
             return Released([&] { return s.Allocate(name, nbytes, {tag, alignment, sealable}); });
           })
      .def("lookup",
           [](Session& s, const std::string& name) {
             return Released([&] { return s.Lookup(name); });
           })
      .def("free", [](Session& s, const HostBuffer& b) { Released([&] { return s.Free(b); }); })
      .def("seal",
           [](Session& s, uint64_t buffer_id, uint64_t segment_id, const std::string& name) {
             trainstream::client::BufferInfo info;
             info.buffer_id = buffer_id;
             info.segment_id = segment_id;
             info.name = name;
             return Released([&] { return s.Seal(info); });
           })
      .def("ring",
           [](Session& s, uint32_t kind, uint64_t id, uint64_t step, uint64_t value) {
             Released([&] { return s.Ring({kind, id, step, value}); });
           })
      .def("wait",
           [](Session& s, int timeout_ms) {
             auto n = Released([&] { return s.Wait(timeout_ms); });
             return py::make_tuple(n.kind, n.id, n.step, n.value);
           })
      .def("ping",
           [](Session& s) { return absl::ToDoubleSeconds(Released([&] { return s.Ping(); })); })
      .def("status", [](Session& s) { return Released([&] { return s.GetStatus(); }); })
      .def("sessions", [](Session& s) { return Released([&] { return s.ListSessions(); }); })
      .def("memory", [](Session& s) { return Released([&] { return s.GetMemory(); }); })
      .def("events",
           [](Session& s, uint64_t since) { return Released([&] { return s.ReadEvents(since); }); })
      .def("plan_host_memory",
           [](Session& s, uint64_t bytes, double wait_s) {
             return Released([&] { return s.PlanHostMemory(bytes, absl::Seconds(wait_s)); });
           })
      .def("set_transfer_totals", &Session::SetTransferTotals)
      .def("report_event",
           [](Session& s, const std::string& kind, const std::string& message,
              const std::vector<std::pair<std::string, double>>& numbers) {
             return Released([&] { return s.ReportEvent(kind, message, numbers); });
           })
      .def(
          "load_base",
          [](Session& s, const std::string& path, const std::string& format, uint32_t block,
             const std::vector<std::string>& quantize, const std::string& name, bool plan_only) {
            Session::LoadBaseOptions options;
            options.path = path;
            options.format = format;
            options.block = block;
            options.quantize = quantize;
            options.name = name;
            options.plan_only = plan_only;
            return Released([&] { return s.LoadBase(options); });
          },
          py::arg("path"), py::arg("format"), py::arg("block"), py::arg("quantize"),
          py::arg("name"), py::arg("plan_only") = false)
      .def("base", [](Session& s, uint64_t id) { return Released([&] { return s.GetBase(id); }); })
      .def("detach_base",
           [](Session& s, uint64_t id) { Released([&] { return s.DetachBase(id); }); })
      .def("bases", [](Session& s) { return Released([&] { return s.ListBases(); }); })
      .def("map_base",
           [](Session& s, uint64_t id) { return Released([&] { return s.MapBase(id); }); })
      .def("place_base_on_gpu",
           [](Session& s, uint64_t base_id, const std::string& uuid) {
             return Released([&] { return s.PlaceBaseOnGpu(base_id, uuid); });
           })
      .def("import_gpu_pool",
           [](Session& s, uint64_t pool_id, int device) {
             return std::shared_ptr<GpuPoolMapping>(
                 Released([&] { return s.ImportGpuPool(pool_id, device); }));
           })
      .def(
          "release_gpu_pool",
          [](Session& s, uint64_t pool_id) { Released([&] { return s.ReleaseGpuPool(pool_id); }); })
      .def("gpu_pools", [](Session& s) { return Released([&] { return s.ListGpuPools(); }); });

  // A pool's VRAM as CUDA memory any library can wrap without a copy (torch.as_tensor reads
  // __cuda_array_interface__ and keeps this object, and so the mapping, alive).
  py::class_<GpuPoolMapping, std::shared_ptr<GpuPoolMapping>>(m, "GpuPoolMapping")
      .def_property_readonly("pool_id", &GpuPoolMapping::pool_id)
      .def_property_readonly("device", &GpuPoolMapping::device)
      .def_property_readonly("device_pointer", &GpuPoolMapping::device_pointer)
      .def_property_readonly("bytes", &GpuPoolMapping::bytes)
      .def_property_readonly("kind", &GpuPoolMapping::kind)
      .def_property_readonly("read_only", &GpuPoolMapping::read_only)
      .def_property_readonly("note", &GpuPoolMapping::note)
      .def_property_readonly("__cuda_array_interface__", [](const GpuPoolMapping& p) {
        py::dict interface;
        interface["shape"] = py::make_tuple(p.bytes());
        interface["typestr"] = "|u1";
        // Declared writable: torch refuses read-only CUDA memory; the mapping itself is
        // read-only where the driver allows it (read_only).
        interface["data"] = py::make_tuple(p.device_pointer(), false);
        interface["version"] = 3;
        interface["strides"] = py::none();
        return interface;
      });
}

}  // namespace trainstream::python
