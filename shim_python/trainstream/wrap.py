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
}


@dataclass
class TrainStreamSession:
    """What ``wrap()`` set up for a model: ``model._trainstream_session``."""

    client: Any
    optimizer: OffloadAdamW
    config: dict
    events: list = field(default_factory=list)
    pager: Any = None  # trainstream.paging.BlockPager when blocks page weights or activations

    @property
    def adapting(self) -> bool:
        """True while offload='auto' is still measuring the first steps."""
        return bool(self.optimizer._switch_when_fits)

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


def _paging_choice(model: torch.nn.Module, config: dict) -> tuple | None:
    """(blocks, weight-paged, activation-paged and recomputed block indices, prefetch depth) for
    param_offload, activation_offload and recompute, or None; checked before anything is set
    up, so a bad choice costs nothing."""
    from .blocks import find_blocks

    weights, acts, again = (config["param_offload"], config["activation_offload"],
                            config["recompute"])
    depth = config["prefetch_depth"]
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"trainstream.wrap: prefetch_depth={depth!r} must be >= 1")
    # "auto": the measured plan (planner.plan_memory) takes these decisions once the probe
    # step is in place; until then every block keeps its weights and activations.
    def is_off(value: Any) -> bool:  # by identity: 0 and 1 are not False and True here
        return value is None or value is False or (isinstance(value, str) and value == "auto")

    for name, value in (("param_offload", weights), ("activation_offload", acts),
                        ("recompute", again)):
        if not (is_off(value) or value is True or isinstance(value, (float, list, tuple))):
            raise ValueError(f"trainstream.wrap: {name}={value!r} is not one of 'auto', True, "
                             "False, a fraction 0.0-1.0" +
                             ("" if name == "activation_offload" else " or a list of block indices"))
    if is_off(weights) and is_off(acts) and is_off(again):
        return None
    blocks = list(config["blocks"]) if config["blocks"] is not None else find_blocks(model)
    if not blocks:
        raise ValueError("trainstream.wrap: param_offload and activation_offload need a repeated "
                         "block stack; none was found (pass blocks=[...])")

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
    # The last block's activations are used as soon as backward starts: they always stay.
    offloaded = chosen("activation_offload", acts, len(blocks) - 1, False)
    recomputed = chosen("recompute", again, len(blocks), True)
    both = sorted((set(paged) | set(offloaded)) & set(recomputed))
    if both:
        raise ValueError(f"trainstream.wrap: blocks {both} are both paged and recomputed; a "
                         "recomputed block keeps no activations to page, and its weights are "
                         "used again in backward: choose one")
    if not paged and not offloaded and not recomputed:
        return None
    frozen = [n for b in paged for n, p in blocks[b].named_parameters() if not p.requires_grad]
    if frozen:
        raise ValueError("trainstream.wrap: paging frozen weights arrives with shared bases; "
                         f"block parameters without gradients: {frozen[:3]}")
    return blocks, paged, offloaded, recomputed, depth


def _page_blocks(model: torch.nn.Module, choice: tuple | None, offload: OffloadAdamW,
                 config: dict, events: list) -> Any:
    """Starts weight and activation paging for the chosen blocks; returns the pager (or
    None)."""
    from .paging import BlockPager
    from .recompute import Recompute

    if choice is None:
        return None
    blocks, paged, offloaded, recomputed, depth = choice
    if recomputed:
        offload._recompute = Recompute(blocks, recomputed)
        events.append(("wrap.recompute", f"{len(recomputed)} of {len(blocks)} blocks recompute "
                                         "their forward in backward instead of keeping "
                                         "activations"))
    if not paged and not offloaded:
        return None
    index = offload._index
    missing = [n for b in paged for n, p in blocks[b].named_parameters() if id(p) not in index]
    if missing:
        raise ValueError("trainstream.wrap: param_offload pages weights the optimizer does not "
                         f"train: {missing[:3]}; pass them to the optimizer or page other blocks")
    arena = None
    if offloaded:
        from .activation_arena import ActivationArena

        client = offload.client
        arena = ActivationArena(
            lambda name, nbytes: client.allocate(name, nbytes, tag="activations"),
            f"activations/{client.session_id}")
    pager = BlockPager(blocks, paged, lambda p: offload._host.param(index[id(p)]), depth,
                       activations=offloaded, min_offload_bytes=int(config["min_offload_bytes"]),
                       arena=arena)
    if paged:
        offload.page_weights(pager)
        # A checkpoint of the model holds the paged weights' host copies, not placeholders.
        names = {id(p): n for n, p in model.named_parameters()}
        paged_names = {names[id(p)]: pager.host[id(p)] for b in paged for p in pager.params[b]
                       if id(p) in names}

        def host_copies(module, state_dict, prefix, local_metadata):
            for name, host in paged_names.items():
                if prefix + name in state_dict:
                    state_dict[prefix + name] = host.detach().clone()

        pager.hooks.append(model._register_state_dict_hook(host_copies))
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


def _keep_daemon_weights_on_load(model: torch.nn.Module, offload: OffloadAdamW,
                                 pager: Any) -> None:
    """model.load_state_dict() on a wrapped model: the daemon's master weights (what the next
    update starts from) take the loaded values too, and paged weights load into their host
    copies."""
    names = {id(p): n for n, p in model.named_parameters()}
    paged = {id(p) for ps in (pager.params.values() if pager else ()) for p in ps}

    def before(state_dict, prefix, *rest):
        offload.synchronize()  # no returning copy may land on top of the loaded values
        for p in offload._params:
            if id(p) in paged:  # a real tensor to load into, for the moment
                p.data = torch.empty(p.shape, dtype=p.dtype, device=p.device)

    def after(module, incompatible):
        with torch.no_grad():
            for i, p in enumerate(offload._params):
                if id(p) not in names:
                    continue
                offload._host.master(i).copy_(p.detach().reshape(p.shape))
                if offload._host.param(i).data_ptr() != offload._host.master(i).data_ptr():
                    offload._host.param(i).copy_(p.detach())
                if id(p) in paged:
                    p.data = pager.placeholders[id(p)]
        if pager is not None:
            pager.weights_changed()

    offload._hooks.append(model._register_load_state_dict_pre_hook(before))
    offload._hooks.append(model.register_load_state_dict_post_hook(after))


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
              "min_offload_bytes": 1 << 20, "recompute": "auto"}
    config.update(options)
    events: list = []

    device = config["device"]
    current = next(model.parameters()).device
    if device is None and current.type == "cpu" and torch.cuda.is_available():
        device = "cuda"
    if device is not None and torch.device(device) != current:
        model.to(device)
        events.append(("wrap.device", f"moved the model from {current} to {device}"))
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise FailedPreconditionError(
            f"the model's parameters are on {sorted(map(str, devices))}; put them on one device")

    paging = _paging_choice(model, config)
    topology = _distributed(config["distributed"])
    rank, world = topology.rank, topology.world
    # A fresh name per call: a model's id() is reused once it is gone, a job is not.
    job_id = config["job_id"] or topology.job or f"wrap-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    client = _client.connect(config["socket"], job_id=job_id, rank=rank, world_size=world)
    try:
        return _wrap_connected(model, optimizer, config, client, topology, paging, job_id, events)
    except BaseException:
        client.close()  # a refused or failed wrap leaves nothing behind in the daemon
        raise


def _wrap_connected(model: torch.nn.Module, optimizer: Any, config: dict, client: Any,
                    topology: _Topology, paging: Any, job_id: str, events: list):
    rank, world = topology.rank, topology.world
    names = {p: n for n, p in model.named_parameters()}
    moment = config["moment_dtype"]
    moment = "float32" if moment == "auto" else moment
    kwargs = dict(moment_dtype=moment, max_grad_norm=config["max_grad_norm"],
                  gradient_dtype=config["gradient_dtype"], machines=topology.machines,
                  machine_group=topology.machine_group, rank=rank, world_size=world,
                  accumulation_steps=config["accumulation_steps"], nonfinite=config["nonfinite"],
                  client=client, names=names)

    if config["check_memory"]:
        # Admission before anything is allocated: the whole job's host memory is planned with
        # the daemon, which keeps it or refuses now, with the numbers, instead of mid-run.
        planned = _host_bytes(model, moment, config, world, topology.machines)
        try:
            client.plan_host_memory(planned, wait_s=float(config["memory_wait_s"]))
        except ResourceExhaustedError as e:
            raise ResourceExhaustedError(
                f"trainstream.wrap: this run needs {planned / 2**30:.2f} GiB of host memory in "
                f"trainstreamd and the machine cannot give it: {e}. Options: "
                "moment_dtype='bfloat16' (4 bytes a parameter less), memory_wait_s= to wait for "
                "other jobs, or check_memory=False to allocate as it goes") from None
        events.append(("wrap.admitted", f"host memory planned: {planned / 2**30:.2f} GiB for "
                                        f"job {job_id}"))

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
    pager = _page_blocks(model, paging, offload, config, events)
    _keep_daemon_weights_on_load(model, offload, pager)
    session = TrainStreamSession(client=client, optimizer=offload, config=config)
    session.pager = pager
    for kind, message in events:
        session.note(kind, message)
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
    # The daemon's log holds this session's events, wrap()'s own decisions among them (as
    # "client.<kind>"), and the machine-wide ones.
    report["events"] = [e for e in session.client.events()
                        if e.get("session_id") in ("", session.client.session_id)]
    report["config"] = dict(session.config)
    return report
