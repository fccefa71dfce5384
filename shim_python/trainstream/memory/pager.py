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

import time
from typing import Any, Callable, Sequence

import torch

from ..errors import InvalidArgumentError
from ..hooks import HookClock
from .block_timing import BlockTiming
from .blocks import weight_tensors
from .saved_tensors import SavedTensorPaging, SavedView
from .weight_slots import PackedWeight, WeightSlots


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


class BlockPager:
    """Pages the weights of ``blocks[i]`` for every ``i`` in ``paged``, and the saved
    activations of every ``i`` in ``activations``: the blocks' forward hooks and saved-tensor
    hooks hand each block's work to its two collaborators, ``weights`` (a WeightSlots) and
    ``activations`` (a SavedTensorPaging), and measure the blocks in ``measure``.

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
        # The device the blocks run on; paged weights may still sit on the CPU when the model
        # did not fit there (wrap() moves only what stays resident).
        self.device = torch.device(device) if device is not None else next(
            self.blocks[0].parameters()).device
        self.cuda = self.device.type == "cuda"
        self.clock = HookClock()  # the CPU time its hooks take (memory_report)
        self.weights = WeightSlots(self.blocks, host_copy, max(1, int(prefetch_depth)),
                                   self.device, self.clock)
        self.activations = SavedTensorPaging(self.device, arena, min_offload_bytes,
                                             max_inflight_bytes)
        self.left_on_host_bytes = 0  # paged weights that close() could not put back on the device
        # Per block whose saved tensors are paged or measured: the storages a saved tensor may
        # come from that paging it would not free.
        self.weight_storages: dict[int, set] = {}
        # Measurement (the probe step): bytes each measured block's forward saves for backward
        # (weights excluded), its input's bytes, and its forward's time.
        self.measure: set[int] = set()
        self.timing = BlockTiming(self.device, self.cuda)
        self._measuring: dict[int, Any] = {}
        self.hooks: list = []
        self._saved_hooks: dict[int, Any] = {}
        self._pack_timed = self.clock.timed("paging.pack", self._pack)
        self._unpack_timed = self.clock.timed("paging.unpack", self._unpack)
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

    @property
    def paged(self) -> list[int]:
        """The blocks streaming their weights, in order."""
        return self.weights.paged

    @property
    def offloading(self) -> list[int]:
        """The blocks paging their saved activations, in order."""
        return self.activations.offloading

    @property
    def bytes_fetched(self) -> int:
        return self.weights.bytes_fetched

    @property
    def bytes_offloaded(self) -> int:
        return self.activations.bytes_offloaded

    def page_weights(self, indices: Sequence[int]) -> list[int]:
        """Blocks ``indices`` start streaming their weights (between steps); returns those that
        were not paged yet."""
        if self.cuda and set(int(i) for i in indices) - set(self.paged):
            self.activations.wait_for_copies()
        return self.weights.page(indices)

    def unpage_weights(self, indices: Sequence[int]) -> list[int]:
        """Blocks ``indices`` keep their weights in VRAM again (between steps); returns those
        that were streaming."""
        if self.cuda and set(int(i) for i in indices) & set(self.paged):
            self.activations.wait_for_copies()
        return self.weights.unpage(indices)

    def weights_changed(self) -> None:
        """The host copies were updated (an optimizer step): later fetches read them anew."""
        self.weights.weights_changed()

    def set_activation_blocks(self, indices: Sequence[int]) -> None:
        """From the next forward, blocks ``indices`` page their saved activations."""
        self.activations.set_blocks(indices)

    def _involved(self, b: int) -> bool:
        return b in self.weights.position or b in self.activations.saved or b in self.measure

    def _before_forward(self, b: int):
        def hook(module, args, kwargs):
            if not self._involved(b):
                return
            if b in self.weights.position:
                self.weights.forward_starting(b)
            if b in self.activations.saved:
                self.activations.forward_starting(b)
            if b in self.activations.saved or b in self.measure:
                # Storages a saved tensor may come from that paging it would not free: the
                # block's weights, and what it was called with besides its input (rotary
                # tables, a mask: the model holds them for every block).
                self.weight_storages[b] = {t.untyped_storage().data_ptr()
                                           for t in weight_tensors(self.blocks[b])}
                called_with = {k: v for k, v in kwargs.items() if args or k != "hidden_states"}
                self.weight_storages[b].update(_storages_of((*args[1:], *called_with.values())))
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
            self.activations.forward_ended(b)
            measuring = self._measuring.pop(b, None)
            if measuring is not None:
                self.timing.record(b, module, measuring)  # while its weights are still bound
            if b in self.weights.position:
                self.weights.forward_ended(b, gradients_follow=saved is not None)
        return hook

    def _pack(self, b: int, t: torch.Tensor) -> Any:
        # Called for every tensor an involved block saves for backward: the cheap tests first.
        packed = self.weights.pack(b, t)
        if packed is not None:
            return packed
        if self._measuring:
            measuring = self._measuring.get(b)
            if measuring is not None:
                key = t.untyped_storage().data_ptr()
                if key not in self.weight_storages.get(b, ()) and key not in measuring["storages"]:
                    measuring["storages"].add(key)
                    measuring["saved_bytes"] += t.untyped_storage().nbytes()
        # Saved weights arrive detached, not as Parameters: told apart by their storage.
        if b in self.activations.saved:
            view = self.activations.pack(b, t, self.weight_storages.get(b, ()))
            if view is not None:
                return view
        # Detached: a saved output keeps no reference to its own graph (no cycle to leak).
        return t.detach()

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, SavedView):
            return self.activations.unpack(packed)
        if isinstance(packed, PackedWeight):
            return self.weights.unpack(packed)
        return packed

    def activation_policy(self) -> list:
        return ["offload" if b in self.activations.saved else "keep"
                for b in range(len(self.blocks))]

    def resident_bytes(self) -> int:
        return self.weights.slot_bytes * len(self.weights.slots)

    def close(self) -> None:
        """Stops paging: every paged parameter gets a tensor of its own again."""
        if self.cuda:
            self.activations.wait_for_copies()
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self.left_on_host_bytes = self.weights.close()
        self.activations.close()
