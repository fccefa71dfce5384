# SPDX-License-Identifier: Apache-2.0
"""``trainstream.wrap()``: one line in a PyTorch training loop, and the optimizer state, the
gradients and the update live in trainstreamd."""

from __future__ import annotations

import os
import uuid
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .transport import client as _client
from .memory.block_memory import (FrozenWeights, adaptive_plan, gpu_state,
                                  keep_daemon_weights_on_load, page_blocks, paging_choice,
                                  place_model, restore_streamed)
from .errors import FailedPreconditionError, InvalidArgumentError
from .frozen.linear import BaseLinear
from .memory.blocks import find_blocks, has_forward, shared_host_buffers
from .integrations.chunked_loss import LossSwitch, loss_working_bytes
from .transport.launcher import launcher_topology
from .memory.kv_cache import CacheSwitch
from .optim.offload_adamw import BF16_MOMENTS_REFUSAL, OffloadAdamW
from .memory.planner import staged_block_indices
from .memory.quantization import quantize_model
from .optim.host_plan import admit, job_host_bytes
from .options import WrapOptions
from .inspection import pcie_bytes, session_transfers
from .integrations.attention_backend import AttentionBackend, attention_modules
from .report import memory_report  # noqa: F401  (trainstream.wrap.memory_report, as before)
from .session import TrainStreamSession, attach, session_of


@dataclass
class _Topology:
    rank: int = 0            # this process's rank on its machine
    world: int = 1           # ranks on this machine
    machines: int = 1
    machine_group: Any = None  # the process group of every machine's rank 0
    job: str = ""


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
    local_rank, local_world, run = launcher_topology(os.environ, dist.get_rank(), world)
    if os.environ.get("TRAINSTREAM_SHM") == "0":
        # No shared host memory between ranks: each rank is a job of its own in the daemon
        # (its own copy of the state), as one machine of many is, and every rank all-reduces
        # its gradients with the others over gloo before its daemon updates.
        group = dist.new_group(list(range(world)), backend="gloo")
        return _Topology(0, 1, world, group, f"{run}-rank{dist.get_rank()}")
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
    return _Topology(local_rank, local_world, machines, group, run)


def wrap(model: torch.nn.Module, optimizer: Any = None, **options: Any):
    """Trains ``model`` through trainstreamd; returns ``(model, optimizer)``.

    ``optimizer`` may be ``torch.optim.AdamW``, ``torch.optim.Adam``, a
    :class:`trainstream.OffloadAdamW`, or ``None`` (one is made with ``lr``). Its
    hyper-parameters, groups and state move to the daemon. See the README for the options.
    """
    config = WrapOptions.from_call(options, model)
    if session_of(model) is not None:
        raise FailedPreconditionError(
            "this model is already wrapped; call trainstream.unwrap(model) first")
    events: list = []

    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise FailedPreconditionError(
            f"the model's parameters are on {sorted(map(str, devices))}; put them on one device")

    # Training builds no key/value cache (kv_cache.py says why); unwrap() turns it back on.
    cache_switch = CacheSwitch(model)
    if cache_switch.count:
        events.append(("wrap.use_cache", "use_cache=False in training forwards (as "
                       "transformers sets it under gradient checkpointing): a key/value cache "
                       "built in a training step holds every layer's keys to the step's end, "
                       "and a recomputed layer's checkpoint would keep each step's graph alive "
                       "through it. Passed to each training call; the model's config is left "
                       "as it is (generation under no_grad, and other models sharing the "
                       "config, keep its use_cache); unwrap() stops it"))
    loss_switch = LossSwitch(model) if config.memory.chunked_loss else None
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
    session_of(model).cache_switch = cache_switch
    session_of(model).loss_switch = loss_switch
    return model, offload


def _wrap_on(model: torch.nn.Module, optimizer: Any, config: WrapOptions, events: list):
    """wrap() once its options are checked and the model's key/value cache is off."""
    device = config.connection.device
    current = next(iter({p.device for p in model.parameters()}))
    if device is None and current.type == "cpu" and torch.cuda.is_available():
        device = "cuda"
    target = torch.device(device) if device is not None else current
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())

    quantize = config.quantization.quantize
    if quantize == "auto":
        quantize = _auto_quantization(model, config, target, events)
    from .frozen.fp8_matmul import outlier_fraction, supported

    outliers = config.quantization.outliers
    if outlier_fraction(outliers):
        chose = " (quantize='auto' chose " + repr(quantize) + ")" if (
            config.quantization.quantize == "auto") else ""
        if quantize != "fp8":
            raise InvalidArgumentError(
                f"trainstream.wrap: outliers={outliers!r} splits FP8 tensor-core "
                f"matmuls of frozen weights; it needs quantize='fp8'{chose}")
        ok, why = supported(target)
        if not ok:
            raise FailedPreconditionError(
                f"trainstream.wrap: outliers={outliers!r} splits FP8 tensor-core "
                f"matmuls, which {target} cannot run ({why}): pass outliers=0")
    if quantize not in (None, False, "none"):
        # Frozen Linear weights only, before the plan sees the model: it plans their stored size.
        # The block stack's frozen layers, as TrainStream 0.6 quantizes: a frozen output head
        # (and the embeddings) stay as they are.
        done = quantize_model(model, quantize, blocks=config.memory.blocks,
                              block_size=config.quantization.quant_block_size,
                              outliers=config.quantization.outliers)
        events.append(("wrap.quantize", f"{done['tensors']} frozen linear layers quantized to "
                                        f"{quantize} in this process "
                                        f"({done['bytes_before'] / 2**20:.1f} MiB -> "
                                        f"{done['bytes_after'] / 2**20:.1f} MiB; a frozen "
                                        "output head stays as it is; load_base() and "
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
        topology = _distributed(config.connection.distributed)
        rank, world = topology.rank, topology.world
        # A fresh name per call: a model's id() is reused once it is gone, a job is not.
        job_id = (config.connection.job_id or topology.job
                  or f"wrap-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        client = _client.connect(config.connection.socket, job_id=job_id, rank=rank,
                                 world_size=world)
        result = _wrap_connected(model, optimizer, config, client, topology, paging, job_id,
                                 events, initial)
    except BaseException:
        if client is not None:
            # A refused or failed wrap leaves nothing behind in the daemon: not even a job to
            # re-attach to, when it made that job (one it resumed stays).
            client.close(end_job=getattr(client, "made_job", False))
        # ...and the model keeps its weights: streamed blocks get their values back.
        restore_streamed(model, initial)
        raise
    initial.clear()  # the daemon's buffers hold these values now
    return result


def _auto_quantization(model: torch.nn.Module, config: WrapOptions, target: torch.device,
                       events: list) -> str | None:
    """quantize="auto": the format the frozen linear weights are stored in (None: as they are),
    chosen as quantize_choice describes, and an event saying why."""
    from .memory import quantization
    from .memory.block_memory import vram_budget

    blocks = list(config.memory.blocks) if config.memory.blocks is not None else find_blocks(model)
    if quantization.frozen_linear_count(model, blocks) == 0:
        events.append(("wrap.quantize", "quantize='auto': no frozen linear weights to quantize "
                                        "(those of the block stack are; a frozen output head "
                                        "stays as it is)"))
        return None
    on_device = sum(t.numel() * t.element_size() for t in
                    list(model.parameters()) + list(model.buffers()) if t.device == target)
    budget = vram_budget(target, config.memory, on_device).bytes
    if budget is None:
        events.append(("wrap.quantize", "quantize='auto': weights kept as they are (a "
                                        f"{target.type} run has no VRAM budget to plan for; "
                                        "vram_budget= sets one)"))
        return None
    auto = [isinstance(v, str) and v == "auto"
            for v in (config.memory.activation_offload, config.memory.recompute)]
    moment = "float32" if config.optimizer.moment_dtype == "auto" else config.optimizer.moment_dtype
    ranks = (launcher_topology(os.environ, 0, 1)[1] if "LOCAL_WORLD_SIZE" in os.environ
             or "SLURM_NTASKS_PER_NODE" in os.environ else 1)

    def host_room() -> int:
        # What the daemon has free, less what the trainable state will take there.
        with _client.connect(config.connection.socket, job_id=f"wrap-quantize-{os.getpid()}") as c:
            memory = c.memory()
            free = int(memory.get("budget_bytes", 0)) - int(memory.get("committed_bytes", 0))
            return free - job_host_bytes(c, model, moment, config.optimizer, ranks, 1)

    weights = config.memory.param_offload
    if not (weights is False or (isinstance(weights, str) and weights == "auto")):
        events.append(("wrap.quantize", "quantize='auto': weights kept as they are "
                                        f"(param_offload={weights!r} streams blocks as asked)"))
        return None
    options = quantization.candidates(model, blocks, budget, config.memory.prefetch_depth,
                                         all(auto) and len(blocks) >= 2, host_room,
                                         config.quantization.quant_block_size,
                                         may_stream=weights is not False)
    chosen = quantization.choose(options, config.quantization.prefer)
    fmt = chosen.fmt
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # Every rank must hold the same weights: the most compact any rank needed.
        picked = [None] * dist.get_world_size()
        dist.all_gather_object(picked, quantization.CANDIDATES.index(fmt))
        fmt = quantization.CANDIDATES[max(picked)]
    message = quantization.explain(options, chosen, budget, len(blocks), config.quantization.prefer)
    if fmt != chosen.fmt:
        message += f"; stored as {fmt}, as another rank needed"
    events.append(("wrap.quantize", message))
    return fmt


def _wrap_connected(model: torch.nn.Module, optimizer: Any, config: WrapOptions, client: Any,
                    topology: _Topology, paging: Any, job_id: str, events: list, initial: dict):
    rank, world = topology.rank, topology.world
    names = {p: n for n, p in model.named_parameters()}
    moment = config.optimizer.moment_dtype
    moment = "float32" if moment == "auto" else moment
    asked = config.optimizer
    kwargs = dict(moment_dtype=moment, max_grad_norm=asked.max_grad_norm,
                  gradient_dtype=asked.gradient_dtype, machines=topology.machines,
                  machine_group=topology.machine_group, rank=rank, world_size=world,
                  accumulation_steps=asked.accumulation_steps, nonfinite=asked.nonfinite,
                  client=client, names=names, initial=initial, threads=asked.threads,
                  eager=asked.eager, mode=asked.optimizer_mode)
    # Each frozen tensor of a streamed block gets a host buffer of its own (block_memory),
    # but a shared base's stored bytes, read where the base holds them.
    shared = shared_host_buffers(model) if paging else set()
    frozen_streamed = [max(t.numel() * t.element_size(), 1) for t in
                       (paging.paged_tensors() if paging else ())
                       if not t.requires_grad and id(t) not in shared]
    chose_bf16 = ""  # why moment_dtype="auto" chose bf16 moments, if it did
    planned = None
    if config.memory.check_memory:
        admitted = admit(client, model, moment, config, world, topology.machines,
                         frozen_streamed, job_id, events)
        planned, chose_bf16 = admitted.planned, admitted.chose_bf16
        kwargs["moment_dtype"] = admitted.moment

    if optimizer is None:
        groups = [p for p in model.parameters() if p.requires_grad]
        offload = OffloadAdamW(groups, lr=config.optimizer.lr, **kwargs)
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
                                           "machine, gradients averaged over every rank"
                                           + (" (TRAINSTREAM_SHM=0: each rank a machine of its "
                                              "own, its own copy of the state)"
                                              if os.environ.get("TRAINSTREAM_SHM") == "0"
                                              else "")))
    # Only a block the model calls has a forward to hook (a ModuleList of a layer's parts is
    # iterated, not called: its parts keep hooks of their own).
    offload.attach_forward_waits(model, [b for b in _block_stack(model, config, paging)
                                         if has_forward(b)])
    frozen = FrozenWeights(client)
    pager, recompute = page_blocks(model, paging, offload, config, events, initial, frozen)
    keep_daemon_weights_on_load(model, offload, pager)
    if config.compatibility.peer is not None and config.compatibility.peer is not False:
        events.append(("wrap.peer", _peer_off(config.compatibility.peer, world, topology.machines)))
    session = TrainStreamSession(client=client, optimizer=offload, config=config)
    session.vram_target = paging.budget if paging is not None else None
    session.pager = pager
    session.recompute = recompute
    session.frozen = frozen
    if config.memory.attention is not None:
        session.attention = AttentionBackend(config.memory.attention, session.note)
        session.attention.install(attention_modules(model, _block_stack(model, config, paging)))
    for kind, message in events:
        session.note(kind, message)
    for module in model.modules():  # an fp8 base's layers say how they multiply
        if isinstance(module, BaseLinear):
            module.note = session.note
    if config.memory.gpu_state_blocks == "auto" and offload.is_cuda:
        refusal = offload.gpu_state_refusal()
        if refusal is not None:
            session.note("plan.gpu_state", f"the optimizer state stays in trainstreamd: {refusal}")
    if paging is not None and paging.adaptive and pager is not None:
        session.plan = adaptive_plan(
            model, paging, pager, offload, client, session,
            planned if config.memory.check_memory else None,
            lambda head_weight, tokens: loss_working_bytes(model, head_weight, tokens))
        offload.configure(memory_plan=session.plan)
    else:
        # No run-time plan to decide them: the blocks asked for move now.
        # ("auto" decides nothing without measurements: none move.)
        asked = [v if v != "auto" else 0
                 for v in (config.memory.gpu_state_blocks, config.memory.staged_state_blocks)]
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
                 f"{'CUDA' if offload.is_cuda else 'CPU'} model, "
                 f"{len(offload.trained_params)} tensors: "
                 f"optimizer state, gradients and update in trainstreamd (job {job_id}, "
                 f"rank {rank}/{world})", tensors=len(offload.trained_params))
    mode, why, figures = offload.mode_decision
    if mode == "gpu":
        why += (f": {offload.staged_state_elements:,} elements updated in place by the GPU, "
                f"{offload.host_updated_elements():,} by trainstreamd (streamed weights, "
                "other dtypes)")
    session.note("optimizer.mode", why, **figures)
    # offload="auto" measures over the first steps, then decides (an event says which way).
    offload.configure(on_decision=session.note, vram_headroom=float(config.memory.vram_headroom),
                      switch_when_fits=config.optimizer.offload == "auto" or None)
    session.transfer_report = offload.register_step_post_hook(_transfer_reporter(session))
    attach(model, session)
    return model, offload


def _peer_off(peer: Any, world: int, machines: int) -> str:
    """Why ``peer=`` (TrainStream 0.6's pooling of frozen blocks in the GPUs' VRAM, copied GPU
    to GPU) is off for this job."""
    if world * machines <= 1:
        why = ("this job is one process on one GPU: pooling frozen blocks across GPUs needs "
               "data-parallel ranks on two or more GPUs of one machine, so there is no peer "
               "to copy from")
    else:
        why = ("trainstream does not pool frozen blocks across GPUs: the ranks of this "
               "machine share one host copy of a base in trainstreamd (load_base), and "
               "attach_base(gpu_pool=True) keeps one VRAM copy per GPU for every process there")
    return f"peer={peer!r}: peer-GPU pooling is off: {why}"


def _transfer_reporter(session: TrainStreamSession) -> Any:
    """A step hook that hands this process's PCIe totals to the session's heartbeats, which
    carry them to the daemon's metrics (a native call, no round trip). It holds the session
    weakly: the optimizer must not keep it alive."""
    ref = weakref.ref(session)

    def report(optimizer: Any, args: Any, kwargs: Any) -> None:
        live = ref()
        if live is not None:
            live.client.set_transfer_totals(*pcie_bytes(live))
    return report


def _block_stack(model: torch.nn.Module, config: WrapOptions, paging: Any) -> list:
    """The repeated blocks: the memory plan's, else blocks=, else those find_blocks finds."""
    if paging is not None:
        return paging.blocks
    return list(config.memory.blocks) if config.memory.blocks is not None else find_blocks(model)


def _check_gpu_state(model: torch.nn.Module, offload: OffloadAdamW, config: WrapOptions,
                     paging: Any, chose_bf16: str = "") -> None:
    """gpu_state_blocks=N and staged_state_blocks=N ask for what this job can have, or wrap()
    says why not (before any hook of wrap()'s own is on the model). ``chose_bf16``: why
    moment_dtype="auto" chose bf16 moments, said with a refusal of them."""
    held, staged = (v if v != "auto" else 0
                    for v in (config.memory.gpu_state_blocks, config.memory.staged_state_blocks))
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
        refusal = (offload.gpu_state_refusal() if option == "gpu_state_blocks"
                   else offload.staged_state_refusal())
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
    session = session_of(model)
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
    if session.attention is not None:
        session.attention.remove()
    for module in model.modules():  # no layer keeps the session alive
        if isinstance(module, BaseLinear):
            module.note = None
    if session.cache_switch is not None:
        session.cache_switch.restore()
    if session.loss_switch is not None:
        session.loss_switch.restore()
    if getattr(session, "plan", None) is not None:
        session.plan.probe.large_blocks.restore()
    if session.transfer_report is not None:
        session.transfer_report.remove()
    attach(model, None, retire=session_transfers)
    return model


