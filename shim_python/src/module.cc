// SPDX-License-Identifier: Apache-2.0
// trainstream._trainstream: the client library for Python. Blocking calls release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "cpu/adamw.h"
#include "cpu/quantize.h"
#ifdef TRAINSTREAM_HAVE_CUDA
#include "cuda/adamw_mapped.h"
#include "cuda/cross_entropy.h"
#include "cuda/dequantize.h"
#endif
#include "replies_bindings.h"
#include "status_exceptions.h"
#include "trainstream/client.h"
#include "trainstream/cuda_transfer.h"
#include "trainstream/host_optimizer.h"
#include "trainstream/version.h"

namespace py = pybind11;
using trainstream::client::GpuPoolMapping;
using trainstream::client::HostBuffer;
using trainstream::client::HostOptimizer;
using trainstream::client::Session;
using trainstream::python::OkOrThrow;
using trainstream::python::ValueOrThrow;

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

// Runs `fn` without the GIL and raises its status as a Python exception.
template <typename Fn>
auto Released(Fn&& fn) {
  using Result = decltype(fn());
  std::optional<Result> result;
  {
    py::gil_scoped_release release;
    result.emplace(fn());
  }
  if constexpr (std::is_same_v<Result, absl::Status>) {
    OkOrThrow(*result);
  } else {
    return ValueOrThrow(std::move(*result));
  }
}

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

PYBIND11_MODULE(_trainstream, m) {
  m.doc() = "trainstream client library (C++), used by the trainstream package";
  m.attr("__version__") = trainstream::kTrainStreamVersion;
  trainstream::python::BindReplies(m);
  m.def("default_socket_path", &trainstream::client::DefaultSocketPath);
  m.def("find_daemon_socket", [] { return Released(trainstream::client::FindDaemonSocket); });
  // AdamW on raw pointers (torch tensors' data_ptr()): the host path's scalar reference
  // (on_gpu false; returns the number of non-finite gradient elements) or the GPU kernel over
  // state in mapped host memory or VRAM (kernels/cuda/adamw_mapped.h; counts into the device
  // uint64 `nonfinite`, queued on `stream`; nothing when the device float `skip_if` is set),
  // which agree bit for bit. Types are "float32", "bfloat16" or "float16"; `step` is 1-based;
  // `decoupled` false is Adam (weight decay folded into the gradient).
  m.def("adamw",
        [](bool on_gpu, uintptr_t master, uintptr_t exp_avg, uintptr_t exp_avg_sq,
           const std::string& moment_type, uintptr_t grad, const std::string& grad_type,
           uintptr_t param, const std::string& param_type, uint64_t numel, double lr, double beta1,
           double beta2, double eps, double weight_decay, uint64_t step, float grad_scale,
           uint64_t rounding_seed, uintptr_t nonfinite, uintptr_t stream, bool decoupled,
           uintptr_t skip_if) -> uint64_t {
          namespace k = trainstream::kernels;
          auto type = [](const std::string& name) {
            if (name == "float32") return k::ScalarType::kFloat32;
            if (name == "bfloat16") return k::ScalarType::kBFloat16;
            if (name == "float16") return k::ScalarType::kFloat16;
            throw py::value_error("a type is float32, bfloat16 or float16, not " + name);
          };
          k::AdamWStep s;
          s.lr = lr;
          s.beta1 = beta1;
          s.beta2 = beta2;
          s.eps = eps;
          s.weight_decay = weight_decay;
          s.grad_scale = grad_scale;
          s.rounding_seed = rounding_seed;
          s.decoupled_weight_decay = decoupled;
          k::SetStepNumber(&s, step);
          if (!on_gpu) {
            const void* grads[] = {reinterpret_cast<const void*>(grad)};
            k::AdamWTensor t;
            t.master = reinterpret_cast<float*>(master);
            t.exp_avg = reinterpret_cast<void*>(exp_avg);
            t.exp_avg_sq = reinterpret_cast<void*>(exp_avg_sq);
            t.moment_type = type(moment_type);
            t.grads = grads;
            t.grad_type = type(grad_type);
            t.param_out = reinterpret_cast<void*>(param);
            t.param_type = type(param_type);
            t.numel = numel;
            uint64_t count = 0;
            py::gil_scoped_release release;
            OkOrThrow(k::AdamWUpdate(t, 0, numel, s, k::Isa::kScalar, &count));
            return count;
          }
#ifdef TRAINSTREAM_HAVE_CUDA
          k::MappedAdamWTensor t;
          t.master = reinterpret_cast<float*>(master);
          t.exp_avg = reinterpret_cast<void*>(exp_avg);
          t.exp_avg_sq = reinterpret_cast<void*>(exp_avg_sq);
          t.moment_type = type(moment_type);
          t.grad = reinterpret_cast<const void*>(grad);
          t.grad_type = type(grad_type);
          t.param = reinterpret_cast<void*>(param);
          t.param_type = type(param_type);
          t.numel = numel;
          OkOrThrow(k::AdamWMappedOnDevice(t, s, reinterpret_cast<unsigned long long*>(nonfinite),
                                           reinterpret_cast<void*>(stream),
                                           reinterpret_cast<const float*>(skip_if)));
#else
    (void)nonfinite;
    (void)stream;
    (void)skip_if;
    OkOrThrow(absl::FailedPreconditionError(
        "this build of trainstream has no CUDA kernels (built without a CUDA toolkit)"));
#endif
          return 0;
        });
  // The host path's stochastic-rounding seed of parameter `index`'s step `t`, for updates of
  // that parameter made elsewhere (optimizer_mode="gpu") to round the same.
  m.def("adamw_rounding_seed", &trainstream::kernels::RoundingSeed);
  // The daemon's reference dequantizer, for checking the shim's own (and the GPU kernels)
  // against it: fp32 values from a quantized tensor's stored bytes.
  m.def("dequantize_reference", [](const std::string& format, int block, uint64_t numel,
                                   const py::bytes& data, const py::bytes& scales,
                                   float tensor_scale) {
    namespace k = trainstream::kernels;
    const k::QuantLayout layout =
        ValueOrThrow(k::LayoutFor(ValueOrThrow(k::ParseQuantFormat(format)), numel, block));
    const std::string d = data, s = scales;
    if (d.size() != layout.data_bytes || s.size() != layout.scale_bytes) {
      OkOrThrow(absl::InvalidArgumentError("data or scales do not match the tensor's layout"));
    }
    std::string out(numel * sizeof(float), '\0');
    OkOrThrow(k::Dequantize(layout, 0, numel, reinterpret_cast<const uint8_t*>(d.data()),
                            reinterpret_cast<const uint8_t*>(s.data()), tensor_scale,
                            reinterpret_cast<float*>(out.data())));
    return py::bytes(out);
  });
  // The daemon's reference quantizer, for models quantized in the process (quantize_model):
  // fp32 values in, (data, scales, tensor scale, block) out.
  m.def("quantize_reference", [](const std::string& format, int block, const py::bytes& values) {
    namespace k = trainstream::kernels;
    const std::string v = values;
    const uint64_t numel = v.size() / sizeof(float);
    const k::QuantFormat f = ValueOrThrow(k::ParseQuantFormat(format));
    const k::QuantLayout layout = ValueOrThrow(k::LayoutFor(f, numel, block));
    const auto* x = reinterpret_cast<const float*>(v.data());
    float tensor_scale = 1.0f;
    if (f == k::QuantFormat::kNvfp4) {
      float amax = 0.0f;
      for (uint64_t i = 0; i < numel; ++i) amax = std::max(amax, std::fabs(x[i]));
      tensor_scale = k::NvFp4TensorScale(amax);
    }
    std::string data(layout.data_bytes, '\0'), scales(layout.scale_bytes, '\0');
    {
      py::gil_scoped_release release;
      OkOrThrow(k::Quantize(layout, 0, x, numel, tensor_scale,
                            reinterpret_cast<uint8_t*>(data.data()),
                            reinterpret_cast<uint8_t*>(scales.data())));
    }
    return py::make_tuple(py::bytes(data), py::bytes(scales), tensor_scale, layout.block);
  });
  // The same quantizer on memory the caller owns (torch tensors' data_ptr()), a chunk at a time
  // and without the GIL, so that quantize_model() runs chunks on every core with no copies:
  // quant_layout() sizes the buffers, quantize_chunk() fills the part of them chunk `first`
  // (a multiple of the block), `n` values long, writes.
  m.def("quant_layout", [](const std::string& format, uint64_t numel, int block) {
    namespace k = trainstream::kernels;
    const k::QuantLayout layout =
        ValueOrThrow(k::LayoutFor(ValueOrThrow(k::ParseQuantFormat(format)), numel, block));
    return py::make_tuple(layout.data_bytes, layout.scale_bytes, layout.block);
  });
  m.def("nvfp4_tensor_scale",
        [](float amax) { return trainstream::kernels::NvFp4TensorScale(amax); });
  m.def("quantize_chunk", [](const std::string& format, int block, uint64_t numel, uint64_t first,
                             uint64_t n, uintptr_t values, float tensor_scale, uintptr_t data,
                             uintptr_t scales) {
    namespace k = trainstream::kernels;
    const k::QuantLayout layout =
        ValueOrThrow(k::LayoutFor(ValueOrThrow(k::ParseQuantFormat(format)), numel, block));
    if (first % layout.block != 0 || first + n > numel) {
      throw py::value_error(
          "quantize_chunk: the chunk must start on a block and lie in the tensor");
    }
    py::gil_scoped_release release;
    OkOrThrow(k::Quantize(layout, first, reinterpret_cast<const float*>(values), n, tensor_scale,
                          reinterpret_cast<uint8_t*>(data), reinterpret_cast<uint8_t*>(scales)));
  });
  // The GPU dequantizer, on device pointers (torch tensors' data_ptr()), queued on `stream`.
  m.def("dequantize_cuda", [](const std::string& format, int block, uint64_t numel, uintptr_t data,
                              uintptr_t scales, float tensor_scale, uintptr_t out, bool bf16,
                              uintptr_t stream) {
#ifdef TRAINSTREAM_HAVE_CUDA
    namespace k = trainstream::kernels;
    const k::QuantLayout layout =
        ValueOrThrow(k::LayoutFor(ValueOrThrow(k::ParseQuantFormat(format)), numel, block));
    OkOrThrow(k::DequantizeOnDevice(layout, reinterpret_cast<const uint8_t*>(data),
                                    reinterpret_cast<const uint8_t*>(scales), tensor_scale,
                                    reinterpret_cast<void*>(out),
                                    bf16 ? k::DeviceOutput::kBFloat16 : k::DeviceOutput::kFloat32,
                                    reinterpret_cast<void*>(stream)));
#else
    OkOrThrow(absl::FailedPreconditionError(
        "this build of trainstream has no CUDA kernels (built without a CUDA toolkit)"));
#endif
  });
  // The causal-LM cross-entropy kernels (kernels/cuda/cross_entropy.h), on device pointers,
  // queued on `stream`.
  m.attr("has_cuda_kernels") = py::bool_(
#ifdef TRAINSTREAM_HAVE_CUDA
      true
#else
      false
#endif
  );
  m.def("cross_entropy_forward", [](const std::string& dtype, int64_t rows, int64_t vocab,
                                    uintptr_t logits, uintptr_t targets, int64_t ignore_index,
                                    uintptr_t lse, uintptr_t loss, uintptr_t stream) {
#ifdef TRAINSTREAM_HAVE_CUDA
    namespace k = trainstream::kernels;
    const k::CrossEntropyRows r{reinterpret_cast<const void*>(logits),
                                ValueOrThrow(k::ParseLogitType(dtype)),
                                rows,
                                vocab,
                                reinterpret_cast<const int64_t*>(targets),
                                ignore_index};
    OkOrThrow(k::CrossEntropyForwardOnDevice(r, reinterpret_cast<float*>(lse),
                                             reinterpret_cast<float*>(loss),
                                             reinterpret_cast<void*>(stream)));
#else
    OkOrThrow(absl::FailedPreconditionError(
        "this build of trainstream has no CUDA kernels (built without a CUDA toolkit)"));
#endif
  });
  m.def(
      "cross_entropy_backward",
      [](const std::string& dtype, int64_t rows, int64_t vocab, uintptr_t logits, uintptr_t targets,
         int64_t ignore_index, uintptr_t lse, uintptr_t scale, uintptr_t grad, uintptr_t stream) {
#ifdef TRAINSTREAM_HAVE_CUDA
        namespace k = trainstream::kernels;
        const k::CrossEntropyRows r{reinterpret_cast<const void*>(logits),
                                    ValueOrThrow(k::ParseLogitType(dtype)),
                                    rows,
                                    vocab,
                                    reinterpret_cast<const int64_t*>(targets),
                                    ignore_index};
        OkOrThrow(k::CrossEntropyBackwardOnDevice(
            r, reinterpret_cast<const float*>(lse), reinterpret_cast<const float*>(scale),
            reinterpret_cast<void*>(grad), reinterpret_cast<void*>(stream)));
#else
        OkOrThrow(absl::FailedPreconditionError(
            "this build of trainstream has no CUDA kernels (built without a CUDA toolkit)"));
#endif
      });
  // Host<->device copies of (dst, src, bytes) pointer pieces, queued on `stream` in one call.
  using Piece = std::tuple<uintptr_t, uintptr_t, uint64_t>;
  m.def("copy_pieces", [](uintptr_t stream, const std::vector<Piece>& pieces) {
    std::vector<trainstream::client::CopyPiece> batch;
    batch.reserve(pieces.size());
    for (const auto& [dst, src, bytes] : pieces) {
      batch.push_back({reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes});
    }
    Released(
        [&] { return trainstream::client::CopyPieces(batch, reinterpret_cast<void*>(stream)); });
  });
  m.def("cuda_available", [] {
    std::string why;
    bool ok = trainstream::client::CudaAvailable(&why);
    return py::make_tuple(ok, why);
  });
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

  m.def("cuda_device_uuid", [](int device) {
    return Released([&] { return trainstream::client::CudaDeviceUuid(device); });
  });

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
