# SPDX-License-Identifier: Apache-2.0
"""Shared bases in the daemon's GPU pools: one VRAM copy of a base per GPU, read in place by
every process of the user on that GPU.

``SharedBase.on_gpu(device)`` asks the daemon to place the base in its pool on that GPU (it
copies the base there from its host copy the first time; later processes join that pool) and
maps the pool into this process, read-only where the driver allows it. ``attach_base(...,
gpu_pool=True)`` builds the model's frozen layers over it: no copy of the base in this process.
The daemon frees a pool when the last process using it releases it or ends.
"""

from __future__ import annotations

import weakref
from typing import Any

from ..transport import device as cuda_device
from ..transport.client import Client, connect
from .formats import source_dtype
from ..errors import FailedPreconditionError, InvalidArgumentError


def _release(client: Client, pool_id: int) -> None:
    try:
        client.release_gpu_pool(pool_id)
    except Exception:  # the session ended first: the daemon released it with the session
        pass


class GpuBase:
    """A base's pool on one GPU, mapped into this process. Its tensors are views of the pool:
    never write to them. The mapping (and this process's share of the pool) lives while any
    view does."""

    def __init__(self, base: Any, device: Any):
        import torch

        self.base = base
        self.device = device
        client = base.client
        self.info = client.place_base_on_gpu(base.id, cuda_device.device_uuid(device.index))
        self.pool_id = int(self.info["pool_id"])
        try:
            mapping = client.import_gpu_pool(self.pool_id, device.index)
        except Exception:
            _release(client, self.pool_id)
            raise
        self.kind = mapping.kind
        self.read_only = mapping.read_only
        self.note = mapping.note
        self.bytes = mapping.bytes
        # The import ends when the mapping goes: after the last view of it. Not at interpreter
        # exit (the mapping may outlive the finalizers then): the session's end releases it.
        weakref.finalize(mapping, _release, client, self.pool_id).atexit = False
        self._pool = torch.as_tensor(mapping, device=device)
        offsets = [int(o) for o in self.info.get("buffer_offsets", [])]
        if len(offsets) != base.buffer_count:
            raise FailedPreconditionError(
                f"GPU pool {self.pool_id} describes {len(offsets)} buffers; base "
                f"'{base.name}' has {base.buffer_count}")
        self._offsets = offsets
        if self.note:
            client.report_event("pool.mapped", f"GPU pool {self.pool_id} on {device}: "
                                f"{self.note}", bytes=float(self.bytes))

    def raw(self, name: str) -> tuple:
        """The stored bytes of ``name`` in the pool: (data, scales), uint8 views on the GPU."""
        t = self.base.record(name)
        start = self._offsets[t.buffer]
        data = self._pool[start + t.data_offset:start + t.data_offset + t.data_bytes]
        scales = self._pool[start + t.scale_offset:start + t.scale_offset + t.scale_bytes]
        return data, scales

    def tensor(self, name: str) -> Any:
        """A tensor the base keeps unquantized, as a view of the pool with its dtype and
        shape."""
        import torch

        t = self.base.record(name)
        if t.stored not in ("bf16", "as_is"):
            raise FailedPreconditionError(f"tensor '{name}' is stored as {t.stored}")
        dtype = torch.bfloat16 if t.stored == "bf16" else getattr(torch, source_dtype(t))
        return self.raw(name)[0].view(dtype).view(t.shape)

    def report(self) -> dict:
        """What memory_report() shows of it."""
        return {"pool_id": self.pool_id, "gpu_uuid": self.info["gpu_uuid"],
                "bytes": self.bytes, "kind": self.kind, "read_only": self.read_only,
                "note": self.note, "fill_seconds": float(self.info.get("fill_seconds", 0.0))}

    def __repr__(self) -> str:
        return (f"<trainstream.GpuBase pool {self.pool_id} of base {self.base.id} on "
                f"{self.device}, {self.bytes / 1e9:.2f} GB, {self.kind}"
                f"{', read-only' if self.read_only else ''}>")


def place_on_gpu(base: Any, device: Any = None) -> GpuBase:
    """``base`` in the daemon's pool on CUDA ``device`` (default: the current one), mapped
    here; one per base and device in this process."""
    import torch

    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda":
        raise InvalidArgumentError(f"GPU pools live on CUDA devices, not {device}")
    if not torch.cuda.is_available():
        raise FailedPreconditionError("no CUDA device in this process: no GPU pool to use")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    pools = base.gpu_pools
    if device.index not in pools:
        pools[device.index] = GpuBase(base, device)
    return pools[device.index]


def gpu_pools(client: Client | None = None) -> dict:
    """The daemon's GPU pools of this user (all users' for an admin): {"pools": [...], "note":
    why none can be made, when none can}."""
    client = client or connect()
    reply = client.gpu_pools()
    return {"pools": reply.get("pools", []), "note": reply.get("note", "")}
