# SPDX-License-Identifier: Apache-2.0
"""Block paging: chosen blocks keep their weights in host memory (the daemon's buffers, or a
shared base's memory for its quantized layers' stored bytes) and borrow a device slot only
while they run; chosen blocks send the activations they save for
backward to host memory and get them back just before backward needs them.

Before a paged block's forward its weights are copied into a free slot (fetched ahead on a
stream of their own, ``prefetch_depth`` blocks in advance) and the parameters point at it; after
the forward they point at a one-element placeholder again, so the slot is free for the next
block. Backward needs the weights once more: the block's saved references to them are packed as
(block, layout) instead of tensors (``torch.autograd.graph.saved_tensors_hooks``), and unpacking
fetches the block again (and the one before it, ahead), unless its slot still holds it (a slot
keeps its block until another takes it: the last blocks of forward are not fetched twice). When
every paged parameter of the block has its gradient, or backward reaches the block before it,
the slot is released. Updated weights land in the host copy that the next fetch reads, so
nothing is copied back.

Saved activations of the chosen blocks (contiguous tensors of at least ``min_offload_bytes``,
other than weights) are copied to pinned host memory on the paging stream as forward saves them;
backward's first use of a block's activations brings back those of the block before it as well,
so they are in VRAM when its turn comes. Copies are exact, so training is bit-identical.

On a CPU the "device" is the CPU and copies are plain copies: the same path, used by the tests.

Limits: paged blocks' weights are placeholders outside their forward and backward, so use them
through the model (``model.state_dict()`` returns the host copies and ``load_state_dict`` loads
into them under ``wrap()``); activation checkpointing inside paged blocks is not combined with
paging; under autocast, keep the model in its compute dtype, or the casts hold bf16 copies of the
paged weights.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, Sequence

import torch

from ..errors import InvalidArgumentError
from ..hooks import HookClock
from ..transport import device as cuda_device
from .block_timing import BlockTiming
from .blocks import base_host_views, weight_tensors
from .saved_tensors import OffloadedActivation, SavedTensorPaging
from .weight_slots import Slot, WeightSlots, mark_streaming


def _storages_of(values: Any) -> set:
    """The storage addresses of the tensors among ``values`` (in tuples, lists and dicts too)."""
    found: set = set()
    stack = list(values)
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            found.add(v.untyped_storage().data_ptr())
        elif isinstance(v, (tuple, list)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return found


class BlockPager(WeightSlots, SavedTensorPaging):
    """Pages the weights of ``blocks[i]`` for every ``i`` in ``paged``, and the saved
    activations of every ``i`` in ``activations``.

    ``host_copy(p)`` returns the host tensor holding parameter ``p``'s current value (for a
    model under ``wrap()``, the daemon's buffer its updates land in), with ``p``'s shape and
    dtype; for CUDA it must be pinned (the daemon's buffers are).
    """

    def __init__(self, blocks: Sequence[torch.nn.Module], paged: Sequence[int],
                 host_copy: Callable[[torch.Tensor], torch.Tensor], prefetch_depth: int = 1,
                 activations: Sequence[int] = (), min_offload_bytes: int = 1 << 20,
                 arena: Any = None, device: Any = None, max_inflight_bytes: int = 1 << 30):
        self.blocks = list(blocks)
        if not self.blocks:
            raise InvalidArgumentError("no blocks to page")
        self.paged: list[int] = []
        self.offloading: list[int] = []
        self.depth = max(1, int(prefetch_depth))
        self.min_offload_bytes = int(min_offload_bytes)
        self.params: dict[int, list] = {}
        # The device the blocks run on; paged weights may still sit on the CPU when the model
        # did not fit there (wrap() moves only what stays resident).
        self.device = torch.device(device) if device is not None else next(
            self.blocks[0].parameters()).device
        self.cuda = self.device.type == "cuda"
        self._device_index = cuda_device.device_index(self.device) if self.cuda else -1
        self.saved: dict[int, list[OffloadedActivation]] = {}
        self.bytes_offloaded = 0
        # Activations still crossing to host memory keep their device memory until the copy
        # lands; past this many bytes, forward waits for the oldest copies.
        self.max_inflight_bytes = int(max_inflight_bytes)
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
        self.inflight_waits = 0
        self.left_on_host_bytes = 0  # paged weights that close() could not put back on the device
        # Host memory for activations: the daemon's (an ActivationArena, or a callable making
        # one when the first block starts paging its activations), else private pinned.
        self._make_arena = arena if callable(arena) and not hasattr(arena, "take") else None
        self.arena = None if self._make_arena is not None else arena
        self.arena_refused: str | None = None
        self.host: dict[int, torch.Tensor] = {}
        self._host_copy = host_copy
        self.layout: dict[int, list[tuple[torch.Tensor, int, int]]] = {}
        self.layout_bytes: dict[int, int] = {}  # per block: its weights' bytes
        self.slot_bytes = 0
        self.slots: list[Slot] = []
        # Weights and activations copied on streams of their own: an activation's copy waits
        # for compute (the copy out for the work that made it, the copy back for the memory it
        # reuses) and so holds no weight prefetch back, and the link carries activations out
        # while weights come in.
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.activation_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.placeholders: dict[int, torch.Tensor] = {}
        self.weight_storages: dict[int, set] = {}
        # Per block whose forward runs now: the storages its saved tensors page, by address
        # (held until the forward ends, so that an address is not reused meanwhile).
        self._paged_storages: dict[int, dict] = {}
        self.position: dict[int, int] = {}  # weight-paged blocks only
        self.pending_grads: dict[int, int] = {}
        self._grad_hooks: dict[int, list] = {}
        self.bound: set[int] = set()
        # The slot each bound block reads its weights from: _pack runs for every tensor a
        # block saves, and looks it up here rather than scanning the slots.
        self._bound_slots: dict[int, Slot] = {}
        self.generation = 0
        self.bytes_fetched = 0
        self.packed = 0  # saved references to paged weights kept as layouts, not tensors
        # Measurement (the probe step): bytes each measured block's forward saves for backward
        # (weights excluded), its input's bytes, and its forward's time.
        self.measure: set[int] = set()
        self.timing = BlockTiming(self.device, self.cuda)
        self._measuring: dict[int, Any] = {}
        self.hooks: list = []
        self._saved_hooks: dict[int, Any] = {}
        self.clock = HookClock()  # the CPU time its hooks take (memory_report)
        self._pack_timed = self.clock.timed("paging.pack", self._pack)
        self._unpack_timed = self.clock.timed("paging.unpack", self._unpack)
        self._gradient_landed_timed = self.clock.timed("paging.gradient_landed",
                                                       self._gradient_landed)
        # Every block is hooked once; which ones page weights, page activations or are measured
        # may change between steps (the plan adapts).
        for b, module in enumerate(self.blocks):
            self.hooks.append(module.register_forward_pre_hook(
                self.clock.timed("paging.before_forward", self._before_forward(b)),
                with_kwargs=True))
            # always_call: a forward that raises (an OOM retried with a smaller batch) still
            # pops its saved-tensor hooks and lets go of its slot.
            self.hooks.append(module.register_forward_hook(
                self.clock.timed("paging.after_forward", self._after_forward(b)),
                always_call=True))
        self.page_weights(paged)
        self.set_activation_blocks(activations)

    def set_activation_blocks(self, indices: Sequence[int]) -> None:
        """From the next forward, blocks ``indices`` page their saved activations."""
        self.offloading = sorted(set(int(i) for i in indices))
        self.saved = {b: self.saved.get(b, []) for b in self.offloading}
        if self.offloading and self.arena is None and self._make_arena is not None:
            self.arena = self._make_arena()  # made when first needed

    def _involved(self, b: int) -> bool:
        return b in self.position or b in self.saved or b in self.measure

    def _before_forward(self, b: int):
        def hook(module, args, kwargs):
            if not self._involved(b):
                return
            if b in self.position:
                self._bind(b)
                self._prefetch_after(b, +1)
            if b in self.saved:
                self.saved[b] = []  # last step's are gone with its graph
                self._predecessor_asked.discard(b)
                if self.arena is not None and b == self.offloading[0] and torch.is_grad_enabled():
                    self.arena.reset()  # a new step: the last one's backward is over
            if b in self.saved or b in self.measure:
                # Storages a saved tensor may come from that paging it would not free: the
                # block's weights, and what it was called with besides its input (rotary
                # tables, a mask: the model holds them for every block).
                self.weight_storages[b] = {t.untyped_storage().data_ptr()
                                           for t in weight_tensors(self.blocks[b])}
                called_with = {k: v for k, v in kwargs.items() if args or k != "hidden_states"}
                self.weight_storages[b].update(_storages_of((*args[1:], *called_with.values())))
                self._paged_storages[b] = {}
            if b in self.measure and torch.is_grad_enabled():
                first = args[0] if args and isinstance(args[0], torch.Tensor) else None
                start = torch.cuda.Event(enable_timing=True) if self.cuda else None
                if start is not None:
                    start.record()
                self._measuring[b] = {"start": start, "storages": set(), "saved_bytes": 0,
                                      "input_bytes": 0 if first is None else
                                      first.numel() * first.element_size(),
                                      "clock": time.perf_counter(), "call": (args, kwargs)}
            if torch.is_grad_enabled():
                saved = torch.autograd.graph.saved_tensors_hooks(
                    lambda t: self._pack_timed(b, t), self._unpack_timed)
                saved.__enter__()
                self._saved_hooks[b] = saved
        return hook

    def _after_forward(self, b: int):
        def hook(module, args, output):
            saved = self._saved_hooks.pop(b, None)
            if saved is not None:
                saved.__exit__(None, None, None)
                if self._unissued:
                    self._issue_offloads()
                if b in self.position:
                    # Its last gradient landing frees the slot early, unless frozen weights
                    # (LoRA's base) are still read for the input gradient after it.
                    trained = [p.requires_grad for p in self.params[b]]
                    self.pending_grads[b] = sum(trained) if all(trained) else -1
            self._paged_storages.pop(b, None)
            measuring = self._measuring.pop(b, None)
            if measuring is not None:
                self.timing.record(b, module, measuring)  # while its weights are still bound
            if b in self.position:
                self._unbind(b)
        return hook

    def activation_policy(self) -> list:
        return ["offload" if b in self.saved else "keep" for b in range(len(self.blocks))]

    def resident_bytes(self) -> int:
        return self.slot_bytes * len(self.slots)

    def close(self) -> None:
        """Stops paging: every paged parameter gets a tensor of its own again."""
        if self.cuda:
            self._wait_for_copies()
        self.bound.clear()
        self._bound_slots.clear()
        for h in self.hooks + [h for hs in self._grad_hooks.values() for h in hs]:
            h.remove()
        self.hooks.clear()
        self._grad_hooks.clear()
        self.slots.clear()  # back to the allocator before the weights' own copies are made
        self.left_on_host_bytes = 0
        for b in self.paged:
            mark_streaming(self.blocks[b], False)
            shared = {v.data_ptr() for v in base_host_views(self.blocks[b])}
            for p in self.params[b]:
                host = self.host[id(p)]
                try:
                    p.data = host.to(self.device, copy=True)
                except torch.OutOfMemoryError:
                    # A model bigger than VRAM: the rest stays on the CPU, out of the daemon's
                    # segment, instead of failing with half the weights moved. A shared base's
                    # bytes stay where the base keeps them (no private copy of tens of GB).
                    p.data = host if host.data_ptr() in shared else host.clone()
                    self.left_on_host_bytes += host.numel() * host.element_size()
        self.saved = {b: [] for b in self.offloading}
