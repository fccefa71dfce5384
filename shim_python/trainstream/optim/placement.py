# SPDX-License-Identifier: Apache-2.0
"""Where OffloadAdamW's state lives per parameter: in trainstreamd (the default), in VRAM under
torch's fused AdamW (keep_state_on_device), or in trainstreamd but updated on the GPU: staged
(moments copied out of the daemon and back around a GPU update) or, under optimizer_mode="gpu",
mapped (the kernel reads and writes them where they lie). Moves between them carry the moments,
weights and step counts."""

from __future__ import annotations

import atexit
import dataclasses
import warnings
import weakref
from typing import Any, Callable, Iterable

import torch

from ..errors import FailedPreconditionError
from ..transport import device as cuda_device
from .gradients import GradientRouter, Traffic
from .groups import torch_group
from .mapped_adamw import MappedAdamW, mappable_dtype
from .nonfinite_guard import DeviceGuard
from .parameters import ParameterTable
from .returns import DeviceReturns
from .staged_adamw import StagedAdamW

# Why no state may move to VRAM under bf16 moments (gpu_state_refusal).
BF16_MOMENTS_REFUSAL = "bf16 moments are the daemon's (torch's fused AdamW keeps fp32 ones)"


def gpu_update_refusal(cuda: bool, world_size: int, machines: int, nonfinite: str,
                       params: list) -> str | None:
    """Why optimizer_mode="gpu" cannot update a job's parameters on the GPU (None: it can).
    Known from the optimizer's arguments alone, so it is said before the daemon is asked."""
    if not cuda:
        return "the model is on the CPU: there is no GPU to update it on"
    if world_size > 1 or machines > 1:
        return ("a data-parallel job sums every rank's gradients in trainstreamd before each "
                "update, so its pass runs there")
    if nonfinite in ("skip", "error"):
        return (f"nonfinite={nonfinite!r} checks every gradient of the step in trainstreamd "
                "before any update ('guard' and 'ignore' work on the GPU)")
    if not any(mappable_dtype(p.dtype) and p.is_contiguous() for p in params):
        return "no parameter is a contiguous fp32, bf16 or fp16 tensor"
    return None

@dataclasses.dataclass(frozen=True)
class UpdateRules:
    """What the optimizer's arguments fix about every update, for the placement's choices."""

    cuda: bool
    kind: str                  # "adamw" or "adam"
    world_size: int
    machines: int
    nonfinite: str
    moment_dtype: torch.dtype
    max_grad_norm: float       # 0: no clipping
    reports_norm: bool         # clipping, or compute_grad_norm
    eager: bool | None


class StatePlacement:
    """Where each parameter's AdamW state lives and is updated, and the moves between the
    places. It owns torch's fused AdamW for the state held in VRAM (``device_optimizer``), the
    GPU engine of the staged or mapped updates (``engine``), the nonfinite guard of what the GPU
    updates, and whether optimizer_mode="gpu" updates on the GPU (``update_on_gpu``).

    ``groups`` gives the optimizer's parameter groups as they are now (a scheduler's lr);
    ``synchronize`` waits for every copy in either direction; ``say(kind, message,
    **numbers)`` reports a decision; ``steps`` gives the optimizer's step count."""

    def __init__(self, *, rules: UpdateRules, host: Any, table: ParameterTable,
                 gradients: GradientRouter, returns: DeviceReturns, traffic: Traffic,
                 device_index: int, groups: Callable[[], list],
                 synchronize: Callable[[], None], say: Callable[..., None],
                 steps: Callable[[], int]) -> None:
        self._rules = rules
        self._host = host
        self._table = table
        self._gradients = gradients
        self._returns = returns
        self._traffic = traffic
        self._device_index = device_index
        self._groups = groups
        self._synchronize = synchronize
        self._say = say
        self._steps = steps
        self.update_on_gpu = False  # optimizer_mode="gpu", once the daemon holds the state
        self.switched_to_gpu = False  # offload="auto" moved the whole optimizer to the GPU
        # Parameters whose AdamW state lives in VRAM (table.state_in_vram): torch's fused
        # AdamW updates them at step(); the daemon's copy of their state is as of the move or
        # the last checkpoint.
        self.device_optimizer: torch.optim.Optimizer | None = None
        self._device_groups: list[int] = []  # for each of its groups, ours
        # Of those, the ones whose moments stay in the daemon, staged through VRAM for each
        # update as backward finishes their gradients (staged_adamw.py), or mapped under
        # optimizer_mode="gpu" (mapped_adamw.py): table.staged.
        self.engine: StagedAdamW | MappedAdamW | None = None
        self._staged_groups: dict[int, int] = {}
        self._guard: DeviceGuard | None = None  # "guard" for what the GPU updates, made on use

    def synchronize(self) -> None:
        """Waits for the GPU engine's copies of staged moments."""
        if self.engine is not None:
            self.engine.synchronize()

    def gpu_state_refusal(self) -> str | None:
        """Why no parameter's AdamW state may move to VRAM in this job (None: it may)."""
        if not self._rules.cuda:
            return "a CPU model's updates land in place in the daemon's shared memory"
        if self._rules.world_size > 1 or self._rules.machines > 1:
            return "a data-parallel job keeps one state in trainstreamd for every rank"
        if self._rules.nonfinite in ("skip", "error"):
            return (f"nonfinite={self._rules.nonfinite!r} checks every gradient in the daemon "
                    "before any update")
        if self._rules.moment_dtype != torch.float32:
            return BF16_MOMENTS_REFUSAL
        if self.switched_to_gpu:
            return "the whole optimizer runs on the GPU already (offload='auto')"
        if not any(p.dtype == torch.float32 for p in self._table.params):
            return ("no parameter is fp32: the fp32 master weights of the others are the "
                    "daemon's")
        return None

    def staged_state_refusal(self) -> str | None:
        """Why no parameter may be updated on the GPU from staged moments (None: it may)."""
        reason = self.gpu_state_refusal()
        if reason is None and self._rules.reports_norm:
            # Held state is updated at step(), after the daemon has the whole norm; staged
            # updates run during backward, before it exists.
            reason = ("max_grad_norm and compute_grad_norm need the global gradient norm, "
                      "which exists only after backward, and staged updates run during it")
        return reason

    def updates_after_backward(self) -> bool:
        """Whether the daemon's updates of the next step wait for backward's last gradient:
        ``eager=False``, or clipping (or ``nonfinite='skip'``/``'error'``) whose last step was
        scaled or skipped. The daemon then waits for the norm (by default it speculates only
        after a step that needed no scaling), or with ``eager=True`` redoes what it
        speculated: either way the host's pass follows backward instead of overlapping it."""
        if self._rules.eager is False:
            return True
        if not (self._rules.max_grad_norm > 0 or self._rules.nonfinite in ("skip", "error")):
            return False
        last = self._host.info().last_step
        return last is not None and (last.clip_coef < 1.0 or last.skipped)

    def gpu_update_refusal(self) -> str | None:
        """Why optimizer_mode="gpu" cannot update this job's parameters on the GPU."""
        if self.switched_to_gpu:
            return "the whole optimizer runs on the GPU already (offload='auto')"
        rules = self._rules
        return gpu_update_refusal(rules.cuda, rules.world_size, rules.machines, rules.nonfinite,
                                  self._table.params)

    def mapped_candidates(self, excluded: set) -> list[int]:
        """The parameters optimizer_mode="gpu" updates on the GPU, of those not in
        ``excluded``: every contiguous fp32, bf16 or fp16 one whose weights do not stream
        (a streamed weight's GPU copy is there only for its block's passes)."""
        return [i for i in range(len(self._table.params)) if i not in excluded
                and i not in self._table.paged and self._table.params[i].is_contiguous()
                and mappable_dtype(self._table.params[i].dtype)]

    def mapped_master(self, i: int) -> torch.Tensor | None:
        """The daemon's fp32 master the GPU kernel updates for parameter ``i`` (None when the
        parameter is fp32, its own master, or not mapped)."""
        if (isinstance(self.engine, MappedAdamW) and i in self._table.staged
                and self._table.params[i].dtype != torch.float32):
            return self._host.master(i)
        return None

    def device_state_candidates(self, param_ids: set) -> list[int]:
        """Of these parameters, the indices whose state may live in VRAM: fp32 ones (their
        master weights are the parameters themselves) whose weights do not stream."""
        return [i for i, p in enumerate(self._table.params)
                if id(p) in param_ids and p.dtype == torch.float32
                and i not in self._table.paged]

    def keep_state_on_device(self, param_ids: set, staged_ids: set = frozenset()) -> int:
        """Keeps the AdamW state of exactly these parameters (of those that may, see
        :meth:`device_state_candidates`) in VRAM, updated there by torch's fused AdamW at
        step(); every other parameter's goes back to the daemon. Their gradients then never
        cross PCIe and the host's pass shrinks by their share, for 12 bytes of VRAM a parameter
        (two fp32 moments, and the gradient until step()).

        ``staged_ids`` are updated on the GPU too, their moments staying in the daemon's
        pinned memory and staged through VRAM as backward finishes each gradient
        (staged_adamw.py): no host pass and no VRAM but the slots (and, with accumulation, the
        gradient until the last micro-step), for 8 bytes a parameter over PCIe each way
        instead of 4.

        Under optimizer_mode="gpu" every other parameter that may (mapped_candidates) is
        updated on the GPU in place of the staged ones, its state read and written where it
        lies in the daemon's memory (mapped_adamw.py); ``staged_ids`` are not asked for then.

        Between steps only. Returns the elements whose state is in VRAM."""
        reason = self.gpu_state_refusal()
        held_wanted = set(self.device_state_candidates(param_ids))
        if reason is not None and held_wanted:
            raise FailedPreconditionError(f"optimizer state cannot move to VRAM: {reason}")
        if self.update_on_gpu:
            staged = set(self.mapped_candidates(held_wanted))
            reason = self.gpu_update_refusal()
            if reason is not None and staged:
                raise FailedPreconditionError(
                    f"optimizer_mode='gpu' cannot update on the GPU: {reason}")
        else:
            staged = {i for i in self.device_state_candidates(set(staged_ids) - set(param_ids))
                      if self._table.params[i].is_contiguous()}  # updated through flat views
            if reason is not None and staged:
                raise FailedPreconditionError(f"optimizer state cannot move to VRAM: {reason}")
            reason = self.staged_state_refusal()
            if reason is not None and staged:
                raise FailedPreconditionError(f"no state can be staged through VRAM: {reason}")
        wanted = held_wanted | staged
        if self._gradients.in_iteration:
            raise FailedPreconditionError(
                "optimizer state moves between steps, not between backward and step()")
        held, new_held = self._table.state_in_vram(), wanted - staged
        if held == new_held and staged == self._table.staged:
            return self.device_state_elements
        self._synchronize()
        # Every parameter whose place changes goes through the daemon: its state is made whole
        # there (moments, steps, master weights), then taken from there.
        steps = self._param_steps()
        old = self.device_optimizer
        leaving_held = sorted(held - new_held)
        leaving_staged = sorted(self._table.staged - staged)
        if leaving_held:
            steps = self.moments_to_daemon(old, leaving_held)
        for i in leaving_staged:
            steps[i] = self._staged_to_daemon(i)
        if leaving_held or leaving_staged:
            self._host.set_step(self._host.iteration, steps)
        self.device_optimizer = self._device_optimizer_for(sorted(new_held))
        if old is not None:  # the staying ones keep their state as it is
            for i in sorted(new_held & held):
                p = self._table.params[i]
                if p in old.state:
                    self.device_optimizer.state[p] = old.state[p]
        arriving_held = sorted(new_held - held)
        if arriving_held:
            self.moments_from_daemon(self.device_optimizer, arriving_held)
        if staged and self.engine is None:
            guard = self.device_guard()
            if self.update_on_gpu:
                self.engine = MappedAdamW(self._table.params[0].device, self._rules.kind,
                                          guard=guard)
            else:
                self.engine = StagedAdamW(self._table.params[0].device, self._rules.kind,
                                          found_inf=guard.found if guard is not None else None)
        for i in sorted(staged - self._table.staged):
            self.engine.set_steps(i, self._table.params[i].numel(), steps[i])
        group_of = {id(p): k for k, g in enumerate(self._groups()) for p in g["params"]}
        self._staged_groups = {i: group_of[id(self._table.params[i])] for i in staged}
        if not staged:
            self.engine = None  # its slots' VRAM goes back
        for i in sorted(self._table.on_device - wanted):
            self._returns.retarget(i, True)
        for i in sorted(wanted - self._table.on_device):
            self._returns.retarget(i, False)  # nothing of the daemon's is copied there any more
        self._table.place(wanted, staged)
        self._returns.forget_waits()  # which parameters come back changed
        if wanted:
            register_exit_return(self)
        else:
            unregister_exit_return(self)
        return self.device_state_elements

    @property
    def device_state_elements(self) -> int:
        """Elements whose AdamW state lives in VRAM (keep_state_on_device)."""
        return sum(self._table.params[i].numel() for i in self._table.state_in_vram())

    @property
    def staged_state_elements(self) -> int:
        """Elements updated on the GPU with their state in the daemon (staged, or mapped under
        optimizer_mode="gpu")."""
        return sum(self._table.params[i].numel() for i in self._table.staged)

    def _hyper(self, i: int) -> tuple:
        """Staged parameter ``i``'s group's hyper-parameters as they are now (a scheduler's)."""
        g = self._groups()[self._staged_groups[i]]
        return (float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]), float(g["eps"]),
                float(g["weight_decay"]))

    def _staged_to_daemon(self, i: int, forget: bool = True) -> int:
        """Staged parameter ``i``'s weights into the daemon's master (its moments are there
        already); returns its steps. After synchronize()."""
        self.weights_to_daemon(i)
        steps = self.engine.steps_of(i)
        if forget:
            self.engine.forget(i)
        return steps

    def _device_optimizer_for(self, indices: list) -> torch.optim.Optimizer | None:
        self._device_groups = []
        if not indices:
            return None
        chosen = {id(self._table.params[i]) for i in indices}
        groups = []
        for k, g in enumerate(self._groups()):
            params = [p for p in g["params"] if id(p) in chosen]
            if params:
                groups.append(dict(params=params, **torch_group(g)))
                self._device_groups.append(k)
        cls = torch.optim.AdamW if self._rules.kind == "adamw" else torch.optim.Adam
        return cls(groups, fused=True)

    def device_guard(self) -> DeviceGuard | None:
        """nonfinite="guard" on the GPU (nonfinite_guard.py): made at the first update there."""
        if self._rules.nonfinite != "guard" or not self._rules.cuda:
            return None
        if self._guard is None:
            self._guard = DeviceGuard(self._table.params[0].device)
        return self._guard

    def say_guarded(self, where: str) -> None:
        """A step that stopped at a non-finite gradient value: an event and a warning."""
        step = self._steps()
        message = (f"step {step}: non-finite gradient values; {where} nothing of the step was "
                   "applied from the first of them on (nonfinite='guard'; 'ignore' applies them, "
                   "'skip' checks every gradient before any update)")
        self._say("optimizer.nonfinite", message, step=step)
        warnings.warn(f"trainstream: {message}", stacklevel=3)

    def post_device_norm(self) -> None:
        """Clipping or a reported norm: the sum of squares of the gradients updated on the GPU
        (in VRAM, or mapped: kept until step() then, see step_on_device) goes to the daemon,
        which adds it to its own for the step's global norm."""
        held = sorted(self._table.state_in_vram()
                      if not self.update_on_gpu else self._table.on_device)
        if not self._rules.reports_norm or not held:
            return
        params = self._table.params
        grads = [params[i].grad for i in held if params[i].grad is not None]
        total = 0.0
        if grads:
            # In fp32 whatever the gradients' dtype (a bf16 norm is off by up to 0.4%).
            norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
            total = float(torch.stack(norms).double().square().sum())
        self._host.post_norm_contribution(total)

    def final_held_gradient(self, i: int, p: torch.Tensor) -> None:
        """Parameter ``i``'s last micro-step gradient, updated on the GPU: staged or mapped, its
        update starts now, beside the rest of backward (mapped with clipping or a reported
        norm: at step(), once the global norm is known); held in VRAM, at step()."""
        if i not in self._table.staged:
            return
        current = cuda_device.current(self._device_index)
        if self.update_on_gpu:
            if not self._rules.reports_norm:
                self._start_mapped([i], current)
            return
        self.engine.add(i, p, p.grad, self._host.exp_avg(i), self._host.exp_avg_sq(i),
                        self._hyper(i), current)
        self._traffic.to_host += 8 * p.numel()  # fp32 moments each way
        self._traffic.to_device += 8 * p.numel()
        p.grad = None  # its chunk holds it until the update has read it

    def _start_mapped(self, indices: list, producer: torch.cuda.Stream,
                      clip_coef: float = 1.0) -> None:
        """Queues the mapped updates of these parameters (optimizer_mode="gpu") from their
        final gradients, which the caller then drops (a forward under inference_mode may
        complete the iteration: the engine's own tensors must stay ordinary ones)."""
        with torch.inference_mode(False):
            self._start_mapped_now(indices, producer, clip_coef)

    def _start_mapped_now(self, indices: list, producer: torch.cuda.Stream,
                          clip_coef: float) -> None:
        for i in indices:
            p = self._table.params[i]
            if p.grad is None:
                continue  # no gradient this step: left alone, as torch does
            moved = self.engine.bytes_each_way
            master = self.mapped_master(i)
            self.engine.add(i, p, p.grad, self._host.exp_avg(i), self._host.exp_avg_sq(i),
                            self._hyper(i), producer, master=master, grad_scale=clip_coef)
            moved = self.engine.bytes_each_way - moved
            self._traffic.to_host += moved
            self._traffic.to_device += moved
            p.grad = None

    def clip_on_device(self, coef: float) -> None:
        """The daemon's clip coefficient, applied to the gradients updated in VRAM."""
        grads = [self._table.params[i].grad for i in self._table.state_in_vram()
                 if self._table.params[i].grad is not None]
        if grads and coef != 1.0:
            torch._foreach_mul_(grads, coef)

    def step_on_device(self, clip_coef: float = 1.0) -> None:
        """Updates the parameters whose state lives in VRAM (queued on the current stream), with
        the groups' hyper-parameters as they are now (a scheduler's lr). Under
        optimizer_mode="gpu" with clipping or a reported norm, the mapped updates were held back
        for the norm: they start here, their gradients scaled by ``clip_coef`` in the kernel."""
        guard = self.device_guard() if (self.engine is not None
                                        or self.device_optimizer is not None) else None
        if guard is not None and guard.last_step_found():
            self.say_guarded("among the parameters updated on the GPU,")
        if self.engine is not None:
            current = cuda_device.current(self._device_index)
            if self.update_on_gpu and self._rules.reports_norm:
                self._start_mapped(sorted(self._table.staged), current, clip_coef)
            self.engine.flush(current)
            self.engine.join(current)  # the next forward reads their new weights
        optimizer = self.device_optimizer
        if optimizer is not None:
            for g, k in zip(optimizer.param_groups, self._device_groups):
                g.update(torch_group(self._groups()[k]))
            if guard is not None:
                # After the staged chunks' checks (joined above): one flag for the step.
                guard.check([self._table.params[i].grad for i in
                             self._table.state_in_vram()])
                optimizer.found_inf = guard.found  # torch's fused AdamW reads it
            # A forward under inference_mode may complete the iteration (settle_updates): the
            # moments torch creates on a first update must still be ordinary tensors.
            with torch.inference_mode(False):
                optimizer.step()
            for i in self._table.on_device:
                self._table.params[i].grad = None  # no gradient stays in VRAM past step()
        if guard is not None:
            guard.end_step()

    def moments_from_daemon(self, optimizer: torch.optim.Optimizer, indices: Iterable[int]
                            ) -> None:
        """Loads the daemon's moments and steps of these parameters into a GPU optimizer."""
        steps = self._param_steps()
        for i in indices:
            p = self._table.params[i]
            optimizer.state.pop(p, None)
            if steps[i] == 0:
                continue  # never stepped: torch keeps no state for it
            optimizer.state[p] = {
                "step": torch.tensor(float(steps[i]), dtype=torch.float32, device=p.device),
                "exp_avg": self._host.exp_avg(i).to(p.device, torch.float32, copy=True),
                "exp_avg_sq": self._host.exp_avg_sq(i).to(p.device, torch.float32, copy=True),
            }

    def moments_to_daemon(self, optimizer: torch.optim.Optimizer | None,
                          indices: Iterable[int]) -> list[int]:
        """Copies a GPU optimizer's moments and these parameters' values into the daemon's
        buffers; returns every parameter's step count with these ones' from the GPU (for
        ``set_step``)."""
        steps = self._param_steps()
        for i in indices:
            p = self._table.params[i]
            entry = optimizer.state.get(p) if optimizer is not None else None
            steps[i] = int(entry["step"]) if entry else 0
            if entry:
                self._host.exp_avg(i).copy_(entry["exp_avg"].reshape(p.shape))
                self._host.exp_avg_sq(i).copy_(entry["exp_avg_sq"].reshape(p.shape))
            self.weights_to_daemon(i)
        return steps

    def weights_to_daemon(self, i: int) -> None:
        """Parameter ``i``'s value on the GPU into the daemon's master (and model-dtype) copy;
        a master the GPU kernel updates in place is current already, and finer than the
        parameter."""
        p = self._table.params[i]
        if self.mapped_master(i) is None:
            self._host.master(i).copy_(p.detach().reshape(p.shape))
        if self._host.param(i).data_ptr() != self._host.master(i).data_ptr():
            self._host.param(i).copy_(p.detach())

    def _param_steps(self) -> list[int]:
        """Every parameter's AdamW step count as the daemon has it."""
        return list(self._host.info().param_steps or [0] * len(self._table.params))

    def state_from_daemon(self) -> None:
        """The VRAM-held state takes the daemon's (after a load)."""
        held = sorted(self._table.state_in_vram())
        if held:
            self.moments_from_daemon(self.device_optimizer, held)
        if self._table.staged:  # their moments are the daemon's; their steps too now
            self.engine.synchronize()
            steps = self._param_steps()
            for i in self._table.staged:
                self.engine.set_steps(i, self._table.params[i].numel(), steps[i])

    def all_state_to_daemon(self) -> None:
        """Every parameter's state back in the daemon and updated there (under
        optimizer_mode="gpu" too, whose mapped updates then stop). Between steps only."""
        on_gpu, self.update_on_gpu = self.update_on_gpu, False
        try:
            self.keep_state_on_device(set())
        finally:
            self.update_on_gpu = on_gpu

    def return_state_to_daemon(self) -> None:
        """Every parameter's state back in the daemon, unless a step is in progress (its
        gradients would land on moved state): at exit, so a process that ends without unwrap()
        leaves the job whole for a restart."""
        if not self._gradients.in_iteration:
            self.all_state_to_daemon()

    def state_to_daemon(self) -> None:
        """The daemon's copy of the VRAM-held state catches up (before a checkpoint)."""
        if self._table.on_device:
            if self._gradients.in_iteration:  # a step in progress, or one that failed
                raise FailedPreconditionError(
                    "a step is in progress; checkpoint between steps (after step())")
            held = sorted(self._table.state_in_vram())
            steps = self.moments_to_daemon(self.device_optimizer, held)
            if self._table.staged:
                self.engine.synchronize()
                for i in self._table.staged:
                    steps[i] = self._staged_to_daemon(i, forget=False)
            self._host.set_step(self._host.iteration, steps)


# Optimizers holding AdamW state in VRAM: at interpreter exit their state goes back to the
# daemon, so a process that ends without unwrap() leaves the job whole for a restart.
_exit_returns: "weakref.WeakSet[StatePlacement]" = weakref.WeakSet()


_exit_hook: list = []  # registered once


def register_exit_return(optimizer: StatePlacement) -> None:
    """``optimizer`` holds state in VRAM: at exit it goes back to the daemon."""
    if not _exit_hook:
        _exit_hook.append(atexit.register(_return_state_at_exit))
    _exit_returns.add(optimizer)


def unregister_exit_return(optimizer: StatePlacement) -> None:
    """``optimizer`` holds no state in VRAM any more (or was detached)."""
    _exit_returns.discard(optimizer)


def _return_state_at_exit() -> None:
    for optimizer in list(_exit_returns):
        try:
            optimizer.return_state_to_daemon()
        except Exception as e:  # noqa: BLE001 - the daemon may be gone; exiting goes on
            warnings.warn(f"trainstream: the AdamW state held in VRAM could not go back to "
                          f"trainstreamd at exit: {e}")
    _exit_returns.clear()
