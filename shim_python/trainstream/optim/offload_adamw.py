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

import atexit
import time
import warnings
import weakref
from typing import Any, Iterable

import torch

from ..transport import client as _client
from ..transport import device as cuda_device
from ..errors import FailedPreconditionError, InvalidArgumentError
from ..hooks import HookClock, weak_hook
from ..transport.host_optimizer import HostOptimizer, ParameterSpec
from .nonfinite_guard import DeviceGuard
from .staged_adamw import StagedAdamW

MOMENT_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, torch.float32: torch.float32,
                 torch.bfloat16: torch.bfloat16}
# "guard" (the default): see nonfinite_guard.py and the daemon's NONFINITE_GUARD.
NONFINITE = ("guard", "ignore", "skip", "error")
GRADIENT_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                   "bf16": torch.bfloat16, torch.float32: torch.float32,
                   torch.bfloat16: torch.bfloat16}
# Why no state may move to VRAM under bf16 moments (gpu_state_refusal).
BF16_MOMENTS_REFUSAL = "bf16 moments are the daemon's (torch's fused AdamW keeps fp32 ones)"
_AUTO_STEPS = 2  # offload="auto" decides after this many offloaded steps
# Gradients up to this size leave on the compute stream itself (a few microseconds of copy
# there, and no cross-stream wait and event per gradient); larger ones on the side stream.
_SIDE_STREAM_BYTES = 1 << 20
# Those small ones leave in batches (one native call and one event each), sent when this many
# gradients or bytes wait, or when the backward they came from ends.
_BATCH_GRADIENTS = 32
_BATCH_BYTES = 8 << 20


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW (``kind="adam"``: Adam) with fp32 master weights and moments in trainstreamd.

    ``params``, ``lr``, ``betas``, ``eps`` and ``weight_decay`` as for ``torch.optim.AdamW``.
    Keyword options: ``moment_dtype`` (``"float32"``, ``"bfloat16"``), ``max_grad_norm``
    (global-norm clipping inside the optimizer), ``compute_grad_norm`` (report it without
    clipping, in ``last_grad_norm``), ``accumulation_steps`` (backward passes per ``step()``),
    ``nonfinite`` (``"guard"``: a step stops updating at its first non-finite gradient value
    and says so; ``"ignore"``, ``"skip"``, ``"error"``), ``client`` (default:
    :func:`trainstream.connect`), ``job_id``, ``rank``, ``world_size``, ``names`` (a dict from
    parameter to name, for messages and checkpoints).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, kind: str = "adamw",
                 moment_dtype: Any = "float32", max_grad_norm: float | None = None,
                 compute_grad_norm: bool = False, accumulation_steps: int = 1,
                 nonfinite: str = "guard", client: Any = None, job_id: str = "",
                 rank: int = 0, world_size: int = 1, names: dict | None = None,
                 switch_when_fits: bool = False, vram_headroom: float = 0.10,
                 on_decision: Any = None, gradient_dtype: Any = None, machines: int = 1,
                 machine_group: Any = None, initial: dict | None = None):
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
        self._all = [p for g in self.param_groups for p in g["params"]]
        self._params = [p for p in self._all if p.requires_grad]
        if not self._params:
            raise InvalidArgumentError("no trainable parameters to optimize")
        first = self._params[0]
        self._cuda = first.is_cuda
        for p in self._params:
            if p.device != first.device:
                raise InvalidArgumentError(
                    f"parameters on {first.device} and {p.device}: put the model on one device")
        self._index = {id(p): i for i, p in enumerate(self._params)}
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
        # The dtype gradients cross PCIe in and reach the host optimizer in (cast on the GPU,
        # on the copy stream); the master weights and moments keep their own precision.
        self._gradient_dtype = gradient_dtype
        self._names = names
        self._grad_dtypes = [gradient_dtype or p.dtype for p in self._params]
        self._grad_sizes = [d.itemsize for d in self._grad_dtypes]
        specs = [ParameterSpec(_safe_name(names.get(p, f"param{i}")), tuple(p.shape), p.dtype,
                               self._grad_dtypes[i], group_of[id(p)])
                 for i, p in enumerate(self._params)]
        self.client = client or _client.connect(job_id=job_id, rank=rank, world_size=world_size)
        # CUDA gradients leave VRAM at every backward, so the daemon sums the micro-steps; CPU
        # gradients accumulate in place in their shared slots and the daemon sees one.
        self._host = HostOptimizer(
            self.client, specs, groups=[_group(g) for g in self.param_groups], kind=kind,
            moment_dtype=MOMENT_DTYPES[moment_dtype], max_grad_norm=max_grad_norm or 0.0,
            report_grad_norm=compute_grad_norm, nonfinite=nonfinite,
            accumulation_steps=self.accumulation_steps if self._cuda else 1, machines=machines)
        # Several machines: this machine's rank 0 all-reduces the machine's summed gradients
        # with the other machines' rank 0s (machine_group) before each update.
        self._machines = int(machines)
        self._machine_group = machine_group
        self._leader = machines > 1 and rank == 0
        # Streamed weights wrap() left on the CPU: their values come from ``initial`` (the
        # parameters hold device placeholders), and no update is ever copied to them.
        initial = initial or {}
        # Whether this process made the job's state (wrap() ends such a job if it is refused).
        self.client.made_job = bool(self._host.initialize)
        if self._host.initialize:
            self._host.load_weights([initial.get(id(p), p).detach().float().cpu()
                                     for p in self._params])
        elif world_size == 1:
            # Re-attaching to a job's state (a restarted process): the daemon's weights win.
            self._resumed = True
            info = self._host.info()
            # Tensors whose state is older than the job's step: kept in VRAM by a process that
            # ended without unwrap() or a checkpoint since (or without gradients since).
            self.behind_on_resume = [i for i, steps in enumerate(info.get("param_steps", []))
                                     if 0 < steps < info["step"]]
        self._moment_dtype = MOMENT_DTYPES[moment_dtype]
        self._reports_norm = bool(max_grad_norm) or compute_grad_norm
        self._max_grad_norm = float(max_grad_norm or 0.0)
        self._nonfinite = nonfinite
        self._guard: DeviceGuard | None = None  # "guard" for what the GPU updates, made on use
        self._pushed = [_group(g) for g in self.param_groups]
        self._backwards = [0] * len(self._params)
        self._grads_this_iteration = 0  # gradients landed since the last step()
        self._hooks: list = []
        self.clock = HookClock()            # the CPU time its hooks take (memory_report)
        self._on_gradient_timed = self.clock.timed("optimizer.gradient_out", self._on_gradient)
        self._forward_wait_timed = self.clock.timed("optimizer.forward_wait",
                                                    self._wait_for_own_parameters)
        self._copy_stream = torch.cuda.Stream(first.device) if self._cuda else None
        self._device_index = cuda_device.device_index(first.device) if self._cuda else -1
        # Small gradients waiting to leave together: (index, micro-step, gradient), all made on
        # the stream _batch_stream; their memory is held until their copies are enqueued.
        self._batch: list[tuple[int, int, torch.Tensor]] = []
        self._batch_stream = 0
        self._batch_bytes = 0
        self._end_task = -2  # the backward whose end is hooked (a graph task id)
        self._backward_ended_timed = self.clock.timed("optimizer.gradient_batch",
                                                      self._backward_ended)
        self._ready: dict[int, Any] = {}
        self.last_grad_norm: float | None = None
        self._pager: Any = None             # weight paging (trainstream.paging.BlockPager)
        self.bytes_to_host = 0              # gradients copied off the GPU, since construction
        self.bytes_to_device = 0            # updated weights copied back to it
        self._adaptive: Any = None          # the run-time memory plan (memory/adaptive.py)
        self._paged_indices: set[int] = set()
        # offload="auto": after _AUTO_STEPS steps, decide whether torch's fused GPU AdamW could
        # hold everything in VRAM instead (see _decide_offload).
        self._kind = kind
        self._world_size = world_size
        self._switch_when_fits = switch_when_fits
        self._vram_headroom = float(vram_headroom)
        self._on_decision = on_decision or (lambda kind, message, **numbers: None)
        self._gpu_optimizer: torch.optim.Optimizer | None = None
        # Parameters whose AdamW state lives in VRAM (keep_state_on_device): their gradients stay
        # on the GPU and torch's fused AdamW (_device_optimizer) updates them at step(); the
        # daemon's copy of their state is as of the move or the last checkpoint.
        self._device_indices: set[int] = set()
        self._device_optimizer: torch.optim.Optimizer | None = None
        self._device_groups: list[int] = []  # for each of its groups, ours
        # Of those, the ones whose moments stay in the daemon, staged through VRAM for each
        # update as backward finishes their gradients (staged_adamw.py).
        self._staged_indices: set[int] = set()
        self._staged: StagedAdamW | None = None
        self._staged_groups: dict[int, int] = {}
        self._steps_at_switch = 0
        self._steps_on_gpu = 0
        self._step_times: list[float] = []
        self._last_step_end: float | None = None
        # CUDA: each updated parameter is copied back by the native side the moment the daemon
        # announces it (during backward and the rest of the update), not after the whole step.
        self._device_return = self._cuda and all(p.is_contiguous() for p in self._params
                                                 if id(p) not in initial)
        self._targets: list[int] = []
        self._module_indices: dict[int, list[int]] = {}
        self._waited_modules: set[int] = set()  # modules whose forward waited since step()
        self._updates_landing = False  # a last micro-step's gradient left: updates come back
        self._completed_early = False  # a forward completed this iteration before step()
        self._finishable = False  # the last backward before step() has ended
        self._finish_pending = False  # a backward running now carries last micro-step gradients
        self._paged_indices = {i for i, p in enumerate(self._params) if id(p) in initial}
        if self._device_return:
            self._targets = [0 if id(p) in initial else p.data_ptr() for p in self._params]
            self._host._native.return_updates_to_device(
                first.device.index if first.device.index is not None else
                torch.cuda.current_device(),
                [(0, 0) if id(p) in initial else (p.data_ptr(), p.numel() * p.element_size())
                 for p in self._params])
        self._hooked_modules: set[int] = set()
        self._wait_blocks: dict[int, Any] = {}  # blocks that wait for everything inside them
        self._hooked_dicts: set[int] = set()
        self._hooked_models: set[int] = set()
        self._model: Any = None
        for i, p in enumerate(self._params):
            self._take_over(i, p)
        if getattr(self, "_resumed", False):
            # After the device-return and paging set-up: refresh_weights() reads both.
            self.refresh_weights()

    def _take_over(self, i: int, p: torch.Tensor) -> None:
        """Routes parameter ``i``'s gradients to the daemon (and, on a CPU, its storage)."""
        if not self._cuda:
            # The weights live in the daemon's shared memory: its updates land in place.
            p.data = self._host.param(i)
            p.grad = self._host.grad(i)
            p.grad.zero_()
        self._hooks.append(p.register_post_accumulate_grad_hook(
            weak_hook(self, "_on_gradient_timed")))

    # -- gradients out, weights back ----------------------------------------------------------

    def _on_gradient(self, p: torch.Tensor) -> None:
        if self._completed_early:
            raise FailedPreconditionError(
                f"backward pass {self.accumulation_steps + 1} before step(); accumulation_steps "
                f"is {self.accumulation_steps} (pass accumulation_steps= to wrap). A forward "
                "after the last backward already applied this step's updates")
        i = self._index[id(p)]
        # A counter, not a scan of every parameter's count: this runs once per gradient.
        if self._grads_this_iteration == 0:
            # The first gradient of an iteration: updates start now, so a scheduler's new lr
            # must reach the daemon before it, and the copies back must know where each
            # parameter's storage is now.
            self._push_hyperparameters()
            self._check_targets()
        micro = self._backwards[i]
        if micro >= self.accumulation_steps:
            raise FailedPreconditionError(
                f"backward pass {micro + 1} before step(); accumulation_steps is "
                f"{self.accumulation_steps} (pass accumulation_steps= to wrap)")
        self._backwards[i] = micro + 1
        self._grads_this_iteration += 1
        if i in self._device_indices:
            # Updated in VRAM at step(): the gradient stays where it is (micro-steps add up in
            # it, as torch's do), and a forward after the last backward still completes the
            # iteration first.
            if micro + 1 == self.accumulation_steps:
                self._finish_after_backward()
                if i in self._staged_indices:
                    # Final: its update starts now, beside the rest of backward.
                    self._staged.add(i, p, p.grad, self._host.exp_avg(i),
                                     self._host.exp_avg_sq(i), self._hyper(i),
                                     cuda_device.current(self._device_index))
                    self.bytes_to_host += 8 * p.numel()
                    self.bytes_to_device += 8 * p.numel()
                    p.grad = None  # its chunk holds it until the update has read it
            return
        if not self._cuda:
            slot = self._host.grad(i)
            if p.grad.data_ptr() != slot.data_ptr():
                # Someone set .grad to None (model.zero_grad()): fold the new tensor into the
                # slot and make the slot the gradient again.
                slot.copy_(p.grad)
                p.grad = slot
            if micro + 1 == self.accumulation_steps:  # the slot holds the sum of the passes
                self._updates_landing = True
                self._finish_after_backward()
                self._host.post(i)
            return
        if micro > 0:
            self._send_batch()  # the last micro-step's gradient may still wait in it
            self._host.wait_consumed(i)
        if micro + 1 == self.accumulation_steps:
            self._updates_landing = True
            self._finish_after_backward()
        grad = p.grad
        convert = grad.dtype != self._grad_dtypes[i] or not grad.is_contiguous()
        nbytes = grad.numel() * self._grad_sizes[i]
        if convert or nbytes > _SIDE_STREAM_BYTES:
            # The side stream, after the work that made the gradient; the allocator keeps its
            # memory until that stream is done with it.
            stream = self._copy_stream
            stream.wait_stream(cuda_device.current(self._device_index))
            grad.record_stream(stream)
            if convert:
                with torch.cuda.stream(stream):
                    grad = grad.to(self._grad_dtypes[i], memory_format=torch.contiguous_format)
            pointer = stream.cuda_stream
            self._host.send_gradient(i, micro, grad, pointer)
        else:
            # On the compute stream, in a batch: its later work (reusing this memory once the
            # batch lets go of it) is ordered after the copies.
            self._add_to_batch(i, micro, grad, nbytes)
        self.bytes_to_host += nbytes
        p.grad = None  # no gradient stays in VRAM

    def _add_to_batch(self, i: int, micro: int, grad: torch.Tensor, nbytes: int) -> None:
        pointer = cuda_device.current_pointer(self._device_index)
        if self._batch and pointer != self._batch_stream:
            self._send_batch()
        if _graph_task() == -1:  # not inside a backward (no end to wait for): sent now
            self._host.send_gradient(i, micro, grad, pointer)
            return
        self._at_backward_end()  # sent then at the latest (a recompute's inner backward too)
        self._batch.append((i, micro, grad))
        self._batch_stream = pointer
        self._batch_bytes += nbytes
        if len(self._batch) >= _BATCH_GRADIENTS or self._batch_bytes >= _BATCH_BYTES:
            self._send_batch()

    def _send_batch(self) -> None:
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        if batch:
            self._host.send_gradients(batch, self._batch_stream)

    def stop_returning(self, param_ids: set) -> None:
        """These parameters' updates are no longer copied to the device (their device memory is
        about to go): waits for copies in flight first. Any of them updated in VRAM go back to
        the daemon first (their weights will be its host copies)."""
        if any(id(self._params[i]) in param_ids for i in self._device_indices):
            def kept(indices: set) -> set:
                return {id(self._params[i]) for i in indices
                        if id(self._params[i]) not in param_ids}
            self.keep_state_on_device(kept(self._device_indices - self._staged_indices),
                                      kept(self._staged_indices))
        self.synchronize()
        self._module_indices.clear()  # which parameters come back changes
        self._waited_modules.clear()
        for i, p in enumerate(self._params):
            if id(p) in param_ids:
                self._paged_indices.add(i)
                if self._device_return and self._targets[i] != 0:
                    self._host._native.retarget_device(i, 0, 0)
                    self._targets[i] = 0

    def resume_returning(self, param_ids: set) -> None:
        """These parameters hold device tensors again (blocks that stopped streaming): their
        updates are copied there from the next step on."""
        self.synchronize()
        self._module_indices.clear()  # which parameters come back changes
        self._waited_modules.clear()
        for i, p in enumerate(self._params):
            if id(p) in param_ids and i in self._paged_indices:
                self._paged_indices.discard(i)
                if self._device_return:
                    self._host._native.retarget_device(i, p.data_ptr(),
                                                       p.numel() * p.element_size())
                    self._targets[i] = p.data_ptr()

    def page_weights(self, pager: Any) -> None:
        """Parameters of ``pager``'s blocks are read from host memory at every use: their
        updates are not copied back, and each step tells the pager the host copies changed."""
        self._pager = pager
        self.stop_returning({id(p) for params in pager.params.values() for p in params})

    # -- state kept in VRAM ---------------------------------------------------------------------

    def _returned(self, i: int) -> bool:
        """Whether parameter ``i``'s updates come back from the daemon to its device tensor
        (not a streamed block's, read from the host copy; not one updated in VRAM)."""
        return i not in self._paged_indices and i not in self._device_indices

    def gpu_state_refusal(self) -> str | None:
        """Why no parameter's AdamW state may move to VRAM in this job (None: it may)."""
        if not self._cuda:
            return "a CPU model's updates land in place in the daemon's shared memory"
        if self._world_size > 1 or self._machines > 1:
            return "a data-parallel job keeps one state in trainstreamd for every rank"
        if self._reports_norm:
            return ("max_grad_norm and compute_grad_norm need every gradient's norm in one "
                    "place, the daemon")
        if self._nonfinite in ("skip", "error"):
            return (f"nonfinite={self._nonfinite!r} checks every gradient in the daemon "
                    "before any update")
        if self._moment_dtype != torch.float32:
            return BF16_MOMENTS_REFUSAL
        if self._gpu_optimizer is not None:
            return "the whole optimizer runs on the GPU already (offload='auto')"
        if not any(p.dtype == torch.float32 for p in self._params):
            return ("no parameter is fp32: the fp32 master weights of the others are the "
                    "daemon's")
        return None

    def device_state_candidates(self, param_ids: set) -> list[int]:
        """Of these parameters, the indices whose state may live in VRAM: fp32 ones (their
        master weights are the parameters themselves) whose weights do not stream."""
        return [i for i, p in enumerate(self._params)
                if id(p) in param_ids and p.dtype == torch.float32
                and i not in self._paged_indices]

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
        instead of 4. Between steps only. Returns the elements whose state is in VRAM."""
        reason = self.gpu_state_refusal()
        staged = {i for i in self.device_state_candidates(set(staged_ids) - set(param_ids))
                  if self._params[i].is_contiguous()}  # updated through flat views
        wanted = set(self.device_state_candidates(param_ids)) | staged
        if reason is not None and wanted:
            raise FailedPreconditionError(f"optimizer state cannot move to VRAM: {reason}")
        if any(self._backwards):
            raise FailedPreconditionError(
                "optimizer state moves between steps, not between backward and step()")
        held, new_held = self._device_indices - self._staged_indices, wanted - staged
        if held == new_held and staged == self._staged_indices:
            return self.device_state_elements
        self.synchronize()
        # Every parameter whose place changes goes through the daemon: its state is made whole
        # there (moments, steps, master weights), then taken from there.
        steps = self._param_steps()
        old = self._device_optimizer
        leaving_held = sorted(held - new_held)
        leaving_staged = sorted(self._staged_indices - staged)
        if leaving_held:
            steps = self._moments_to_daemon(old, leaving_held)
        for i in leaving_staged:
            steps[i] = self._staged_to_daemon(i)
        if leaving_held or leaving_staged:
            self._host.set_step(self._host.iteration, steps)
        self._device_optimizer = self._device_optimizer_for(sorted(new_held))
        if old is not None:  # the staying ones keep their state as it is
            for i in sorted(new_held & held):
                p = self._params[i]
                if p in old.state:
                    self._device_optimizer.state[p] = old.state[p]
        arriving_held = sorted(new_held - held)
        if arriving_held:
            self._moments_from_daemon(self._device_optimizer, arriving_held)
        if staged and self._staged is None:
            guard = self._device_guard()
            self._staged = StagedAdamW(self._params[0].device, self._kind,
                                       found_inf=guard.found if guard is not None else None)
        for i in sorted(staged - self._staged_indices):
            self._staged.set_steps(i, self._params[i].numel(), steps[i])
        group_of = {id(p): k for k, g in enumerate(self.param_groups) for p in g["params"]}
        self._staged_groups = {i: group_of[id(self._params[i])] for i in staged}
        if not staged:
            self._staged = None  # its slots' VRAM goes back
        for i in sorted(self._device_indices - wanted):
            p = self._params[i]
            if self._device_return:
                self._host._native.retarget_device(i, p.data_ptr(),
                                                   p.numel() * p.element_size())
                self._targets[i] = p.data_ptr()
        for i in sorted(wanted - self._device_indices):
            if self._device_return:  # nothing of the daemon's is copied there any more
                self._host._native.retarget_device(i, 0, 0)
                self._targets[i] = 0
        self._device_indices, self._staged_indices = wanted, staged
        self._module_indices.clear()  # which parameters come back changed
        self._waited_modules.clear()
        if wanted:
            _register_exit_return(self)
        else:
            _unregister_exit_return(self)
        return self.device_state_elements

    @property
    def device_state_elements(self) -> int:
        """Elements whose AdamW state lives in VRAM (keep_state_on_device)."""
        return sum(self._params[i].numel() for i in self._device_indices - self._staged_indices)

    @property
    def staged_state_elements(self) -> int:
        """Elements updated on the GPU with their moments staged from the daemon."""
        return sum(self._params[i].numel() for i in self._staged_indices)

    def _hyper(self, i: int) -> tuple:
        """Staged parameter ``i``'s group's hyper-parameters as they are now (a scheduler's)."""
        g = self.param_groups[self._staged_groups[i]]
        return (float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]), float(g["eps"]),
                float(g["weight_decay"]))

    def _staged_to_daemon(self, i: int, forget: bool = True) -> int:
        """Staged parameter ``i``'s weights into the daemon's master (its moments are there
        already); returns its steps. After synchronize()."""
        self._weights_to_daemon(i)
        steps = self._staged.steps_of(i)
        if forget:
            self._staged.forget(i)
        return steps

    def _device_optimizer_for(self, indices: list) -> torch.optim.Optimizer | None:
        self._device_groups = []
        if not indices:
            return None
        chosen = {id(self._params[i]) for i in indices}
        groups = []
        for k, g in enumerate(self.param_groups):
            params = [p for p in g["params"] if id(p) in chosen]
            if params:
                groups.append(dict(params=params, **_torch_group(g)))
                self._device_groups.append(k)
        cls = torch.optim.AdamW if self._kind == "adamw" else torch.optim.Adam
        return cls(groups, fused=True)

    def _device_guard(self) -> DeviceGuard | None:
        """nonfinite="guard" on the GPU (nonfinite_guard.py): made at the first update there."""
        if self._nonfinite != "guard" or not self._cuda:
            return None
        if self._guard is None:
            self._guard = DeviceGuard(self._params[0].device)
        return self._guard

    def _say_guarded(self, where: str) -> None:
        """A step that stopped at a non-finite gradient value: an event and a warning."""
        message = (f"step {self.steps}: non-finite gradient values; {where} nothing of the step "
                   "was applied from the first of them on (nonfinite='guard'; 'ignore' applies "
                   "them, 'skip' checks every gradient before any update)")
        self._on_decision("optimizer.nonfinite", message, step=self.steps)
        warnings.warn(f"trainstream: {message}", stacklevel=3)

    def _step_on_device(self) -> None:
        """Updates the parameters whose state lives in VRAM (queued on the current stream), with
        the groups' hyper-parameters as they are now (a scheduler's lr)."""
        guard = self._device_guard() if (self._staged is not None
                                         or self._device_optimizer is not None) else None
        if guard is not None and guard.last_step_found():
            self._say_guarded("among the parameters updated on the GPU,")
        if self._staged is not None:
            current = cuda_device.current(self._device_index)
            self._staged.flush(current)
            self._staged.join(current)  # the next forward reads their new weights
        optimizer = self._device_optimizer
        if optimizer is not None:
            for g, k in zip(optimizer.param_groups, self._device_groups):
                g.update(_torch_group(self.param_groups[k]))
            if guard is not None:
                # After the staged chunks' checks (joined above): one flag for the step.
                guard.check([self._params[i].grad for i in
                             self._device_indices - self._staged_indices])
                optimizer.found_inf = guard.found  # torch's fused AdamW reads it
            # A forward under inference_mode may complete the iteration (_settle_updates): the
            # moments torch creates on a first update must still be ordinary tensors.
            with torch.inference_mode(False):
                optimizer.step()
            for i in self._device_indices:
                self._params[i].grad = None  # no gradient stays in VRAM past step()
        if guard is not None:
            guard.end_step()

    def _moments_from_daemon(self, optimizer: torch.optim.Optimizer, indices: Iterable[int]
                             ) -> None:
        """Loads the daemon's moments and steps of these parameters into a GPU optimizer."""
        steps = self._param_steps()
        for i in indices:
            p = self._params[i]
            optimizer.state.pop(p, None)
            if steps[i] == 0:
                continue  # never stepped: torch keeps no state for it
            optimizer.state[p] = {
                "step": torch.tensor(float(steps[i]), dtype=torch.float32, device=p.device),
                "exp_avg": self._host.exp_avg(i).to(p.device, torch.float32, copy=True),
                "exp_avg_sq": self._host.exp_avg_sq(i).to(p.device, torch.float32, copy=True),
            }

    def _moments_to_daemon(self, optimizer: torch.optim.Optimizer | None,
                           indices: Iterable[int]) -> list[int]:
        """Copies a GPU optimizer's moments and these parameters' values into the daemon's
        buffers; returns every parameter's step count with these ones' from the GPU (for
        ``set_step``)."""
        steps = self._param_steps()
        for i in indices:
            p = self._params[i]
            entry = optimizer.state.get(p) if optimizer is not None else None
            steps[i] = int(entry["step"]) if entry else 0
            if entry:
                self._host.exp_avg(i).copy_(entry["exp_avg"].reshape(p.shape))
                self._host.exp_avg_sq(i).copy_(entry["exp_avg_sq"].reshape(p.shape))
            self._weights_to_daemon(i)
        return steps

    def _weights_to_daemon(self, i: int) -> None:
        """Parameter ``i``'s value on the GPU into the daemon's master (and model-dtype) copy."""
        p = self._params[i]
        self._host.master(i).copy_(p.detach().reshape(p.shape))
        if self._host.param(i).data_ptr() != self._host.master(i).data_ptr():
            self._host.param(i).copy_(p.detach())

    def _param_steps(self) -> list[int]:
        """Every parameter's AdamW step count as the daemon has it."""
        return list(self._host.info().get("param_steps", [0] * len(self._params)))

    def _device_state_from_daemon(self) -> None:
        """The VRAM-held state takes the daemon's (after a load)."""
        held = sorted(self._device_indices - self._staged_indices)
        if held:
            self._moments_from_daemon(self._device_optimizer, held)
        if self._staged_indices:  # their moments are the daemon's; their steps too now
            self._staged.synchronize()
            steps = self._param_steps()
            for i in self._staged_indices:
                self._staged.set_steps(i, self._params[i].numel(), steps[i])

    def _device_state_to_daemon(self) -> None:
        """The daemon's copy of the VRAM-held state catches up (before a checkpoint)."""
        if self._device_indices:
            if any(self._backwards):  # a step in progress, or one that failed
                raise FailedPreconditionError(
                    "a step is in progress; checkpoint between steps (after step())")
            held = sorted(self._device_indices - self._staged_indices)
            steps = self._moments_to_daemon(self._device_optimizer, held)
            if self._staged_indices:
                self._staged.synchronize()
                for i in self._staged_indices:
                    steps[i] = self._staged_to_daemon(i, forget=False)
            self._host.set_step(self._host.iteration, steps)

    def _check_targets(self) -> None:
        if not self._device_return:
            return
        moved = [i for i, p in enumerate(self._params)
                 if self._returned(i) and p.data_ptr() != self._targets[i]]
        if moved:
            # The old storage may be reused already: nothing may still be copying into it.
            self._host._native.synchronize_device_returns()
        for i in moved:
            # Someone gave the parameter new storage (p.data = ...): copy there from now on.
            p = self._params[i]
            self._host._native.retarget_device(i, p.data_ptr(), p.numel() * p.element_size())
            self._targets[i] = p.data_ptr()

    def _finish_after_backward(self) -> None:
        # The iteration may be completed early only once the backward that produced its last
        # gradients has ended (not from another thread while it runs): marked at its end. A
        # gradient still arriving (an outer backward after a recompute's inner one) unmarks it
        # until its own end.
        self._finishable = False
        self._finish_pending = True
        self._at_backward_end()

    def _at_backward_end(self) -> None:
        """Has _backward_ended run when the backward running now ends (once per backward; on
        every call where torch cannot tell one backward from another)."""
        task = _graph_task()
        if task != self._end_task or task == -1:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended_timed)
            self._end_task = task

    def _backward_ended(self) -> None:
        self._send_batch()
        if self._staged is not None:
            self._staged.flush(cuda_device.current(self._device_index))
        if self._finish_pending:
            self._finish_pending = False
            self._finishable = True

    def _settle_updates(self) -> None:
        """Between the last backward and step(), updates are still landing: a forward, or a
        checkpoint, completes the iteration first and reads the new values, all of them. Not
        in a data-parallel job, where completing waits for every rank's gradients and joins
        the machines' all-reduce, which the other ranks reach only from their step()."""
        if (self._finishable and not _in_backward() and self._gpu_optimizer is None
                and self._world_size == 1 and self._machines == 1):
            self._finishable = False  # once: a failure is raised again by step(), not here
            self._complete_iteration()
            self._completed_early = True

    def _wait_for_own_parameters(self, module: Any, args: Any) -> None:
        self._settle_updates()  # a submodule called on its own, say
        key = id(module)
        if key in self._waited_modules and (not self._updates_landing or _in_backward()):
            # Waited on since the last step(), and no update of its own can have come back
            # since: updates land only once the last backward before step() has produced
            # their gradients, after the module's last forward or recompute in it. (A forward
            # between that backward and step(), an evaluation say, waits again.)
            return
        self._waited_modules.add(key)
        # The module's trained parameters whose updates come back to the device (a streamed
        # block's are read from the host copy at each fetch: nothing to wait for).
        indices = self._module_indices.get(key)
        if indices is None:
            indices = [self._index[id(p)] for p in module.parameters(recurse=key in
                                                                     self._wait_blocks)
                       if id(p) in self._index and self._returned(self._index[id(p)])]
            self._module_indices[key] = indices
        if not indices:
            return
        stream = cuda_device.current(self._device_index)
        if self._ready:
            for i in indices:
                event = self._ready.pop(id(self._params[i]), None)
                if event is not None:
                    stream.wait_event(event)
        if self._device_return:
            self._host._native.wait_for_parameters(indices, stream.cuda_stream)

    def attach_forward_waits(self, model: torch.nn.Module, blocks: Iterable[Any] = ()) -> None:
        """Makes each module's forward wait for its own parameters' new values (CUDA), and a
        forward between the last backward and step() wait for every update (CPU too).
        Each of ``blocks`` (the repeated layers, each a module the model calls: a ModuleList of
        a layer's parts is iterated, not called, and has no forward to hook) waits once, for
        every trained parameter inside it: one hook where a LoRA block would have seven, and none that a recomputed block's
        second forward calls again (its updates cannot have come back by then)."""
        if id(model) not in self._hooked_models:
            # A forward or a checkpoint between the last backward and step() completes the
            # iteration first, on a CPU too (updates land in place there).
            self._hooked_models.add(id(model))
            self._hooks.append(model.register_forward_pre_hook(
                lambda module, args: self._settle_updates()))
            if hasattr(model, "register_state_dict_pre_hook"):
                self._hooks.append(model.register_state_dict_pre_hook(
                    lambda module, prefix, keep_vars: self._settle_updates()))
        if not self._cuda:
            return
        self._model = model
        self._wait_blocks.update({id(b): b for b in blocks})
        inside_blocks = {id(m) for b in self._wait_blocks.values() for m in b.modules()}
        candidates = [(b, True) for b in self._wait_blocks.values()] + [
            (m, False) for m in model.modules() if id(m) not in inside_blocks]
        for module, whole in candidates:
            if id(module) in self._hooked_modules:
                continue
            # Only modules that own a trained parameter have copies to wait for (a frozen
            # base's layers get none): a pre-hook on every module costs each forward a call.
            if any(id(p) in self._index for p in module.parameters(recurse=whole)):
                self._hooked_modules.add(id(module))
                self._hooks.append(module.register_forward_pre_hook(self._forward_wait_timed))
        self._module_indices.clear()  # parameters may have been added since
        if hasattr(model, "register_state_dict_pre_hook") and id(model) not in self._hooked_dicts:
            self._hooked_dicts.add(id(model))
            # A checkpoint reads every weight outside forward: let the copies land first.
            self._hooks.append(model.register_state_dict_pre_hook(
                lambda module, prefix, keep_vars: self.synchronize()))

    def synchronize(self) -> None:
        """Blocks until every queued copy in either direction has landed."""
        if self._cuda:
            self._send_batch()
            self._host.drain_gradients()
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
            self._ready.clear()
        if self._device_return:
            self._host._native.synchronize_device_returns()
        if self._staged is not None:
            self._staged.synchronize()

    def detach(self) -> None:
        """Removes the hooks; CPU weights move out of shared memory into ordinary tensors."""
        self.synchronize()
        if self._device_indices:
            if any(self._backwards):
                warnings.warn("trainstream: unwrapped between backward and step(): the AdamW "
                              "state held in VRAM stays as of its last move or checkpoint in "
                              "trainstreamd", stacklevel=3)
            else:
                # The daemon holds the whole job's state again (a later process may resume it).
                self.keep_state_on_device(set())
        _unregister_exit_return(self)
        if self._pager is not None:
            self._pager.close()  # paged weights get tensors of their own again
            self._pager, self._paged_indices = None, set()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if not self._cuda:
            for i, p in enumerate(self._params):
                p.data = self._host.param(i).clone()
                p.grad = None

    # -- torch.optim.Optimizer ----------------------------------------------------------------

    # torch.amp.GradScaler hands itself to step() when this is set, so fp16 scaling is caught
    # here with a clear message instead of failing inside the scaler.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure: Any = None, grad_scaler: Any = None, **kwargs: Any) -> Any:
        """Waits for every parameter's update (most finished during backward) and starts the
        copies of the new weights back to the GPU."""
        if self._gpu_optimizer is not None:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if self._reports_norm:
                # What the daemon did before the switch: clip (or only measure) the global norm.
                norm = torch.nn.utils.clip_grad_norm_(self._params,
                                                      self._max_grad_norm or float("inf"))
                self.last_grad_norm = float(norm)
            guard = self._device_guard()
            if guard is not None:
                if guard.last_step_found():
                    self._say_guarded("")
                guard.check([p.grad for p in self._params])
                self._gpu_optimizer.found_inf = guard.found  # torch's fused AdamW reads it
            self._gpu_optimizer.step()
            if guard is not None:
                guard.end_step()
            self._steps_on_gpu += 1
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
        backwards = max(self._backwards)
        if 0 < backwards < self.accumulation_steps:
            raise FailedPreconditionError(
                f"step() after {backwards} backward pass(es); accumulation_steps is "
                f"{self.accumulation_steps}")
        if not self._completed_early:
            self._complete_iteration()
        self._completed_early = self._finishable = self._finish_pending = False
        now = time.perf_counter()
        if self._last_step_end is not None:
            self._step_times.append(now - self._last_step_end)
        self._last_step_end = now
        if self._adaptive is not None:
            self._adaptive.after_step()
        # Decided once the memory plan has settled: its peaks are what the choice compares.
        if (self._switch_when_fits and self._host.iteration >= _AUTO_STEPS
                and (self._adaptive is None or not self._adaptive.adapting)):
            self._switch_when_fits = False
            self._decide_offload()
        return loss

    def _complete_iteration(self) -> None:
        """Waits for every update of the iteration (most finished during backward) and starts
        their copies back: step()'s work, done early by a forward between the last backward
        and step(). Updates land during backward, so such a forward would otherwise read
        whichever had landed; it reads all of them instead."""
        self._push_hyperparameters()
        if self._cuda:
            self._send_batch()
            self._host.drain_gradients()
        for i, count in enumerate(self._backwards):
            # No gradient this step: left alone, as torch does; one updated in VRAM: by the
            # GPU, below.
            if count == 0 or i in self._device_indices:
                for micro in range(self._host.accumulation_steps):
                    self._host.post(i, micro, no_grad=True)
        if self._leader:
            self._reduce_across_machines()
        # Queued on the GPU before waiting for the host's updates: the two overlap.
        self._step_on_device()
        result = self._host.wait()
        if result["skipped"] and self._nonfinite == "guard":
            self._say_guarded("in trainstreamd's pass (tsctl events has the count),")
        # Every update of this step is on its way back (the router enqueued each copy before
        # passing its notice on): the next forward of each module waits again.
        self._waited_modules.clear()
        self._updates_landing = False
        if self._pager is not None:
            self._pager.weights_changed()
        if self._cuda:
            self.bytes_to_device += sum(
                p.numel() * p.element_size() for i, p in enumerate(self._params)
                if result["updated"][i] and i not in self._paged_indices)
        self._backwards = [0] * len(self._params)
        self._grads_this_iteration = 0
        if self._reports_norm:
            self.last_grad_norm = self._host.info()["last_step"]["grad_norm"]
        if self._cuda and not self._device_return:
            stream = self._copy_stream
            for i, p in enumerate(self._params):
                if result["updated"][i] and i not in self._paged_indices:
                    self._host.param_buffer(i).copy_to_device(p.data, stream=stream)
                    event = torch.cuda.Event()
                    event.record(stream)
                    self._ready[id(p)] = event

    # -- offload="auto" -----------------------------------------------------------------------

    def _decide_offload(self) -> None:
        """Moves the optimizer to torch's fused GPU AdamW when the model, its gradients and both
        moments fit in VRAM under the cap with the headroom left, as measured over the first
        steps; otherwise keeps it in the daemon. Either way, says so in an event."""
        numel = sum(p.numel() for p in self._params)
        step_ms = 1000 * min(self._step_times) if self._step_times else 0.0
        if not self._cuda:
            self._on_decision("wrap.offload", "CPU model: the optimizer stays in trainstreamd",
                              parameters=numel)
            return
        if self._world_size > 1 or self._machines > 1:
            self._on_decision("wrap.offload", "data parallel job: the optimizer stays in "
                              "trainstreamd (one state for every rank)", parameters=numel)
            return
        if self._pager is not None and self._pager.paged:
            self._on_decision("wrap.offload", "weights are paged from host memory: the "
                              "optimizer stays in trainstreamd, where they are updated",
                              parameters=numel)
            return
        if self._nonfinite in ("skip", "error"):
            self._on_decision("wrap.offload", f"nonfinite={self._nonfinite!r}: the optimizer "
                              "stays in trainstreamd, which checks every gradient before a step",
                              parameters=numel)
            return
        odd = sorted({str(p.dtype) for p in self._params if p.dtype != torch.float32})
        if odd:
            self._on_decision("wrap.offload", f"parameters in {', '.join(odd)}: the optimizer "
                              "stays in trainstreamd, which keeps their fp32 master weights",
                              parameters=numel)
            return
        device = self._params[0].device
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = 1.0
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if getter is not None:
            fraction = float(getter(device))
        limit = total * fraction
        peak = torch.cuda.max_memory_allocated(device)
        allowed = (1.0 - self._vram_headroom) * limit
        if self._adaptive is not None:
            # The memory plan's budget (vram_budget=, what else the process holds) binds too.
            peak -= self._adaptive.others
            allowed = min(allowed, self._adaptive.budget)
        # Stock AdamW keeps every gradient and both fp32 moments in VRAM: 12 bytes a parameter
        # more than the offloaded steps measured (those updated in VRAM already counted).
        need = peak + 12 * (numel - self.device_state_elements)
        numbers = dict(parameters=numel, peak_bytes=peak, need_bytes=need,
                       allowed_bytes=allowed, offloaded_step_ms=step_ms)
        if need > allowed:
            self._on_decision(
                "wrap.offload", f"kept offloaded: torch AdamW on {device} would need "
                f"{need / 2**30:.2f} GiB (peak {peak / 2**30:.2f} GiB + 12 B x {numel:,} "
                f"parameters), more than {allowed / 2**30:.2f} GiB ({1 - self._vram_headroom:.0%} "
                f"of the {limit / 2**30:.2f} GiB this process may use)", **numbers)
            return
        self._switch_to_gpu()
        self._on_decision(
            "wrap.offload", f"switched to torch fused AdamW on {device}: the model fits "
            f"({need / 2**30:.2f} GiB of the {allowed / 2**30:.2f} GiB allowed); offloaded steps "
            f"took {step_ms:.1f} ms", **numbers)

    def _switch_to_gpu(self) -> None:
        self.synchronize()
        self.keep_state_on_device(set())  # the daemon's state is whole, then all moves
        if self._adaptive is not None:
            self._adaptive.state_left_vram()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        cls = torch.optim.AdamW if self._kind == "adamw" else torch.optim.Adam
        # The same group dicts: a scheduler that holds this optimizer keeps working.
        gpu = cls(self.param_groups, fused=True)
        self._gpu_optimizer = gpu
        self._steps_at_switch = self._host.iteration
        if self._adaptive is not None:
            self._adaptive.weights_fixed = True  # nothing left in the daemon to stream from
        self._load_gpu_state_from_daemon()
        for p in self._params:
            p.grad = None
        self.state = gpu.state
        self.param_groups = gpu.param_groups  # one list: groups added later reach both

    def _load_gpu_state_from_daemon(self) -> None:
        self._gpu_optimizer.state.clear()
        self._moments_from_daemon(self._gpu_optimizer, range(len(self._params)))

    @property
    def on_gpu(self) -> bool:
        """True once offload='auto' moved the optimizer to torch's fused GPU AdamW."""
        return self._gpu_optimizer is not None

    def _reduce_across_machines(self) -> None:
        """Sums every parameter's machine-summed gradient over the machines, in place in the
        daemon's reduce buffers, in one fixed order on every machine (the collectives must line
        up), then lets the daemon update each."""
        import torch.distributed as dist

        order = list(reversed(range(len(self._params))))  # backward's: the first ready first
        had = torch.tensor([float(self._host.wait_reduce_ready(i)) for i in order])
        # Which parameters any machine had a gradient for: the others are left alone, as on
        # one machine, and need no all-reduce.
        dist.all_reduce(had, op=dist.ReduceOp.MAX, group=self._machine_group)
        for i, any_gradient in zip(order, had.tolist()):
            if any_gradient:
                dist.all_reduce(self._host.reduce(i), group=self._machine_group)
            self._host.post_reduced(i, bool(any_gradient))

    def _push_hyperparameters(self) -> None:
        # A scheduler changes lr between steps: the daemon gets it before the next updates.
        current = [_group(g) for g in self.param_groups]
        if current != self._pushed:
            self._host.set_groups(current)
            self._pushed = current

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._gpu_optimizer is not None:
            self._gpu_optimizer.zero_grad(set_to_none)
            return
        if self._cuda:
            for p in self._params:
                p.grad = None
        else:
            for i, p in enumerate(self._params):
                self._host.grad(i).zero_()
                p.grad = self._host.grad(i)  # backward accumulates into the shared slot

    def add_param_group(self, param_group: dict) -> None:
        """Adds a group between steps (a layer unfrozen mid-run): its parameters get their state
        in the daemon, starting from their current values, and train from the next step."""
        if getattr(self, "_host", None) is None:  # torch's constructor adds the first groups
            super().add_param_group(param_group)
            return
        if self._gpu_optimizer is not None:
            self._gpu_optimizer.add_param_group(param_group)
            return
        if self._world_size > 1 or self._machines > 1:
            raise FailedPreconditionError(
                "add_param_group in a data-parallel job is not supported: pass every group when "
                "building the optimizer")
        if any(self._backwards):
            raise FailedPreconditionError(
                "add_param_group between backward and step(): add groups between steps")
        super().add_param_group(param_group)  # torch's checks and defaults
        group = self.param_groups[-1]
        new = [p for p in group["params"] if p.requires_grad]
        bad = [p for p in new if p.device != self._params[0].device]
        if bad:
            self.param_groups.pop()
            raise InvalidArgumentError(
                f"the new group has a parameter on {bad[0].device}; the others are on "
                f"{self._params[0].device}")
        start = len(self._params)
        grad_dtypes = [self._gradient_dtype or p.dtype for p in new]
        specs = [ParameterSpec(_safe_name(self._names.get(p, f"param{i}")), tuple(p.shape),
                               p.dtype, grad_dtypes[k], len(self.param_groups) - 1)
                 for k, (i, p) in enumerate(zip(range(start, start + len(new)), new))]
        groups = [_group(g) for g in self.param_groups]
        if not new:  # only frozen parameters: the daemon just learns the group
            self._host.set_groups(groups)
            self._pushed = groups
            self._all += group["params"]
            return
        try:
            first = self._host.add_parameters(specs, groups)
        except BaseException:
            # Back to the groups the daemon had (it drops a group no parameter is in).
            self.param_groups.pop()
            self._host.set_groups(self._pushed)
            raise
        self._pushed = groups
        self._all += group["params"]
        self._params += new
        for i, p in enumerate(new, start=start):
            self._index[id(p)] = i
        self._grad_dtypes += grad_dtypes
        self._grad_sizes += [d.itemsize for d in grad_dtypes]
        if first <= start:
            self._host.load_weights([p.detach().float().cpu() for p in new], first=start)
        self._backwards += [0] * len(new)
        if self._device_return:
            self._targets += [p.data_ptr() for p in new]
            self._host._native.add_device_targets(
                [(p.data_ptr(), p.numel() * p.element_size()) for p in new])
        for i, p in enumerate(new, start=start):
            self._take_over(i, p)
        if self._model is not None:
            self.attach_forward_waits(self._model)

    def state_dict(self) -> dict:
        """``torch.optim.AdamW``-compatible, plus ``"master"``: the fp32 master weights."""
        if self._gpu_optimizer is not None:
            return self._gpu_optimizer.state_dict()
        self._settle_updates()  # between the last backward and step(): the updated state
        if self._staged is not None:
            self._staged.synchronize()  # the daemon's moments of staged ones are current
        ours = self._host.state_dict()
        for i in self._device_indices:  # the VRAM-held state, as it is now
            p = self._params[i]
            if i in self._staged_indices:
                entry = None
                steps = self._staged.steps_of(i)
                if steps:
                    entry = {"step": torch.tensor(float(steps)),
                             "exp_avg": self._host.exp_avg(i).clone(),
                             "exp_avg_sq": self._host.exp_avg_sq(i).clone()}
            else:
                entry = self._device_optimizer.state.get(p)
            ours["state"].pop(i, None)
            if entry:
                ours["state"][i] = {"step": entry["step"].detach().cpu().clone(),
                                    "exp_avg": entry["exp_avg"].detach().cpu().clone(),
                                    "exp_avg_sq": entry["exp_avg_sq"].detach().cpu().clone()}
            ours["master"][i] = p.detach().float().cpu().clone()
        position = {id(p): n for n, p in enumerate(self._all)}
        state = {position[id(self._params[i])]: entry for i, entry in ours["state"].items()}
        groups = []
        for g in self.param_groups:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry.update(amsgrad=False, maximize=False, foreach=None, capturable=False,
                         differentiable=False, fused=None)
            entry["params"] = [position[id(p)] for p in g["params"]]
            groups.append(entry)
        return {"state": state, "param_groups": groups, "master": ours["master"],
                "iteration": ours["iteration"]}

    def load_state_dict(self, state_dict: dict) -> None:
        self._settle_updates()  # the updates landing now would write over what is loaded
        self.synchronize()  # and so would copies still in flight (staged moments, weights)
        if "master" not in state_dict:
            # The weights stay as they are: the daemon's master of the VRAM-held ones first
            # catches up, since the load copies every master back to the model.
            self._device_state_to_daemon()
        if self._gpu_optimizer is not None:
            if "master" in state_dict:
                with torch.no_grad():
                    for p, master in zip(self._params, state_dict["master"]):
                        p.copy_(master.reshape(p.shape))
            self._gpu_optimizer.load_state_dict(
                {k: v for k, v in state_dict.items() if k in ("state", "param_groups")})
            return
        position = {id(p): n for n, p in enumerate(self._all)}
        ours_state = {}
        for i, p in enumerate(self._params):
            key = position[id(p)]
            if key in state_dict["state"]:
                ours_state[i] = state_dict["state"][key]
        groups = [dict(g, params=[self._index[id(p)] for p in mine["params"] if p.requires_grad])
                  for g, mine in zip(state_dict["param_groups"], self.param_groups)]
        converted = {"state": ours_state, "param_groups": groups}
        if "master" in state_dict:
            converted["master"] = state_dict["master"]
        if "iteration" in state_dict:
            converted["iteration"] = state_dict["iteration"]
        self._host.load_state_dict(converted)
        for g, loaded in zip(self.param_groups, state_dict["param_groups"]):
            for key in ("lr", "betas", "eps", "weight_decay"):
                g[key] = loaded[key]
        self._pushed = [_group(g) for g in self.param_groups]
        self.refresh_weights()
        self._device_state_from_daemon()

    def refresh_weights(self) -> None:
        """Brings the model's weights to the daemon's (after a load, or when joining a job whose
        state another rank created). CPU weights are the daemon's memory already."""
        if self._cuda:
            if self._device_return:
                # A returning copy still in flight must not land after these.
                self._host._native.synchronize_device_returns()
            for i, p in enumerate(self._params):
                if i in self._paged_indices:
                    continue  # read from the host copy at its next use
                self._host.param_buffer(i).copy_to_device(p.data, stream=self._copy_stream)
            self._copy_stream.synchronize()
        if self._pager is not None:
            self._pager.weights_changed()

    def save(self, path: str) -> int:
        """Checkpoints the optimizer state by the daemon (atomic rename)."""
        self._settle_updates()  # between the last backward and step(): the updated state
        if self._gpu_optimizer is not None:
            # The state lives in VRAM now: hand the daemon a copy, then let it write the file.
            param_steps = self._moments_to_daemon(self._gpu_optimizer, range(len(self._params)))
            self._host.set_groups([_group(g) for g in self.param_groups])
            self._host.set_step(self.steps, param_steps)
            self._steps_at_switch, self._steps_on_gpu = self.steps, 0
        self._device_state_to_daemon()
        return self._host.save(path)

    def load(self, path: str) -> None:
        self._settle_updates()  # the updates landing now would write over what is loaded
        self.synchronize()  # and so would copies still in flight (staged moments, weights)
        self._host.load(path)
        self.refresh_weights()
        self._device_state_from_daemon()
        if self._gpu_optimizer is not None:
            # The GPU optimizer continues from the checkpoint's moments and steps.
            self._load_gpu_state_from_daemon()
            self._steps_at_switch, self._steps_on_gpu = self._host.iteration, 0

    @property
    def steps(self) -> int:
        if self._gpu_optimizer is not None:
            return self._steps_at_switch + self._steps_on_gpu
        return self._host.iteration

    def stats(self) -> dict:
        """The daemon's figures for this job's optimizer (and where the optimizer runs now)."""
        info = self._host.info()
        info["runs_on"] = "gpu" if self._gpu_optimizer is not None else "trainstreamd"
        # Parameters updated in VRAM by torch's fused AdamW (keep_state_on_device).
        info["gpu_state"] = {"tensors": len(self._device_indices - self._staged_indices),
                             "elements": self.device_state_elements,
                             "moment_bytes": 8 * self.device_state_elements}
        # Updated on the GPU from moments staged out of the daemon (keep_state_on_device).
        staged = self._staged
        info["staged_state"] = {"tensors": len(self._staged_indices),
                                "elements": self.staged_state_elements,
                                "chunks": staged.chunks if staged else 0,
                                "bytes_each_way": staged.bytes_each_way if staged else 0}
        info["steps"] = self.steps
        return info


def _graph_task() -> int:
    """The autograd backward this thread runs now (its graph task id), -1 when none."""
    return _current_graph_task() if _current_graph_task is not None else -1


# Each backward's id, from torch (-1 outside one); a torch without it sends each gradient on
# its own, and lets every forward wait.
_current_graph_task = getattr(torch._C, "_current_graph_task_id", None)


def _in_backward() -> bool:
    """Whether this thread runs an autograd backward now (a recompute inside it, say)."""
    return _graph_task() != -1


# Optimizers holding AdamW state in VRAM: at interpreter exit their state goes back to the
# daemon, so a process that ends without unwrap() leaves the job whole for a restart.
_exit_returns: "weakref.WeakSet[OffloadAdamW]" = weakref.WeakSet()


_exit_hook: list = []  # registered once


def _register_exit_return(optimizer: OffloadAdamW) -> None:
    if not _exit_hook:
        _exit_hook.append(atexit.register(_return_state_at_exit))
    _exit_returns.add(optimizer)


def _unregister_exit_return(optimizer: OffloadAdamW) -> None:
    _exit_returns.discard(optimizer)


def _return_state_at_exit() -> None:
    for optimizer in list(_exit_returns):
        try:
            if not any(optimizer._backwards):
                optimizer.keep_state_on_device(set())
        except Exception as e:  # noqa: BLE001 - the daemon may be gone; exiting goes on
            warnings.warn(f"trainstream: the AdamW state held in VRAM could not go back to "
                          f"trainstreamd at exit: {e}")
    _exit_returns.clear()


def _torch_group(g: dict) -> dict:
    """A group's hyper-parameters as torch's optimizers name them."""
    return dict(lr=g["lr"], betas=tuple(g["betas"]), eps=g["eps"],
                weight_decay=g["weight_decay"])


def _group(g: dict) -> dict:
    return dict(lr=float(g["lr"]), betas=tuple(float(b) for b in g["betas"]),
                eps=float(g["eps"]), weight_decay=float(g["weight_decay"]))


def _safe_name(name: str) -> str:
    allowed = "".join(c if c.isalnum() or c in "_.:/-" else "_" for c in name)
    return allowed[:120] or "param"
