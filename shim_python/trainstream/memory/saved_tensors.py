# SPDX-License-Identifier: Apache-2.0
"""The activations a paging block saves for backward (BlockPager's, memory/pager.py): copied to host
memory as forward saves them, on a stream of their own, and brought back, a block ahead, as
backward needs them."""

from __future__ import annotations

import collections
from typing import Any, Callable, Sequence

import torch

from ..transport import device as cuda_device


class OffloadedActivation:
    """One saved activation in host memory (and, once brought back, on the device again)."""

    def __init__(self, block: int, host: torch.Tensor, copied: Any):
        self.block = block
        self.host = host
        self.copied = copied        # event: the block's copies to host landed (CUDA)
        self.device: torch.Tensor | None = None
        self.returned: Any = None   # event: the copy back (with its batch) landed
        self.used = False           # backward has unpacked every view of it
        self.views = 0              # the saved tensors that are views of it
        self.left = 0               # of them, those this backward has not unpacked yet


class SavedView:
    """What autograd holds for one saved tensor of a paging block: its layout over the storage
    an OffloadedActivation item pages. Tensors saved from one storage share the item (q, k and
    v sliced from one fused projection's output, a gate and its up projection: views that keep
    the whole storage alive), so that paging them frees that storage and copies it once."""

    __slots__ = ("item", "dtype", "shape", "stride", "offset")

    def __init__(self, item: OffloadedActivation, t: torch.Tensor):
        self.item = item
        self.dtype, self.shape = t.dtype, tuple(t.shape)
        self.stride, self.offset = tuple(t.stride()), t.storage_offset()


class SavedTensorPaging:
    """Pages the saved activations of the blocks in ``offloading`` on ``device``: contiguous
    storages of at least ``min_offload_bytes`` other than the block's weights go to host memory
    (``arena``'s, the daemon's: an ActivationArena, or a callable making one when the first
    block starts paging; else private pinned), at most ``max_inflight_bytes`` in flight."""

    def __init__(self, device: torch.device, arena: Any, min_offload_bytes: int,
                 max_inflight_bytes: int):
        self.device = device
        self.cuda = device.type == "cuda"
        self._device_index = cuda_device.device_index(device) if self.cuda else -1
        self.min_offload_bytes = int(min_offload_bytes)
        # Activations still crossing to host memory keep their device memory until the copy
        # lands; past this many bytes, forward waits for the oldest copies.
        self.max_inflight_bytes = int(max_inflight_bytes)
        self.offloading: list[int] = []
        self.saved: dict[int, list[OffloadedActivation]] = {}
        self.bytes_offloaded = 0
        self.inflight_waits = 0
        self._inflight: collections.deque = collections.deque()
        self._inflight_bytes = 0
        # Activations the block running now saved, with their device tensors: copied to host
        # together after its forward, behind one event (a stream switch and an event per
        # tensor cost the CPU more than the copy's own call).
        self._unissued: list[tuple[OffloadedActivation, torch.Tensor]] = []
        self._unissued_bytes = 0
        self._compute_waited: Any = None  # the last copy-back event the compute stream waited on
        # Blocks whose backward has asked for their predecessor's activations since their
        # forward.
        self._predecessor_asked: set[int] = set()
        self._make_arena: Callable[[], Any] | None = (
            arena if callable(arena) and not hasattr(arena, "take") else None)
        self.arena = None if self._make_arena is not None else arena
        self.arena_refused: str | None = None
        # Copied on a stream of their own: an activation's copy waits for compute (the copy
        # out for the work that made it, the copy back for the memory it reuses) and so holds
        # no weight fetch back, and the link carries activations out while weights come in.
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # Per block whose forward runs now: the storages its saved tensors page, by address
        # (held until the forward ends, so that an address is not reused meanwhile).
        self._paged_storages: dict[int, dict] = {}

    def set_blocks(self, indices: Sequence[int]) -> None:
        """From the next forward, blocks ``indices`` page their saved activations."""
        self.offloading = sorted(set(int(i) for i in indices))
        self.saved = {b: self.saved.get(b, []) for b in self.offloading}
        if self.offloading and self.arena is None and self._make_arena is not None:
            self.arena = self._make_arena()  # made when first needed

    def forward_starting(self, b: int) -> None:
        """Block ``b`` (one of ``offloading``) starts its forward: last step's activations are
        gone with its graph; the first block of a step with a graph starts the arena over (the
        last step's backward is over)."""
        self.saved[b] = []
        self._predecessor_asked.discard(b)
        self._paged_storages[b] = {}
        if self.arena is not None and b == self.offloading[0] and torch.is_grad_enabled():
            self.arena.reset()

    def forward_ended(self, b: int) -> None:
        """Block ``b``'s forward ended: its activations' copies to host start."""
        if self._unissued:
            self._issue_offloads()
        self._paged_storages.pop(b, None)

    def pack(self, b: int, t: torch.Tensor, weight_storages: Any) -> SavedView | None:
        """What autograd keeps of ``t``, saved by block ``b``, when it pages (None: it does
        not). Storages in ``weight_storages`` (the block's weights, what it was called with
        besides its input) stay: paging them would free nothing."""
        if t.device != self.device:
            return None
        storage = t.untyped_storage()
        if (storage.nbytes() < self.min_offload_bytes
                or storage.nbytes() % t.element_size() != 0
                or storage.data_ptr() in weight_storages):
            return None
        item = self._offload(b, t, storage)
        if item is None:
            return None
        item.views += 1
        item.left = item.views
        return SavedView(item, t)

    def _host_for(self, t: torch.Tensor) -> torch.Tensor | None:
        if self.arena is None:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda)
        try:
            return self.arena.take(tuple(t.shape), t.dtype)
        except MemoryError as e:  # the daemon has no room left: this one stays on the device
            self.arena_refused = str(e)
            return None

    def _offload(self, b: int, t: torch.Tensor, storage: Any) -> OffloadedActivation | None:
        """The item paging ``t``'s whole storage (None: no host memory for it, and ``t`` stays
        on the device): made, and its copy queued, for the first tensor saved from it."""
        known = self._paged_storages.setdefault(b, {}).get(storage.data_ptr())
        if known is not None:
            return known[0]
        t = t.as_strided((storage.nbytes() // t.element_size(),), (1,), 0)
        nbytes = storage.nbytes()
        host = self._host_for(t)
        if host is None:
            return None
        item = OffloadedActivation(b, host, None)
        self._paged_storages[b][storage.data_ptr()] = (item, t)
        if self.cuda:
            if self._unissued and (self._inflight_bytes + self._unissued_bytes + nbytes
                                   > self.max_inflight_bytes):
                # This block alone passes the cap: its copies so far start now, so that the
                # wait below has something of this block's to wait for.
                self._issue_offloads()
            self._limit_inflight(self._unissued_bytes + nbytes)
            self._unissued.append((item, t))
            self._unissued_bytes += nbytes
        else:
            host.copy_(t)
        self.bytes_offloaded += nbytes
        self.saved[b].append(item)
        return item

    def _issue_offloads(self) -> None:
        """Copies the running block's saved activations to host memory on the activation
        stream, after the work that made them, behind one event: what bringing them back waits
        for, and what bounds the bytes in flight."""
        stream = self.stream
        stream.wait_stream(cuda_device.current(self._device_index))
        self._copy_activations(stream, [(item.host, t) for item, t in self._unissued])
        for _, t in self._unissued:
            t.record_stream(stream)  # not reused before its copy is done
        copied = torch.cuda.Event()
        copied.record(stream)
        for item, _ in self._unissued:
            item.copied = copied
        self._inflight.append((copied, self._unissued_bytes))
        self._inflight_bytes += self._unissued_bytes
        self._unissued, self._unissued_bytes = [], 0

    def _copy_activations(self, stream: Any, pairs: list) -> None:
        """Copies each ``(destination, source)`` pair on ``stream``. The arena's host memory
        (the daemon's, alive as long as the pager) takes one native call for all of them;
        private pinned tensors go through torch, whose pinned-memory pool then keeps a freed
        buffer from being handed out again before its copy has run."""
        if self.arena is not None:
            cuda_device.copy_pieces(stream.cuda_stream, [(dst.data_ptr(), src.data_ptr(),
                                                          src.nbytes) for dst, src in pairs])
            return
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

    def _limit_inflight(self, nbytes: int) -> None:
        while self._inflight and self._inflight[0][0].query():  # landed already
            self._inflight_bytes -= self._inflight.popleft()[1]
        while self._inflight and self._inflight_bytes + nbytes > self.max_inflight_bytes:
            event, size = self._inflight.popleft()
            event.synchronize()
            self._inflight_bytes -= size
            self.inflight_waits += 1

    def wait_for_copies(self) -> None:
        """The compute stream waits for every copy issued so far."""
        cuda_device.current(self._device_index).wait_stream(self.stream)

    def _bring_back(self, items: list) -> None:
        """Copies ``items`` (those not on the device already) back, as one batch behind one
        event."""
        todo = [item for item in items if item.device is None]
        if not todo:
            return
        if not self.cuda:
            for item in todo:
                item.device = item.host
            return
        if self._unissued:  # a forward that never reached its end hook
            self._issue_offloads()
        # Allocated from the compute stream's pool (where they are used and freed); the copies
        # wait for the compute stream's earlier work, and the allocator waits for the copies
        # before it reuses the memory.
        compute = cuda_device.current(self._device_index)
        for item in todo:
            item.device = torch.empty_like(item.host, device=self.device)
        self.stream.wait_stream(compute)
        for event in {id(item.copied): item.copied for item in todo}.values():
            self.stream.wait_event(event)
        self._copy_activations(self.stream,
                               [(item.device, item.host) for item in todo])
        returned = torch.cuda.Event()
        returned.record(self.stream)
        for item in todo:
            item.device.record_stream(self.stream)
            item.returned = returned

    def _arrived(self, item: OffloadedActivation) -> torch.Tensor:
        """``item``'s storage on the device, for backward to use on the current stream: brought
        back if it was not yet, with its block's predecessor's storages after it the first
        time backward reaches the block."""
        if item.device is None:
            self._bring_back([item])
        if item.block not in self._predecessor_asked:
            # Backward reached this block: its predecessor's activations come back now (those
            # backward has not used yet), in one batch.
            self._predecessor_asked.add(item.block)
            k = self.offloading.index(item.block)
            if k > 0:
                self._bring_back([other for other in self.saved[self.offloading[k - 1]]
                                  if not other.used])
        if self.cuda:
            compute = cuda_device.current(self._device_index)
            # A batch's event once per stream: later waits on it would add nothing.
            if self._compute_waited != (compute, item.returned):
                compute.wait_event(item.returned)
                self._compute_waited = (compute, item.returned)
        return item.device

    def unpack(self, packed: SavedView) -> torch.Tensor:
        """The saved tensor ``packed`` describes, on the device for backward."""
        item = packed.item
        storage = self._arrived(item)
        if packed.dtype != storage.dtype:
            storage = storage.view(packed.dtype)
        # The host copy may be a slice of the arena's storage (on a CPU "device" it is what
        # comes back): the layout's offset counts from where the copy starts.
        view = storage.as_strided(packed.shape, packed.stride,
                                  storage.storage_offset() + packed.offset)
        item.left -= 1
        if item.left <= 0:
            # Backward owns its views now: the storage is freed with the last of them rather
            # than kept until the next forward (the host copy stays, for retain_graph, which
            # unpacks every view again).
            item.device, item.used, item.left = None, True, item.views
        return view

    def close(self) -> None:
        """Forgets every paged activation (the pager stops)."""
        self.saved = {b: [] for b in self.offloading}
