# SPDX-License-Identifier: Apache-2.0
"""Block paging: chosen blocks keep their weights in host memory (the daemon's buffers) and
borrow a device slot only while they run; chosen blocks send the activations they save for
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

from ..transport import device as cuda_device
from ..errors import InvalidArgumentError
from ..hooks import HookClock, weak_hook
from .kv_cache import CACHE_ARGUMENTS

# Forwards timed when a measured block is replayed (after one warm-up).
_REPLAYS = 2


def _plain(value: Any) -> bool:
    """Whether a block's argument is data a forward only reads: tensors and plain values,
    alone or in tuples, lists and dicts."""
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str, torch.dtype)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(v) for v in value.values())
    return False


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


class _Slot:
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
        self.unpacked: dict[tuple, torch.Tensor] = {}  # saved weights' views, by packed layout


class _Offloaded:
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


class _SavedView:
    """What autograd holds for one saved tensor of a paging block: its layout over the storage
    an _Offloaded item pages. Tensors saved from one storage share the item (q, k and v sliced
    from one fused projection's output, a gate and its up projection: views that keep the whole
    storage alive), so that paging them frees that storage and copies it once."""

    __slots__ = ("item", "dtype", "shape", "stride", "offset")

    def __init__(self, item: _Offloaded, t: torch.Tensor):
        self.item = item
        self.dtype, self.shape = t.dtype, tuple(t.shape)
        self.stride, self.offset = tuple(t.stride()), t.storage_offset()


class BlockPager:
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
        self.saved: dict[int, list[_Offloaded]] = {}
        self.bytes_offloaded = 0
        # Activations still crossing to host memory keep their device memory until the copy
        # lands; past this many bytes, forward waits for the oldest copies.
        self.max_inflight_bytes = int(max_inflight_bytes)
        self._inflight: collections.deque = collections.deque()
        self._inflight_bytes = 0
        # Activations the block running now saved, with their device tensors: copied to host
        # together after its forward, behind one event (a stream switch and an event per
        # tensor cost the CPU more than the copy's own call).
        self._unissued: list[tuple[_Offloaded, torch.Tensor]] = []
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
        self.slots: list[_Slot] = []
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
        self._bound_slots: dict[int, _Slot] = {}
        self.generation = 0
        self.bytes_fetched = 0
        self.packed = 0  # saved references to paged weights kept as layouts, not tensors
        # Measurement (the probe step): bytes each measured block's forward saves for backward
        # (weights excluded), its input's bytes, and its forward's time.
        self.measure: set[int] = set()
        self.measured: dict[int, dict] = {}
        self._measuring: dict[int, Any] = {}
        # The step's VRAM peak when a measured block was replayed (the replay's own memory is
        # not the step's); read with the allocator's peak since, and cleared with it.
        self.peak_before_replay = 0
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

    def page_weights(self, indices: Sequence[int]) -> list[int]:
        """Blocks ``indices`` start streaming their weights (between steps); returns those that
        were not paged yet. Their parameters' values are read from ``host_copy`` from now on,
        and their device memory goes back to the allocator."""
        added = sorted(set(int(i) for i in indices) - set(self.paged))
        if not added:
            return []
        if self.bound:
            raise RuntimeError("blocks can start paging only between steps")
        for b in added:
            self.params[b] = list(self.blocks[b].parameters(recurse=True))
            for p in self.params[b]:
                host = self._host_copy(p)
                if (host.dtype != p.dtype or host.shape != p.shape
                        or not host.is_contiguous()):
                    raise InvalidArgumentError(
                        f"the host copy of a {tuple(p.shape)} {p.dtype} parameter of block {b} "
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
            self._wait_for_copies()
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
        self.slots = [_Slot(self.slot_bytes, self.device) for _ in range(self.depth + 1)]
        return added

    def unpage_weights(self, indices: Sequence[int]) -> list[int]:
        """Blocks ``indices`` keep their weights in VRAM again (between steps): each parameter
        gets a device tensor holding the host copy's current value. Returns those that were
        streaming."""
        removed = sorted(set(int(i) for i in indices) & set(self.paged))
        if not removed:
            return []
        if self.bound:
            raise RuntimeError("blocks can stop paging only between steps")
        if self.cuda:
            self._wait_for_copies()
        self.slots = []  # back to the allocator before the blocks' device copies are made
        for b in removed:
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
            self.slots = [_Slot(self.slot_bytes, self.device) for _ in range(self.depth + 1)]
        return removed

    def _slot_size(self, b: int) -> int:
        _, offset, nbytes = self.layout[b][-1]
        return (offset + nbytes + 255) // 256 * 256

    def set_activation_blocks(self, indices: Sequence[int]) -> None:
        """From the next forward, blocks ``indices`` page their saved activations."""
        self.offloading = sorted(set(int(i) for i in indices))
        self.saved = {b: self.saved.get(b, []) for b in self.offloading}
        if self.offloading and self.arena is None and self._make_arena is not None:
            self.arena = self._make_arena()  # made when first needed

    # -- slots ----------------------------------------------------------------------------------

    def weights_changed(self) -> None:
        """The host copies were updated (an optimizer step): later fetches read them anew, and
        a block still bound (a parameter that got no gradient) lets go of its slot."""
        for b in list(self.bound):
            self._unbind(b)
        self.generation += 1
        # Slots added when every one was bound (a block some of whose parameters got no
        # gradient) go back.
        del self.slots[self.depth + 1:]

    def _slot_of(self, b: int) -> _Slot | None:
        return next((s for s in self.slots
                     if s.block == b and s.generation == self.generation), None)

    def _fetch(self, b: int, needed: bool = True) -> _Slot | None:
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
            self.slots.append(_Slot(self.slot_bytes, self.device))
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

    def _holds_current(self, slot: _Slot) -> bool:
        return slot.block is not None and slot.generation == self.generation

    def _in_use(self, slot: _Slot) -> bool:
        return self._holds_current(slot) and slot.block in self.bound

    def _distance(self, held: int | None, wanted: int) -> int:
        return 0 if held is None else -abs(self.position[held] - self.position[wanted])

    def _views(self, b: int, slot: _Slot) -> list:
        """Block ``b``'s parameters as views of ``slot``, made once per slot and block (the
        slots live as long as the layout: both change only between steps)."""
        views = slot.views.get(b)
        if views is None:
            views = [slot.storage[offset:offset + nbytes].view(p.dtype).view(p.shape)
                     for p, offset, nbytes in self.layout[b]]
            slot.views[b] = views
        return views

    def _copy_in(self, b: int, slot: _Slot) -> None:
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

    # -- forward --------------------------------------------------------------------------------

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
                self.weight_storages[b] = {p.untyped_storage().data_ptr()
                                           for p in self.blocks[b].parameters()}
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
                end = None
                if self.cuda:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                self.measured[b] = {"saved_bytes": measuring["saved_bytes"],
                                    "input_bytes": measuring["input_bytes"],
                                    "events": (measuring["start"], end),
                                    "wall_s": time.perf_counter() - measuring["clock"],
                                    # while its weights are still bound
                                    "replay_s": self._replay_seconds(module, *measuring["call"])}
            if b in self.position:
                self._unbind(b)
        return hook

    def _replay_seconds(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> float | None:
        """The block's forward run again without gradients, after one warm-up: its time with
        the kernels chosen and the CPU ahead of the GPU, which is what a recompute costs. The
        timed forward of a step reads higher: in the first step the allocator grows and libraries
        pick kernels, and hooks can leave the GPU waiting for the CPU. The replay runs in eval
        mode (no running statistics updated, no dropout) and its memory is kept out of the
        step's peak (``peak_before_replay``). None when it fails (out of memory, say) or when the
        block is called with something a replay could change (an object other than tensors and
        plain values)."""
        # A key/value cache would grow with each replay; training never reads it back, and an
        # empty one gives attention the same keys as none.
        kwargs = {k: (None if k in CACHE_ARGUMENTS else False if k == "use_cache" else v)
                  for k, v in kwargs.items()}
        if not all(_plain(v) for v in (*args, *kwargs.values())):
            return None
        modes = [(m, m.training) for m in module.modules()]
        if self.cuda:
            self.peak_before_replay = max(self.peak_before_replay,
                                          torch.cuda.max_memory_allocated(self.device))
        try:
            module.eval()
            # Its own random numbers: whatever samples in eval mode leaves the step's stream.
            with torch.no_grad(), torch.random.fork_rng(
                    devices=[self.device] if self.cuda else [],
                    device_type="cuda" if self.cuda else "cpu"):
                module.forward(*args, **kwargs)
                if self.cuda:
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(_REPLAYS):
                        module.forward(*args, **kwargs)
                    end.record()
                    end.synchronize()
                    return start.elapsed_time(end) / 1000.0 / _REPLAYS
                clock = time.perf_counter()
                for _ in range(_REPLAYS):
                    module.forward(*args, **kwargs)
                return (time.perf_counter() - clock) / _REPLAYS
        except Exception:  # noqa: BLE001 - a measurement only: the step's timing stands in
            return None
        finally:
            for m, training in modes:
                m.training = training
            if self.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)

    def forward_seconds(self, b: int) -> float:
        """The measured block's forward time: replayed when it could be (see _replay_seconds),
        else as timed in the step (GPU time on CUDA)."""
        m = self.measured[b]
        if m.get("replay_s") is not None:
            return m["replay_s"]
        start, end = m["events"]
        if start is not None and end is not None:
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        return m["wall_s"]

    def _pack(self, b: int, t: torch.Tensor) -> Any:
        # Called for every tensor an involved block saves for backward: the cheap tests first.
        ptr = t.data_ptr()
        slot = self._bound_slots.get(b)
        if slot is not None and slot.base <= ptr < slot.end:
            # A view of the slot (a weight, or a view of one): keep its layout, not its bytes.
            # (Host and device pointers share one address space, so the range alone says it.)
            self.packed += 1
            return ("paged", b, t.dtype, tuple(t.shape), tuple(t.stride()),
                    (ptr - slot.base) // t.element_size())
        if self._measuring:
            measuring = self._measuring.get(b)
            if measuring is not None:
                key = t.untyped_storage().data_ptr()
                if key not in self.weight_storages.get(b, ()) and key not in measuring["storages"]:
                    measuring["storages"].add(key)
                    measuring["saved_bytes"] += t.untyped_storage().nbytes()
        # Saved weights arrive detached, not as Parameters: told apart by their storage.
        if b in self.saved and t.device == self.device:
            storage = t.untyped_storage()
            if (storage.nbytes() >= self.min_offload_bytes
                    and storage.nbytes() % t.element_size() == 0
                    and storage.data_ptr() not in self.weight_storages.get(b, ())):
                item = self._offload(b, t, storage)
                if item is not None:
                    item.views += 1
                    item.left = item.views
                    return _SavedView(item, t)
        # Detached: a saved output keeps no reference to its own graph (no cycle to leak).
        return t.detach()

    def _host_for(self, t: torch.Tensor) -> torch.Tensor | None:
        if self.arena is None:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda)
        try:
            return self.arena.take(tuple(t.shape), t.dtype)
        except MemoryError as e:  # the daemon has no room left: this one stays on the device
            self.arena_refused = str(e)
            return None

    def _offload(self, b: int, t: torch.Tensor, storage: Any) -> _Offloaded | None:
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
        item = _Offloaded(b, host, None)
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
        stream = self.activation_stream
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

    def _wait_for_copies(self) -> None:
        compute = cuda_device.current(self._device_index)
        compute.wait_stream(self.stream)
        compute.wait_stream(self.activation_stream)

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
        self.activation_stream.wait_stream(compute)
        for event in {id(item.copied): item.copied for item in todo}.values():
            self.activation_stream.wait_event(event)
        self._copy_activations(self.activation_stream,
                               [(item.device, item.host) for item in todo])
        returned = torch.cuda.Event()
        returned.record(self.activation_stream)
        for item in todo:
            item.device.record_stream(self.activation_stream)
            item.returned = returned

    def _arrived(self, item: _Offloaded) -> torch.Tensor:
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

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _SavedView):
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
                # Backward owns its views now: the storage is freed with the last of them
                # rather than kept until the next forward (the host copy stays, for
                # retain_graph, which unpacks every view again).
                item.device, item.used, item.left = None, True, item.views
            return view
        if not (isinstance(packed, tuple) and packed and packed[0] == "paged"):
            return packed
        _, b, dtype, shape, stride, offset = packed
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
            view = slot.storage.view(dtype).as_strided(shape, stride, offset)
            slot.unpacked[packed] = view
        return view

    def _gradient_landed(self, b: int, p: torch.Tensor) -> None:
        if b not in self.position:
            return
        left = self.pending_grads.get(b, 0) - 1
        self.pending_grads[b] = left
        if left == 0:
            self._unbind(b)

    # -- the rest -------------------------------------------------------------------------------

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
            for p in self.params[b]:
                host = self.host[id(p)]
                try:
                    p.data = host.to(self.device, copy=True)
                except torch.OutOfMemoryError:
                    # A model bigger than VRAM: the rest stays on the CPU, out of the daemon's
                    # segment, instead of failing with half the weights moved.
                    p.data = host.clone()
                    self.left_on_host_bytes += host.numel() * host.element_size()
        self.saved = {b: [] for b in self.offloading}
