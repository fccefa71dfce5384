# SPDX-License-Identifier: Apache-2.0
"""Shared frozen bases: a checkpoint held once by trainstreamd, bf16 or quantized, that every
process of the user maps read-only instead of loading its own copy.

``load_base(path, format="nf4")`` asks the daemon for the base (it reads the checkpoint the
first time, converting and quantizing as it reads, with progress) and maps it; its tensors are
then views of the daemon's memory (``raw()``) or dequantized copies (``dequantize()``).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

from ..transport import kernels
from ..transport.client import Client, connect, in_one_registration
from ..errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from .formats import E2M1_VALUES, FORMATS, NF4_VALUES, BaseTensor, source_dtype  # noqa: F401
from .gpu_pool import place_on_gpu

class SharedBase:
    """A base this process is attached to. The daemon keeps it while any process is, and a
    while after (``tsctl bases``); ``close()`` detaches this one."""

    def __init__(self, client: Client, info: dict, buffers: list):
        self.client = client  # the session the base is mapped through
        self._info = info
        self._buffers = buffers
        # This process's mappings of the base's GPU pools, by CUDA device index (on_gpu).
        self.gpu_pools: dict = {}
        self.tensors = {t["name"]: BaseTensor(
            name=t["name"], shape=tuple(int(d) for d in t.get("shape", [])),
            source_dtype=t["source_dtype"], stored=t["stored"], block=int(t["block"]),
            tensor_scale=float(t["tensor_scale"]), buffer=int(t["buffer"]),
            data_offset=int(t["data_offset"]), data_bytes=int(t["data_bytes"]),
            scale_offset=int(t["scale_offset"]), scale_bytes=int(t["scale_bytes"]))
            for t in info.get("tensors", [])}

    id = property(lambda self: int(self._info["base_id"]))
    name = property(lambda self: self._info["name"])
    format = property(lambda self: self._info["format"])
    source = property(lambda self: self._info["source"])
    stored_bytes = property(lambda self: int(self._info["stored_bytes"]))
    load_seconds = property(lambda self: float(self._info["load_seconds"]))

    def in_one_registration(self, name: str) -> bool:
        """Whether ``name``'s stored bytes (data, and scales) each lie inside one CUDA host
        registration of their buffer, as a streamed block's fetch by raw pointers needs."""
        t = self.record(name)
        buffer = self._buffers[t.buffer]
        return (in_one_registration(buffer, t.data_offset, t.data_bytes)
                and in_one_registration(buffer, t.scale_offset, t.scale_bytes))

    def info(self) -> dict:
        """The daemon's view now (users, bytes, state)."""
        return self.client.base_info(self.id)

    def _bytes(self, t: BaseTensor, offset: int, nbytes: int) -> Any:
        import torch
        import warnings

        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only: torch can't enforce it
            return torch.frombuffer(self._buffers[t.buffer], dtype=torch.uint8, count=nbytes,
                                    offset=offset)

    def raw(self, name: str) -> tuple:
        """The stored bytes of ``name``, as views of the daemon's read-only memory: (data,
        scales), uint8 tensors (scales empty unless quantized). Never write to them."""
        t = self.record(name)
        data = self._bytes(t, t.data_offset, t.data_bytes)
        scales = self._bytes(t, t.scale_offset, t.scale_bytes)
        return data, scales

    def tensor(self, name: str) -> Any:
        """A tensor kept unquantized (bf16, or as the checkpoint had it), as a read-only view
        of the shared copy with its shape; quantized ones need :meth:`dequantize`."""
        import torch

        t = self.record(name)
        if t.stored not in ("bf16", "as_is"):
            raise FailedPreconditionError(f"tensor '{name}' is stored as {t.stored}: "
                                          "use dequantize()")
        dtype = torch.bfloat16 if t.stored == "bf16" else getattr(torch, source_dtype(t))
        data, _ = self.raw(name)
        return data.view(dtype).view(t.shape)

    def dequantize(self, name: str, dtype: Any = None, device: Any = None) -> Any:
        """``name`` as a new tensor of ``dtype`` (bf16 by default) on ``device`` (the CPU by
        default), whatever its stored format."""
        import torch

        t = self.record(name)
        dtype = dtype or torch.bfloat16
        if t.stored in ("bf16", "as_is"):
            return self.tensor(name).to(device=device, dtype=dtype, copy=True)
        data, scales = self.raw(name)
        data, scales = data.to(device), scales.to(device)
        if data.is_cuda and dtype in (torch.bfloat16, torch.float32):
            return dequantize_cuda(t, data, scales, dtype).view(t.shape)
        return dequantize(t, data, scales).to(dtype).view(t.shape)

    def on_gpu(self, device: Any = None) -> Any:
        """This base in the daemon's VRAM pool on CUDA ``device``: one copy per GPU, shared by
        every process of the user there (see :mod:`trainstream.gpu_pools`)."""
        if not self._buffers:
            raise FailedPreconditionError(f"base '{self.name}' is closed in this process")
        return place_on_gpu(self, device)

    buffer_count = property(lambda self: len(self._buffers))

    def record(self, name: str) -> BaseTensor:
        """Where and how tensor ``name`` is stored in the base."""
        if not self._buffers:
            raise FailedPreconditionError(f"base '{self.name}' is closed in this process")
        if name not in self.tensors:
            raise NotFoundError(f"base '{self.name}' has no tensor '{name}'")
        return self.tensors[name]

    def close(self) -> None:
        """Detaches this process; the daemon frees the base when no process uses it (after
        its keep-warm time)."""
        if self._buffers:
            self._buffers = []
            # Its GPU pools go with the last view of them (a model built over one keeps it).
            self.gpu_pools = {}
            self.client.detach_base(self.id)

    def __enter__(self) -> "SharedBase":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<trainstream.SharedBase {self.id} '{self.name}' {self.format}, "
                f"{len(self.tensors)} tensors, {self.stored_bytes / 1e9:.2f} GB>")


def dequantize(t: BaseTensor, data: Any, scales: Any) -> Any:
    """fp32 values of a quantized tensor from its stored bytes (uint8 tensors on any device),
    computed as the daemon's reference quantizer defines them."""
    import torch

    n, block, device = t.numel, t.block, data.device

    def per_value(block_scales: Any) -> Any:
        return block_scales.repeat_interleave(block)[:n]

    def nibbles(first_high: bool) -> Any:
        high, low = (data >> 4).long(), (data & 0xF).long()
        pairs = torch.stack((high, low) if first_high else (low, high), dim=1)
        return pairs.reshape(-1)[:n]

    if t.stored == "int8":
        return data.view(torch.int8).float() * per_value(scales.view(torch.float32))
    if t.stored == "nf4":
        table = torch.tensor(NF4_VALUES, dtype=torch.float32, device=device)
        return table[nibbles(True)] * per_value(scales.view(torch.float32))
    if t.stored == "fp8":
        return data.view(torch.float8_e4m3fn).float() * per_value(scales.view(torch.float32))
    if t.stored == "nvfp4":
        table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
        block_scales = scales.view(torch.float8_e4m3fn).float() * t.tensor_scale
        return table[nibbles(False)] * per_value(block_scales)
    raise InvalidArgumentError(f"tensor '{t.name}' is stored as {t.stored}, not quantized")


def dequantize_cuda(t: BaseTensor, data: Any, scales: Any, dtype: Any = None) -> Any:
    """The GPU kernel's dequantization (kernels/cuda/dequantize.cu) of a quantized tensor whose
    stored bytes are CUDA tensors, into a new bf16 (default) or fp32 tensor, queued on the
    current stream."""
    import torch

    dtype = dtype or torch.bfloat16
    if dtype not in (torch.bfloat16, torch.float32):
        raise InvalidArgumentError(f"dequantize_cuda writes bf16 or fp32, not {dtype}")
    if t.stored not in ("int8", "nf4", "fp8", "nvfp4"):
        raise InvalidArgumentError(f"tensor '{t.name}' is stored as {t.stored}, not quantized")
    if not (data.is_cuda and scales.is_cuda and data.device == scales.device):
        raise InvalidArgumentError("dequantize_cuda needs the stored bytes on one CUDA device")
    data, scales = data.contiguous(), scales.contiguous()
    with torch.cuda.device(data.device):  # the kernel runs on the data's device
        out = torch.empty(t.numel, dtype=dtype, device=data.device)
        kernels.dequantize_cuda(t.stored, t.block, t.numel, data.data_ptr(),
                                scales.data_ptr(), t.tensor_scale, out.data_ptr(),
                                dtype == torch.bfloat16,
                                torch.cuda.current_stream(data.device).cuda_stream)
    return out


def _print_progress(info: dict) -> None:
    total = max(1, int(info.get("read_total", 0)))
    read = int(info.get("read_bytes", 0))
    print(f"\rtrainstream: loading base '{info['name']}' ({info['format']}): "
          f"{100 * read / total:5.1f}% of {total / 1e9:.2f} GB", end="", file=sys.stderr,
          flush=True)


def load_base(path: str, format: str = "bf16", block: int = 0, quantize: list | None = None,
              name: str = "", client: Client | None = None, timeout_s: float | None = None,
              progress: bool | Callable[[dict], None] = True) -> SharedBase:
    """The shared base of the checkpoint at ``path`` (a .safetensors file, an index, or their
    folder) stored as ``format``; loads it in the daemon unless one of this user's processes
    already has. ``quantize`` names the tensors to quantize (default: every 2-D float tensor but
    the embeddings and the output head). Waits until it is ready, showing progress on stderr
    (``progress=False`` for none, or a callable given each state)."""
    import os

    if format not in FORMATS:
        raise InvalidArgumentError(f"format={format!r} is not one of {', '.join(FORMATS)}")
    if not isinstance(block, int) or block < 0:
        raise InvalidArgumentError(f"block={block!r} must be 0 (the format's default) or more")
    client = client or connect(job_id=f"base-{os.getpid()}")
    info = client.load_base(os.path.abspath(path), format, block, list(quantize or []), name)
    report = progress if callable(progress) else (_print_progress if progress else None)
    start = time.monotonic()
    shown = False
    while info["state"] == "loading":
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise TimeoutError(f"base '{info['name']}' still loading after {timeout_s} s "
                               f"({int(info['read_bytes'])} of {int(info['read_total'])} bytes)")
        if report is not None:
            report(info)
            shown = True
        time.sleep(0.1)
        info = client.base_info(int(info["base_id"]))
    if shown and report is _print_progress:
        print(file=sys.stderr)
    if info["state"] != "ready":
        raise FailedPreconditionError(f"base '{info['name']}' failed to load: {info['error']}")
    return SharedBase(client, info, client.map_base(int(info["base_id"])))


def mapped_segments() -> dict:
    """The daemon's segments as this process maps them (Linux /proc/self/smaps): bytes
    resident, and this process's proportional share of them (a page mapped by n processes
    counts 1/n in each, so the processes' shares of a shared base add up to one copy)."""
    totals = {"resident_bytes": 0, "proportional_bytes": 0}
    keys = {"Rss:": "resident_bytes", "Pss:": "proportional_bytes"}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):
                inside = "trainstream-segment" in line  # a mapping's header line
            elif inside and parts and parts[0] in keys:
                totals[keys[parts[0]]] += int(parts[1]) * 1024
    return totals


def bases(client: Client | None = None) -> list:
    """This user's bases in the daemon (all users' for an admin), as dicts."""
    client = client or connect()
    return client.bases()
