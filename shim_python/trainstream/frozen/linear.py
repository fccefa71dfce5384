# SPDX-License-Identifier: Apache-2.0
"""Linear layers whose frozen weight is a shared base's tensor (bf16 or quantized), and the
functions that put them into a model: ``attach_base`` (weights from a daemon base, one host copy
for every process) and ``quantize_layers`` (weights quantized in this process; the public
``quantize_model``, memory/quantization.py, chooses which).

A ``BaseLinear`` keeps the weight as stored; each forward turns it into the compute dtype (the
CUDA kernel on a GPU, torch operations on the CPU), multiplies, and lets it go; backward does
the same for the input's gradient. The weight gets no gradient: adapters (LoRA) next to it
train. It is an ``nn.Linear`` to the libraries that look for one (PEFT wraps it in its LoRA
layer as it would any linear layer), without a weight parameter of its own: ``.weight`` is made
from the stored bytes at each read, so merging adapters into it (``merge_and_unload``) cannot
change it; merge into a model loaded with its own weights.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any

import torch
from torch import nn

from . import fp8_matmul
from .fp8_matmul import outlier_fraction
from .store import BaseTensor, SharedBase, dequantize, dequantize_cuda, source_dtype
from ..errors import FailedPreconditionError, InvalidArgumentError
from ..transport import kernels


def _stored(layer: "BaseLinear") -> tuple:
    """The two tensors ``layer``'s weight is made from now: the row-scaled FP8 copy and its
    scales, or the stored bytes and their scales."""
    if layer.fp8_rows is not None:
        return layer.fp8_rows, layer.fp8_row_scales
    return layer.data, layer.scales


def _weight(layer: "BaseLinear", device: torch.device, stored: tuple | None = None
            ) -> torch.Tensor:
    """``layer``'s weight in its compute dtype on ``device``, from ``stored`` (what
    :func:`_stored` gave; default: now)."""
    data, scales = stored if stored is not None else _stored(layer)
    if layer.fp8_rows is not None:  # requantized for FP8 tensor cores (see fp8_matmul)
        return fp8_matmul.rowwise_weight(data, scales, layer.compute_dtype)
    t = layer.stored
    # Kept on the host: this use's copy (DMA from registered memory). Each on its own: an
    # unwrap() that ran out of VRAM may have left one of the two on the host.
    if data.device != device:
        data = data.to(device, non_blocking=True)
    if scales.device != device:
        scales = scales.to(device, non_blocking=True)
    if t.stored in ("bf16", "as_is"):  # as_is: a float kept as the file has it
        dtype = torch.bfloat16 if t.stored == "bf16" else getattr(torch, source_dtype(t))
        return data.view(dtype).view(t.shape).to(layer.compute_dtype)
    if data.is_cuda and layer.compute_dtype in (torch.bfloat16, torch.float32):
        return dequantize_cuda(t, data, scales, layer.compute_dtype).view(t.shape)
    return dequantize(t, data, scales).to(layer.compute_dtype).view(t.shape)


class _FrozenLinear(torch.autograd.Function):
    """y = x W^T + b with W made from stored bytes in forward and again in backward, so no
    full-precision copy of it outlives either.

    The stored tensors are saved for backward (references, no copy): a block that streams its
    weights binds them to a device slot only around its forward, and its pager keeps saved
    views of that slot as layouts, fetching the block again when backward unpacks them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: Any, layer: "BaseLinear") -> torch.Tensor:
        ctx.layer = layer
        ctx.bias_grad = bias is not None and bias.requires_grad
        if layer.matmul_choice is None and layer.stored.stored == "fp8":
            layer._choose_matmul(x)
        stored = _stored(layer)
        ctx.save_for_backward(*stored)
        if layer.fp8_rows is not None:
            return fp8_matmul.linear(x, *stored, bias, layer.compute_dtype, layer.outliers)
        return nn.functional.linear(x, _weight(layer, x.device, stored), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        layer, grad_x = ctx.layer, None
        stored = ctx.saved_tensors
        if ctx.needs_input_grad[0] and layer.fp8_rows is not None:
            grad_x = fp8_matmul.input_grad(grad, *stored)
        elif ctx.needs_input_grad[0]:
            grad_x = grad @ _weight(layer, grad.device, stored)
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.bias_grad else None
        return grad_x, grad_b, None


class BaseLinear(nn.Linear):
    """A linear layer over a stored weight (``stored`` describes it; ``data`` and ``scales`` are
    its bytes, on the CPU as views of a shared base, or copied to a device).

    An fp8 weight on a GPU with FP8 tensor cores may multiply there instead of being
    dequantized (``fp8_matmul``, see :mod:`trainstream.frozen.fp8_matmul`): "auto" times both
    at the first forward of each shape and keeps the faster; ``matmul_choice`` says what was
    chosen and why, and ``memory_report()`` counts the layers per path. ``outliers`` (an fp8
    weight on the tensor-core path only): the fraction of each call's input channels, its
    largest, multiplied in the compute dtype instead (see fp8_matmul); a layer that cannot take that
    path refuses it at its first forward rather than ignore it."""

    def __init__(self, stored: BaseTensor, data: torch.Tensor, scales: torch.Tensor,
                 bias: Any, compute_dtype: torch.dtype, fp8_matmul: Any = "auto",
                 outliers: Any = 0):
        # nn.Linear's own constructor would allocate a weight: the module's is enough.
        nn.Module.__init__(self)
        if fp8_matmul not in ("auto", True, False):
            raise InvalidArgumentError(f"fp8_matmul={fp8_matmul!r}: use 'auto', True or False")
        if len(stored.shape) != 2:
            raise InvalidArgumentError(f"'{stored.name}' is not a matrix: {stored.shape}")
        self.stored = stored
        self.out_features, self.in_features = stored.shape
        # Buffers, not parameters: frozen, moved by .to(), and left out of state_dict (the base
        # holds them).
        self.register_buffer("data", data, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        # A trained bias (an nn.Parameter that requires grad) is kept as it is, trained.
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias, requires_grad=False)
        self.bias = bias
        self.compute_dtype = compute_dtype
        # fp8 weights only: "auto" times FP8 tensor cores against dequantizing at the first
        # forward on a GPU that has them, True uses them, False never does.
        self.fp8_matmul = fp8_matmul
        # Only an fp8 weight's input is quantized: the others multiply in full precision.
        fraction = outlier_fraction(outliers)
        self.outliers = fraction if stored.stored == "fp8" else 0.0
        if self.outliers and fp8_matmul is False:
            raise InvalidArgumentError(
                f"outliers={outliers!r} splits the FP8 tensor-core matmul, which "
                "fp8_matmul=False never uses")
        self.matmul_choice: dict | None = None  # what was chosen, and why (memory_report)
        self.note: Any = None  # wrap() sets its session's note(kind, message, **numbers)
        self.pooled = False  # its bytes are a view of a daemon GPU pool (attach_base)
        # Where its bytes are a shared base's host memory (attach_base without a GPU pool, a
        # random base's daemon buffers): those views, by buffer name. A block streaming them
        # reads them there, also when the layer's own copy is on the GPU.
        self.host_views: dict = {}
        # Its block streams its weights (memory/weight_slots.py): the stored bytes are bound to
        # a device slot only around the block's forward and backward.
        self.streams = False
        self.register_buffer("fp8_rows", None, persistent=False)
        self.register_buffer("fp8_row_scales", None, persistent=False)

    def _choose_matmul(self, x: torch.Tensor) -> None:
        """Decides, at the first forward, whether this fp8 weight multiplies on FP8 tensor cores
        (see fp8_matmul); when it does, the row-scaled copy replaces the stored bytes on the
        device."""
        forced = self.fp8_matmul is True
        ok, why = fp8_matmul.supported(x.device, forced)
        if self.fp8_matmul is False:
            ok, why = False, "fp8_matmul=False"
        elif ok and self.data.device != x.device:
            ok, why = False, "the weight stays in host memory (keep_on_host)"
        elif ok and self.streams:
            # The row-scaled copy would replace the stored bytes the block's slot holds.
            ok, why = False, "its block streams its weights from host memory"
        elif ok and not forced and self.pooled:
            ok, why = False, ("the weight is in a shared GPU pool: a row-scaled copy would "
                              "add one per process")
        elif ok and not fp8_matmul.shape_fits(self.out_features, self.in_features):
            ok, why = False, f"{self.out_features}x{self.in_features} is not in multiples of 16"
        elif ok and not forced and self.compute_dtype != torch.bfloat16:
            ok, why = False, f"computes in {self.compute_dtype} (row-scaled FP8 gives bf16)"
        if not ok:
            self.matmul_choice = {"path": "dequantize", "why": why}
            if self.outliers:
                raise FailedPreconditionError(
                    f"outliers={self.outliers} splits the FP8 tensor-core matmul; "
                    f"{self.stored.name} cannot take that path ({why}): pass outliers=0")
            return
        timed_now = False
        with torch.no_grad():
            try:
                codes, scales = fp8_matmul.rowwise(_weight(self, x.device))
                if forced:
                    choice = {"path": "scaled_mm", "why": "fp8_matmul=True"}
                elif self.outliers:
                    # Asked for: the split exists on the tensor-core path alone.
                    choice = {"path": "scaled_mm", "why": f"outliers={self.outliers}"}
                else:
                    choice, timed_now = fp8_matmul.choose(x.detach(), codes, scales,
                                                          lambda: _weight(self, x.device),
                                                          self.compute_dtype)
                    choice["why"] = "timed on this GPU"
            except torch.OutOfMemoryError:
                if forced or self.outliers:
                    raise
                codes = scales = None
                choice = {"path": "dequantize", "why": "no memory to requantize and time it"}
            except RuntimeError as e:  # this torch or GPU refused: dequantize as before
                if forced or self.outliers:
                    raise
                codes = scales = None
                choice = {"path": "dequantize",
                          "why": f"_scaled_mm failed: {str(e).splitlines()[0][:200]}"}
        if timed_now and self.note is not None:
            self.note("base.fp8_matmul",
                      f"{self.out_features}x{self.in_features} fp8 weights at "
                      f"{x.numel() // x.shape[-1]} tokens: FP8 tensor cores "
                      f"{choice['scaled_mm_ms']:.3f} ms, dequantize and multiply "
                      f"{choice['dequantize_ms']:.3f} ms: {choice['path']}",
                      scaled_mm_ms=choice["scaled_mm_ms"],
                      dequantize_ms=choice["dequantize_ms"])
        if choice["path"] == "scaled_mm":
            # As integers: a later model.to(dtype) or .half() casts floating-point buffers, and
            # would turn the codes into numbers and round the scales.
            self.fp8_rows = codes.view(torch.uint8)
            self.fp8_row_scales = scales.view(torch.int32)
            # The stored bytes on the device give way to the row-scaled copy (as many bytes).
            self.data = self.data.new_empty(0)
            self.scales = self.scales.new_empty(0)
        if self.outliers:
            choice["outliers"] = self.outliers
        self.matmul_choice = choice

    @property
    def weight(self) -> torch.Tensor:
        """The weight in the compute dtype, made now (for inspection; forward makes its own)."""
        return _weight(self, self.data.device)

    @weight.setter
    def weight(self, value: Any) -> None:
        raise FailedPreconditionError(
            f"the weight of a BaseLinear ({self.stored.name}, stored as {self.stored.stored}) is "
            "the shared base's and cannot be replaced; load the model with its own weights to "
            "change them")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FrozenLinear.apply(x.to(self.compute_dtype), self.bias, self)

    def extra_repr(self) -> str:
        path = f", matmul={self.matmul_choice['path']}" if self.matmul_choice else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"stored={self.stored.stored}, bias={self.bias is not None}{path}")


def host_views(data: torch.Tensor, scales: torch.Tensor) -> dict:
    """A ``BaseLinear.host_views`` of host bytes: tensors of their own over the same memory, so
    that the pager pointing the layer's buffers elsewhere (``.data =``) leaves them be."""
    return {"data": data.detach(), "scales": scales.detach()}


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Puts ``new`` in place of ``model``'s submodule ``name``."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def checkpoint_name(name: str) -> str:
    """A model tensor's name as a checkpoint holds it: PEFT's wrappers taken out (its
    ``base_model.model.`` prefix, the ``base_layer`` of a LoRA layer, the ``original_module`` of
    a module it keeps a trained copy of)."""
    name = name.removeprefix("base_model.model.")
    return ".".join(part for part in name.split(".")
                    if part not in ("base_layer", "original_module"))


def attach_base(model: nn.Module, base: SharedBase, device: Any = None,
                keep_on_host: bool = False, rename: Any = None,
                fp8_matmul: Any = "auto", gpu_pool: bool = False, outliers: Any = 0) -> dict:
    """Takes ``model``'s frozen weights from ``base`` by name: each ``nn.Linear`` whose weight
    the base holds becomes a :class:`BaseLinear` over the base's bytes (on the CPU the shared
    copy itself; on a GPU copied there once, or read from the shared host copy at every use with
    ``keep_on_host``); other frozen
    tensors the base holds (norms, embeddings) get its values. Trainable parameters are left as
    they are. ``rename(model_name) -> base_name`` maps the model's tensor names to the
    checkpoint's where they differ (another prefix); by default, names are taken as they are
    or with PEFT's wrappers taken out (:func:`checkpoint_name`), so adapters added before or
    after work alike. A model of which the base holds no frozen tensor is refused, with names
    from both sides.
    ``fp8_matmul`` ("auto", True, False): whether an fp8 base's layers multiply on FP8 tensor
    cores (see :class:`BaseLinear`); ``outliers`` (0; "auto" or True: 0.01; a fraction up to
    0.1): on that path, each call's largest input channels multiplied in the compute dtype
    (an fp8 base only: others quantize no input). ``gpu_pool=True`` (a CUDA ``device``): the
    layers read the base in place from the daemon's VRAM pool on that GPU, one copy shared by every
    process of the user there (:meth:`SharedBase.on_gpu`), and unquantized frozen tensors of the
    model's dtype are views of it too. Returns what was taken: {"linear": [...], "copied": [...],
    "viewed": [...], "bytes": n}, by the model's names."""
    if rename is None:
        def rename(name: str) -> str:
            return name if name in base.tensors else checkpoint_name(name)
    device = torch.device(device) if device is not None else next(
        (p.device for p in model.parameters()), torch.device("cpu"))
    if gpu_pool not in (True, False):
        raise InvalidArgumentError(f"gpu_pool={gpu_pool!r}: use True or False")
    if gpu_pool and (device.type != "cuda" or keep_on_host):
        raise InvalidArgumentError(
            f"gpu_pool=True reads the base from a GPU's VRAM: it needs a CUDA device (not "
            f"{device}) and no keep_on_host")
    if outlier_fraction(outliers) and base.format != "fp8":
        raise InvalidArgumentError(
            f"outliers={outliers!r} splits FP8 tensor-core matmuls; a {base.format} base "
            "quantizes no input (load it as fp8, or pass outliers=0)")
    pool = base.on_gpu(device) if gpu_pool else None
    taken: dict = {"linear": [], "copied": [], "viewed": [], "bytes": 0}
    handled: set = set()  # biases of the layers replaced, set with them
    for name, module in list(model.named_modules()):
        key = rename(f"{name}.weight" if name else "weight")
        if (not isinstance(module, nn.Linear) or isinstance(module, BaseLinear)
                or key not in base.tensors):
            continue
        if module.weight.requires_grad:
            continue  # trained: it is not the base's
        stored = base.tensors[key]
        if stored.shape != tuple(module.weight.shape):
            raise InvalidArgumentError(f"base tensor '{key}' is {stored.shape}; the model's "
                                       f"weight is {tuple(module.weight.shape)}")
        if pool is not None:  # the pool's bytes in place
            data, scales = pool.raw(key)
        else:
            data, scales = base.raw(key)
            if not keep_on_host and device.type != "cpu":  # on the CPU the shared copy is used
                data, scales = data.to(device, copy=True), scales.to(device, copy=True)
        bias = None
        if module.bias is not None:
            handled.add(f"{name}.bias")
            bias_key = rename(f"{name}.bias")
            if module.bias.requires_grad:
                bias = module.bias  # trained: not the base's
            elif bias_key in base.tensors:
                bias = base.dequantize(bias_key, dtype=module.weight.dtype, device=device)
            else:
                bias = module.bias.detach().to(device)
        layer = BaseLinear(stored, data, scales, bias, compute_dtype=module.weight.dtype,
                           fp8_matmul=fp8_matmul, outliers=outliers)
        layer.pooled = pool is not None
        if pool is None and base.in_one_registration(key):
            # The base's host bytes, which the attached base keeps mapped: a block that
            # streams reads them there, with no copy of its own, also when they were copied
            # to the GPU here. (Across two registrations, it makes a copy of its own.)
            layer.host_views = host_views(*base.raw(key))
        replace_module(model, name, layer)
        taken["linear"].append(f"{name}.weight")
        taken["bytes"] += stored.data_bytes + stored.scale_bytes
    for name, param in list(model.named_parameters()):
        key = rename(name)
        if param.requires_grad or key not in base.tensors or name in handled:
            continue
        stored = base.tensors[key]
        if stored.shape != tuple(param.shape):
            raise InvalidArgumentError(f"base tensor '{key}' is {stored.shape}; the model's "
                                       f"parameter '{name}' is {tuple(param.shape)}")
        # A new frozen parameter in its place: the old one may live on another device, or on
        # the meta device of a model built without memory.
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        if pool is not None and stored.stored in ("bf16", "as_is") and (
                pool.tensor(key).dtype == param.dtype):
            value = pool.tensor(key)  # the pool's copy, in place
            taken["viewed"].append(name)
        else:
            value = base.dequantize(key, dtype=param.dtype, device=device)
            taken["copied"].append(name)
        setattr(owner, leaf, nn.Parameter(value, requires_grad=False))
    if not (taken["linear"] or taken["copied"] or taken["viewed"]) and base.tensors:
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        raise FailedPreconditionError(
            f"attach_base: the base holds none of the model's frozen tensors (the model has "
            f"{', '.join(frozen[:3]) or 'no frozen parameter'}; the base "
            f"{', '.join(list(base.tensors)[:3])}): pass rename= to map the model's names "
            "onto the checkpoint's")
    model._trainstream_base = base  # the mapping lives as long as the model
    if pool is not None:
        model._trainstream_gpu_base = pool
    return taken


def attached_base(model: nn.Module) -> tuple:
    """The shared base attach_base() built ``model``'s frozen layers over, and its GPU pool:
    (SharedBase or None, GpuBase or None)."""
    return (getattr(model, "_trainstream_base", None),
            getattr(model, "_trainstream_gpu_base", None))


def quantize_layers(model: nn.Module, names: list, format: str, block: int = 0,
                    fp8_matmul: Any = "auto", outliers: Any = 0) -> dict:
    """Quantizes the frozen ``nn.Linear`` layers of ``model`` named in ``names`` in this process
    (the daemon's reference quantizer) into :class:`BaseLinear` layers on their device; a name
    that is not a frozen ``nn.Linear`` is left as it is. ``block``: values a scale (0: the
    format's own). Returns ``{"layers": [names quantized], "bytes_before": ..., "bytes_after":
    ...}`` (the weights' bytes as they were, and as stored with their scales).
    :func:`trainstream.quantize_model` chooses the layers; for one host copy shared by several
    processes, load the checkpoint with :func:`trainstream.load_base` and :func:`attach_base`
    instead."""
    if format not in ("int8", "nf4", "fp8", "nvfp4"):
        raise InvalidArgumentError(f"format={format!r} is not one of int8, nf4, fp8, nvfp4")
    if outlier_fraction(outliers) and format != "fp8":
        raise InvalidArgumentError(
            f"outliers={outliers!r} splits FP8 tensor-core matmuls; {format} weights quantize "
            "no input here (use format='fp8', or outliers=0)")
    done = {"layers": [], "bytes_before": 0, "bytes_after": 0}
    wanted = set(names)
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for name, module in list(model.named_modules()):
            if (name not in wanted or not isinstance(module, nn.Linear)
                    or isinstance(module, BaseLinear) or module.weight.requires_grad):
                continue
            w = module.weight.detach()
            data, scales, tensor_scale, block_used = quantize_on_every_core(
                pool, w, format, block)
            stored = BaseTensor(name=f"{name}.weight", shape=tuple(w.shape), source_dtype="F32",
                                stored=format, block=block_used, tensor_scale=tensor_scale,
                                buffer=0, data_offset=0, data_bytes=data.numel(), scale_offset=0,
                                scale_bytes=scales.numel())
            bias = module.bias
            if bias is not None and not bias.requires_grad:
                bias = bias.detach()
            layer = BaseLinear(stored, data.to(w.device), scales.to(w.device), bias,
                               compute_dtype=w.dtype, fp8_matmul=fp8_matmul, outliers=outliers)
            replace_module(model, name, layer)
            done["layers"].append(name)
            done["bytes_before"] += w.numel() * w.element_size()
            done["bytes_after"] += data.numel() + scales.numel()
    return done


# Values a quantizing task takes (a multiple of every format's block): enough to keep a core
# busy for milliseconds, small enough that a layer spreads over every core.
_CHUNK_VALUES = 1 << 22


def quantized_sizes(format: str, numel: int, block: int = 0) -> tuple:
    """(data bytes, scale bytes, block) of ``numel`` values quantized as ``format``."""
    return kernels.quant_layout(format, numel, block)


def quantize_on_every_core(pool: Any, w: torch.Tensor, format: str, block: int,
                            out: tuple | None = None) -> tuple:
    """``w`` quantized by the daemon's quantizer (the same bytes as quantize_reference), its
    chunks on ``pool``'s threads, in place in torch buffers (``out``: the (data, scales) uint8
    CPU tensors to fill, of :func:`quantized_sizes`; default: new ones): (data, scales, tensor
    scale, block)."""
    values = w.float().cpu().contiguous().view(-1)  # a copy only where w is not fp32 on the CPU
    numel = values.numel()
    data_bytes, scale_bytes, block_used = kernels.quant_layout(format, numel, block)
    if out is None:
        out = (torch.empty(data_bytes, dtype=torch.uint8),
               torch.empty(scale_bytes, dtype=torch.uint8))
    data, scales = out
    if data.numel() != data_bytes or scales.numel() != scale_bytes or not (
            data.is_contiguous() and scales.is_contiguous()):
        raise InvalidArgumentError(
            f"quantizing {numel} values as {format}: the destinations hold {data.numel()} and "
            f"{scales.numel()} bytes; {data_bytes} and {scale_bytes} contiguous are needed")
    tensor_scale = (kernels.nvfp4_tensor_scale(float(values.abs().max()))
                    if format == "nvfp4" and numel else 1.0)
    step = max(block_used, _CHUNK_VALUES // block_used * block_used)
    tasks = [pool.submit(kernels.quantize_chunk, format, block_used, numel, first,
                         min(step, numel - first),
                         values.data_ptr() + 4 * first, tensor_scale, data.data_ptr(),
                         scales.data_ptr())
             for first in range(0, numel, step)]
    for task in tasks:
        task.result()  # raises the first failure (a non-finite weight, say)
    return data, scales, tensor_scale, block_used
