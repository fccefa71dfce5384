# SPDX-License-Identifier: Apache-2.0
"""``trainstream.wrap()``: one line in a PyTorch training loop, and the optimizer state, the
gradients and the update live in trainstreamd."""

from __future__ import annotations

import os
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .transport import client as _client
from .memory.block_memory import (FrozenWeights, adaptive_plan, gpu_state,
                           keep_daemon_weights_on_load, page_blocks, paging_choice, place_model)
from .errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError
from .frozen.linear import BaseLinear, attached_base, quantize_model
from .memory.blocks import find_blocks, has_forward
from .frozen.gpu_pool import gpu_pools
from .integrations.chunked_loss import LossSwitch, loss_working_bytes
from .memory.kv_cache import CacheSwitch
from .optim.offload_adamw import BF16_MOMENTS_REFUSAL, MOMENT_DTYPES, NONFINITE, OffloadAdamW
from .memory.planner import staged_block_indices

# Options wrap() accepts, with the values each takes; naming any other is an error rather than
# silently ignored.
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
    "quantize": (None, False, "none", "auto", "int8", "nf4", "fp8", "nvfp4"),
    "prefer": ("exact", "speed"),
    "quant_block_size": "0 (the format's default) or an even number of values per scale",
    "gpu_state_blocks": "'auto', or an integer >= 0: the first N blocks, and the parameters "
                        "outside the stack, keep their AdamW state in VRAM (0: none)",
    "staged_state_blocks": "'auto', or an integer >= 0: that many of the blocks after those "
                           "are updated on the GPU with their moments staged from the "
                           "daemon's memory (0: none)",
    "chunked_loss": (True, False),
}


@dataclass
class TrainStreamSession:
    """What ``wrap()`` set up for a model: ``model._trainstream_session``."""

    client: Any
    optimizer: OffloadAdamW
    config: dict
    events: list = field(default_factory=list)
    pager: Any = None  # memory.pager.BlockPager when blocks page weights or activations
    recompute: Any = None  # memory.recompute.Recompute when blocks may recompute their forward
    plan: Any = None   # trainstream.adaptive_plan.AdaptivePlan when the memory plan adapts
    frozen: Any = None  # host copies of frozen weights that stream
    cache_switch: Any = None  # the model configs whose use_cache wrap() turned off
    loss_switch: Any = None   # the models whose causal-LM loss wrap() computes in chunks

    @property
    def adapting(self) -> bool:
        """True while offload='auto' is still measuring the first steps."""
        return self.optimizer.switch_pending or bool(self.plan and self.plan.adapting)

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
            raise InvalidArgumentError(
                f"trainstream.wrap: unknown option {name!r}; accepted: {', '.join(sorted(_ACCEPTED))}")
        accepted = _ACCEPTED[name]
        if isinstance(accepted, tuple):
            ok = value in accepted or (name in ("moment_dtype", "gradient_dtype")
                                       and value in MOMENT_DTYPES)
            if not ok:
                raise InvalidArgumentError(
                    f"trainstream.wrap: {name}={value!r} is not one of {accepted}")
    steps = options.get("accumulation_steps", 1)
    if not isinstance(steps, int) or steps < 1:
        raise InvalidArgumentError(
            f"trainstream.wrap: accumulation_steps={steps!r} must be an integer >= 1")
    wait = options.get("memory_wait_s", 0.0)
    if not (isinstance(wait, (int, float)) and 0 <= wait <= 3600):
        raise InvalidArgumentError(
            f"trainstream.wrap: memory_wait_s={wait!r} must be seconds in [0, 3600]")
    headroom = options.get("vram_headroom", 0.10)
    if not (isinstance(headroom, (int, float)) and 0 <= headroom < 1):
        raise InvalidArgumentError(
            f"trainstream.wrap: vram_headroom={headroom!r} must be a float in [0, 1)")
    for name in ("max_inflight_bytes", "host_arena"):
        value = options.get(name)
        if value is None or value is False or (name == "host_arena" and value == "auto"):
            continue
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise InvalidArgumentError(
                f"trainstream.wrap: {name}={value!r} must be " +
                ("None or bytes > 0" if name == "max_inflight_bytes" else
                 "'auto', False or bytes > 0"))
    block = options.get("quant_block_size", 0)
    if not (isinstance(block, int) and not isinstance(block, bool) and block >= 0
            and block % 2 == 0):
        raise InvalidArgumentError(
            f"trainstream.wrap: quant_block_size={block!r} must be 0 or an even "
            "number of values")
    for option in ("gpu_state_blocks", "staged_state_blocks"):
        count = options.get(option, 0)
        if not (count == "auto" or (isinstance(count, int) and not isinstance(count, bool)
                                    and count >= 0)):
            raise InvalidArgumentError(
                f"trainstream.wrap: {option}={count!r} must be 'auto' or an "
                "integer >= 0")
    budget = options.get("vram_budget")
    if budget is not None and not (isinstance(budget, int) and not isinstance(budget, bool)
                                   and budget > 0):
        raise InvalidArgumentError(
            f"trainstream.wrap: vram_budget={budget!r} must be None or bytes > 0")
    norm = options.get("max_grad_norm")
    if norm is not None and not (isinstance(norm, (int, float)) and norm > 0):
        raise InvalidArgumentError(
            f"trainstream.wrap: max_grad_norm={norm!r} must be None or a float > 0")


@dataclass
class _Topology:
    rank: int = 0            # this process's rank on its machine
    world: int = 1           # ranks on this machine
    machines: int = 1
    machine_group: Any = None  # the process group of every machine's rank 0
    job: str = ""


def _host_bytes(client: Any, model: torch.nn.Module, moment: Any, config: dict, ranks: int,
                machines: int, other_buffers: Sequence[int] = ()) -> int:
    """The host memory the daemon will hold for this job, as the daemon counts it with the code
    that allocates it: the optimizer's state for each trainable tensor (master, moments, a
    model-dtype copy, a gradient slot per rank, a summing buffer), plus ``other_buffers`` (the
    frozen weights streamed from host memory), each placed into segments as the arena will."""
    from .transport.host_optimizer import ParameterSpec, estimate_host_memory
    from .optim.offload_adamw import GRADIENT_DTYPES, MOMENT_DTYPES

    grad_dtype = GRADIENT_DTYPES.get(config["gradient_dtype"]) if config["gradient_dtype"] else None
    cuda = next(model.parameters()).is_cuda
    trainable = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    specs = [ParameterSpec(f"p{i}", tuple(p.shape), p.dtype, grad_dtype or p.dtype)
             for i, p in enumerate(trainable)]
    # CUDA gradients are summed over micro-steps in the daemon (OffloadAdamW's choice).
    accumulation = config["accumulation_steps"] if cuda else 1
    return estimate_host_memory(client, specs, MOMENT_DTYPES[moment], accumulation, machines,
                                ranks, other_buffers).bytes


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
              "distributed": None, "verbose": False, "lr": 1e-3, "nonfinite": "guard",
              "job_id": "", "socket": None, "vram_headroom": 0.10, "gradient_dtype": None,
              "check_memory": True, "memory_wait_s": 0.0, "param_offload": "auto",
              "blocks": None, "prefetch_depth": 1, "activation_offload": "auto",
              "min_offload_bytes": 1 << 20, "recompute": "auto", "vram_budget": None,
              "max_inflight_bytes": None, "host_arena": "auto", "profile": True,
              "quantize": None, "quant_block_size": 0, "prefer": "exact",
              "gpu_state_blocks": "auto", "staged_state_blocks": "auto",
              "chunked_loss": True}
    config.update(options)
    events: list = []

    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise FailedPreconditionError(
            f"the model's parameters are on {sorted(map(str, devices))}; put them on one device")

    # Training builds no key/value cache (kv_cache.py says why); unwrap() turns it back on.
    cache_switch = CacheSwitch(model)
    if cache_switch.count:
        events.append(("wrap.use_cache", "use_cache=False while training (as transformers sets "
                       "it under gradient checkpointing): a key/value cache built in a training "
                       "step holds every layer's keys to the step's end, and a recomputed "
                       "layer's checkpoint would keep each step's graph alive through it; "
                       "unwrap() turns it back on"))
    loss_switch = LossSwitch(model) if config["chunked_loss"] else None
    if loss_switch is not None and loss_switch.switched:
        events.append(("wrap.loss", "the causal-LM loss is computed from the logits in chunks "
                       "of positions: backward keeps the logits and their gradient in their "
                       "own dtype instead of the whole fp32 log-softmax and its gradients "
                       "(about 12 bytes a logit); the loss and gradients are the same sums; "
                       "chunked_loss=False keeps transformers' own"))
    try:
        model, offload = _wrap_on(model, optimizer, config, events)
    except BaseException:
        cache_switch.restore()
        if loss_switch is not None:
            loss_switch.restore()
        raise
    model._trainstream_session.cache_switch = cache_switch
    model._trainstream_session.loss_switch = loss_switch
    return model, offload


def _wrap_on(model: torch.nn.Module, optimizer: Any, config: dict, events: list):
    """wrap() once its options are checked and the model's key/value cache is off."""
    device = config["device"]
    current = next(iter({p.device for p in model.parameters()}))
    if device is None and current.type == "cpu" and torch.cuda.is_available():
        device = "cuda"
    target = torch.device(device) if device is not None else current
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())

    quantize = config["quantize"]
    if quantize == "auto":
        quantize = _auto_quantization(model, config, target, events)
    if quantize not in (None, False, "none"):
        # Frozen Linear weights only, before the plan sees the model: it plans their stored size.
        done = quantize_model(model, quantize, config["quant_block_size"])
        events.append(("wrap.quantize", f"{len(done)} frozen linear layers quantized to "
                                        f"{quantize} in this process (load_base() and "
                                        "attach_base() share one copy between processes)"))
    # Planned before the model moves: blocks whose weights stream never go to the device whole.
    paging = paging_choice(model, config, target)
    for kind, message in (paging.events if paging else ()):
        events.append((kind, message))
    if target != current or (paging and paging.paged):
        initial = place_model(model, target, paging)
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
            # A refused or failed wrap leaves nothing behind in the daemon: not even a job to
            # re-attach to, when it made that job (one it resumed stays).
            client.close(end_job=getattr(client, "made_job", False))
        # ...and the model keeps its weights: streamed blocks get their values back.
        for p in model.parameters():
            if id(p) in initial:
                p.data = initial[id(p)]
        raise
    initial.clear()  # the daemon's buffers hold these values now
    return result


def _auto_quantization(model: torch.nn.Module, config: dict, target: torch.device,
                       events: list) -> str | None:
    """quantize="auto": the format the frozen linear weights are stored in (None: as they are),
    chosen as quantize_choice describes, and an event saying why."""
    from .memory import quantization
    from .memory.block_memory import vram_budget

    if quantization.frozen_linear_count(model) == 0:
        events.append(("wrap.quantize", "quantize='auto': no frozen linear weights to quantize"))
        return None
    on_device = sum(t.numel() * t.element_size() for t in
                    list(model.parameters()) + list(model.buffers()) if t.device == target)
    budget = vram_budget(target, config, on_device)
    if budget is None:
        events.append(("wrap.quantize", "quantize='auto': weights kept as they are (a "
                                        f"{target.type} run has no VRAM budget to plan for; "
                                        "vram_budget= sets one)"))
        return None
    blocks = list(config["blocks"]) if config["blocks"] is not None else find_blocks(model)
    auto = [isinstance(config[k], str) and config[k] == "auto"
            for k in ("activation_offload", "recompute")]
    moment = "float32" if config["moment_dtype"] == "auto" else config["moment_dtype"]
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    def host_room() -> int:
        # What the daemon has free, less what the trainable state will take there.
        with _client.connect(config["socket"], job_id=f"wrap-quantize-{os.getpid()}") as c:
            memory = c.memory()
            free = int(memory.get("budget_bytes", 0)) - int(memory.get("committed_bytes", 0))
            return free - _host_bytes(c, model, moment, config, ranks, 1)

    weights = config["param_offload"]
    if not (weights is False or (isinstance(weights, str) and weights == "auto")):
        events.append(("wrap.quantize", "quantize='auto': weights kept as they are "
                                        f"(param_offload={weights!r} streams blocks as asked)"))
        return None
    options = quantization.candidates(model, blocks, budget, config["prefetch_depth"],
                                         all(auto) and len(blocks) >= 2, host_room,
                                         config["quant_block_size"],
                                         may_stream=weights is not False)
    chosen = quantization.choose(options, config["prefer"])
    fmt = chosen.fmt
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # Every rank must hold the same weights: the most compact any rank needed.
        picked = [None] * dist.get_world_size()
        dist.all_gather_object(picked, quantization.CANDIDATES.index(fmt))
        fmt = quantization.CANDIDATES[max(picked)]
    message = quantization.explain(options, chosen, budget, len(blocks), config["prefer"])
    if fmt != chosen.fmt:
        message += f"; stored as {fmt}, as another rank needed"
    events.append(("wrap.quantize", message))
    return fmt


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
    # Each frozen tensor of a streamed block gets a host buffer of its own (block_memory).
    frozen_streamed = [max(p.numel() * p.element_size(), 1) for p in
                       (paging.paged_params() if paging else ()) if not p.requires_grad]
    chose_bf16 = ""  # why moment_dtype="auto" chose bf16 moments, if it did

    if config["check_memory"]:
        # Admission before anything is allocated: the whole job's host memory is planned with
        # the daemon, which keeps it or refuses now, with the numbers, instead of mid-run.
        planned = _host_bytes(client, model, moment, config, world, topology.machines,
                              frozen_streamed)
        fp32_bytes = planned
        try:
            try:
                client.plan_host_memory(planned, wait_s=float(config["memory_wait_s"]))
            except ResourceExhaustedError as e:
                if config["moment_dtype"] != "auto":
                    raise
                # moment_dtype="auto": bf16 moments (stochastically rounded) when fp32 ones do
                # not fit; the master weights stay fp32.
                smaller = _host_bytes(client, model, "bfloat16", config, world,
                                      topology.machines, frozen_streamed)
                planned, moment = smaller, "bfloat16"  # what the refusal below would be about
                client.plan_host_memory(smaller, wait_s=float(config["memory_wait_s"]))
                chose_bf16 = (f"with fp32 moments this run needs {fp32_bytes / 2**30:.2f} "
                              f"GiB of host memory and the daemon refused ({e})")
                events.append(("wrap.plan", f"moments in bf16: {chose_bf16}"))
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
                    raise InvalidArgumentError(
                        f"trainstream.wrap: {type(optimizer).__name__}({flag}=True) "
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
    else:
        raise InvalidArgumentError(
            f"trainstream.wrap: optimizer {type(optimizer).__name__} is not supported; use "
            "torch.optim.AdamW, torch.optim.Adam, trainstream.OffloadAdamW or None")
    try:
        # (An OffloadAdamW passed in keeps the moments it was made with.)
        _check_gpu_state(model, offload, config, paging,
                         chose_bf16 if offload is not optimizer else "")
    except ValueError:
        if offload is not optimizer:
            offload.detach()  # the model keeps no hook of an optimizer wrap() made
        raise
    if type(optimizer) in (torch.optim.AdamW, torch.optim.Adam):
        optimizer.state.clear()  # the moments now live in the daemon only
    if world > 1 or topology.machines > 1:
        # Every rank starts from the weights the first rank wrote into the shared master, as
        # DistributedDataParallel starts from rank 0's; across machines, from machine 0's.
        import torch.distributed as dist

        dist.barrier()
        if topology.machines > 1 and rank == 0:
            host = offload.host
            for i in range(len(offload.trained_params)):
                dist.broadcast(host.master(i), src=0, group=topology.machine_group)
                if host.param(i).data_ptr() != host.master(i).data_ptr():
                    host.param(i).copy_(host.master(i))
            dist.barrier(group=topology.machine_group)
        dist.barrier()
        offload.refresh_weights()
        events.append(("wrap.distributed", f"rank {rank} of {world} on machine "
                                           f"{dist.get_rank() // world} of {topology.machines} "
                                           f"joined job {job_id}: one optimizer state per "
                                           "machine, gradients averaged over every rank"))
    # Only a block the model calls has a forward to hook (a ModuleList of a layer's parts is
    # iterated, not called: its parts keep hooks of their own).
    offload.attach_forward_waits(model, [b for b in _block_stack(model, config, paging)
                                         if has_forward(b)])
    frozen = FrozenWeights(client)
    pager, recompute = page_blocks(model, paging, offload, config, events, initial, frozen)
    keep_daemon_weights_on_load(model, offload, pager)
    session = TrainStreamSession(client=client, optimizer=offload, config=config)
    session.pager = pager
    session.recompute = recompute
    session.frozen = frozen
    for kind, message in events:
        session.note(kind, message)
    for module in model.modules():  # an fp8 base's layers say how they multiply
        if isinstance(module, BaseLinear):
            module.note = session.note
    if config["gpu_state_blocks"] == "auto" and offload.is_cuda:
        refusal = offload.gpu_state_refusal()
        if refusal is not None:
            session.note("plan.gpu_state", f"the optimizer state stays in trainstreamd: {refusal}")
    if paging is not None and paging.adaptive and pager is not None:
        session.plan = adaptive_plan(
            model, paging, pager, offload, client, session,
            planned if config["check_memory"] else None,
            lambda head_weight, tokens: loss_working_bytes(model, head_weight, tokens))
        offload.configure(memory_plan=session.plan)
    else:
        # No run-time plan to decide them: the blocks asked for move now.
        # ("auto" decides nothing without measurements: none move.)
        asked = [config[k] if config[k] != "auto" else 0
                 for k in ("gpu_state_blocks", "staged_state_blocks")]
        if any(asked):
            held, staged = gpu_state(model, _block_stack(model, config, paging), offload,
                                     *asked)
            said = []
            if asked[0]:
                said.append(f"the AdamW state of blocks 0-{asked[0] - 1} and of the "
                            f"parameters outside the stack ({held:,} elements) lives in VRAM")
            if asked[1]:
                said.append(f"{asked[1]} blocks after those ({staged:,} elements) are updated "
                            "on the GPU from moments staged out of trainstreamd")
            session.note("plan.gpu_state", "; ".join(said) + ", as asked (gpu_state_blocks, "
                         "staged_state_blocks)", gpu_state_elements=held,
                         staged_elements=staged)
    if offload.resumed:
        behind = getattr(offload, "behind_on_resume", [])
        lagging = (f"; {len(behind)} tensors' state is older than that (kept in VRAM by a "
                   "process that ended without unwrap() or a checkpoint since, or without "
                   "gradients since): they resume from their last step in trainstreamd"
                   if behind else "")
        session.note("wrap.resumed", f"re-attached to job {job_id}'s optimizer state after "
                     f"{offload.steps} completed steps; the model's weights are the daemon's"
                     f"{lagging}", steps=offload.steps, behind_tensors=len(behind))
        if behind:
            warnings.warn(f"trainstream.wrap: {lagging[2:]}", stacklevel=2)
    session.note("wrap.optimizer",
                 f"{'CUDA' if offload.is_cuda else 'CPU'} model, {len(offload.trained_params)} tensors: "
                 f"optimizer state, gradients and update in trainstreamd (job {job_id}, "
                 f"rank {rank}/{world})", tensors=len(offload.trained_params))
    # offload="auto" measures over the first steps, then decides (an event says which way).
    offload.configure(on_decision=session.note, vram_headroom=float(config["vram_headroom"]),
                      switch_when_fits=config["offload"] == "auto" or None)
    model._trainstream_session = session
    return model, offload


def _block_stack(model: torch.nn.Module, config: dict, paging: Any) -> list:
    """The repeated blocks: the memory plan's, else blocks=, else those find_blocks finds."""
    if paging is not None:
        return paging.blocks
    return list(config["blocks"]) if config["blocks"] is not None else find_blocks(model)


def _check_gpu_state(model: torch.nn.Module, offload: OffloadAdamW, config: dict,
                     paging: Any, chose_bf16: str = "") -> None:
    """gpu_state_blocks=N and staged_state_blocks=N ask for what this job can have, or wrap()
    says why not (before any hook of wrap()'s own is on the model). ``chose_bf16``: why
    moment_dtype="auto" chose bf16 moments, said with a refusal of them."""
    held, staged = (config[k] if config[k] != "auto" else 0
                    for k in ("gpu_state_blocks", "staged_state_blocks"))
    if not held and not staged:
        return
    n = len(_block_stack(model, config, paging))
    # Blocks streamed because param_offload asked (those the plan streamed at wrap() for the
    # probe come back when the state moves: it never streams blocks updated on the GPU).
    asked_streaming = (set(paging.paged) if paging is not None and not paging.weights_auto
                       else set())
    for option, count, room, too_many, indices, keeps in (
            ("gpu_state_blocks", held, n, f"the model has {n} blocks", range(held),
             "a block updated in VRAM keeps its weights there"),
            ("staged_state_blocks", staged, n - held,
             f"{n - held} blocks are left after those whose state is in VRAM (gpu_state_blocks)",
             staged_block_indices(n, held, staged), "a staged block keeps its weights in VRAM")):
        if not count:
            continue
        refusal = offload.gpu_state_refusal()
        if refusal == BF16_MOMENTS_REFUSAL and chose_bf16:
            # bf16 moments the user did not ask for: say why they are.
            refusal += (f"; moment_dtype='auto' chose bf16 moments: {chose_bf16}. Free host "
                        "memory for fp32 moments, or ask for no state in VRAM")
        if refusal is not None:
            raise InvalidArgumentError(f"trainstream.wrap: {option}={count}: {refusal}")
        if count > room:
            raise InvalidArgumentError(f"trainstream.wrap: {option}={count} but {too_many}")
        streamed = sorted(asked_streaming & set(indices))
        if streamed:
            raise InvalidArgumentError(
                f"trainstream.wrap: {option}={count} but blocks {streamed} stream "
                f"their weights (param_offload): {keeps}")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Removes the hooks and gives the model ordinary tensors again; returns the model."""
    session = getattr(model, "_trainstream_session", None)
    if session is None:
        raise FailedPreconditionError("this model is not wrapped by trainstream")
    session.optimizer.detach()
    if session.pager is not None and session.pager.hooks:
        session.pager.close()  # activation paging alone is not the optimizer's to undo
    left = getattr(session.pager, "left_on_host_bytes", 0) if session.pager else 0
    if left:
        warnings.warn(f"trainstream.unwrap: {left / 2**30:.2f} GiB of streamed weights do not fit "
                      "in VRAM and stay on the CPU; the model is split between the two devices",
                      stacklevel=2)
    if session.recompute is not None:
        session.recompute.close()
    for module in model.modules():  # no layer keeps the session alive
        if isinstance(module, BaseLinear):
            module.note = None
    if session.cache_switch is not None:
        session.cache_switch.restore()
    if session.loss_switch is not None:
        session.loss_switch.restore()
    if getattr(session, "plan", None) is not None:
        session.plan.large_blocks.restore()
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
    recompute = session.recompute
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
    # The CPU time trainstream's hooks took, by hook: what the client adds to the thread that
    # issues the GPU's work (a paged step that waits on the CPU is slowed by it).
    hooks = {**opt.clock.report(opt.steps), **(pager.clock.report(opt.steps) if pager else {})}
    report["hooks"] = {"per_hook": hooks,
                       "ms_per_step": round(sum(h["ms_per_step"] for h in hooks.values()), 3)}
    report["plan"] = session.plan.report() if session.plan is not None else None
    report["frozen_host_bytes"] = session.frozen.bytes if session.frozen is not None else 0
    layers = [m for m in model.modules() if isinstance(m, BaseLinear) and m.matmul_choice]
    if layers:  # an fp8 base: how its layers multiply (see BaseLinear)
        report["fp8_matmul"] = {
            "scaled_mm": sum(m.matmul_choice["path"] == "scaled_mm" for m in layers),
            "dequantize": sum(m.matmul_choice["path"] == "dequantize" for m in layers),
            # (out, in, path, why, FP8 tensor cores ms, dequantize ms): the times where timed
            "choices": sorted({(m.out_features, m.in_features, m.matmul_choice["path"],
                                m.matmul_choice["why"], m.matmul_choice.get("scaled_mm_ms"),
                                m.matmul_choice.get("dequantize_ms")) for m in layers},
                              key=str)}
    base, gpu_base = attached_base(model)
    if base is not None:  # attach_base(): the frozen weights are the daemon's shared copy
        info = base.info()
        report["base"] = {"id": base.id, "name": base.name, "format": base.format,
                          "stored_bytes": base.stored_bytes, "users": int(info["users"])}
    if gpu_base is not None:  # attach_base(gpu_pool=True): the base read in place from VRAM
        report["gpu_pool"] = gpu_base.report()
        report["gpu_pool"]["importers"] = next(
            (len(p.get("importers", [])) for p in gpu_pools(gpu_base.base.client)["pools"]
             if int(p["pool_id"]) == gpu_base.pool_id), 0)
    if os.path.exists("/proc/self/smaps"):
        from .frozen.store import mapped_segments
        report["mapped_segments"] = mapped_segments()
    # The daemon's log holds this session's events, wrap()'s own decisions among them (as
    # "client.<kind>"), and the machine-wide ones.
    report["events"] = [e for e in session.client.events()
                        if e.get("session_id") in ("", session.client.session_id)]
    report["config"] = dict(session.config)
    return report
