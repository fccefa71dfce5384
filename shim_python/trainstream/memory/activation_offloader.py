# SPDX-License-Identifier: Apache-2.0
"""``ActivationOffloader``: activation paging on its own, for any model with a layer stack,
without the rest of trainstream (TrainStream 0.6's tool of that name). The blocks chosen copy
what their forward saves for backward to host memory as forward runs and bring it back, a
block ahead, as backward needs it (the pager ``wrap()`` uses, memory/pager.py); others may
recompute their forward in backward instead.

``offload="auto"`` pages only what does not fit: the first training step measures what each
block saves, and the offloader then keeps in VRAM as many blocks' activations as the VRAM target
holds, the latest first (backward reaches them first), and pages the earlier ones; those host
memory cannot hold are recomputed. Without a VRAM target (on the CPU) nothing is paged. TrainStream
0.6 tuned "auto" by the slowdown it measured instead; here, as in ``wrap()``, the target decides.
0.6's tuning arguments are accepted, checked and recorded (``.tuning``, and an event saying what
each would have tuned), and change nothing."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..errors import InvalidArgumentError
from .blocks import has_forward

# Working memory of the step beside the activations kept: a block's forward and the backward of
# the block before it, each about one block's saved activations.
_WORKING_BLOCKS = 2
# TrainStream 0.6's tuning arguments: what each takes there, and why it changes nothing here.
_SEED_TUNING = {
    "calibrate_steps": ("an integer >= 2", "0.6 measured that many steps with nothing paged "
                        "before tuning; here one probe step measures each block"),
    "max_slowdown": ("a float >= 0", "0.6 paged until a step was that much slower; here what "
                     "fits under vram_target stays in VRAM and the rest pages"),
    "tune_window": ("an integer >= 1", "0.6 timed each setting over that many steps; here no "
                    "setting is timed"),
    "profile": ("None or a HardwareProfile", "0.6 sized its first guess from the link's "
                "bandwidth; here the probe step's measurements decide"),
    "reserved_link_bytes": ("bytes >= 0, or a pair of them", "0.6 counted the optimizer's "
                            "PCIe traffic against the slowdown; here no slowdown is budgeted"),
    "memory_pressure": ("True or False", "wrap() told 0.6 whether weights page; here "
                        "weights_paged does, for the probe's event"),
}


def _host_available() -> int:
    """Bytes the kernel says it can give without swapping (MemAvailable)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _checked_tuning(options: dict) -> dict:
    """TrainStream 0.6's tuning arguments given (see _SEED_TUNING), checked: {name: value}."""
    for name, value in options.items():
        if name not in _SEED_TUNING:
            raise TypeError(f"ActivationOffloader() got an unexpected keyword argument "
                            f"{name!r}")
        if name in ("calibrate_steps", "tune_window"):
            least = 2 if name == "calibrate_steps" else 1
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= least
        elif name == "max_slowdown":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
        elif name == "profile":
            ok = value is None or isinstance(value, dict)
        elif name == "reserved_link_bytes":
            pair = value if isinstance(value, (tuple, list)) and len(value) == 2 else (value,)
            ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                     for v in pair)
        else:  # memory_pressure
            ok = value is True or value is False
        if not ok:
            raise InvalidArgumentError(
                f"ActivationOffloader: {name}={value!r} must be {_SEED_TUNING[name][0]} "
                f"(TrainStream 0.6's tuning argument; recorded here, with no effect: "
                f"{_SEED_TUNING[name][1]})")
    return dict(options)


class ActivationOffloader:
    """Pages the saved activations of ``blocks`` (the model's layer stack, in call order).

    ``offload``: ``"auto"``, True (every block but the last, whose activations backward uses at
    once), False, a fraction 0.0-1.0 of the blocks (the earliest), or block indices.
    ``recompute``: False, True, a fraction or block indices: blocks that keep only their input
    and run their forward again in backward. ``min_bytes``: smaller saved tensors stay where they
    are. ``prefetch_depth``: blocks brought back ahead of backward. ``max_inflight_bytes``: device
    memory held by copies still crossing to the host. ``vram_target``: the bytes the step may use
    on the device, for ``"auto"`` (default: what this process may use of the GPU, less 10%).
    ``recompute="auto"`` (the default, as in 0.6): the blocks ``offload="auto"`` finds host
    memory cannot hold recompute; with blocks named in ``offload``, none does.
    ``client``: a trainstream client whose daemon holds the host copies (counted there like any
    buffer); default private pinned memory.

    TrainStream 0.6's tuning arguments (``calibrate_steps``, ``max_slowdown``, ``tune_window``,
    ``profile``, ``reserved_link_bytes``, ``memory_pressure``) are checked and recorded in
    ``.tuning``, with an ``activations.tuning`` event saying what each tuned there; "auto" here
    plans against the VRAM target instead, so they change nothing."""

    def __init__(self, model: torch.nn.Module, blocks: Iterable[torch.nn.Module],
                 offload: Any = "auto", *, min_bytes: int = 1 << 20, prefetch_depth: int = 1,
                 max_inflight_bytes: int = 1 << 30, recompute: Any = "auto",
                 vram_target: int | None = None, client: Any = None, **seed_options: Any):
        from .pager import BlockPager
        from .recompute import Recompute

        self.tuning = _checked_tuning(seed_options)
        self.blocks = list(blocks)
        count = len(self.blocks)
        if count < 2:
            raise InvalidArgumentError(
                f"ActivationOffloader: {count} blocks; paging needs a stack of two or more")
        uncalled = [i for i, b in enumerate(self.blocks) if not has_forward(b)]
        if uncalled:
            raise InvalidArgumentError(
                f"ActivationOffloader: blocks[{uncalled[0]}] is a "
                f"{type(self.blocks[uncalled[0]]).__name__} without a forward of its own; pass "
                "the layers the model calls")
        for name, value in (("min_bytes", min_bytes), ("prefetch_depth", prefetch_depth),
                            ("max_inflight_bytes", max_inflight_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < (
                    1 if name == "prefetch_depth" else 0):
                raise InvalidArgumentError(f"ActivationOffloader: {name}={value!r} must be an "
                                           f"integer >= {1 if name == 'prefetch_depth' else 0}")
        self.adjustable = isinstance(offload, str) and offload == "auto"
        offloaded = [] if self.adjustable else self._chosen("offload", offload, count - 1)
        recomputed = ([] if isinstance(recompute, str) and recompute == "auto"
                      else self._chosen("recompute", recompute, count))
        both = sorted(set(offloaded) & set(recomputed))
        if both:
            raise InvalidArgumentError(
                f"ActivationOffloader: blocks {both} are both paged and recomputed; a "
                "recomputed block keeps no activations to page: choose one")
        first = next(self.blocks[0].parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.vram_target = vram_target
        if self.adjustable and vram_target is None and self.device.type == "cuda":
            from .block_memory import vram_budget

            from ..options import MemoryOptions

            self.vram_target = vram_budget(self.device, MemoryOptions()).bytes
        if vram_target is not None and (not isinstance(vram_target, int) or vram_target <= 0):
            raise InvalidArgumentError(
                f"ActivationOffloader: vram_target={vram_target!r} must be a positive integer")

        arena = None
        if client is not None:
            from .activation_arena import ActivationArena

            def arena():
                return ActivationArena(
                    lambda name, nbytes: client.allocate(name, nbytes, tag="activations"),
                    f"activations/{client.session_id}")
        self._pager = BlockPager(self.blocks, [], lambda p: p, prefetch_depth,
                                 activations=offloaded, min_offload_bytes=min_bytes,
                                 arena=arena, device=self.device,
                                 max_inflight_bytes=max_inflight_bytes)
        self._recompute = Recompute(self.blocks, recomputed)
        self._hooks: list = []
        self.events: list[dict] = []
        self.decision: dict = {"kept_blocks": []}
        self.block_bytes: int | None = None
        self.weights_paged = None  # wrap() sets it in TrainStream 0.6; nothing streams here
        if self.tuning:
            self._say("activations.tuning", "; ".join(
                f"{name}={value!r} recorded, no effect: {_SEED_TUNING[name][1]}"
                for name, value in self.tuning.items()))
        if self.adjustable:
            if self.vram_target is None:
                self.decision.update(
                    reason=f"the blocks run on {self.device.type}, with no VRAM target: "
                           "nothing is paged (pass vram_target= to plan against one)")
                self._say("activations.auto", self.decision["reason"])
            else:
                self._pager.measure = set(range(count))
                self._baseline: int | None = None
                self._hooks.append(self.blocks[0].register_forward_pre_hook(
                    self._before_first_block, prepend=True))
        else:
            self.decision.update(reason="set by the caller", offloaded=offloaded,
                                 recomputed=recomputed)
            if offloaded or recomputed:
                self._say("activations.set",
                          f"{len(offloaded)} of {count} blocks page their saved activations "
                          f"to host memory, {len(recomputed)} recompute their forward")

    # -- the choice -----------------------------------------------------------------------

    def _chosen(self, name: str, value: Any, count: int) -> list:
        if value is None or value is False:
            return []
        if value is True:
            return list(range(count))
        if isinstance(value, float):
            if not 0.0 <= value <= 1.0:
                raise InvalidArgumentError(f"ActivationOffloader: {name}={value} must be in "
                                           "[0, 1]")
            return list(range(round(value * count)))
        if isinstance(value, (list, tuple, set, frozenset, range)):
            picked = sorted(set(int(i) for i in value))
            if picked and not (0 <= picked[0] and picked[-1] < len(self.blocks)):
                raise InvalidArgumentError(f"ActivationOffloader: {name}={value!r} names "
                                           f"blocks outside 0..{len(self.blocks) - 1}")
            if name == "offload" and len(self.blocks) - 1 in picked:
                raise InvalidArgumentError(
                    f"ActivationOffloader: offload={value!r} names the last block, whose "
                    "activations backward uses as soon as it starts: it keeps them")
            return picked
        extra = "'auto', "
        raise InvalidArgumentError(f"ActivationOffloader: {name}={value!r} is not one of "
                                   f"{extra}True, False, a fraction 0.0-1.0 or block indices")

    def _device_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        # Without an allocator to ask: what the blocks' own tensors hold.
        return sum(t.numel() * t.element_size() for b in self.blocks
                   for t in list(b.parameters()) + list(b.buffers()))

    def _before_first_block(self, module, args):
        if not torch.is_grad_enabled():
            return
        pager = self._pager
        if self._baseline is None:
            self._baseline = self._device_bytes()  # the probe step starts: weights, inputs
            return
        if len(pager.timing.measured) < len(self.blocks):
            return  # the probe step has not reached every block yet
        self._decide()

    def _decide(self) -> None:
        pager, count = self._pager, len(self.blocks)
        saved = [int(pager.timing.measured[b]["saved_bytes"]) for b in range(count)]
        pager.measure = set()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.block_bytes = max(saved)
        room = self.vram_target - self._baseline - _WORKING_BLOCKS * self.block_bytes
        kept, total = [], 0
        for b in reversed(range(count)):
            if b != count - 1 and total + saved[b] > room:
                break
            kept.append(b)
            total += saved[b]
        rest = sorted(set(range(count)) - set(kept))
        host_room = _host_available() // 2  # half: the rest of the machine keeps the other
        offloaded, recomputed, hosted = [], [], 0
        for b in reversed(rest):  # the latest are brought back first: they page
            if hosted + saved[b] <= host_room:
                offloaded.append(b)
                hosted += saved[b]
            else:
                recomputed.append(b)
        offloaded.sort()
        recomputed.sort()
        if recomputed:
            self._recompute.set(sorted(set(self._recompute.indices) | set(recomputed)))
        pager.set_activation_blocks([b for b in offloaded if b not in self._recompute.indices])
        self.decision.update(
            vram_target_bytes=self.vram_target, baseline_bytes=self._baseline,
            saved_bytes=saved, kept=sorted(kept), offloaded=offloaded, recomputed=recomputed,
            reason=(f"the probe step saved {sum(saved) / 2**20:.1f} MiB of activations; "
                    f"{len(kept)} of {count} blocks' fit in the "
                    f"{max(0, room) / 2**20:.1f} MiB the VRAM target leaves beside "
                    f"{self._baseline / 2**20:.1f} MiB already held and "
                    f"{_WORKING_BLOCKS} blocks' working memory"))
        message = self.decision["reason"]
        if offloaded or recomputed:
            message += (f"; {len(offloaded)} page to host memory"
                        + (f", {len(recomputed)} recompute (host memory holds no more)"
                           if recomputed else ""))
        self._say("activations.auto", message)

    def _say(self, kind: str, message: str) -> None:
        self.events.append({"kind": kind, "message": message})

    # -- what it does now -----------------------------------------------------------------

    @property
    def policy(self) -> list:
        """Per block: "keep", "offload" or "recompute"."""
        recomputed = set(self._recompute.indices)
        return ["recompute" if b in recomputed else "offload" if b in self._pager.offloading
                else "keep" for b in range(len(self.blocks))]

    @property
    def stats(self) -> dict:
        pager = self._pager
        arena = pager.activations.arena
        return {"offloaded_bytes": pager.bytes_offloaded,
                "inflight_waits": pager.activations.inflight_waits,
                "host_bytes": arena.reserved_bytes if arena is not None else None,
                "offloaded_blocks": len(pager.offloading),
                "recomputed_blocks": len(self._recompute.indices),
                "host_refused": pager.activations.arena_refused}

    def keep_resident(self, k: int) -> list:
        """Keeps the activations of up to ``k`` blocks that "auto" pages or recomputes in VRAM
        instead, the latest first; returns the blocks moved. A policy the caller set stays."""
        if not self.adjustable or k <= 0:
            return []
        chosen = sorted(set(self._pager.offloading) | set(self._recompute.indices),
                        reverse=True)[:int(k)]
        if not chosen:
            return []
        self._pager.set_activation_blocks([b for b in self._pager.offloading if b not in chosen])
        self._recompute.set([b for b in self._recompute.indices if b not in chosen])
        self.decision["kept_blocks"] = sorted(set(self.decision["kept_blocks"]) | set(chosen))
        self._say("activations.kept", f"blocks {sorted(chosen)} keep their activations in "
                                      "VRAM again")
        return sorted(chosen)

    def remove(self) -> None:
        """Takes the offloader off: every block keeps its activations and runs as before."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._pager.close()
        self._recompute.close()
