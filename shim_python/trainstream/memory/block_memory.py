# SPDX-License-Identifier: Apache-2.0
"""The block stack's memory under ``wrap()``: which blocks stream their weights (planned
against the VRAM budget before the model moves), where the model's tensors go, the host copies
of streamed frozen weights, the pager and recompute set up for the chosen blocks, blocks that
start or stop streaming between steps, ``load_state_dict`` reaching streamed weights, and the
run-time plan (``adaptive_plan.AdaptivePlan``) wired to the optimizer and the daemon."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import InvalidArgumentError
from ..optim.offload_adamw import OffloadAdamW
from ..options import MemoryOptions, WrapOptions
from .blocks import shared_host_buffers, streamed_tensors
from .planner import staged_block_indices
from .weight_plan import weight_plan
from ..optim.staged_adamw import slots_bytes


@dataclass
class PagingChoice:
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
    others_bytes: int = 0    # VRAM the process held besides the model at wrap()

    def paged_tensors(self) -> list:
        """What the streamed blocks move: parameters, and quantized layers' stored bytes."""
        return [t for b in self.paged for t in streamed_tensors(self.blocks[b])]


# The least VRAM the budget leaves free, whatever share vram_headroom names: what the caching
# allocator's rounding can strand in reserved but unusable memory, a few of the 20 MiB
# segments it cuts tensors of 1 to 10 MiB from. Under a 296 MiB cap a TinyGPT step ran out of
# memory asking for 20 MiB with 28 MiB reserved but free: the 10% headroom is 30 MiB there
# (H200, 2026-12-03).
_ALLOCATOR_SLACK_BYTES = 64 << 20


@dataclass(frozen=True)
class VramBudget:
    """The VRAM a run may plan for (None: none to plan against, a CPU run), and what this
    process held besides the model when it was taken (another model, a cache: it stays)."""

    bytes: int | None
    others_bytes: int = 0


def vram_budget(device: torch.device, memory: MemoryOptions, model_bytes: int = 0) -> VramBudget:
    """The VRAM this run may plan for: vram_budget= if given; on CUDA, what this process may use
    (torch's per-process fraction, and what other processes leave free) less the headroom
    (vram_headroom's share, 64 MiB at least) and what it holds besides the model
    (``model_bytes`` of it on ``device``)."""
    if memory.vram_budget is not None:
        return VramBudget(int(memory.vram_budget))
    if device.type != "cuda":
        return VramBudget(None)
    total = torch.cuda.get_device_properties(device).total_memory
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    limit = total * (float(getter(device)) if getter is not None else 1.0)
    free, _ = torch.cuda.mem_get_info(device)
    limit = min(limit, free + torch.cuda.memory_reserved(device))
    _make_matmul_workspaces(device)
    # Tensors this process holds besides the model's (another model, a cache) stay where they are.
    others = max(0, torch.cuda.memory_allocated(device) - model_bytes)
    headroom = max(float(memory.vram_headroom) * limit, _ALLOCATOR_SLACK_BYTES)
    return VramBudget(max(0, int(limit - headroom - others)), others)


def _make_matmul_workspaces(device: torch.device) -> None:
    """cuBLAS takes a workspace (32 MiB on Hopper) from the caching allocator for each handle
    and stream at their first matmul, and keeps it: made here, on the stream the model will run
    on, the forward's and backward's are counted with what the process already holds instead
    of appearing in the first step (a fresh process's first backward under a 263 MiB cap asked
    for one and ran out of memory, H200, 2026-12-03)."""
    x = torch.ones(8, 8, device=device, dtype=torch.bfloat16, requires_grad=True)
    # Forward on this thread's cuBLAS handle, backward on autograd's device thread's: a
    # workspace each.
    torch.nn.functional.linear(x, x, x[0]).float().sum().backward()


def paging_choice(model: torch.nn.Module, config: WrapOptions,
                  device: torch.device) -> PagingChoice | None:
    """The block stack's paging and recompute, from param_offload, activation_offload and
    recompute (each "auto" by default: planned against the VRAM budget); checked before anything
    is set up, so a bad choice costs nothing. None when nothing pages, recomputes or adapts."""
    from .blocks import find_blocks, has_forward

    # Their kinds of value, and prefetch_depth, were checked with wrap()'s other options
    # (options.py); which blocks a list names is checked here, against the stack.
    weights, acts, again = (config.memory.param_offload, config.memory.activation_offload,
                            config.memory.recompute)
    depth = config.memory.prefetch_depth

    def is_auto(value: Any) -> bool:
        return isinstance(value, str) and value == "auto"

    def is_off(value: Any) -> bool:  # by identity: 0 and 1 are not False and True here
        return value is None or value is False or is_auto(value)
    on_device = sum(t.numel() * t.element_size() for t in
                    list(model.parameters()) + list(model.buffers()) if t.device == device)
    measured = vram_budget(device, config.memory, on_device)
    budget = measured.bytes
    planned = budget is not None and (is_auto(weights) or (is_auto(acts) and is_auto(again)))
    if is_off(weights) and is_off(acts) and is_off(again) and not planned:
        return None
    explicit = config.memory.blocks is not None
    blocks = list(config.memory.blocks) if explicit else find_blocks(model)
    uncalled = [i for i, b in enumerate(blocks) if not has_forward(b)]
    if uncalled:
        raise InvalidArgumentError(
            f"trainstream.wrap: blocks[{uncalled[0]}] is a {type(blocks[uncalled[0]]).__name__} "
            "without a forward of its own: a block must be a module the model calls (its "
            "weights are bound and its activations paged around that call); pass the layers "
            "themselves")
    if not blocks:
        if not (is_off(weights) and is_off(acts) and is_off(again)):
            raise InvalidArgumentError(
                "trainstream.wrap: param_offload, activation_offload and recompute "
                "need a repeated block stack; none was found (pass blocks=[...])")
        return None

    def chosen(name: str, value: Any, count: int) -> list:
        if is_off(value):
            return []
        if value is True:
            return list(range(count))
        if isinstance(value, float):
            return list(range(round(value * count)))
        picked = sorted(set(int(i) for i in value))
        if picked and not (0 <= picked[0] and picked[-1] < len(blocks)):
            raise InvalidArgumentError(
                f"trainstream.wrap: {name}={value!r} names blocks outside "
                f"0..{len(blocks) - 1}")
        return picked

    paged = chosen("param_offload", weights, len(blocks))
    events = []
    if is_auto(weights) and budget is not None:
        paged = weight_plan(model, blocks, budget, depth,
                            probe=is_auto(acts) and is_auto(again) and len(blocks) >= 2)
        if paged:
            events.append(("wrap.plan", f"{len(paged)} of {len(blocks)} blocks stream their "
                                        f"weights: the weights do not fit in the "
                                        f"{budget / 2**30:.2f} GiB VRAM budget otherwise"))
    # The last block's activations are used as soon as backward starts: they always stay.
    offloaded = chosen("activation_offload", acts, len(blocks) - 1)
    recomputed = chosen("recompute", again, len(blocks))
    both = sorted((set(paged) | set(offloaded)) & set(recomputed))
    if both:
        raise InvalidArgumentError(
            f"trainstream.wrap: blocks {both} are both paged and recomputed; a "
            "recomputed block keeps no activations to page, and its weights are "
            "used again in backward: choose one")
    adaptive = budget is not None and is_auto(acts) and is_auto(again) and len(blocks) >= 2
    if not (paged or offloaded or recomputed or adaptive):
        return None
    return PagingChoice(blocks, paged, offloaded, recomputed, depth, budget, adaptive,
                        is_auto(weights), events, measured.others_bytes)


def place_model(model: torch.nn.Module, device: torch.device,
                paging: PagingChoice | None) -> dict:
    """Moves the model to ``device`` except the weights of blocks that stream (parameters, and
    quantized layers' stored bytes): those stay where they are (a model bigger than VRAM is
    built on the CPU) and get a placeholder on the device; returns their values by tensor id,
    for the host copies (:func:`restore_streamed` puts them back if wrap() fails)."""
    streamed = {id(t) for t in paging.paged_tensors()} if paging else set()
    initial = {}

    def stay(t: torch.Tensor) -> None:
        if id(t) not in initial:
            initial[id(t)] = t.data
            t.data = torch.zeros((), dtype=t.dtype, device=device).expand(t.shape)

    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in streamed:
                stay(p)
            elif p.device != device:
                p.data = p.data.to(device)
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and id(buf) in streamed:
                stay(buf)
            elif buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
    return initial


def restore_streamed(model: torch.nn.Module, initial: dict) -> None:
    """A refused or failed wrap(): the tensors place_model() left on the host get their values
    back."""
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in initial:
            t.data = initial[id(t)]


class FrozenWeights:
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


def page_blocks(model: torch.nn.Module, choice: PagingChoice | None, offload: OffloadAdamW,
                 config: WrapOptions, events: list, initial: dict,
                 frozen: FrozenWeights) -> tuple:
    """Starts weight and activation paging and recompute for the chosen blocks; returns the
    pager and the recompute (each None when there is none)."""
    from .pager import BlockPager
    from .recompute import Recompute

    if choice is None:
        return None, None
    blocks, paged, offloaded, recomputed, depth = (choice.blocks, choice.paged, choice.offloaded,
                                                   choice.recomputed, choice.depth)
    recompute = None
    if recomputed or choice.adaptive:
        recompute = Recompute(blocks, recomputed)
        if recomputed:
            events.append(("wrap.recompute", f"{len(recomputed)} of {len(blocks)} blocks "
                                             "recompute their forward in backward instead of "
                                             "keeping activations"))
    if not paged and not offloaded and not choice.adaptive:
        return None, recompute
    names = {id(p): n for n, p in [*model.named_parameters(), *model.named_buffers()]}
    shared = shared_host_buffers(model)

    def host_copy(p: torch.Tensor) -> torch.Tensor:
        i = offload.index_of(p)
        if i is not None:
            return offload.host.param(i)
        if id(p) in shared:
            # Stored bytes of a shared base in its host memory (keep_on_host, a CPU run, a
            # random base): read where they are, pinned by the client's registration.
            return shared[id(p)]
        # A frozen weight: its own daemon buffer, filled once.
        return frozen.copy(p, _safe(names.get(id(p), f"param{id(p)}")),
                           initial.get(id(p), p.data))

    client = offload.client

    def arena():
        from .activation_arena import ActivationArena

        if config.memory.host_arena is None or config.memory.host_arena is False:
            return None  # private pinned memory
        return ActivationArena(
            lambda name, nbytes: client.allocate(name, nbytes, tag="activations"),
            f"activations/{client.session_id}",
            cap=0 if config.memory.host_arena == "auto" else int(config.memory.host_arena))

    device = next(iter(offload.trained_params)).device
    inflight = config.memory.max_inflight_bytes
    if inflight is None:
        inflight = min(1 << 30, (choice.budget or (10 << 30)) // 10)
    pager = BlockPager(blocks, [], host_copy, depth,
                       min_offload_bytes=int(config.memory.min_offload_bytes), arena=arena,
                       device=device, max_inflight_bytes=int(inflight))
    stream_weights(offload, pager, paged)
    pager.set_activation_blocks(offloaded)
    # A checkpoint of the model holds the paged weights' host copies, not placeholders.

    def host_copies(module, state_dict, prefix, local_metadata):
        for b in pager.paged:
            for p in pager.weights.params[b]:
                key = prefix + names.get(id(p), "")
                if key in state_dict:
                    state_dict[key] = pager.weights.host[id(p)].detach().clone()

    pager.hooks.append(model._register_state_dict_hook(host_copies))
    if paged:
        moved = sum(t.numel() * t.element_size() for b in paged for t in pager.weights.params[b])
        slots = pager.weights
        events.append(("wrap.param_offload",
                       f"{len(paged)} of {len(blocks)} blocks stream their weights from host "
                       f"memory ({moved / 2**30:.2f} GiB; {len(slots.slots)} device slots of "
                       f"{slots.slot_bytes / 2**20:.1f} MiB, prefetch depth {depth})"))
    if offloaded:
        events.append(("wrap.activation_offload",
                       f"{len(offloaded)} of {len(blocks)} blocks page their saved activations "
                       f"to host memory (those of {config.memory.min_offload_bytes} bytes and up)"))
    return pager, recompute


def stream_weights(offload: OffloadAdamW, pager: Any, blocks: list) -> None:
    """Blocks start streaming their weights: the optimizer stops returning their updates to the
    device (nothing may still be copying there), then the pager frees their device memory."""
    if not blocks:
        return
    streamed = {id(p) for b in blocks for p in pager.blocks[b].parameters()}
    offload.stop_returning(streamed)
    pager.page_weights(blocks)
    offload.page_weights(pager)


def unstream_weights(offload: OffloadAdamW, pager: Any, blocks: list) -> None:
    """Blocks keep their weights in VRAM again: device tensors with the current values first,
    then the optimizer copies their updates there."""
    if not blocks:
        return
    ids = {id(p) for b in blocks for p in pager.weights.params.get(b, ())}
    pager.unpage_weights(blocks)
    offload.resume_returning(ids)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name) or "param"


def keep_daemon_weights_on_load(model: torch.nn.Module, offload: OffloadAdamW,
                                pager: Any) -> None:
    """model.load_state_dict() on a wrapped model: the daemon's master weights (what the next
    update starts from) take the loaded values too, and paged weights load into their host
    copies."""
    names = {id(p): n for n, p in model.named_parameters()}
    streamed: list = []

    def before(state_dict, prefix, *rest):
        # The parameters of blocks that stream now (the plan may have changed them since
        # wrap()); quantized layers' stored bytes are not in a state dict.
        streamed[:] = [p for ps in (pager.weights.params.values() if pager else ()) for p in ps
                       if isinstance(p, torch.nn.Parameter)]
        offload.synchronize()  # no returning copy may land on top of the loaded values
        for p in streamed:  # a real tensor to load into, for the moment (frozen ones too),
            # holding the current value for keys the state dict leaves out
            p.data = pager.weights.host[id(p)].to(p.device, copy=True)

    def after(module, incompatible):
        with torch.no_grad():
            for i, p in enumerate(offload.trained_params):
                if id(p) in names:
                    offload.weights_to_daemon(i)
            for p in streamed:
                if offload.index_of(p) is None:  # frozen: its host copy takes the value
                    pager.weights.host[id(p)].copy_(p.detach())
                p.data = pager.weights.placeholders[id(p)]
        if pager is not None:
            pager.weights_changed()

    offload.add_hook(model._register_load_state_dict_pre_hook(before))
    offload.add_hook(model.register_load_state_dict_post_hook(after))


def adaptive_plan(model: torch.nn.Module, paging: PagingChoice, pager: Any,
                  offload: OffloadAdamW, client: Any, session: Any, planned: int | None,
                  loss_bytes: Callable[[torch.Tensor, int], int]) -> Any:
    """The run-time plan: probe step, then the planner's choices, then the watchdog.
    ``loss_bytes(head_weight, tokens)``: the loss's working memory for a step of ``tokens``
    (the loss is the integration's: chunked or the model's own)."""
    from .adaptive import AdaptivePlan
    from .plan_setup import PlanActions, PlanReadings, PlanSettings

    inside = {id(t) for blk in paging.blocks for t in streamed_tensors(blk)}
    # Outside the blocks: parameters, and the stored bytes of quantized (or shared-base) layers
    # held on the GPU, a head of a shared base say; the wrap-time plan counts them too.
    other = sum(t.numel() * t.element_size() for t in streamed_tensors(model)
                if id(t) not in inside and (isinstance(t, torch.nn.Parameter) or t.is_cuda))
    link = 0.0
    if pager.cuda and session.config.memory.profile:
        from ..transport.hardware import profile_hardware

        gpu = profile_hardware().get("gpu") or {}
        link = 1e9 * min(gpu.get("h2d_gbps", 0.0), gpu.get("d2h_gbps", 0.0))

    # The optimizer's own PCIe traffic a step: gradients out, updated weights back (streamed
    # blocks' updates stay on the host: their fetches are counted by the plan).
    grads = sum(p.numel() * torch.tensor([], dtype=dtype).element_size()
                for p, dtype in zip(offload.trained_params, offload.gradient_dtypes))

    def transfers() -> tuple:
        return offload.returned_bytes(), grads

    def host_free() -> int:
        memory = client.memory()
        return int(memory.get("budget_bytes", 0)) - int(memory.get("committed_bytes", 0))

    def host_pass() -> tuple:
        # The last step's pass: the workers' busy time over their count, and what it covered.
        info = offload.host.info()
        seconds = info.last_step.update_seconds if info.last_step is not None else 0.0
        seconds /= max(1, info.threads)
        return seconds, offload.host_updated_elements()

    option = session.config.memory.gpu_state_blocks
    staged_option = session.config.memory.staged_state_blocks
    refusal = offload.gpu_state_refusal()
    if refusal is not None:
        option = staged_option = 0
    if offload.staged_state_refusal() is not None or offload.updates_on_gpu:
        staged_option = 0  # optimizer_mode="gpu": mapped updates need no staging slots
    # Only fp32 weights may keep their state in VRAM (the master weights of others are the
    # daemon's); each updated on the host moves its gradient out and itself back a step.
    trainable_outside = sum(p.numel() for p in offload.trained_params
                            if id(p) not in inside and p.dtype == torch.float32)
    update_transfer = (4, offload.gradient_dtype.itemsize if offload.gradient_dtype else 4)

    frozen_at_wrap = session.frozen.bytes
    arena = session.config.memory.host_arena
    arena_cap = arena if type(arena) is int else 0  # host_arena= bytes (not "auto" or False)

    def plan_host(activation_bytes: int) -> None:
        # The job's plan from wrap(), with the activations paged now and the frozen weights'
        # host copies made since (blocks the plan streamed).
        if planned is not None:  # check_memory=False: allocated as it goes
            client.plan_host_memory(planned + activation_bytes +
                                    session.frozen.bytes - frozen_at_wrap)

    settings = PlanSettings(
        budget=int(paging.budget), other_weight_bytes=int(other), prefetch_depth=paging.depth,
        link_bytes_per_s=float(link), weights_fixed=not paging.weights_auto,
        others_bytes=int(paging.others_bytes), host_cap=int(arena_cap), gpu_state=option,
        staged_state=staged_option, staged_vram=int(slots_bytes()),
        # Micro-steps add up in a staged parameter's own gradient.
        staged_grad_bytes=4 if offload.accumulation_steps > 1 else 0,
        other_trainable=int(trainable_outside), update_transfer=tuple(update_transfer))
    actions = PlanActions(
        stream_weights=lambda blocks: stream_weights(offload, pager, blocks),
        unstream_weights=lambda blocks: unstream_weights(offload, pager, blocks),
        plan_host=plan_host, note=session.note,
        set_gpu_state=lambda blocks, staged: gpu_state(model, paging.blocks, offload, blocks,
                                                       staged))
    readings = PlanReadings(host_free=host_free, transfer_bytes=transfers, host_pass=host_pass,
                            updates_after_backward=offload.updates_after_backward)
    plan = AdaptivePlan(paging.blocks, pager, session.recompute, settings, actions, readings)
    handle = _room_for_probe(model, plan, loss_bytes)
    if handle is not None:
        offload.add_hook(handle)  # unwrap() before any step removes it
    return plan


def _room_for_probe(model: torch.nn.Module, plan: Any,
                    loss_bytes: Callable[[torch.Tensor, int], int]) -> Any:
    """For a model with an output head (a language model's logits), the probe step's size is
    read as its forward starts and the plan makes room for its loss (see
    ProbeStep.make_room). Once, at the first forward with gradients."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    vocab, hidden = weight.shape

    def before_forward(module, args, kwargs):
        if not torch.is_grad_enabled():
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        if isinstance(ids, torch.Tensor):
            tokens = ids.numel()
        elif isinstance(embeds, torch.Tensor):
            tokens = embeds.numel() // embeds.shape[-1]
        else:
            tokens = 0
        plan.probe.make_room(tokens, int(vocab), int(hidden),  # may refuse the step
                             loss_bytes(weight, tokens))
        handle.remove()

    handle = model.register_forward_pre_hook(before_forward, with_kwargs=True)
    return handle


def gpu_state(model: torch.nn.Module, blocks: list, offload: OffloadAdamW, count: int,
              staged: int = 0) -> tuple:
    """Keeps the AdamW state of the first ``count`` blocks, and of the parameters outside the
    stack with them, in VRAM (none for 0), and updates ``staged`` of the blocks after them on
    the GPU from moments staged out of the daemon (planner.staged_block_indices); returns the
    elements of each."""
    chosen = {id(p) for b in blocks[:count] for p in b.parameters()}
    if count:
        inside = {id(p) for b in blocks for p in b.parameters()}
        chosen |= {id(p) for p in model.parameters() if id(p) not in inside}
    stage = {id(p) for i in staged_block_indices(len(blocks), count, staged)
             for p in blocks[i].parameters()}
    held = offload.keep_state_on_device(chosen, stage)
    return held, offload.staged_state_elements
