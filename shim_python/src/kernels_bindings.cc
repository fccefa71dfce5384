// SPDX-License-Identifier: Apache-2.0
// The kernels on raw pointers (torch tensors' data_ptr()), for the package's own paths and for
// checking the GPU kernels against the daemon's references.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "bindings.h"
#include "cpu/adamw.h"
#include "cpu/quantize.h"
#ifdef TRAINSTREAM_HAVE_CUDA
#include "cuda/adamw_mapped.h"
#include "cuda/cross_entropy.h"
#include "cuda/dequantize.h"
#endif
#include "status_exceptions.h"

namespace trainstream::python {

namespace py = pybind11;

namespace {

#ifdef TRAINSTREAM_HAVE_CUDA
// The rows the loss kernels read, from the pointers and names the Python side passes.
kernels::CrossEntropyRows LossRows(const std::string& dtype, int64_t rows, int64_t vocab,
                                   uintptr_t logits, uintptr_t targets, int64_t ignore_index) {
  return {reinterpret_cast<const void*>(logits),
          ValueOrThrow(kernels::ParseLogitType(dtype)),
          rows,
          vocab,
          reinterpret_cast<const int64_t*>(targets),
          ignore_index};
}
#else
[[noreturn]] void ThrowNoCudaKernels() {
  ThrowStatus(absl::FailedPreconditionError(
      "this build of trainstream has no CUDA kernels (built without a CUDA toolkit)"));
}
#endif

}  // namespace

void BindKernels(py::module_& m) {
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
    ThrowNoCudaKernels();
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
    ThrowNoCudaKernels();
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
    const k::CrossEntropyRows r = LossRows(dtype, rows, vocab, logits, targets, ignore_index);
    OkOrThrow(k::CrossEntropyForwardOnDevice(r, reinterpret_cast<float*>(lse),
                                             reinterpret_cast<float*>(loss),
                                             reinterpret_cast<void*>(stream)));
#else
    ThrowNoCudaKernels();
#endif
  });
  m.def(
      "cross_entropy_backward",
      [](const std::string& dtype, int64_t rows, int64_t vocab, uintptr_t logits, uintptr_t targets,
         int64_t ignore_index, uintptr_t lse, uintptr_t scale, uintptr_t grad, uintptr_t stream) {
#ifdef TRAINSTREAM_HAVE_CUDA
        namespace k = trainstream::kernels;
        const k::CrossEntropyRows r = LossRows(dtype, rows, vocab, logits, targets, ignore_index);
        OkOrThrow(k::CrossEntropyBackwardOnDevice(
            r, reinterpret_cast<const float*>(lse), reinterpret_cast<const float*>(scale),
            reinterpret_cast<void*>(grad), reinterpret_cast<void*>(stream)));
#else
        ThrowNoCudaKernels();
#endif
      });
}

}  // namespace trainstream::python
