# SPDX-License-Identifier: Apache-2.0
"""A key/value cache for generation whose offloaded layers keep their keys and values in host
memory from the daemon's buffers (pinned, counted against the job like everything it holds).
Resident layers keep theirs in VRAM. Attention reads an offloaded layer's keys and values from a
device slot: two slots shared by every offloaded layer, one filled from host memory on a copy
stream while the layer before uses the other.

A layer's host memory is one extent (a daemon buffer) sized for ``max_tokens`` at first, and a
further one each time a sequence outgrows what it has (twice as much again): reading a layer
back is then one copy for its keys and one for its values, not one per page, which is what the
Python side of decoding can afford for every offloaded layer and every new token. Extents and
slots are laid out position-major ([positions, batch, heads, head_dim]), so that a run of
positions is one contiguous block each way over PCIe; attention gets a [batch, heads, positions,
head_dim] view of the slot. Inference only (no autograd through host memory)."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from ..errors import InvalidArgumentError
from ..transport import device as cuda_device

_ids = itertools.count()


def _check(num_layers: Any, max_tokens: Any, resident_layers: Any, page_tokens: Any,
           vram_fraction: Any) -> None:
    for name, value in (("num_layers", num_layers), ("max_tokens", max_tokens),
                        ("page_tokens", page_tokens)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise InvalidArgumentError(f"PagedKVCache: {name}={value!r} must be an integer >= 1")
    if not (isinstance(vram_fraction, (int, float)) and 0 < vram_fraction <= 1):
        raise InvalidArgumentError(
            f"PagedKVCache: vram_fraction={vram_fraction!r} must be in (0, 1]")
    if resident_layers == "auto":
        return
    if isinstance(resident_layers, int) and not isinstance(resident_layers, bool):
        if not 0 <= resident_layers <= num_layers:
            raise InvalidArgumentError(
                f"PagedKVCache: resident_layers={resident_layers} must be in [0, {num_layers}]")
        return
    if (isinstance(resident_layers, (list, tuple))
            and all(isinstance(i, int) and 0 <= i < num_layers for i in resident_layers)
            and len(set(resident_layers)) == len(resident_layers)):
        return
    raise InvalidArgumentError(
        f"PagedKVCache: resident_layers={resident_layers!r} must be 'auto', a count, or a list "
        f"of distinct layer indices below {num_layers}")


def spread(count: int, num_layers: int) -> list:
    """``count`` layer indices spread evenly through ``num_layers``."""
    return sorted({min(num_layers - 1, int((i + 0.5) * num_layers / count))
                   for i in range(count)}) if count else []


def inside_one_registration(offset: int, length: int, piece: int) -> bool:
    """Whether ``length`` bytes at ``offset`` of a segment lie inside one CUDA registration of
    it, the segment being registered ``piece`` bytes at a time (0: whole, or not at all)."""
    return not piece or length == 0 or offset // piece == (offset + length - 1) // piece


class _Extent:
    """One daemon buffer of a layer's positions ``first`` onward: its keys, then its values,
    each ``[positions, batch, heads, head_dim]``."""

    def __init__(self, first: int, positions: int, row: int, buffer: Any, dtype: Any,
                 shape: tuple, dma: bool):
        self.first, self.positions, self.row, self.buffer, self.dma = (first, positions, row,
                                                                      buffer, dma)
        self.half = positions * row
        raw = buffer.tensor(torch.uint8, (2 * self.half,))
        self.keys = raw[:self.half].view(dtype).view(positions, *shape)
        self.values = raw[self.half:].view(dtype).view(positions, *shape)
        self.keys_address = self.keys.data_ptr()
        self.values_address = self.values.data_ptr()
        # Raw pointer copies (one native call for many) only where each half lies inside one
        # CUDA registration of the segment; the buffer's own copies split at their edges.
        piece = buffer.registration_piece_bytes
        self.direct = dma and all(inside_one_registration(start, self.half, piece)
                                  for start in (buffer.offset, buffer.offset + self.half))

    def write(self, at: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Positions ``first + at`` onward from contiguous device (or CPU) tensors."""
        if self.dma:
            self.buffer.copy_from_device(keys, at * self.row)
            self.buffer.copy_from_device(values, self.half + at * self.row)
        else:
            self.keys[at:at + keys.shape[0]].copy_(keys, non_blocking=True)
            self.values[at:at + values.shape[0]].copy_(values, non_blocking=True)

    def read(self, count: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The first ``count`` positions into contiguous device (or CPU) tensors."""
        if self.dma:
            self.buffer.copy_to_device(keys, 0)
            self.buffer.copy_to_device(values, self.half)
        else:
            keys.copy_(self.keys[:count], non_blocking=True)
            values.copy_(self.values[:count], non_blocking=True)


class PagedKVCache:
    """``update(layer, keys, values)`` appends ``[batch, heads, tokens, head_dim]`` keys and
    values and returns the layer's whole keys and values on their device. ``resident_layers``:
    ``"auto"`` (as many as fit in ``vram_fraction`` of the free VRAM at the first update, the
    rest spread through the stack; all of them without a GPU), a count (the others spread
    among them) or a list of indices. ``max_tokens`` sizes the slots, the first host extent of
    each offloaded layer and the ``"auto"`` budget; longer sequences take a further extent and
    regrow the slots. ``page_tokens``: host extents hold whole pages of this many positions."""

    def __init__(self, num_layers: int, max_tokens: int, *, resident_layers: Any = "auto",
                 page_tokens: int = 256, vram_fraction: float = 0.5, client: Any = None):
        _check(num_layers, max_tokens, resident_layers, page_tokens, vram_fraction)
        self.num_layers, self.max_tokens = num_layers, max_tokens
        self.page_tokens, self.vram_fraction = page_tokens, float(vram_fraction)
        self._asked = resident_layers
        self._client = client
        self._name = f"kv-cache/{next(_ids)}"
        self.resident: list = []
        self.offloaded: list = []
        self._decided = False
        self._lengths = [0] * num_layers
        self._device_kv: dict = {}   # resident layer -> (keys, values), capacity >= length
        # offloaded layer -> list of (first position, keys, values), position-major extents
        self._extents: dict = {}
        self._buffers: list = []     # the daemon's buffers the extents view, kept alive
        self._slots: list = []       # two (keys, values) device slots for offloaded layers
        self._slot_of: dict = {}     # offloaded layer -> the slot it uses
        self._next_offloaded: dict = {}  # offloaded layer -> the one after it (wrapping)
        self._filled: dict = {}      # slot -> (layer, tokens, event): what a prefetch put there
        # Per slot, made once: attention's [batch, heads, positions, head_dim] views of it, and
        # the two events its updates record (re-recorded each time: a wait takes the event's
        # state when it is queued). Fewer torch calls a layer and a token: decoding is bound by
        # the CPU that issues them.
        self._slot_views: dict = {}
        self._events: dict = {}
        self._indirect_extents = 0  # extents the pointer copies may not reach (see _Extent)
        self._copy_stream = None
        self._shape: tuple | None = None  # (batch, heads, head_dim, dtype, device)
        # What .stats reports (with TrainStream 0.6's names beside these); "prefetched": slots
        # filled ahead of the layer that reads them.
        self._counts = {"extents": 0, "d2h_bytes": 0, "h2d_bytes": 0, "prefetch_hits": 0,
                        "prefetch_misses": 0, "reallocations": 0, "pageable_extents": 0,
                        "prefetched": 0}

    # -- decisions -----------------------------------------------------------------------

    def _layer_bytes(self) -> int:
        batch, heads, dim, dtype, _ = self._shape
        return 2 * batch * heads * self.max_tokens * dim * dtype.itemsize

    def _decide(self) -> None:
        device = self._shape[4]
        if self._asked == "auto":
            if device.type != "cuda":
                count = self.num_layers  # no VRAM to spare: host memory is where they are
            else:
                free, _ = torch.cuda.mem_get_info(device)
                # The two slots offloaded layers share come out of the same budget.
                budget = int(free * self.vram_fraction)
                count = min(self.num_layers, max(0, budget // self._layer_bytes()))
                if count < self.num_layers:
                    count = max(0, min(count, budget // self._layer_bytes() - 2))
            offloaded = spread(self.num_layers - count, self.num_layers)
            self.resident = [i for i in range(self.num_layers) if i not in offloaded]
        elif isinstance(self._asked, int):
            offloaded = spread(self.num_layers - self._asked, self.num_layers)
            self.resident = [i for i in range(self.num_layers) if i not in offloaded]
        else:
            self.resident = sorted(self._asked)
        self.offloaded = [i for i in range(self.num_layers) if i not in self.resident]
        for n, layer in enumerate(self.offloaded):
            self._slot_of[layer] = n % 2
            self._next_offloaded[layer] = self.offloaded[(n + 1) % len(self.offloaded)]
        self._decided = True

    # -- storage -------------------------------------------------------------------------

    def _empty(self, tokens: int, device: Any, position_major: bool) -> tuple:
        batch, heads, dim, dtype, _ = self._shape
        shape = (tokens, batch, heads, dim) if position_major else (batch, heads, tokens, dim)
        return (torch.empty(shape, dtype=dtype, device=device),
                torch.empty(shape, dtype=dtype, device=device))

    def _grown(self, kv: tuple, needed: int, device: Any, position_major: bool = False) -> tuple:
        """``kv`` with room for ``needed`` positions (doubled when it had too little)."""
        axis = 0 if position_major else 2
        if kv is not None and kv[0].shape[axis] >= needed:
            return kv
        grown = self._empty(max(needed, self.max_tokens,
                                2 * (kv[0].shape[axis] if kv is not None else 0)), device,
                            position_major)
        if kv is not None:
            self._counts["reallocations"] += 1
            for old, new in zip(kv, grown):
                new.narrow(axis, 0, old.shape[axis]).copy_(old)
        return grown

    def _page_client(self) -> Any:
        if self._client is None:
            from ..transport.client import connect

            self._client = connect()
        return self._client

    def _capacity(self, layer: int) -> int:
        extents = self._extents.get(layer, [])
        return extents[-1].first + extents[-1].positions if extents else 0

    def _add_extent(self, layer: int, needed: int) -> None:
        """Host room for the layer's positions up to ``needed``: ``max_tokens`` the first time,
        then at least as much again as it has (whole pages of ``page_tokens`` positions)."""
        batch, heads, dim, dtype, device = self._shape
        extents = self._extents.setdefault(layer, [])
        have = self._capacity(layer)
        positions = max(needed - have, self.max_tokens if not extents else have)
        positions = -(-positions // self.page_tokens) * self.page_tokens
        row = batch * heads * dim * dtype.itemsize
        buffer = self._page_client().allocate(f"{self._name}/{layer}/{len(extents)}",
                                              2 * positions * row)
        self._buffers.append(buffer)
        # A registered buffer crosses by the transport's DMA copies; one that is not (the
        # session opened without registration) through torch's, which then stage through
        # pageable memory and hold the CPU for each copy: said once, in stats.
        dma = device.type == "cuda" and buffer.cuda_registered
        self._counts["pageable_extents"] += device.type == "cuda" and not dma
        extent = _Extent(have, positions, row, buffer, dtype, (batch, heads, dim), dma)
        self._indirect_extents += not extent.direct
        extents.append(extent)
        self._counts["extents"] += 1

    def _to_host(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copies positions ``start`` onward (``keys``, ``values``, position-major and
        contiguous) into the layer's host extents, on the current stream."""
        count = keys.shape[0]
        if self._capacity(layer) < start + count:
            self._add_extent(layer, start + count)
        for extent in self._extents[layer]:
            lo, hi = max(start, extent.first), min(start + count, extent.first + extent.positions)
            if lo < hi:
                extent.write(lo - extent.first, keys[lo - start:hi - start],
                             values[lo - start:hi - start])
        self._counts["d2h_bytes"] += 2 * keys.numel() * keys.element_size()

    def _from_host(self, layer: int, tokens: int, slot: tuple) -> None:
        """The layer's first ``tokens`` positions into ``slot``, on the current stream: one
        copy each for keys and values per extent (one extent unless past ``max_tokens``)."""
        for extent in self._extents.get(layer, []):
            n = min(extent.positions, tokens - extent.first)
            if n <= 0:
                break
            extent.read(n, slot[0][extent.first:extent.first + n],
                        slot[1][extent.first:extent.first + n])
        self._counts["h2d_bytes"] += 2 * tokens * slot[0][0].numel() * slot[0].element_size()

    # -- the cache -----------------------------------------------------------------------

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple:
        if not 0 <= layer < self.num_layers:
            raise InvalidArgumentError(f"PagedKVCache: layer {layer} of {self.num_layers}")
        if keys.dim() != 4 or keys.shape != values.shape:
            raise InvalidArgumentError(
                f"PagedKVCache: keys {tuple(keys.shape)} and values {tuple(values.shape)} must "
                "be [batch, heads, tokens, head_dim] alike")
        shape = (keys.shape[0], keys.shape[1], keys.shape[3], keys.dtype, keys.device)
        if self._shape is not None and shape != self._shape:
            if any(self._lengths):
                raise InvalidArgumentError(
                    f"PagedKVCache: keys of {tuple(keys.shape)} {keys.dtype} on {keys.device} "
                    f"after {self._shape[:2]} {self._shape[3]}; reset() before other prompts")
            self._drop_storage()  # other prompts after reset(): sized afresh
        self._shape = shape
        self._row_bytes = shape[0] * shape[1] * shape[2] * shape[3].itemsize  # one position
        if not self._decided:
            self._decide()
        start, count = self._lengths[layer], keys.shape[2]
        self._lengths[layer] = start + count
        device = keys.device
        if layer in self._device_kv or layer in self.resident:
            kv = self._grown(self._device_kv.get(layer), start + count, device)
            self._device_kv[layer] = kv
            kv[0][:, :, start:start + count].copy_(keys)
            kv[1][:, :, start:start + count].copy_(values)
            return kv[0][:, :, :start + count], kv[1][:, :, :start + count]
        return self._update_offloaded(layer, start, keys, values)

    def _update_offloaded(self, layer: int, start: int, keys: torch.Tensor,
                          values: torch.Tensor) -> tuple:
        device, count = keys.device, keys.shape[2]
        cuda = device.type == "cuda"
        while len(self._slots) < 2:
            self._slots.append(None)
        index = self._slot_of[layer]
        current = torch.cuda.current_stream(device) if cuda else None
        old = self._slots[index]
        if cuda and self._copy_stream is not None and (old is None
                                                       or old[0].shape[0] < start + count):
            # A slot about to be replaced may still be written by the copy stream.
            current.wait_stream(self._copy_stream)
        slot = self._grown(old, start + count, device, position_major=True)
        resized = slot is not old
        self._slots[index] = slot
        filled = self._filled.pop(index, None)
        if filled is not None and filled[:2] == (layer, start) and not resized:
            self._counts["prefetch_hits"] += 1
            if cuda:
                # Recorded after every earlier copy on the copy stream: the rows of the layers
                # before, which that stream reads from the slot, are out too.
                current.wait_event(filled[2])
        else:
            if cuda and self._copy_stream is not None:
                # The copy stream may still read this slot's rows (an earlier layer's new
                # positions on their way to host memory: a prompt's too, start 0) or write it
                # (a prefetch); this layer's writes come after.
                current.wait_stream(self._copy_stream)
            if start:
                self._counts["prefetch_misses"] += 1
                self._from_host(layer, start, slot)
        # Position-major, straight into the slot (the copy reorders them); host memory takes
        # them from the slot's rows.
        slot[0][start:start + count].copy_(keys.permute(2, 0, 1, 3))
        slot[1][start:start + count].copy_(values.permute(2, 0, 1, 3))
        if resized or index not in self._slot_views:
            self._slot_views[index] = (slot[0].permute(1, 2, 0, 3), slot[1].permute(1, 2, 0, 3))
        if cuda:
            # The new positions go to host memory on the copy stream once the compute stream
            # has them; the next offloaded layer's slot is filled there too, after the layer
            # that last used it (enqueued before this update) is done with it. A slot is
            # replaced only after the compute stream has waited for the copy stream (above),
            # so the rows read here outlive the copy.
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(device)
            stream = self._copy_stream
            ready, _ = self._slot_events(index)
            ready.record(current)
            stream.wait_event(ready)
            if self._capacity(layer) < start + count:
                self._add_extent(layer, start + count)  # first: its kind decides the path
            if self._all_direct:
                # Both ways in one native call: this layer's new rows out, the next offloaded
                # layer's positions in.
                target = self._prefetch_target(layer)
                pieces = self._to_host_pieces(layer, start, count, slot)
                if target is not None:
                    pieces += self._fill_pieces(*target)
                cuda_device.copy_pieces(stream.cuda_stream, pieces)
                if target is not None:
                    _, done = self._slot_events(target[2])
                    done.record(stream)
                    self._filled[target[2]] = (target[0], target[1], done)
                    self._counts["prefetched"] += 1
            else:
                with torch.cuda.stream(stream):
                    self._to_host(layer, start, slot[0][start:start + count],
                                  slot[1][start:start + count])
                    self._prefetch_next(layer, device)
        else:
            self._to_host(layer, start, slot[0][start:start + count],
                          slot[1][start:start + count])
        views = self._slot_views[index]
        return views[0].narrow(2, 0, start + count), views[1].narrow(2, 0, start + count)

    def _slot_events(self, index: int) -> tuple:
        events = self._events.get(index)
        if events is None:
            events = self._events[index] = (torch.cuda.Event(), torch.cuda.Event())
        return events

    @property
    def _all_direct(self) -> bool:
        return self._indirect_extents == 0

    def _to_host_pieces(self, layer: int, start: int, count: int, slot: tuple) -> list:
        """(host, device, bytes) copies of the slot's rows ``start`` onward into the layer's
        extents (the D2H half of :meth:`_to_host`, as pointers for one native call; the
        caller has made the room)."""
        row = self._row_bytes
        keys, values = slot[0].data_ptr(), slot[1].data_ptr()
        pieces = []
        for extent in self._extents[layer]:
            lo, hi = max(start, extent.first), min(start + count, extent.first + extent.positions)
            if lo < hi:
                at = (lo - extent.first) * row
                pieces.append((extent.keys_address + at, keys + lo * row, (hi - lo) * row))
                pieces.append((extent.values_address + at, values + lo * row, (hi - lo) * row))
        self._counts["d2h_bytes"] += 2 * count * row
        return pieces

    def _fill_pieces(self, layer: int, tokens: int, index: int, slot: tuple) -> list:
        """(device, host, bytes) copies of the layer's first ``tokens`` positions into
        ``slot`` (:meth:`_from_host`, as pointers for one native call)."""
        row = self._row_bytes
        keys, values = slot[0].data_ptr(), slot[1].data_ptr()
        pieces = []
        for extent in self._extents.get(layer, []):
            n = min(extent.positions, tokens - extent.first)
            if n <= 0:
                break
            at = extent.first * row
            pieces.append((keys + at, extent.keys_address, n * row))
            pieces.append((values + at, extent.values_address, n * row))
        self._counts["h2d_bytes"] += 2 * tokens * row
        return pieces

    def _prefetch_target(self, layer: int) -> tuple | None:
        """(layer, tokens, slot index, slot) to fill after ``layer``'s update: the next
        offloaded layer (the first one again after the last: the next token's), or None."""
        if len(self.offloaded) < 2:
            return None
        nxt = self._next_offloaded[layer]
        tokens = self._lengths[nxt]
        index = self._slot_of[nxt]
        slot = self._slots[index]
        # Not into the slot this layer's attention is about to read (an odd count of offloaded
        # layers wraps from the last to the first on the same slot).
        if (not tokens or slot is None or slot[0].shape[0] < tokens + 1
                or index == self._slot_of[layer]):
            return None
        return nxt, tokens, index, slot

    def _prefetch_next(self, layer: int, device: Any) -> None:
        """Fills the other slot with the next offloaded layer's positions, on the copy stream
        (the path for extents without DMA)."""
        target = self._prefetch_target(layer)
        if target is None:
            return
        nxt, tokens, index, slot = target
        self._from_host(nxt, tokens, slot)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        self._filled[index] = (nxt, tokens, done)
        self._counts["prefetched"] += 1

    def _drop_storage(self) -> None:
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        # The views of the extents go before the buffers they view are given back.
        self._extents, self._device_kv, self._slots, self._filled = {}, {}, [], {}
        self._slot_views, self._events, self._copy_stream = {}, {}, None
        self._indirect_extents = 0
        buffers, self._buffers = self._buffers, []
        for buffer in buffers:
            self._client.free(buffer)
        self._decided = False

    def close(self) -> None:
        """Gives the host extents back to the daemon and the VRAM to the allocator."""
        self._drop_storage()
        self._shape = None

    def seq_length(self, layer: int = 0) -> int:
        return self._lengths[layer]

    def reset(self) -> None:
        """Empties every layer (the next prompts start at position 0); keeps the memory."""
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        self._lengths = [0] * self.num_layers
        self._filled.clear()

    def memory(self) -> dict:
        """Bytes held: VRAM (resident layers and the slots) and the daemon's host extents;
        with TrainStream 0.6's names beside them: ``device_bytes`` (the resident layers and the
        slots together, on the device the keys live on) and ``host_bytes`` (the host pages)."""
        def size(kv: Any) -> int:
            return 0 if kv is None else sum(t.numel() * t.element_size() for t in kv)

        host = sum(b.nbytes for b in self._buffers) if self._buffers else 0
        resident = sum(size(kv) for kv in self._device_kv.values())
        slots = sum(size(s) for s in self._slots)
        return {"resident_layers": len(self.resident), "offloaded_layers": len(self.offloaded),
                "resident_bytes": resident, "slot_bytes": slots,
                "host_page_bytes": host, "tokens": max(self._lengths),
                "device_bytes": resident + slots, "host_bytes": host}

    @property
    def stats(self) -> dict:
        """Counts since the cache was made: ``extents`` (host extents taken), ``d2h_bytes`` and
        ``h2d_bytes``, ``prefetch_hits`` and ``prefetch_misses`` (an offloaded layer's slot
        filled ahead, or filled when the layer asked), ``reallocations``, ``pageable_extents``;
        and TrainStream 0.6's names: ``pages`` (host pages of ``page_tokens`` positions held),
        ``prefetched`` (slots filled ahead of time) and ``gathered`` (slots filled on
        demand)."""
        counts = dict(self._counts)
        counts["pages"] = sum(extent.positions // self.page_tokens
                              for extents in self._extents.values() for extent in extents)
        counts["gathered"] = counts["prefetch_misses"]
        return counts
