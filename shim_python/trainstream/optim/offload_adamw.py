# SPDX-License-Identifier: Apache-2.0
"""``OffloadAdamW``: a ``torch.optim`` drop-in whose state and update live in trainstreamd.

Gradients leave as backward produces them (``register_post_accumulate_grad_hook``); the daemon
updates each tensor as soon as every rank's gradient for it is in; the updated weights come
back before they are used. CPU models keep their weights and gradients in the daemon's shared
memory itself, so nothing is copied; CUDA models copy each gradient out (small ones on the
compute stream, large ones on a side stream) and a native thread announces it once it landed;
updates come back on a stream of their own, and a module's forward waits only for its own
parameters' copies.
"""

from __future__ import annotations

import os
import uuid
import warnings
from typing import Any, Iterable

import torch

from ..transport import client as _client
from ..transport import device as cuda_device
from ..errors import FailedPreconditionError, InvalidArgumentError
from ..hooks import HookClock, weak_hook
from ..transport.host_optimizer import HostOptimizer, ParameterSpec
from ..transport.launcher import this_machines_ranks
from .checkpoints import Checkpoints
from .gpu_switch import AutoOffload
from .gradients import GradientRouter, Traffic, in_backward, reduce_across_machines
from .groups import daemon_group, safe_name
from .iteration import Iteration
from .parameters import ParameterTable
from .pass_options import check_pass_options
from .placement import (BF16_MOMENTS_REFUSAL, StatePlacement, UpdateRules, gpu_update_refusal,
                        unregister_exit_return)
from .returns import DeviceReturns
from .surface import LayerSurface
from .update_mode import check_mode, decide_mode

MOMENT_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, torch.float32: torch.float32,
                 torch.bfloat16: torch.bfloat16}
# "guard" (the default): see nonfinite_guard.py and the daemon's NONFINITE_GUARD.
NONFINITE = ("guard", "ignore", "skip", "error")
GRADIENT_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                   "bf16": torch.bfloat16, torch.float32: torch.float32,
                   torch.bfloat16: torch.bfloat16}
__all__ = ["BF16_MOMENTS_REFUSAL", "GRADIENT_DTYPES", "MOMENT_DTYPES", "NONFINITE", "OffloadAdamW"]


class OffloadAdamW(LayerSurface, Checkpoints, torch.optim.Optimizer):
    """AdamW (``kind="adam"``: Adam) with fp32 master weights and moments in trainstreamd.

    ``params``, ``lr``, ``betas``, ``eps`` and ``weight_decay`` as for ``torch.optim.AdamW``.
    Keyword options: ``moment_dtype`` (``"float32"``, ``"bfloat16"``), ``max_grad_norm``
    (global-norm clipping inside the optimizer), ``compute_grad_norm`` (report it without
    clipping, in ``last_grad_norm``), ``accumulation_steps`` (backward passes per ``step()``),
    ``nonfinite`` (``"guard"``: a step stops updating at its first non-finite gradient value
    and says so; ``"ignore"``, ``"skip"``, ``"error"``), ``client`` (default:
    :func:`trainstream.connect`), ``job_id``, ``rank``, ``world_size``, ``names`` (a dict from
    parameter to name, for messages and checkpoints), ``mode`` (``"cpu"``, ``"gpu"``:
    mapped_adamw.py, ``"auto"``: update_mode.py). TrainStream 0.6's ``distributed``,
    ``threads``, ``chunk_elems``, ``eager`` and ``pin_moments``: see pass_options.py and the
    README.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, kind: str = "adamw",
                 moment_dtype: Any = "float32", max_grad_norm: float | None = None,
                 compute_grad_norm: bool = False, accumulation_steps: int = 1,
                 nonfinite: str = "guard", client: Any = None, job_id: str = "",
                 rank: int = 0, world_size: int = 1, names: dict | None = None,
                 switch_when_fits: bool = False, vram_headroom: float = 0.10,
                 on_decision: Any = None, gradient_dtype: Any = None, machines: int = 1,
                 machine_group: Any = None, initial: dict | None = None, mode: str = "cpu",
                 distributed: bool = False, threads: int | None = None,
                 chunk_elems: int | None = None, eager: bool | None = None,
                 pin_moments: bool | None = None):
        check_mode(mode)
        check_pass_options(threads, chunk_elems, eager, pin_moments)
        if distributed:
            rank, world_size, job_id = this_machines_ranks(job_id)
        if moment_dtype not in MOMENT_DTYPES:
            raise InvalidArgumentError(
                f"moment_dtype {moment_dtype!r} is not one of 'float32', "
                "'bfloat16', torch.float32 or torch.bfloat16")
        if nonfinite not in NONFINITE:
            raise InvalidArgumentError(f"nonfinite {nonfinite!r} is not one of {NONFINITE}")
        if int(accumulation_steps) < 1:
            raise InvalidArgumentError(
                f"accumulation_steps must be an integer >= 1, got {accumulation_steps}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        self.accumulation_steps = int(accumulation_steps)
        all_params = [p for g in self.param_groups for p in g["params"]]
        trained = [p for p in all_params if p.requires_grad]
        if not trained:
            raise InvalidArgumentError("no trainable parameters to optimize")
        first = trained[0]
        self._cuda = first.is_cuda
        # optimizer_mode: refused or decided before the daemon is asked (update_mode.py).
        self.mode_decision = decide_mode(mode, gpu_update_refusal(
            self._cuda, world_size, machines, nonfinite, trained), trained,
            MOMENT_DTYPES.get(moment_dtype, torch.float32))
        for p in trained:
            if p.device != first.device:
                raise InvalidArgumentError(
                    f"parameters on {first.device} and {p.device}: put the model on one device")
        group_of = {id(p): k for k, g in enumerate(self.param_groups) for p in g["params"]}
        names = names or {}
        if gradient_dtype is not None:
            if gradient_dtype not in GRADIENT_DTYPES:
                raise InvalidArgumentError(
                    f"gradient_dtype {gradient_dtype!r} is not one of None, "
                    "'float32', 'bfloat16', torch.float32 or torch.bfloat16")
            if not self._cuda:
                raise InvalidArgumentError(
                    "gradient_dtype applies to CUDA models (a CPU model's gradients "
                    "accumulate in place, in the parameters' dtype)")
            gradient_dtype = GRADIENT_DTYPES[gradient_dtype]
        self._names = names
        # gradient_dtype: the dtype gradients cross PCIe in and reach the host optimizer in
        # (cast on the GPU, on the copy stream); the master weights and moments keep their own
        # precision.
        self.table = ParameterTable(all_params, gradient_dtype)
        specs = [ParameterSpec(safe_name(names.get(p, f"param{i}")), tuple(p.shape), p.dtype,
                               self.table.grad_dtypes[i], group_of[id(p)])
                 for i, p in enumerate(self.table.params)]
        if client is None and not job_id and world_size == 1:
            # Independent optimizers of one process are independent jobs; ranks of one job
            # name theirs (wrap() derives it from the launcher).
            job_id = f"adamw-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.client = client or _client.connect(job_id=job_id, rank=rank, world_size=world_size)
        # The daemon's side (its master weights, moments and gradient slots per parameter).
        # CUDA gradients leave VRAM at every backward, so the daemon sums the micro-steps; CPU
        # gradients accumulate in place in their shared slots and the daemon sees one.
        self.host = HostOptimizer(
            self.client, specs, groups=[daemon_group(g) for g in self.param_groups], kind=kind,
            moment_dtype=MOMENT_DTYPES[moment_dtype], max_grad_norm=max_grad_norm or 0.0,
            report_grad_norm=compute_grad_norm, nonfinite=nonfinite,
            accumulation_steps=self.accumulation_steps if self._cuda else 1, machines=machines,
            threads=threads or 0, chunk_elements=chunk_elems or 0, defer_updates=eager is False,
            eager_updates=eager is True)
        # Several machines: this machine's rank 0 all-reduces the machine's summed gradients
        # with the other machines' rank 0s (machine_group) before each update.
        self._machines = int(machines)
        self._machine_group = machine_group
        self._leader = machines > 1 and rank == 0
        # Streamed weights wrap() left on the CPU: their values come from ``initial`` (the
        # parameters hold device placeholders), and no update is ever copied to them.
        initial = initial or {}
        # Whether this process made the job's state (wrap() ends such a job if it is refused).
        self.client.made_job = bool(self.host.initialize)
        if self.host.initialize:
            self.host.load_weights([initial.get(id(p), p).detach().float().cpu()
                                    for p in self.table.params])
        elif world_size == 1:
            # Re-attaching to a job's state (a restarted process): the daemon's weights win.
            self._resumed = True
            info = self.host.info()
            # Tensors whose state is older than the job's step: kept in VRAM by a process that
            # ended without unwrap() or a checkpoint since (or without gradients since).
            self.behind_on_resume = [i for i, steps in enumerate(info.param_steps)
                                     if 0 < steps < info.step]
        self.rules = UpdateRules(
            cuda=self._cuda, kind=kind, world_size=world_size, machines=int(machines),
            nonfinite=nonfinite, moment_dtype=MOMENT_DTYPES[moment_dtype],
            max_grad_norm=float(max_grad_norm or 0.0),
            reports_norm=bool(max_grad_norm) or compute_grad_norm, eager=eager)
        self._pushed = [daemon_group(g) for g in self.param_groups]
        self._hooks: list = []
        self.clock = HookClock()            # the CPU time its hooks take (memory_report)
        copy_stream = torch.cuda.Stream(first.device) if self._cuda else None
        self._device_index = cuda_device.device_index(first.device) if self._cuda else -1
        self.traffic = Traffic()            # bytes over PCIe each way, since construction
        self._iteration = Iteration()
        self.gradients = GradientRouter(
            host=self.host, table=self.table, iteration=self._iteration,
            accumulation_steps=self.accumulation_steps, device_index=self._device_index,
            copy_stream=copy_stream, traffic=self.traffic, clock=self.clock,
            first_gradient=self._iteration_begins,
            held_gradient=lambda i, p: self.placement.final_held_gradient(i, p),
            backward_ended=self._flush_staged)
        self.last_grad_norm: float | None = None
        self._pager: Any = None             # weight paging (trainstream.memory.pager.BlockPager)
        self._adaptive: Any = None          # the run-time memory plan (memory/adaptive.py)
        self._world_size = world_size
        self._on_decision = on_decision or (lambda kind, message, **numbers: None)
        # CUDA: each updated parameter is copied back by the native side the moment the daemon
        # announces it (during backward and the rest of the update), not after the whole step.
        self.table.paged = {i for i, p in enumerate(self.table.params) if id(p) in initial}
        self.returns = DeviceReturns(
            host=self.host, table=self.table, iteration=self._iteration,
            device_index=self._device_index, copy_stream=copy_stream, clock=self.clock,
            placeholders=set(initial),
            settle=self.settle_updates, synchronize=self.synchronize,
            add_hook=self._hooks.append)
        # Where each parameter's state lives and is updated (the daemon, VRAM, staged, mapped).
        self.placement = StatePlacement(
            rules=self.rules, host=self.host, table=self.table, gradients=self.gradients,
            returns=self.returns, traffic=self.traffic, device_index=self._device_index,
            groups=lambda: self.param_groups, synchronize=self.synchronize,
            say=lambda kind, message, **numbers: self._on_decision(kind, message, **numbers),
            steps=lambda: self.steps)
        # offload="auto": after a few offloaded steps, whether torch's fused GPU AdamW could
        # hold everything in VRAM instead; once it does, ``auto.optimizer`` runs every step.
        self.auto = AutoOffload(
            rules=self.rules, table=self.table, placement=self.placement, host=self.host,
            enabled=bool(switch_when_fits), vram_headroom=float(vram_headroom),
            say=lambda kind, message, **numbers: self._on_decision(kind, message, **numbers))
        for i, p in enumerate(self.table.params):
            self._take_over(i, p)
        if getattr(self, "_resumed", False):
            # After the device-return and paging set-up: refresh_weights() reads both.
            self.refresh_weights()
        if self.mode_decision[0] == "gpu":
            self.placement.update_on_gpu = True
            self.keep_state_on_device(set())  # every parameter that may: mapped_candidates
        if client is None and mode != "cpu":  # wrap() says it itself, with its own figures
            self.client.report_event("optimizer.mode", self.mode_decision[1],
                                     **self.mode_decision[2])

    def _take_over(self, i: int, p: torch.Tensor) -> None:
        """Routes parameter ``i``'s gradients to the daemon (and, on a CPU, its storage)."""
        if not self._cuda:
            # The weights live in the daemon's shared memory: its updates land in place.
            p.data = self.host.param(i)
            p.grad = self.host.grad(i)
            p.grad.zero_()
        self._hooks.append(p.register_post_accumulate_grad_hook(
            weak_hook(self.gradients, "on_gradient_timed")))

    def add_hook(self, handle: Any) -> None:
        """A hook someone installed for it, removed with it at detach()."""
        self._hooks.append(handle)

    def synchronize(self) -> None:
        """Blocks until every queued copy in either direction has landed."""
        self.gradients.drain()
        self.returns.synchronize()
        self.placement.synchronize()

    def detach(self) -> None:
        """Removes the hooks; CPU weights move out of shared memory into ordinary tensors."""
        self.synchronize()
        if self.table.on_device:
            if self.gradients.in_iteration:
                warnings.warn("trainstream: unwrapped between backward and step(): the AdamW "
                              "state held in VRAM stays as of its last move or checkpoint in "
                              "trainstreamd", stacklevel=3)
            else:
                # The daemon holds the whole job's state again (a later process may resume it).
                self.placement.all_state_to_daemon()
        unregister_exit_return(self.placement)
        if self._pager is not None:
            self._pager.close()  # paged weights get tensors of their own again
            self._pager, self.table.paged = None, set()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if not self._cuda:
            for i, p in enumerate(self.table.params):
                p.data = self.host.param(i).clone()
                p.grad = None

    # -- torch.optim.Optimizer ----------------------------------------------------------------

    # torch.amp.GradScaler hands itself to step() when this is set, so fp16 scaling is caught
    # here with a clear message instead of failing inside the scaler.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure: Any = None, grad_scaler: Any = None, **kwargs: Any) -> Any:
        """Waits for every parameter's update (most finished during backward) and starts the
        copies of the new weights back to the GPU."""
        gpu_optimizer = self.auto.optimizer
        if gpu_optimizer is not None:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if self.rules.reports_norm:
                # What the daemon did before the switch: clip (or only measure) the global norm.
                norm = torch.nn.utils.clip_grad_norm_(self.table.params,
                                                      self.rules.max_grad_norm or float("inf"))
                self.last_grad_norm = float(norm)
            guard = self.placement.device_guard()
            if guard is not None:
                if guard.last_step_found():
                    self.placement.say_guarded("")
                guard.check([p.grad for p in self.table.params])
                gpu_optimizer.found_inf = guard.found  # torch's fused AdamW reads it
            gpu_optimizer.step()
            if guard is not None:
                guard.end_step()
            self.auto.stepped_on_gpu()
            if self._adaptive is not None:
                self._adaptive.after_step()  # the watchdog still reads every step's peak
            return loss
        if grad_scaler is not None or kwargs:
            raise FailedPreconditionError(
                "torch.amp.GradScaler is not supported: gradients leave the GPU during backward, "
                "before the scaler could unscale them. Train in bfloat16 (no scaler needed), or "
                "pass nonfinite='skip' to skip steps whose gradients overflow")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        backwards = self.gradients.most_backwards
        if 0 < backwards < self.accumulation_steps:
            raise FailedPreconditionError(
                f"step() after {backwards} backward pass(es); accumulation_steps is "
                f"{self.accumulation_steps}")
        if not self._iteration.completed_early:
            self._complete_iteration()
        self._iteration.stepped()
        self.auto.offloaded_step_ended()
        if self._adaptive is not None:
            self._adaptive.after_step()
        if self.auto.due(self._adaptive):
            switch = self.auto.decide(self._pager is not None and bool(self._pager.paged),
                                      self._adaptive)
            if switch is not None:
                self._switch_to_gpu()
                self._on_decision("wrap.offload", switch.message, **switch.numbers)
        return loss

    def _switch_to_gpu(self) -> None:
        """Moves every parameter's state to torch's fused AdamW on the GPU (offload="auto")."""
        self.synchronize()
        self.placement.all_state_to_daemon()  # the daemon's state is whole, then all moves
        if self._adaptive is not None:
            self._adaptive.state.left_vram()
            self._adaptive.weights_fixed = True  # nothing left in the daemon to stream from
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        gpu = self.auto.switch(self.param_groups)
        for p in self.table.params:
            p.grad = None
        self.state = gpu.state
        self.param_groups = gpu.param_groups  # one list: groups added later reach both

    @property
    def on_gpu(self) -> bool:
        """True once offload='auto' moved the optimizer to torch's fused GPU AdamW."""
        return self.auto.optimizer is not None

    def _complete_iteration(self) -> None:
        """Waits for every update of the iteration (most finished during backward) and starts
        their copies back: step()'s work, done early by a forward between the last backward
        and step(). Updates land during backward, so such a forward would otherwise read
        whichever had landed; it reads all of them instead."""
        self._push_hyperparameters()
        self.gradients.drain()
        # Before the posts below: the daemon decides the clip once the last one is in.
        placement = self.placement
        placement.post_device_norm()
        for i in range(len(self.table)):
            # No gradient this step: left alone, as torch does; one updated in VRAM: by the
            # GPU, below.
            if self.gradients.backwards_of(i) == 0 or i in self.table.on_device:
                for micro in range(self.host.accumulation_steps):
                    self.host.post(i, micro, no_grad=True)
        if self._leader:
            reduce_across_machines(self.host, len(self.table), self._machine_group)
        # Queued on the GPU before waiting for the host's updates, so that the two overlap;
        # clipping state held in VRAM waits for the daemon's coefficient instead.
        clip_on_device = self.rules.max_grad_norm > 0 and bool(self.table.on_device)
        if not clip_on_device:
            placement.step_on_device()
        result = self.host.wait()
        if clip_on_device:
            coef = 1.0
            if not result["skipped"]:
                last = self.host.info().last_step
                coef = last.clip_coef if last is not None else 1.0
                placement.clip_on_device(coef)
            placement.step_on_device(coef)
        if result["skipped"] and self.rules.nonfinite == "guard":
            placement.say_guarded("in trainstreamd's pass (tsctl events has the count),")
        self._iteration.updates_returned()
        if self._pager is not None:
            self._pager.weights_changed()
        self.gradients.iteration_done()
        if self.rules.reports_norm:
            last = self.host.info().last_step
            self.last_grad_norm = last.grad_norm if last is not None else 0.0
        # Every update of this step is on its way back (the session's pump started each copy
        # before queueing its notice; without device returns, the copies start here, last):
        # the next forward of each module waits again.
        self.traffic.to_device += self.returns.updates_sent(result["updated"])

    def _iteration_begins(self) -> None:
        """The iteration's first gradient is about to leave: updates start now, so a scheduler's
        new lr must reach the daemon before it, and the copies back must know where each
        parameter's storage is now."""
        self._push_hyperparameters()
        self.returns.check_targets()

    def _flush_staged(self) -> None:
        """A backward that sent gradients ended: staged updates still batched start now."""
        engine = self.placement.engine
        if engine is not None:
            engine.flush(cuda_device.current(self._device_index))

    def settle_updates(self) -> None:
        """Between the last backward and step(), updates are still landing: a forward, or a
        checkpoint, completes the iteration first and reads the new values, all of them. Not
        in a data-parallel job, where completing waits for every rank's gradients and joins
        the machines' all-reduce, which the other ranks reach only from their step()."""
        if (self.auto.optimizer is None and self._world_size == 1 and self._machines == 1
                and not in_backward() and self._iteration.start_early_completion()):
            self._complete_iteration()
            self._iteration.completed_before_step()

    def _push_hyperparameters(self) -> None:
        # A scheduler changes lr between steps: the daemon gets it before the next updates.
        current = [daemon_group(g) for g in self.param_groups]
        if current != self._pushed:
            self.host.set_groups(current)
            self._pushed = current

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.auto.optimizer is not None:
            self.auto.optimizer.zero_grad(set_to_none)
            return
        if self._cuda:
            for p in self.table.params:
                p.grad = None
        else:
            for i, p in enumerate(self.table.params):
                self.host.grad(i).zero_()
                p.grad = self.host.grad(i)  # backward accumulates into the shared slot

    def add_param_group(self, param_group: dict) -> None:
        """Adds a group between steps (a layer unfrozen mid-run): its parameters get their state
        in the daemon, starting from their current values, and train from the next step."""
        if getattr(self, "host", None) is None:  # torch's constructor adds the first groups
            super().add_param_group(param_group)
            return
        if self.auto.optimizer is not None:
            self.auto.optimizer.add_param_group(param_group)
            return
        if self._world_size > 1 or self._machines > 1:
            raise FailedPreconditionError(
                "add_param_group in a data-parallel job is not supported: pass every group when "
                "building the optimizer")
        if self.gradients.in_iteration:
            raise FailedPreconditionError(
                "add_param_group between backward and step(): add groups between steps")
        super().add_param_group(param_group)  # torch's checks and defaults
        group = self.param_groups[-1]
        new = [p for p in group["params"] if p.requires_grad]
        bad = [p for p in new if p.device != self.table.params[0].device]
        if bad:
            self.param_groups.pop()
            raise InvalidArgumentError(
                f"the new group has a parameter on {bad[0].device}; the others are on "
                f"{self.table.params[0].device}")
        start = len(self.table.params)
        grad_dtypes = [self.table.grad_dtype or p.dtype for p in new]
        specs = [ParameterSpec(safe_name(self._names.get(p, f"param{i}")), tuple(p.shape),
                               p.dtype, grad_dtypes[k], len(self.param_groups) - 1)
                 for k, (i, p) in enumerate(zip(range(start, start + len(new)), new))]
        groups = [daemon_group(g) for g in self.param_groups]
        if not new:  # only frozen parameters: the daemon just learns the group
            self.host.set_groups(groups)
            self._pushed = groups
            self.table.extend(group["params"])
            return
        try:
            first = self.host.add_parameters(specs, groups)
        except BaseException:
            # Back to the groups the daemon had (it drops a group no parameter is in).
            self.param_groups.pop()
            self.host.set_groups(self._pushed)
            raise
        self._pushed = groups
        self.table.extend(group["params"])
        if first <= start:
            self.host.load_weights([p.detach().float().cpu() for p in new], first=start)
        self.gradients.extend(len(new))
        self.returns.extend(new)
        for i, p in enumerate(new, start=start):
            self._take_over(i, p)
        if self.returns.model is not None:
            self.attach_forward_waits(self.returns.model)

    def attach(self, model: torch.nn.Module, guard: bool = True,
               blocks: Iterable[Any] = ()) -> "OffloadAdamW":
        """What wrap() does once it has the optimizer (TrainStream 0.6's name): each forward of
        ``model`` waits for the new values of the weights it reads (``blocks``: repeated layers
        that wait once each, for all of theirs), and a forward between the last backward and
        step() for every update. ``guard=False`` (forwards reading weights mid-update) is not
        offered. Returns the optimizer."""
        if guard is not True:
            raise InvalidArgumentError(
                "OffloadAdamW.attach: guard=False (forwards reading weights while their "
                "update lands) is not offered; each forward waits only for its own weights")
        self.attach_forward_waits(model, list(blocks))
        return self

    # -- the weights' way back, for the layers above (paging, wrap) ----------------------------

    def attach_forward_waits(self, model: torch.nn.Module, blocks: Iterable[Any] = ()) -> None:
        """Each forward of ``model`` waits for its own parameters' new values, each of
        ``blocks`` once for all of its own (see DeviceReturns.attach_forward_waits)."""
        self.returns.attach_forward_waits(model, blocks)

    def stop_returning(self, param_ids: set) -> None:
        """These parameters' updates are no longer copied to the device (their device memory is
        about to go): waits for copies in flight first. Any of them updated in VRAM go back to
        the daemon first (their weights will be its host copies)."""
        table = self.table
        leaving = {i for i, p in enumerate(table.params) if id(p) in param_ids}
        moved = leaving & table.on_device
        # Paged first: optimizer_mode="gpu" then leaves them to the daemon with the rest.
        table.paged |= leaving
        if moved:
            def kept(indices: set) -> set:
                return {id(table.params[i]) for i in indices
                        if id(table.params[i]) not in param_ids}
            self.keep_state_on_device(kept(table.state_in_vram()), kept(table.staged))
        self.synchronize()
        self.returns.forget_waits()  # which parameters come back changes
        for i in sorted(leaving):
            self.returns.retarget(i, False)

    def resume_returning(self, param_ids: set) -> None:
        """These parameters hold device tensors again (blocks that stopped streaming): their
        updates are copied there from the next step on."""
        self.synchronize()
        self.returns.forget_waits()  # which parameters come back changes
        table = self.table
        for i, p in enumerate(table.params):
            if id(p) in param_ids and i in table.paged:
                table.paged.discard(i)
                self.returns.retarget(i, True)
        if self.placement.update_on_gpu:  # optimizer_mode="gpu": updated on the GPU again
            self.keep_state_on_device({id(table.params[i]) for i in table.state_in_vram()})

    def page_weights(self, pager: Any) -> None:
        """Parameters of ``pager``'s blocks are read from host memory at every use: their
        updates are not copied back, and each step tells the pager the host copies changed."""
        self._pager = pager
        self.stop_returning({id(p) for params in pager.weights.params.values() for p in params})

    def refresh_weights(self) -> None:
        """Brings the model's weights to the daemon's (after a load, or when joining a job whose
        state another rank created). CPU weights are the daemon's memory already."""
        self.returns.refresh()
        if self._pager is not None:
            self._pager.weights_changed()

    @property
    def bytes_to_host(self) -> int:
        """Gradients (and staged moments) copied off the GPU since construction."""
        return self.traffic.to_host

    @property
    def bytes_to_device(self) -> int:
        """Updated weights (and staged moments) copied back to the GPU since construction."""
        return self.traffic.to_device

    @property
    def steps(self) -> int:
        if self.auto.optimizer is not None:
            return self.auto.steps
        return self.host.iteration

    def stats(self) -> dict:
        """The daemon's figures for this job's optimizer (and where the optimizer runs now)."""
        info = _client.reply_dict(self.host.info())
        info["runs_on"] = "gpu" if self.auto.optimizer is not None else "trainstreamd"
        # Parameters updated in VRAM by torch's fused AdamW (keep_state_on_device).
        info["gpu_state"] = {"tensors": len(self.table.state_in_vram()),
                             "elements": self.device_state_elements,
                             "moment_bytes": 8 * self.device_state_elements}
        # Updated on the GPU from moments staged out of the daemon (keep_state_on_device), or
        # read where they lie (optimizer_mode="gpu": "mapped").
        staged, mapped = self.placement.engine, self.placement.update_on_gpu
        info["staged_state"] = {"tensors": len(self.table.staged),
                                "elements": self.staged_state_elements,
                                "engine": ("mapped" if mapped else "staged"),
                                "chunks": staged.chunks if staged else 0,
                                "bytes_each_way": staged.bytes_each_way if staged else 0}
        if mapped and staged is not None:  # applied, unless nonfinite="guard"
            info["staged_state"]["nonfinite_values"] = staged.nonfinite_values()
        info["optimizer_mode"] = {"mode": self.mode_decision[0], "why": self.mode_decision[1],
                                  **self.mode_decision[2]}
        info["steps"] = self.steps
        return info

