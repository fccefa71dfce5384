# SPDX-License-Identifier: Apache-2.0
"""``trainstream.wrap()``: one line in a PyTorch training loop, and the optimizer state, the
gradients and the update live in trainstreamd."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from . import client as _client
from .errors import FailedPreconditionError, ResourceExhaustedError
from .offload_adamw import MOMENT_DTYPES, NONFINITE, OffloadAdamW

# Options wrap() accepts now, with the values each takes. Later milestones add the paging and
# planner options; until then naming one is an error rather than silently ignored.
_ACCEPTED = {
    "optimizer_mode": ("cpu", "auto"),
    "offload": ("auto", True),
    "moment_dtype": ("auto", "float32", "fp32", "bfloat16", "bf16", "torch.float32",
                     "torch.bfloat16"),
    "max_grad_norm": "None or a float > 0",
    "accumulation_steps": "an integer >= 1",
    "threads": "None or an integer >= 1 (the daemon's --threads; reported, not changed)",
    "device": "None, 'cpu', 'cuda', 'cuda:N' or a torch.device",
    "distributed": (None, True, False),
    "verbose": (True, False),
    "lr": "a float (used only when optimizer is None)",
    "nonfinite": NONFINITE,
    "job_id": "a job name (ranks and restarted processes with the same one share the state)",
    "socket": "a trainstreamd socket path",
    "vram_headroom": "a float in [0, 1): the share of usable VRAM offload='auto' leaves free",
    "gradient_dtype": (None, "float32", "fp32", "bfloat16", "bf16"),
    "check_memory": (True, False),
    "param_offload": "'auto', True, False, a fraction 0.0-1.0, or a list of block indices",
    "blocks": "None or the list of repeated layer modules (found with find_blocks by default)",
    "prefetch_depth": "an integer >= 1: paged blocks fetched ahead",
    "activation_offload": "'auto', True, False, or a fraction 0.0-1.0 of the blocks",
    "min_offload_bytes": "an integer: smaller saved activations stay on the device",
    "recompute": "'auto', True, False, a fraction 0.0-1.0, or a list of block indices",
    "memory_wait_s": "seconds to wait for host memory other jobs hold (default 0)",
    "vram_budget": "None or bytes: the VRAM the memory plan may use (default: what this process "
                   "may use, less vram_headroom)",
    "max_inflight_bytes": "None or bytes: VRAM held by activations still crossing to host "
                          "memory (default 1 GiB or 10% of the VRAM budget, the smaller)",
    "host_arena": "'auto' (the daemon's buffers, grown on demand), bytes (reserved now, never "
                  "more), or False (private pinned memory, not counted by the daemon)",
    "profile": (True, False),
}


@dataclass
class TrainStreamSession:
    """What ``wrap()`` set up for a model: ``model._trainstream_session``."""

    client: Any
    optimizer: OffloadAdamW
    config: dict
    events: list = field(default_factory=list)
    pager: Any = None  # trainstream.paging.BlockPager when blocks page weights or activations
    plan: Any = None   # trainstream.adaptive_plan.AdaptivePlan when the memory plan adapts
    frozen: Any = None  # host copies of frozen weights that stream

    @property
    def adapting(self) -> bool:
        """True while offload='auto' is still measuring the first steps."""
        return bool(self.optimizer._switch_when_fits) or bool(self.plan and self.plan.adapting)

    @property
    def steps(self) -> int:
        """Optimizer steps so far."""
        return self.optimizer.steps

    def note(self, kind: str, message: str, **numbers: float) -> None:
        """Records a decision: here, in the daemon's event log (``tsctl events``), and on
        stdout with ``verbose=True``."""
        event = {"time": time.time(), "kind": kind, "message": message, "numbers": numbers}
        self.events.append(event)
        try:
            self.client.report_event(kind, message[:1024], **numbers)
        except Exception as e:  # the decision stands; only its copy in the daemon's log is lost
            event["not_reported"] = str(e)
        if self.config.get("verbose"):
            print(f"trainstream: {kind}: {message}")


def _check_options(options: dict) -> None:
    for name, value in options.items():
        if name not in _ACCEPTED:
            raise ValueError(
                f"trainstream.wrap: unknown option {name!r}; accepted: {', '.join(sorted(_ACCEPTED))}")
        accepted = _ACCEPTED[name]
        if isinstance(accepted, tuple):
            ok = value in accepted or (name in ("moment_dtype", "gradient_dtype")
                                       and value in MOMENT_DTYPES)
            if not ok:
                raise ValueError(f"trainstream.wrap: {name}={value!r} is not one of {accepted}")
    steps = options.get("accumulation_steps", 1)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"trainstream.wrap: accumulation_steps={steps!r} must be an integer >= 1")
    wait = options.get("memory_wait_s", 0.0)
    if not (isinstance(wait, (int, float)) and 0 <= wait <= 3600):
        raise ValueError(f"trainstream.wrap: memory_wait_s={wait!r} must be seconds in [0, 3600]")
    headroom = options.get("vram_headroom", 0.10)
    if not (isinstance(headroom, (int, float)) and 0 <= headroom < 1):
        raise ValueError(f"trainstream.wrap: vram_headroom={headroom!r} must be a float in [0, 1)")
    for name in ("max_inflight_bytes", "host_arena"):
        value = options.get(name)
        if value is None or value is False or (name == "host_arena" and value == "auto"):
            continue
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"trainstream.wrap: {name}={value!r} must be " +
                             ("None or bytes > 0" if name == "max_inflight_bytes" else
                              "'auto', False or bytes > 0"))
    budget = options.get("vram_budget")
    if budget is not None and not (isinstance(budget, int) and not isinstance(budget, bool)
                                   and budget > 0):
        raise ValueError(f"trainstream.wrap: vram_budget={budget!r} must be None or bytes > 0")
    norm = options.get("max_grad_norm")
    if norm is not None and not (isinstance(norm, (int, float)) and norm > 0):
        raise ValueError(f"trainstream.wrap: max_grad_norm={norm!r} must be None or a float > 0")


@dataclass
class _Topology:
    rank: int = 0            # this process's rank on its machine
    world: int = 1           # ranks on this machine
    machines: int = 1
    machine_group: Any = None  # the process group of every machine's rank 0
    job: str = ""


@dataclass
class _Paging:
    """What wrap() decided for the block stack before anything is set up."""

    blocks: list
    paged: list              # blocks whose weights stream from host memory
    offloaded: list          # blocks whose saved activations go to host memory
    recomputed: list         # blocks recomputed in backward
    depth: int
    budget: int | None       # usable VRAM (None: not planned against VRAM)
    adaptive: bool           # activations decided by a probe step and the planner
    weights_auto: bool       # param_offload="auto"
    events: list = field(default_factory=list)

    def paged_params(self) -> list:
        return [p for b in self.paged for p in self.blocks[b].parameters()]


def _vram_budget(device: torch.device, config: dict, model_bytes: int = 0) -> int | None:
    """The VRAM this run may plan for: vram_budget= if given; on CUDA, what this process may use
    (torch's per-process fraction, and what other processes leave free) less the headroom."""
    if config["vram_budget"] is not None:
        return int(config["vram_budget"])
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    limit = total * (float(getter(device)) if getter is not None else 1.0)
    free, _ = torch.cuda.mem_get_info(device)
    limit = min(limit, free + torch.cuda.memory_reserved(device))
    # Tensors this process holds besides the model's (another model, a cache) stay where they are.
    others = max(0, torch.cuda.memory_allocated(device) - model_bytes)
    config["_others_bytes"] = others
    return max(0, int((1.0 - float(config["vram_headroom"])) * limit - others))


def _weight_plan(model: torch.nn.Module, blocks: list, budget: int, depth: int,
                 probe: bool) -> list:
    """param_offload="auto" at wrap(): the fewest blocks (spread over the stack, see
    planner.spread_order) whose weights must stream for the weights to fit, with room for one
    block's gradients in flight, and, when a probe step follows, a quarter of the budget for
    that step's activations and working memory (unknown until it runs: the logits of a large
    vocabulary alone can take gigabytes). The plan made from the probe's measurements streams
    more blocks, or fewer."""
    from .planner import BlockFacts, MemoryPlanError, PlanInputs, plan_memory, size

    sizes = [sum(p.numel() * p.element_size() for p in blk.parameters()) for blk in blocks]
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    other, working = total - sum(sizes), 2 * max(sizes)
    if probe:
        working = max(working, budget // 4)
    inputs = PlanInputs(blocks=tuple(BlockFacts(weight_bytes=w, activation_bytes=0) for w in sizes),
                        other_weight_bytes=other, other_trainable=0, working_bytes=working,
                        vram_budget=budget, host_budget=1 << 62, grad_bytes=0,
                        activation_offload=False, prefetch_depth=depth)
    try:
        return plan_memory(inputs).paged_blocks
    except MemoryPlanError:
        need = other + (depth + 1) * max(sizes) + working
        room = ("room for the probe step and a block's gradients in flight" if probe else
                "a block's gradients in flight")
        raise MemoryPlanError(
            f"trainstream.wrap: the weights do not fit in the {size(budget)} VRAM budget even "
            f"with every block streaming: the weights outside the {len(blocks)} blocks "
            f"({size(other)}), {depth + 1} device slots of {size(max(sizes))} and {room} "
            f"({size(working)}) need {size(need)}. Use a GPU with more free memory or a larger "
            "vram_budget, lower vram_headroom" + (", or prefetch_depth=1" if depth > 1 else "")
        ) from None


def _paging_choice(model: torch.nn.Module, config: dict, device: torch.device) -> _Paging | None:
    """The block stack's paging and recompute, from param_offload, activation_offload and
    recompute (each "auto" by default: planned against the VRAM budget); checked before anything
    is set up, so a bad choice costs nothing. None when nothing pages, recomputes or adapts."""
    from .blocks import find_blocks

    weights, acts, again = (config["param_offload"], config["activation_offload"],
                            config["recompute"])
    depth = config["prefetch_depth"]
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"trainstream.wrap: prefetch_depth={depth!r} must be >= 1")

    def is_auto(value: Any) -> bool:
        return isinstance(value, str) and value == "auto"

    def is_off(value: Any) -> bool:  # by identity: 0 and 1 are not False and True here
        return value is None or value is False or is_auto(value)

    for name, value in (("param_offload", weights), ("activation_offload", acts),
                        ("recompute", again)):
        if not (is_off(value) or value is True or isinstance(value, (float, list, tuple))):
            lists = "" if name == "activation_offload" else " or a list of block indices"
            raise ValueError(f"trainstream.wrap: {name}={value!r} is not one of 'auto', True, "
                             f"False, a fraction 0.0-1.0{lists}")
    on_device = sum(t.numel() * t.element_size() for t in
                    list(model.parameters()) + list(model.buffers()) if t.device == device)
    budget = _vram_budget(device, config, on_device)
    planned = budget is not None and (is_auto(weights) or (is_auto(acts) and is_auto(again)))
    if is_off(weights) and is_off(acts) and is_off(again) and not planned:
        return None
    explicit = config["blocks"] is not None
    blocks = list(config["blocks"]) if explicit else find_blocks(model)
    if not blocks:
        if not (is_off(weights) and is_off(acts) and is_off(again)):
            raise ValueError("trainstream.wrap: param_offload, activation_offload and recompute "
                             "need a repeated block stack; none was found (pass blocks=[...])")
        return None

    def chosen(name: str, value: Any, count: int, allow_list: bool) -> list:
        if is_off(value):
            return []
        if value is True:
            return list(range(count))
        if isinstance(value, float):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"trainstream.wrap: {name}={value} must be in [0, 1]")
            return list(range(round(value * count)))
        if not allow_list:
            raise ValueError(f"trainstream.wrap: {name}={value!r} is not one of 'auto', True, "
                             "False or a fraction")
        picked = sorted(set(int(i) for i in value))
        if picked and not (0 <= picked[0] and picked[-1] < len(blocks)):
            raise ValueError(f"trainstream.wrap: {name}={value!r} names blocks outside "
                             f"0..{len(blocks) - 1}")
        return picked

    paged = chosen("param_offload", weights, len(blocks), True)
    events = []
    if is_auto(weights) and budget is not None:
        paged = _weight_plan(model, blocks, budget, depth,
                             probe=is_auto(acts) and is_auto(again) and len(blocks) >= 2)
        if paged:
            events.append(("wrap.plan", f"{len(paged)} of {len(blocks)} blocks stream their "
                                        f"weights: the weights do not fit in the "
                                        f"{budget / 2**30:.2f} GiB VRAM budget otherwise"))
    # The last block's activations are used as soon as backward starts: they always stay.
    offloaded = chosen("activation_offload", acts, len(blocks) - 1, False)
    recomputed = chosen("recompute", again, len(blocks), True)
    both = sorted((set(paged) | set(offloaded)) & set(recomputed))
    if both:
        raise ValueError(f"trainstream.wrap: blocks {both} are both paged and recomputed; a "
                         "recomputed block keeps no activations to page, and its weights are "
                         "used again in backward: choose one")
    adaptive = budget is not None and is_auto(acts) and is_auto(again) and len(blocks) >= 2
    if not (paged or offloaded or recomputed or adaptive):
        return None
    return _Paging(blocks, paged, offloaded, recomputed, depth, budget, adaptive,
                   is_auto(weights), events)


def _place(model: torch.nn.Module, device: torch.device, paging: _Paging | None) -> dict:
    """Moves the model to ``device`` except the weights of blocks that stream: those stay where
    they are (a model bigger than VRAM is built on the CPU) and get a placeholder on the device;
    returns their values by parameter id, for the daemon's host copies."""
    streamed = {id(p) for p in paging.paged_params()} if paging else set()
    initial = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in streamed:
                if id(p) not in initial:
                    initial[id(p)] = p.data
                    p.data = torch.zeros((), dtype=p.dtype, device=device).expand(p.shape)
            elif p.device != device:
                p.data = p.data.to(device)
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
    return initial


class _FrozenWeights:
    """Host copies of frozen weights that stream (no optimizer holds them): daemon buffers,
    pinned and counted against the job like the rest."""

    def __init__(self, client: Any):
        self._client = client
        self._buffers: list = []
        self._copies: dict[int, torch.Tensor] = {}
        self.bytes = 0

    def copy(self, p: torch.Tensor, name: str, value: torch.Tensor) -> torch.Tensor:
        """``p``'s host copy holding ``value``: made the first time ``p``'s block streams, and
        written again (not made again) when it streams again after a time in VRAM."""
        host = self._copies.get(id(p))
        if host is None:
            nbytes = value.numel() * value.element_size()
            buffer = self._client.allocate(f"frozen/{self._client.session_id}/{name}",
                                           max(nbytes, 1), tag="frozen_weights")
            self._buffers.append(buffer)
            self.bytes += nbytes
            host = buffer.tensor(torch.uint8, (max(nbytes, 1),))[:nbytes].view(
                value.dtype).view(value.shape)
            self._copies[id(p)] = host
        host.copy_(value.detach())
        return host


def _page_blocks(model: torch.nn.Module, choice: _Paging | None, offload: OffloadAdamW,
                 config: dict, events: list, initial: dict, frozen: _FrozenWeights) -> Any:
    """Starts weight and activation paging and recompute for the chosen blocks; returns the
    pager (or None)."""
    from .paging import BlockPager
    from .recompute import Recompute

    if choice is None:
        return None
    blocks, paged, offloaded, recomputed, depth = (choice.blocks, choice.paged, choice.offloaded,
                                                   choice.recomputed, choice.depth)
    if recomputed or choice.adaptive:
        offload._recompute = Recompute(blocks, recomputed)
        if recomputed:
            events.append(("wrap.recompute", f"{len(recomputed)} of {len(blocks)} blocks "
                                             "recompute their forward in backward instead of "
                                             "keeping activations"))
    if not paged and not offloaded and not choice.adaptive:
        return None
    index = offload._index
    names = {id(p): n for n, p in model.named_parameters()}

    def host_copy(p: torch.Tensor) -> torch.Tensor:
        if id(p) in index:
            return offload._host.param(index[id(p)])
        # A frozen weight: its own daemon buffer, filled once.
        return frozen.copy(p, _safe(names.get(id(p), f"param{id(p)}")),
                           initial.get(id(p), p.data))

    client = offload.client

    def arena():
        from .activation_arena import ActivationArena

        if config["host_arena"] is None or config["host_arena"] is False:
            return None  # private pinned memory
        return ActivationArena(
            lambda name, nbytes: client.allocate(name, nbytes, tag="activations"),
            f"activations/{client.session_id}",
            cap=0 if config["host_arena"] == "auto" else int(config["host_arena"]))

    device = next(iter(offload._params)).device
    inflight = config["max_inflight_bytes"]
    if inflight is None:
        inflight = min(1 << 30, (choice.budget or (10 << 30)) // 10)
    pager = BlockPager(blocks, [], host_copy, depth,
                       min_offload_bytes=int(config["min_offload_bytes"]), arena=arena,
                       device=device, max_inflight_bytes=int(inflight))
    _stream_weights(offload, pager, paged)
    pager.set_activation_blocks(offloaded)
    # A checkpoint of the model holds the paged weights' host copies, not placeholders.

    def host_copies(module, state_dict, prefix, local_metadata):
        for b in pager.paged:
            for p in pager.params[b]:
                key = prefix + names.get(id(p), "")
                if key in state_dict:
                    state_dict[key] = pager.host[id(p)].detach().clone()

    pager.hooks.append(model._register_state_dict_hook(host_copies))
    if paged:
        moved = sum(p.numel() * p.element_size() for b in paged for p in pager.params[b])
        events.append(("wrap.param_offload",
                       f"{len(paged)} of {len(blocks)} blocks stream their weights from host "
                       f"memory ({moved / 2**30:.2f} GiB; {len(pager.slots)} device slots of "
                       f"{pager.slot_bytes / 2**20:.1f} MiB, prefetch depth {depth})"))
    if offloaded:
        events.append(("wrap.activation_offload",
                       f"{len(offloaded)} of {len(blocks)} blocks page their saved activations "
                       f"to host memory (those of {config['min_offload_bytes']} bytes and up)"))
    return pager


def _stream_weights(offload: OffloadAdamW, pager: Any, blocks: list) -> None:
    """Blocks start streaming their weights: the optimizer stops returning their updates to the
    device (nothing may still be copying there), then the pager frees their device memory."""
    if not blocks:
        return
    streamed = {id(p) for b in blocks for p in pager.blocks[b].parameters()}
    offload.stop_returning(streamed)
    pager.page_weights(blocks)
    offload.page_weights(pager)


def _unstream_weights(offload: OffloadAdamW, pager: Any, blocks: list) -> None:
    """Blocks keep their weights in VRAM again: device tensors with the current values first,
    then the optimizer copies their updates there."""
    if not blocks:
        return
    ids = {id(p) for b in blocks for p in pager.params.get(b, ())}
    pager.unpage_weights(blocks)
    offload.resume_returning(ids)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name) or "param"


def _keep_daemon_weights_on_load(model: torch.nn.Module, offload: OffloadAdamW,
                                 pager: Any) -> None:
    """model.load_state_dict() on a wrapped model: the daemon's master weights (what the next
    update starts from) take the loaded values too, and paged weights load into their host
    copies."""
    names = {id(p): n for n, p in model.named_parameters()}
    streamed: list = []

    def before(state_dict, prefix, *rest):
        # The blocks that stream now (the plan may have changed them since wrap()).
        streamed[:] = [p for ps in (pager.params.values() if pager else ()) for p in ps]
        offload.synchronize()  # no returning copy may land on top of the loaded values
        for p in streamed:  # a real tensor to load into, for the moment (frozen ones too),
            # holding the current value for keys the state dict leaves out
            p.data = pager.host[id(p)].to(p.device, copy=True)

    def after(module, incompatible):
        with torch.no_grad():
            for i, p in enumerate(offload._params):
                if id(p) not in names:
                    continue
                offload._host.master(i).copy_(p.detach().reshape(p.shape))
                if offload._host.param(i).data_ptr() != offload._host.master(i).data_ptr():
                    offload._host.param(i).copy_(p.detach())
            for p in streamed:
                if id(p) not in offload._index:  # frozen: its host copy takes the value
                    pager.host[id(p)].copy_(p.detach())
                p.data = pager.placeholders[id(p)]
        if pager is not None:
            pager.weights_changed()

    offload._hooks.append(model._register_load_state_dict_pre_hook(before))
    offload._hooks.append(model.register_load_state_dict_post_hook(after))


def _adaptive_plan(model: torch.nn.Module, paging: _Paging, pager: Any, offload: OffloadAdamW,
                   client: Any, session: TrainStreamSession, planned: int | None) -> Any:
    """The run-time plan: probe step, then the planner's choices, then the watchdog."""
    from .adaptive_plan import AdaptivePlan

    inside = {id(p) for blk in paging.blocks for p in blk.parameters()}
    other = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in inside)
    link = 0.0
    if pager.cuda and session.config["profile"]:
        from .hardware import profile_hardware

        gpu = profile_hardware().get("gpu") or {}
        link = 1e9 * min(gpu.get("h2d_gbps", 0.0), gpu.get("d2h_gbps", 0.0))

    # The optimizer's own PCIe traffic a step: gradients out, updated weights back (streamed
    # blocks' updates stay on the host: their fetches are counted by the plan).
    grads = sum(p.numel() * torch.tensor([], dtype=dtype).element_size()
                for p, dtype in zip(offload._params, offload._grad_dtypes))

    def transfers() -> tuple:
        back = sum(p.numel() * p.element_size() for i, p in enumerate(offload._params)
                   if i not in offload._paged_indices)
        return back, grads

    def host_free() -> int:
        memory = client.memory()
        return int(memory.get("budget_bytes", 0)) - int(memory.get("committed_bytes", 0))

    frozen_at_wrap = session.frozen.bytes
    arena = session.config["host_arena"]
    arena_cap = arena if type(arena) is int else 0  # host_arena= bytes (not "auto" or False)

    def plan_host(activation_bytes: int) -> None:
        # The job's plan from wrap(), with the activations paged now and the frozen weights'
        # host copies made since (blocks the plan streamed).
        if planned is not None:  # check_memory=False: allocated as it goes
            client.plan_host_memory(planned + activation_bytes +
                                    session.frozen.bytes - frozen_at_wrap)

    return AdaptivePlan(paging.blocks, pager, offload._recompute, paging.budget,
                        stream_weights=lambda blocks: _stream_weights(offload, pager, blocks),
                        unstream_weights=lambda blocks: _unstream_weights(offload, pager, blocks),
                        plan_host=plan_host, host_free=host_free, note=session.note,
                        other_weight_bytes=other, prefetch_depth=paging.depth,
                        link_bytes_per_s=link, weights_fixed=not paging.weights_auto,
                        others_bytes=session.config.get("_others_bytes", 0),
                        transfer_bytes=transfers,
                        host_cap=arena_cap)


def _host_bytes(model: torch.nn.Module, moment: Any, config: dict, ranks: int,
                machines: int) -> int:
    """The host memory the daemon will hold for this job: per trainable tensor, the fp32
    master, both moments, a model-dtype copy unless fp32, one gradient slot per rank, and an
    fp32 sum buffer with accumulation (CUDA) or across machines; each buffer rounded up as the
    daemon's segments are, plus one shared segment's worth."""
    from .offload_adamw import GRADIENT_DTYPES, MOMENT_DTYPES

    moment_bytes = torch.tensor([], dtype=MOMENT_DTYPES[moment]).element_size()
    grad_dtype = GRADIENT_DTYPES.get(config["gradient_dtype"]) if config["gradient_dtype"] else None
    cuda = next(model.parameters()).is_cuda
    accum = machines > 1 or (cuda and config["accumulation_steps"] > 1)
    granularity, shared = 2 << 20, 64 << 20
    total = shared
    seen = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel()
        grad = torch.tensor([], dtype=grad_dtype or p.dtype).element_size()
        buffers = [4 * n, moment_bytes * n, moment_bytes * n] + [grad * n] * ranks
        if p.dtype != torch.float32:
            buffers.append(p.element_size() * n)
        if accum:
            buffers.append(4 * n)
        total += sum((b + granularity - 1) // granularity * granularity if b >= shared // 2
                     else b + 64 for b in buffers)
    return total


def _distributed(option: Any) -> _Topology:
    """Where this process sits in a torch.distributed job (a lone process when there is none)."""
    import torch.distributed as dist

    if option is False or not (dist.is_available() and dist.is_initialized()):
        if option is True:
            raise FailedPreconditionError(
                "distributed=True needs an initialised torch.distributed process group")
        return _Topology()
    world = dist.get_world_size()
    if world == 1:
        return _Topology()
    # Ranks on one machine form one job in its daemon: torchrun gives them a common run id.
    run = os.environ.get("TORCHELASTIC_RUN_ID") or (
        f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}")
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % local_world:
        raise FailedPreconditionError(
            f"{world} ranks over machines of {local_world}: every machine needs the same number "
            "of ranks")
    machines = world // local_world
    group = None
    if machines > 1:
        # Collective: every rank creates it, only each machine's rank 0 uses it.
        # gloo: the group all-reduces the daemon's shared-memory (CPU) buffers, whatever backend
        # the job trains with.
        group = dist.new_group([m * local_world for m in range(machines)], backend="gloo")
    return _Topology(local_rank, local_world, machines, group, f"torchrun-{run}")


def wrap(model: torch.nn.Module, optimizer: Any = None, **options: Any):
    """Trains ``model`` through trainstreamd; returns ``(model, optimizer)``.

    ``optimizer`` may be ``torch.optim.AdamW``, ``torch.optim.Adam``, a
    :class:`trainstream.OffloadAdamW`, or ``None`` (one is made with ``lr``). Its
    hyper-parameters, groups and state move to the daemon. See the README for the options.
    """
    _check_options(options)
    if getattr(model, "_trainstream_session", None) is not None:
        raise FailedPreconditionError("this model is already wrapped; call trainstream.unwrap(model) first")
    config = {"optimizer_mode": "cpu", "offload": "auto", "moment_dtype": "auto",
              "max_grad_norm": None, "accumulation_steps": 1, "threads": None, "device": None,
              "distributed": None, "verbose": False, "lr": 1e-3, "nonfinite": "ignore",
              "job_id": "", "socket": None, "vram_headroom": 0.10, "gradient_dtype": None,
              "check_memory": True, "memory_wait_s": 0.0, "param_offload": "auto",
              "blocks": None, "prefetch_depth": 1, "activation_offload": "auto",
              "min_offload_bytes": 1 << 20, "recompute": "auto", "vram_budget": None,
              "max_inflight_bytes": None, "host_arena": "auto", "profile": True}
    config.update(options)
    events: list = []

    device = config["device"]
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise FailedPreconditionError(
            f"the model's parameters are on {sorted(map(str, devices))}; put them on one device")
    current = next(iter(devices))
    if device is None and current.type == "cpu" and torch.cuda.is_available():
        device = "cuda"
    target = torch.device(device) if device is not None else current
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    # Planned before the model moves: blocks whose weights stream never go to the device whole.
    paging = _paging_choice(model, config, target)
    for kind, message in (paging.events if paging else ()):
        events.append((kind, message))
    if target != current or (paging and paging.paged):
        initial = _place(model, target, paging)
        if target != current:
            events.append(("wrap.device", f"moved the model from {current} to {target}" +
                           (f", except the {len(paging.paged)} blocks whose weights stream"
                            if paging and paging.paged else "")))
    else:
        initial = {}
    client = None
    try:
        topology = _distributed(config["distributed"])
        rank, world = topology.rank, topology.world
        # A fresh name per call: a model's id() is reused once it is gone, a job is not.
        job_id = config["job_id"] or topology.job or f"wrap-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        client = _client.connect(config["socket"], job_id=job_id, rank=rank, world_size=world)
        result = _wrap_connected(model, optimizer, config, client, topology, paging, job_id,
                                 events, initial)
    except BaseException:
        if client is not None:
            client.close()  # a refused or failed wrap leaves nothing behind in the daemon
        # ...and the model keeps its weights: streamed blocks get their values back.
        for p in model.parameters():
            if id(p) in initial:
                p.data = initial[id(p)]
        raise
    initial.clear()  # the daemon's buffers hold these values now
    return result


def _wrap_connected(model: torch.nn.Module, optimizer: Any, config: dict, client: Any,
                    topology: _Topology, paging: Any, job_id: str, events: list, initial: dict):
    rank, world = topology.rank, topology.world
    names = {p: n for n, p in model.named_parameters()}
    moment = config["moment_dtype"]
    moment = "float32" if moment == "auto" else moment
    kwargs = dict(moment_dtype=moment, max_grad_norm=config["max_grad_norm"],
                  gradient_dtype=config["gradient_dtype"], machines=topology.machines,
                  machine_group=topology.machine_group, rank=rank, world_size=world,
                  accumulation_steps=config["accumulation_steps"], nonfinite=config["nonfinite"],
                  client=client, names=names, initial=initial)
    frozen_streamed = sum(p.numel() * p.element_size() for p in
                          (paging.paged_params() if paging else ()) if not p.requires_grad)

    if config["check_memory"]:
        # Admission before anything is allocated: the whole job's host memory is planned with
        # the daemon, which keeps it or refuses now, with the numbers, instead of mid-run.
        planned = _host_bytes(model, moment, config, world, topology.machines) + frozen_streamed
        fp32_bytes = planned
        try:
            try:
                client.plan_host_memory(planned, wait_s=float(config["memory_wait_s"]))
            except ResourceExhaustedError as e:
                if config["moment_dtype"] != "auto":
                    raise
                # moment_dtype="auto": bf16 moments (stochastically rounded) when fp32 ones do
                # not fit; the master weights stay fp32.
                smaller = _host_bytes(model, "bfloat16", config, world,
                                      topology.machines) + frozen_streamed
                planned, moment = smaller, "bfloat16"  # what the refusal below would be about
                client.plan_host_memory(smaller, wait_s=float(config["memory_wait_s"]))
                events.append(("wrap.plan", f"moments in bf16: with fp32 moments this run "
                                            f"needs {fp32_bytes / 2**30:.2f} GiB of host "
                                            f"memory and the daemon refused ({e})"))
                kwargs["moment_dtype"] = moment
        except ResourceExhaustedError as e:
            smaller = "" if moment == "bfloat16" else (
                "moment_dtype='bfloat16' (4 bytes a parameter less), ")
            raise ResourceExhaustedError(
                f"trainstream.wrap: this run needs {planned / 2**30:.2f} GiB of host memory in "
                f"trainstreamd ({moment} moments) and the machine cannot give it: {e}. "
                f"Options: {smaller}memory_wait_s= to wait for other jobs, or "
                "check_memory=False to allocate as it goes") from None
        events.append(("wrap.admitted", f"host memory planned: {planned / 2**30:.2f} GiB for "
                                        f"job {job_id} ({moment} moments)"))

    if optimizer is None:
        groups = [p for p in model.parameters() if p.requires_grad]
        offload = OffloadAdamW(groups, lr=config["lr"], **kwargs)
    elif isinstance(optimizer, OffloadAdamW):
        offload = optimizer
    elif type(optimizer) in (torch.optim.AdamW, torch.optim.Adam):
        for g in optimizer.param_groups:
            for flag in ("amsgrad", "maximize"):
                if g.get(flag):
                    raise ValueError(f"trainstream.wrap: {type(optimizer).__name__}({flag}=True) "
                                     "is not supported")
        kind = "adamw" if type(optimizer) is torch.optim.AdamW else "adam"
        groups = [{k: v for k, v in g.items() if k in ("params", "lr", "betas", "eps",
                                                       "weight_decay")}
                  for g in optimizer.param_groups]
        old_state = optimizer.state_dict()
        offload = OffloadAdamW(groups, kind=kind, **kwargs)
        if old_state["state"]:
            offload.load_state_dict(old_state)
            events.append(("wrap.state", f"migrated {len(old_state['state'])} parameters' "
                                         f"{type(optimizer).__name__} state to the daemon"))
        optimizer.state.clear()  # the moments now live in the daemon only
    else:
        raise ValueError(
            f"trainstream.wrap: optimizer {type(optimizer).__name__} is not supported; use "
            "torch.optim.AdamW, torch.optim.Adam, trainstream.OffloadAdamW or None")
    if world > 1 or topology.machines > 1:
        # Every rank starts from the weights the first rank wrote into the shared master, as
        # DistributedDataParallel starts from rank 0's; across machines, from machine 0's.
        import torch.distributed as dist

        dist.barrier()
        if topology.machines > 1 and rank == 0:
            for i in range(len(offload._params)):
                dist.broadcast(offload._host.master(i), src=0, group=topology.machine_group)
                if offload._host.param(i).data_ptr() != offload._host.master(i).data_ptr():
                    offload._host.param(i).copy_(offload._host.master(i))
            dist.barrier(group=topology.machine_group)
        dist.barrier()
        offload.refresh_weights()
        events.append(("wrap.distributed", f"rank {rank} of {world} on machine "
                                           f"{dist.get_rank() // world} of {topology.machines} "
                                           f"joined job {job_id}: one optimizer state per "
                                           "machine, gradients averaged over every rank"))
    offload.attach_forward_waits(model)
    frozen = _FrozenWeights(client)
    pager = _page_blocks(model, paging, offload, config, events, initial, frozen)
    _keep_daemon_weights_on_load(model, offload, pager)
    session = TrainStreamSession(client=client, optimizer=offload, config=config)
    session.pager = pager
    session.frozen = frozen
    for kind, message in events:
        session.note(kind, message)
    if paging is not None and paging.adaptive and pager is not None:
        session.plan = _adaptive_plan(model, paging, pager, offload, client, session,
                                      planned if config["check_memory"] else None)
        offload._adaptive = session.plan
    if getattr(offload, "_resumed", False):
        session.note("wrap.resumed", f"re-attached to job {job_id}'s optimizer state after "
                     f"{offload.steps} completed steps; the model's weights are the daemon's",
                     steps=offload.steps)
    session.note("wrap.optimizer",
                 f"{'CUDA' if offload._cuda else 'CPU'} model, {len(offload._params)} tensors: "
                 f"optimizer state, gradients and update in trainstreamd (job {job_id}, "
                 f"rank {rank}/{world})", tensors=len(offload._params))
    offload._on_decision = session.note
    offload._vram_headroom = float(config["vram_headroom"])
    if config["offload"] == "auto":
        # Measured over the first steps, then decided (an event says which way).
        offload._switch_when_fits = True
    model._trainstream_session = session
    return model, offload


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Removes the hooks and gives the model ordinary tensors again; returns the model."""
    session = getattr(model, "_trainstream_session", None)
    if session is None:
        raise FailedPreconditionError("this model is not wrapped by trainstream")
    session.optimizer.detach()
    if session.pager is not None and session.pager.hooks:
        session.pager.close()  # activation paging alone is not the optimizer's to undo
    recompute = getattr(session.optimizer, "_recompute", None)
    if recompute is not None:
        recompute.close()
    del model._trainstream_session
    return model


def memory_report(model: torch.nn.Module | None = None) -> dict:
    """What trainstream holds and decided, for a wrapped model (or the GPU alone)."""
    report: dict = {}
    if torch.cuda.is_available():
        report["gpu"] = {"allocated": torch.cuda.memory_allocated(),
                         "reserved": torch.cuda.memory_reserved(),
                         "peak_allocated": torch.cuda.max_memory_allocated()}
    if model is None:
        return report
    session = getattr(model, "_trainstream_session", None)
    if session is None:
        raise FailedPreconditionError("this model is not wrapped by trainstream")
    memory = session.client.memory()
    mine = [r for r in memory.get("by_session", []) if r["key"] == session.client.session_id]
    report["pinned"] = {"daemon_reserved": memory.get("reserved_bytes", 0),
                        "session_bytes": mine[0]["bytes"] if mine else 0}
    report["pinned_by_tag"] = {r["key"]: r["bytes"] for r in memory.get("by_tag", [])}
    report["optimizer"] = session.optimizer.stats()
    pager = session.pager
    report["params"] = {
        "paged_blocks": list(pager.paged) if pager else [],
        "slot_bytes": pager.resident_bytes() if pager else 0,
        "load_bytes": pager.bytes_fetched if pager else 0,  # host to device, since wrap()
    }
    recompute = getattr(session.optimizer, "_recompute", None)
    policy = pager.activation_policy() if pager else []
    if recompute is not None:
        count = len(recompute.blocks)
        policy = policy or ["keep"] * count
        policy = ["recompute" if i in recompute.indices else p for i, p in enumerate(policy)]
    report["activations"] = {
        "policy": policy,
        "offloaded_bytes": pager.bytes_offloaded if pager else 0,  # device to host, since wrap()
        "host_bytes": pager.arena.reserved_bytes if pager and pager.arena else 0,
        "host_refused": pager.arena_refused if pager else None,
    }
    opt = session.optimizer
    offloaded = pager.bytes_offloaded if pager else 0
    to_device = (pager.bytes_fetched if pager else 0) + offloaded + opt.bytes_to_device
    to_host = offloaded + opt.bytes_to_host
    steps = max(1, opt.steps)
    # Since wrap(): streamed weights fetched, activations out and back, gradients out, updated
    # weights back (on a GPU; after a switch to GPU AdamW nothing more crosses).
    report["pcie"] = {"to_device_bytes": to_device, "to_host_bytes": to_host,
                      "steps": opt.steps, "to_device_per_step": to_device // steps,
                      "to_host_per_step": to_host // steps}
    report["activations"]["inflight_waits"] = pager.inflight_waits if pager else 0
    report["plan"] = session.plan.report() if session.plan is not None else None
    report["frozen_host_bytes"] = session.frozen.bytes if session.frozen is not None else 0
    # The daemon's log holds this session's events, wrap()'s own decisions among them (as
    # "client.<kind>"), and the machine-wide ones.
    report["events"] = [e for e in session.client.events()
                        if e.get("session_id") in ("", session.client.session_id)]
    report["config"] = dict(session.config)
    return report
