# SPDX-License-Identifier: Apache-2.0
"""The daemon's host optimizer, one rank's view: AdamW/Adam run by trainstreamd over fp32 master
weights in shared memory, fed by gradients this process writes into its slots.

``trainstream.wrap()`` drives this for a model; use it directly to feed gradients yourself.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

from .client import Client
from ..errors import InvalidArgumentError

_NONFINITE = {"error": 1, "skip": 2, "ignore": 3, "guard": 4}
_KINDS = ("adamw", "adam")


def _dtype_code(dtype: Any) -> int:
    import torch

    codes = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
    if dtype not in codes:
        raise InvalidArgumentError(
            f"dtype {dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
    return codes[dtype]


def _natives(params: Sequence["ParameterSpec"]) -> list:
    import torch

    out = []
    for p in params:
        dtype = p.dtype or torch.float32
        out.append((p.name, p.numel, _dtype_code(dtype), _dtype_code(p.grad_dtype or dtype),
                    p.group))
    return out


@dataclass(frozen=True)
class ParameterSpec:
    """One tensor the optimizer updates."""

    name: str
    shape: tuple
    dtype: Any = None        # the model parameter's dtype (default float32)
    grad_dtype: Any = None   # the dtype gradients arrive in (default: dtype)
    group: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1


def _group(g: dict) -> dict:
    betas = g.get("betas", (0.9, 0.999))
    return {"lr": float(g.get("lr", 1e-3)), "beta1": float(betas[0]), "beta2": float(betas[1]),
            "eps": float(g.get("eps", 1e-8)), "weight_decay": float(g.get("weight_decay", 1e-2))}


def _spec(kind: str, moment_dtype: Any, max_grad_norm: float, report_grad_norm: bool,
          nonfinite: str, accumulation_steps: int, machines: int, groups: Sequence[dict],
          threads: int = 0, chunk_elements: int = 0, defer_updates: bool = False,
          eager_updates: bool = False) -> dict:
    """The optimizer as the native module passes it to the daemon."""
    return {"kind": kind, "moment_dtype": _dtype_code(moment_dtype),
            "max_grad_norm": float(max_grad_norm), "report_grad_norm": bool(report_grad_norm),
            "nonfinite": _NONFINITE[nonfinite], "accumulation_steps": int(accumulation_steps),
            "machines": int(machines), "groups": list(groups), "threads": int(threads),
            "chunk_elements": int(chunk_elements), "defer_updates": bool(defer_updates),
            "eager_updates": bool(eager_updates)}


def estimate_host_memory(client: Client, params: Sequence[ParameterSpec],
                         moment_dtype: Any = None, accumulation_steps: int = 1,
                         machines: int = 1, ranks: int = 1,
                         other_buffers: Sequence[int] = ()) -> Any:
    """The host memory a job would hold in the daemon with a host optimizer over ``params``
    joined by ``ranks`` ranks on this machine, plus ``other_buffers`` (sizes in bytes) that the
    job allocates itself, counted by the daemon with the code that will allocate them: its
    buffer list and its segments' rounding. Allocates nothing. Returns a
    ``HostMemoryEstimate``: ``.bytes`` (what to plan with ``Client.plan_host_memory``),
    ``.optimizer_bytes``, ``.buffer_bytes``, ``.buffers``, ``.segment_bytes`` and
    ``.segment_granularity``."""
    import torch

    from .. import _trainstream

    spec = _spec("adamw", moment_dtype or torch.float32, 0.0, False, "ignore",
                 accumulation_steps, machines, [_group({})])
    return _trainstream.estimate_host_memory(client.native_session, spec, _natives(params),
                                             int(ranks), [int(b) for b in other_buffers])


class HostOptimizer:
    """A job's optimizer in the daemon, joined by this rank.

    Every rank of a job passes the same ``params`` and options. The rank for which
    ``initialize`` is true writes the starting weights with :meth:`load_weights` first.
    """

    def __init__(self, client: Client, params: Sequence[ParameterSpec],
                 groups: Sequence[dict] = ({},), kind: str = "adamw", moment_dtype: Any = None,
                 max_grad_norm: float = 0.0, report_grad_norm: bool = False,
                 nonfinite: str = "ignore", accumulation_steps: int = 1,
                 machines: int = 1, timeout_s: float = 120.0, threads: int = 0,
                 chunk_elements: int = 0, defer_updates: bool = False,
                 eager_updates: bool = False):
        import torch

        if kind not in _KINDS:
            raise InvalidArgumentError(f"kind must be one of {_KINDS}, got {kind!r}")
        if nonfinite not in _NONFINITE:
            raise InvalidArgumentError(
                f"nonfinite must be one of {tuple(_NONFINITE)}, got {nonfinite!r}")
        moment_dtype = moment_dtype or torch.float32
        if moment_dtype not in (torch.float32, torch.bfloat16):
            raise InvalidArgumentError("moment_dtype must be torch.float32 or torch.bfloat16")
        self.params = list(params)
        self._groups = [_group(g) for g in groups]
        self._max_grad_norm = float(max_grad_norm or 0.0)
        spec = _spec(kind, moment_dtype, self._max_grad_norm, report_grad_norm, nonfinite,
                     accumulation_steps, machines, self._groups, threads, chunk_elements,
                     defer_updates, eager_updates)
        from .. import _trainstream

        self._native = _trainstream.HostOptimizer(client.native_session, spec,
                                                  _natives(self.params))
        self.client = client
        self.moment_dtype = moment_dtype
        self.accumulation_steps = int(accumulation_steps)
        self.timeout_ms = int(timeout_s * 1000)
        self.iteration = self._native.attached_at_iteration
        self._views = [self._make_views(i) for i in range(len(self.params))]

    @property
    def initialize(self) -> bool:
        """True for the rank that created the state: it must write the starting weights."""
        return self._native.initialize

    def _make_views(self, i: int) -> dict:
        import torch

        p = self.params[i]
        master, m, v, param, grad, reduce = self._native.buffers(i)
        shape = p.shape
        dtype = p.dtype or torch.float32
        from .client import Buffer

        self._buffers = getattr(self, "_buffers", {})
        self._buffers[i] = {"grad": Buffer(grad),
                            "param": Buffer(param) if param is not None else Buffer(master)}
        views = {
            "master": Buffer(master).tensor(torch.float32, shape),
            "exp_avg": Buffer(m).tensor(self.moment_dtype, shape),
            "exp_avg_sq": Buffer(v).tensor(self.moment_dtype, shape),
            "grad": Buffer(grad).tensor(p.grad_dtype or dtype, shape),
        }
        views["param"] = (Buffer(param).tensor(dtype, shape) if param is not None
                          else views["master"])
        if reduce is not None:
            views["reduce"] = Buffer(reduce).tensor(torch.float32, shape)
        return views

    def add_parameters(self, params: Sequence[ParameterSpec], groups: Sequence[dict]) -> int:
        """Adds parameters between steps (torch's ``add_param_group``): ``groups`` is the whole
        list of groups (new ones last), ``params`` the new parameters. Returns the index of the
        first parameter this rank must initialise with :meth:`load_weights`: the first new one,
        or the count of parameters when another rank of the job added them already."""
        self.set_groups(groups)
        first = self._native.add_parameters(_natives(self.params + list(params)))
        self.params = self.params + list(params)
        self._views += [self._make_views(i) for i in range(len(self._views), len(self.params))]
        return first

    def master(self, i: int):
        """The fp32 master weights of parameter ``i`` (a view of shared memory)."""
        return self._views[i]["master"]

    def param(self, i: int):
        """Parameter ``i``'s updated value in its own dtype (the master for float32)."""
        return self._views[i]["param"]

    def grad(self, i: int):
        """This rank's gradient slot for parameter ``i``."""
        return self._views[i]["grad"]

    def grad_buffer(self, i: int):
        """This rank's gradient slot as a :class:`trainstream.Buffer` (for device copies)."""
        return self._buffers[i]["grad"]

    def param_buffer(self, i: int):
        """The updated parameter's buffer (the master for float32), for device copies."""
        return self._buffers[i]["param"]

    def reduce(self, i: int):
        """Multi-machine jobs, rank 0: parameter ``i``'s fp32 gradient summed over this
        machine's ranks (after :meth:`wait_reduce_ready`), to all-reduce in place."""
        return self._views[i]["reduce"]

    def wait_reduce_ready(self, i: int) -> bool:
        """Waits for parameter ``i``'s machine sum; returns whether any rank here had a
        gradient for it."""
        return self._native.wait_reduce_ready(i, self.iteration + 1, self.timeout_ms)

    def post_reduced(self, i: int, any_gradient: bool = True) -> None:
        """The reduce buffer of ``i`` holds every machine's sum: the daemon may update it (or,
        when no machine had a gradient for it, leave it alone)."""
        self._native.post_reduced(i, self.iteration + 1, any_gradient)

    def exp_avg(self, i: int):
        return self._views[i]["exp_avg"]

    def exp_avg_sq(self, i: int):
        return self._views[i]["exp_avg_sq"]

    def load_weights(self, tensors: Sequence[Any], first: int = 0) -> None:
        """Writes starting values into the master weights (and the model-dtype copies) of
        parameters ``first``, ``first + 1``, ..."""
        for i, t in enumerate(tensors, start=first):
            self.master(i).copy_(t.detach().reshape(self.params[i].shape))
            if self.param(i).data_ptr() != self.master(i).data_ptr():
                self.param(i).copy_(self.master(i))

    def post(self, i: int, micro: int = 0, no_grad: bool = False) -> None:
        """Announces that gradient slot ``i`` holds micro-step ``micro`` of the next iteration."""
        self._native.post(i, self.iteration + 1, micro, no_grad)

    def post_norm_contribution(self, sum_squares: float) -> None:
        """Adds the sum of squares of the next iteration's gradients that this rank updates on
        its GPU to the job's global norm; before those parameters are posted without one."""
        self._native.post_norm_contribution(self.iteration + 1, float(sum_squares))

    def send_gradient(self, i: int, micro: int, grad: Any, stream: Any) -> None:
        """CUDA: copies ``grad`` (contiguous, in slot ``i``'s dtype) into gradient slot ``i``
        on ``stream`` (a ``torch.cuda.Stream``, or a ``cudaStream_t`` as an int) and announces
        it, as :meth:`post` does, once the copy has landed: a native thread waits for the
        copy, so the caller never does. Failures come back from :meth:`drain_gradients`."""
        self._native.send_gradient(i, self.iteration + 1, micro, grad.get_device(),
                                   grad.data_ptr(), grad.nbytes,
                                   stream if isinstance(stream, int) else stream.cuda_stream)

    def send_gradients(self, copies: Sequence[tuple], stream: Any) -> None:
        """:meth:`send_gradient` for each ``(i, micro, grad)`` of ``copies`` (on one device and
        ``stream``), posted together once all have landed: one call and one event for them."""
        if not copies:
            return
        self._native.send_gradients(
            self.iteration + 1, copies[0][2].get_device(),
            stream if isinstance(stream, int) else stream.cuda_stream,
            [(i, micro, grad.data_ptr(), grad.nbytes) for i, micro, grad in copies])

    def drain_gradients(self) -> None:
        """Blocks until every sent gradient is announced; raises the first failure."""
        self._native.drain_gradients()

    # Updates copied straight back into the parameters' CUDA storage (the daemon's copy engine
    # writes them as each parameter's update lands). A target is (device pointer, bytes);
    # (0, 0) for a parameter whose values come back another way (paged from the host copy).
    def return_updates_to_device(self, device_index: int, targets: Sequence[tuple]) -> None:
        """From now on each parameter's update is copied to its target on CUDA device
        ``device_index``."""
        self._native.return_updates_to_device(int(device_index), list(targets))

    def add_device_targets(self, targets: Sequence[tuple]) -> None:
        """The targets of parameters added since (add_parameters), in their order."""
        self._native.add_device_targets(list(targets))

    def retarget_device(self, i: int, pointer: int, nbytes: int) -> None:
        """Parameter ``i``'s updates go to new storage (0, 0: no longer copied back)."""
        self._native.retarget_device(int(i), int(pointer), int(nbytes))

    def wait_for_parameters(self, indices: Sequence[int], stream_pointer: int) -> None:
        """Work queued next on the stream (a ``cudaStream_t``) waits until these parameters'
        returning copies have landed."""
        self._native.wait_for_parameters(list(indices), int(stream_pointer))

    def synchronize_device_returns(self) -> None:
        """Blocks until no returning copy is in flight (before storage may be reused)."""
        self._native.synchronize_device_returns()

    def wait_consumed(self, i: int) -> None:
        self._native.wait_consumed(i, self.iteration + 1, self.timeout_ms)

    def wait(self) -> dict:
        """Waits for every parameter's update of the next iteration; returns what happened."""
        skipped, updated = self._native.wait_iteration(self.iteration + 1, self.timeout_ms)
        self.iteration += 1
        return {"iteration": self.iteration, "skipped": skipped, "updated": updated}

    def step(self, grads: Sequence[Any]) -> dict:
        """One iteration from a list of gradients (``None`` for a parameter without one); with
        accumulation, pass a list of such lists, one per micro-step."""
        micro_steps = grads if self.accumulation_steps > 1 else [grads]
        if len(micro_steps) != self.accumulation_steps:
            raise InvalidArgumentError(
                f"{len(micro_steps)} micro-steps given; accumulation_steps is "
                f"{self.accumulation_steps}")
        for micro, gs in enumerate(micro_steps):
            if len(gs) != len(self.params):
                raise InvalidArgumentError(
                    f"{len(gs)} gradients given for {len(self.params)} parameters")
            for i, g in enumerate(gs):
                if micro > 0 and g is not None:
                    self.wait_consumed(i)
                if g is None:
                    self.post(i, micro, no_grad=True)
                    continue
                self.grad(i).copy_(g.reshape(self.params[i].shape))
                self.post(i, micro)
        return self.wait()

    def set_groups(self, groups: Sequence[dict], max_grad_norm: float | None = None) -> None:
        """New hyper-parameters (a scheduler's lr, ...) for the following iterations."""
        self._groups = [_group(g) for g in groups]
        if max_grad_norm is not None:
            self._max_grad_norm = float(max_grad_norm)
        self._native.set_groups(self._groups, self._max_grad_norm)

    def set_step(self, iteration: int, param_steps: Sequence[int] | None = None) -> None:
        self._native.set_step(int(iteration), list(param_steps or []))
        self.iteration = int(iteration)

    def state_dict(self) -> dict:
        """The state in ``torch.optim.AdamW.state_dict()`` form (fp32 moments), plus the fp32
        master weights under ``"master"``: loadable by torch and by :meth:`load_state_dict`."""
        import torch

        steps = self.info().param_steps or [0] * len(self.params)
        state = {}
        for i in range(len(self.params)):
            if steps[i] == 0:
                continue  # torch keeps no state for a parameter it never stepped
            state[i] = {"step": torch.tensor(float(steps[i])),
                        "exp_avg": self.exp_avg(i).float().clone(),
                        "exp_avg_sq": self.exp_avg_sq(i).float().clone()}
        groups = []
        for k, g in enumerate(self._groups):
            groups.append({"lr": g["lr"], "betas": (g["beta1"], g["beta2"]), "eps": g["eps"],
                           "weight_decay": g["weight_decay"], "amsgrad": False,
                           "maximize": False, "foreach": None, "capturable": False,
                           "differentiable": False, "fused": None,
                           "params": [i for i, p in enumerate(self.params) if p.group == k]})
        return {"state": state, "param_groups": groups,
                "master": [self.master(i).clone() for i in range(len(self.params))],
                "iteration": self.iteration}

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a :meth:`state_dict`, or a ``torch.optim.AdamW``/``Adam`` one for the same
        parameters in the same order (without ``"master"``, the current weights are kept)."""
        import torch

        groups = state_dict["param_groups"]
        if sum(len(g["params"]) for g in groups) != len(self.params):
            raise InvalidArgumentError(
                f"the state_dict covers {sum(len(g['params']) for g in groups)} parameters; "
                f"this optimizer has {len(self.params)}")
        if len(groups) != len(self._groups):
            raise InvalidArgumentError(
                f"the state_dict has {len(groups)} parameter groups; this optimizer has "
                f"{len(self._groups)}")
        order = [i for g in groups for i in g["params"]]
        index_of = {key: n for n, key in enumerate(order)}
        steps = [0] * len(self.params)
        for key, entry in state_dict["state"].items():
            i = index_of[key]
            for name in ("exp_avg", "exp_avg_sq"):
                value = entry[name]
                if value.numel() != self.params[i].numel:
                    raise InvalidArgumentError(
                        f"{name} of parameter {i} has {value.numel()} elements; "
                        f"'{self.params[i].name}' has {self.params[i].numel}")
                getattr(self, name)(i).copy_(value.reshape(self.params[i].shape))
            steps[i] = int(torch.as_tensor(entry["step"]).item())
        for i in set(range(len(self.params))) - {index_of[k] for k in state_dict["state"]}:
            self.exp_avg(i).zero_()
            self.exp_avg_sq(i).zero_()
        if "master" in state_dict:
            self.load_weights(state_dict["master"])
        self.set_groups([dict(lr=g["lr"], betas=g["betas"], eps=g["eps"],
                              weight_decay=g["weight_decay"]) for g in groups])
        iteration = int(state_dict.get("iteration", max(steps) if steps else 0))
        self.set_step(iteration, steps)

    def save(self, path: str) -> int:
        """Checkpoints the job's optimizer state to ``path`` (atomically); returns its bytes.
        This process creates the file, with its own rights; the daemon writes it."""
        return self._native.save(os.path.abspath(os.fspath(path)))

    def load(self, path: str) -> None:
        """Restores a checkpoint written by :meth:`save` for the same parameters (opened by
        this process, read by the daemon)."""
        self._native.load(os.path.abspath(os.fspath(path)))
        self.iteration = self.info().step

    def info(self) -> Any:
        """The job's optimizer figures (the native OptimizerInfo: step, state, param_steps,
        spec, and last_step with its norm, clip, time and GB/s; reply_dict() makes it a
        dict)."""
        return self._native.info()
