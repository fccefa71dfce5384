# SPDX-License-Identifier: Apache-2.0
"""Streamed weights (BlockPager's, memory/pager.py): which blocks keep their weights in host memory,
the device slots they borrow while they run, the fetches into a slot ahead of the block that needs
it, binding a block's parameters to its slot and back to placeholders, and the saved references to
those weights that backward fetches again."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch

from ..errors import FailedPreconditionError, InvalidArgumentError
from ..hooks import HookClock, weak_hook
from ..transport import device as cuda_device
from .blocks import base_host_views, streamed_tensors


def mark_streaming(block: torch.nn.Module, streams: bool) -> None:
    """Tells ``block``'s quantized layers whether their stored bytes stream (an FP8 layer then
    keeps multiplying from them instead of a row-scaled copy of its own). Layers read from a
    GPU pool never stream."""
    from ..frozen.linear import BaseLinear

    for m in block.modules():
        if isinstance(m, BaseLinear) and not m.pooled:
            m.streams = streams


class PackedWeight(NamedTuple):
    """What autograd holds for a saved view of a bound slot (a weight, or a view of one): its
    layout over the slot, not its bytes; unpacking binds the block again."""

    block: int
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    offset: int  # in elements of ``dtype`` from the slot's start


class Slot:
    """One device buffer big enough for any paged block."""

    def __init__(self, nbytes: int, device: torch.device):
        self.storage = torch.empty(nbytes, dtype=torch.uint8, device=device)
        # Its address range: a saved tensor is a view of the slot when its data lies inside.
        self.base = self.storage.data_ptr()
        self.end = self.base + nbytes
        self.block: int | None = None
        self.generation = -1        # the weights' generation it holds
        self.ready: Any = None      # event: the fetch into it landed
        self.released: Any = None   # event: compute finished with it
        self.views: dict[int, list] = {}  # per block: its parameters' views of the storage
        self.unpacked: dict[PackedWeight, torch.Tensor] = {}  # saved weights' views


class WeightSlots:
    """The streamed weights of ``blocks``: those of the blocks in ``paged`` live in host memory
    (``host_copy(p)``, pinned for CUDA) and are fetched into one of ``depth + 1`` device slots,
    ``depth`` blocks ahead, on a stream of their own."""

    def __init__(self, blocks: Sequence[torch.nn.Module],
                 host_copy: Callable[[torch.Tensor], torch.Tensor], depth: int,
                 device: torch.device, clock: HookClock):
        self.blocks = blocks
        self.depth = depth
        self.device = device
        self.cuda = device.type == "cuda"
        self._device_index = cuda_device.device_index(device) if self.cuda else -1
        self._host_copy = host_copy
        self.paged: list[int] = []
        self.position: dict[int, int] = {}  # a paged block's place in ``paged``
        self.params: dict[int, list] = {}   # a paged block's streamed tensors
        self.host: dict[int, torch.Tensor] = {}          # by id(p): its host copy
        self.placeholders: dict[int, torch.Tensor] = {}  # by id(p): what it holds unbound
        self.layout: dict[int, list[tuple[torch.Tensor, int, int]]] = {}
        self.layout_bytes: dict[int, int] = {}  # per block: its weights' bytes
        self.slot_bytes = 0
        self.slots: list[Slot] = []
        # Weights are copied on a stream of their own: no activation's copy holds them back.
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.pending_grads: dict[int, int] = {}
        self._grad_hooks: dict[int, list] = {}
        self.bound: set[int] = set()
        # The slot each bound block reads its weights from: pack() runs for every tensor a
        # block saves, and looks it up here rather than scanning the slots.
        self._bound_slots: dict[int, Slot] = {}
        self.generation = 0
        self.bytes_fetched = 0
        self.packed = 0  # saved references to paged weights kept as layouts, not tensors
        self._gradient_landed_timed = clock.timed("paging.gradient_landed",
                                                  self._gradient_landed)

    def page(self, indices: Sequence[int]) -> list[int]:
        """Blocks ``indices`` start streaming their weights (between steps); returns those that
        were not paged yet. Their parameters' values are read from ``host_copy`` from now on,
        and their device memory goes back to the allocator."""
        added = sorted(set(int(i) for i in indices) - set(self.paged))
        if not added:
            return []
        if self.bound:
            raise FailedPreconditionError("blocks can start paging only between steps")
        for b in added:
            # Parameters, then quantized layers' stored bytes (buffers): bound and fetched
            # alike, with the stored format's bytes crossing the link.
            self.params[b] = streamed_tensors(self.blocks[b])
            mark_streaming(self.blocks[b], True)
            for p in self.params[b]:
                host = self._host_copy(p)
                if (host.dtype != p.dtype or host.shape != p.shape
                        or not host.is_contiguous()):
                    raise InvalidArgumentError(
                        f"the host copy of a {tuple(p.shape)} {p.dtype} tensor of block {b} "
                        f"is a {tuple(host.shape)} {host.dtype} tensor"
                        f"{'' if host.is_contiguous() else ' (not contiguous)'}: it must match "
                        "the parameter, contiguous")
                self.host[id(p)] = host
            offset, parts = 0, []
            for p in self.params[b]:
                offset = (offset + 255) // 256 * 256  # every view aligned as the allocator would
                parts.append((p, offset, p.numel() * p.element_size()))
                offset += p.numel() * p.element_size()
            self.layout[b] = parts
            self.layout_bytes[b] = sum(nbytes for _, _, nbytes in parts)
            self.slot_bytes = max(self.slot_bytes, (offset + 255) // 256 * 256)
        self.paged = sorted(set(self.paged) | set(added))
        self.position = {b: k for k, b in enumerate(self.paged)}
        if self.cuda:
            self.wait_for_copies()
        # The blocks' device weights go first (their values are in the host copies now), then
        # the old slots, then slots sized for the biggest paged block are made: the peak is the
        # larger of before and after, not their sum.
        for b in added:
            for p in self.params[b]:
                self.placeholders[id(p)] = torch.zeros(
                    (), dtype=p.dtype, device=self.device).expand(p.shape)
                p.data = self.placeholders[id(p)]
                if p.requires_grad:
                    self._grad_hooks.setdefault(b, []).append(
                        p.register_post_accumulate_grad_hook(
                            weak_hook(self, "_gradient_landed_timed", b)))
        self.slots = []
        self.slots = [Slot(self.slot_bytes, self.device) for _ in range(self.depth + 1)]
        return added

    def unpage(self, indices: Sequence[int]) -> list[int]:
        """Blocks ``indices`` keep their weights in VRAM again (between steps): each parameter
        gets a device tensor holding the host copy's current value. Returns those that were
        streaming."""
        removed = sorted(set(int(i) for i in indices) & set(self.paged))
        if not removed:
            return []
        if self.bound:
            raise FailedPreconditionError("blocks can stop paging only between steps")
        if self.cuda:
            self.wait_for_copies()
        self.slots = []  # back to the allocator before the blocks' device copies are made
        for b in removed:
            mark_streaming(self.blocks[b], False)
            for handle in self._grad_hooks.pop(b, []):
                handle.remove()
            for p in self.params.pop(b):
                # On a CPU the host copy is the daemon's buffer its updates land in: used as is.
                host = self.host.pop(id(p))
                p.data = host.to(self.device, copy=True) if self.cuda else host
                self.placeholders.pop(id(p), None)
            self.layout.pop(b)
            self.layout_bytes.pop(b)
            self.pending_grads.pop(b, None)
        self.paged = [b for b in self.paged if b not in removed]
        self.position = {b: k for k, b in enumerate(self.paged)}
        self.slot_bytes = max((self._slot_size(b) for b in self.paged), default=0)
        self.slots = []
        if self.paged:
            self.slots = [Slot(self.slot_bytes, self.device) for _ in range(self.depth + 1)]
        return removed

    def _slot_size(self, b: int) -> int:
        _, offset, nbytes = self.layout[b][-1]
        return (offset + nbytes + 255) // 256 * 256

    def weights_changed(self) -> None:
        """The host copies were updated (an optimizer step): later fetches read them anew, and
        a block still bound (a parameter that got no gradient) lets go of its slot."""
        for b in list(self.bound):
            self._unbind(b)
        self.generation += 1
        # Slots added when every one was bound (a block some of whose parameters got no
        # gradient) go back.
        del self.slots[self.depth + 1:]

    def _slot_of(self, b: int) -> Slot | None:
        return next((s for s in self.slots
                     if s.block == b and s.generation == self.generation), None)

    def _fetch(self, b: int, needed: bool = True) -> Slot | None:
        """Starts copying block ``b`` into a slot (or finds it there already). A prefetch
        (``needed`` false) only takes a slot no bound block uses; a needed fetch adds a slot
        when every one is bound."""
        slot = self._slot_of(b)
        if slot is not None:
            return slot
        candidates = [s for s in self.slots if not self._in_use(s)]
        if not candidates:
            if not needed:
                return None
            self.slots.append(Slot(self.slot_bytes, self.device))
            candidates = [self.slots[-1]]
        # An empty slot (or one holding an earlier generation's weights), else the one holding
        # the block that runs furthest from this one.
        slot = min(candidates, key=lambda s: (self._holds_current(s),
                                              self._distance(s.block, b)
                                              if self._holds_current(s) else 0))
        slot.block, slot.generation = b, self.generation
        if self.cuda:
            if slot.released is None:
                self.stream.wait_stream(cuda_device.current(self._device_index))
            else:
                self.stream.wait_event(slot.released)
            self._copy_in(b, slot)
            slot.ready = torch.cuda.Event()
            slot.ready.record(self.stream)
        else:
            self._copy_in(b, slot)
        return slot

    def _holds_current(self, slot: Slot) -> bool:
        return slot.block is not None and slot.generation == self.generation

    def _in_use(self, slot: Slot) -> bool:
        return self._holds_current(slot) and slot.block in self.bound

    def _distance(self, held: int | None, wanted: int) -> int:
        return 0 if held is None else -abs(self.position[held] - self.position[wanted])

    def _views(self, b: int, slot: Slot) -> list:
        """Block ``b``'s parameters as views of ``slot``, made once per slot and block (the
        slots live as long as the layout: both change only between steps)."""
        views = slot.views.get(b)
        if views is None:
            views = [slot.storage[offset:offset + nbytes].view(p.dtype).view(p.shape)
                     for p, offset, nbytes in self.layout[b]]
            slot.views[b] = views
        return views

    def _copy_in(self, b: int, slot: Slot) -> None:
        host = self.host
        pairs = zip(self.layout[b], self._views(b, slot))
        if self.cuda:
            # The block's weights in one native call, on the weight stream (torch would
            # dispatch each tensor's copy on its own: a block has a score of them).
            cuda_device.copy_pieces(self.stream.cuda_stream,
                                    [(view.data_ptr(), host[id(p)].data_ptr(), nbytes)
                                     for (p, _, nbytes), view in pairs])
        else:
            for (p, _, _), view in pairs:
                view.copy_(host[id(p)])
        self.bytes_fetched += self.layout_bytes[b]

    def _bind(self, b: int) -> None:
        """Points block ``b``'s parameters at its slot, once the fetch has landed."""
        slot = self._fetch(b)
        if self.cuda and slot.ready is not None:
            cuda_device.current(self._device_index).wait_event(slot.ready)
        for (p, _, _), view in zip(self.layout[b], self._views(b, slot)):
            p.data = view
        self.bound.add(b)
        self._bound_slots[b] = slot

    def _unbind(self, b: int) -> None:
        """Lets block ``b``'s slot go once the compute stream is done with it. The slot keeps
        the weights until another block takes it: the last blocks of forward are still there
        when backward starts with them, and are not fetched again."""
        slot = self._slot_of(b)
        self.bound.discard(b)
        self._bound_slots.pop(b, None)
        for p in self.params[b]:
            p.data = self.placeholders[id(p)]
        if slot is None:
            return
        if self.cuda:
            slot.released = torch.cuda.Event()
            slot.released.record(cuda_device.current(self._device_index))

    def _prefetch_after(self, b: int, step: int) -> None:
        k = self.position[b]
        for ahead in range(1, self.depth + 1):
            j = k + step * ahead
            if 0 <= j < len(self.paged):
                self._fetch(self.paged[j], needed=False)

    def _gradient_landed(self, b: int, p: torch.Tensor) -> None:
        if b not in self.position:
            return
        left = self.pending_grads.get(b, 0) - 1
        self.pending_grads[b] = left
        if left == 0:
            self._unbind(b)

    def forward_starting(self, b: int) -> None:
        """A paged block's forward begins: its weights are bound, the next ones fetched."""
        self._bind(b)
        self._prefetch_after(b, +1)

    def forward_ended(self, b: int, gradients_follow: bool) -> None:
        """A paged block's forward ended: its slot goes back. With ``gradients_follow`` (the
        forward recorded a graph), its last gradient landing frees the slot in backward early,
        unless frozen weights (LoRA's base) are still read for the input gradient after it."""
        if gradients_follow:
            trained = [p.requires_grad for p in self.params[b]]
            self.pending_grads[b] = sum(trained) if all(trained) else -1
        self._unbind(b)

    def pack(self, b: int, t: torch.Tensor) -> PackedWeight | None:
        """``t``'s layout when it is a view of block ``b``'s bound slot, else None. (Host and
        device pointers share one address space, so the range alone says it.)"""
        slot = self._bound_slots.get(b)
        if slot is None:
            return None
        ptr = t.data_ptr()
        if not slot.base <= ptr < slot.end:
            return None
        self.packed += 1
        return PackedWeight(b, t.dtype, tuple(t.shape), tuple(t.stride()),
                            (ptr - slot.base) // t.element_size())

    def unpack(self, packed: PackedWeight) -> torch.Tensor:
        """The saved weight ``packed`` describes, its block bound again if it was let go."""
        b = packed.block
        if b not in self.bound:
            # Backward reached block b: every block after it has finished its backward (block
            # b's input gradient needs theirs), so their slots go back. This covers blocks whose
            # frozen weights get no gradient to say so.
            for later in [x for x in self.bound if self.position[x] > self.position[b]]:
                self._unbind(later)
            self._bind(b)
            self._prefetch_after(b, -1)  # backward runs the blocks in reverse
        slot = self._bound_slots[b]
        # The same saved weight comes back each step: its view is made once per slot.
        view = slot.unpacked.get(packed)
        if view is None:
            view = slot.storage.view(packed.dtype).as_strided(packed.shape, packed.stride,
                                                               packed.offset)
            slot.unpacked[packed] = view
        return view

    def wait_for_copies(self) -> None:
        """The compute stream waits for every fetch issued so far."""
        cuda_device.current(self._device_index).wait_stream(self.stream)

    def close(self) -> int:
        """Every paged parameter gets a tensor of its own again; returns the bytes left in host
        memory (a model bigger than VRAM: the rest stays on the CPU, out of the daemon's segment,
        instead of failing with half the weights moved)."""
        if self.cuda:
            self.wait_for_copies()
        self.bound.clear()
        self._bound_slots.clear()
        for handle in (h for hs in self._grad_hooks.values() for h in hs):
            handle.remove()
        self._grad_hooks.clear()
        self.slots.clear()  # back to the allocator before the weights' own copies are made
        left_on_host = 0
        for b in self.paged:
            mark_streaming(self.blocks[b], False)
            shared = {v.data_ptr() for v in base_host_views(self.blocks[b])}
            for p in self.params[b]:
                host = self.host[id(p)]
                try:
                    p.data = host.to(self.device, copy=True)
                except torch.OutOfMemoryError:
                    # A shared base's bytes stay where the base keeps them (no private copy of
                    # tens of GB).
                    p.data = host if host.data_ptr() in shared else host.clone()
                    left_on_host += host.numel() * host.element_size()
        return left_on_host
