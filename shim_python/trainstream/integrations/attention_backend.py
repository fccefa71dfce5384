# SPDX-License-Identifier: Apache-2.0
"""``wrap(attention=...)``: which of PyTorch's scaled-dot-product-attention kernels a wrapped
model's attention runs. ``"auto"`` times every kernel that can run on the first attention call
of a training forward, on that call's own shapes (forward and backward), and PyTorch's own pick
beside them ("default"), twice each in turn, and keeps the fastest (so it is never slower than
leaving PyTorch alone, as far as two trials can tell); a named one (``"cudnn"``,
``"efficient"``, ``"flash"``, ``"math"``) is tried first, PyTorch's order after it; ``None`` leaves
PyTorch's order alone.

The choice is applied to every ``F.scaled_dot_product_attention`` call made inside an
attention module's call (forward hooks route them through :meth:`AttentionBackend._call`), so
a block that recomputes its forward in backward runs the same kernel. Each call tries the
chosen kernels in order, each alone (PyTorch's priority order is not read on every device),
and takes the first that runs these inputs; the list is read again at every call: under
``torch.use_deterministic_algorithms(True)`` the kernels whose backward is not deterministic
(cuDNN, flash) are left out, and with ``warn_only=True`` the memory-efficient one too
(PyTorch then keeps its non-deterministic backward rather than refusing it)."""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import InvalidArgumentError

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
NAMES = {v: k for k, v in BACKENDS.items()}
# PyTorch's own order of preference, after a named kernel.
ORDER = ["flash", "efficient", "cudnn", "math"]
# "auto"'s name for PyTorch's own choice, timed beside the kernels.
DEFAULT = "default"
# Trials of each candidate, in turn: the fastest of them counts. Each lasts TRIAL_SECONDS at
# least (the repeats asked for at the least, MAX_REPEATS at the most).
TRIALS = 2
TRIAL_SECONDS, MAX_REPEATS = 0.01, 200
MODES = ("auto", None) + tuple(BACKENDS)


def allowed(names: list) -> list:
    """``names`` less the kernels deterministic mode leaves out now."""
    if not torch.are_deterministic_algorithms_enabled():
        return names
    out = [n for n in names if n not in ("cudnn", "flash")]
    if torch.is_deterministic_algorithms_warn_only_enabled():
        out = [n for n in out if n != "efficient"]
    return out or ["math"]


def _time_kernel(name: str, args: tuple, kwargs: dict, repeats: int) -> float:
    """Milliseconds of one forward and backward of the call with kernel ``name`` only
    (``"default"``: PyTorch's own choice)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in args[:3])
    cuda = q.is_cuda

    def once() -> None:
        if name == DEFAULT:
            out = PYTORCH_SDPA(q, k, v, *args[3:], **kwargs)
        else:
            with sdpa_kernel([BACKENDS[name]]):
                out = PYTORCH_SDPA(q, k, v, *args[3:], **kwargs)
        out.backward(torch.ones_like(out))

    def timed(count: int) -> float:
        if cuda:
            torch.cuda.synchronize(q.device)
        began = time.perf_counter()
        for _ in range(count):
            once()
        if cuda:
            torch.cuda.synchronize(q.device)
        return time.perf_counter() - began

    once()  # chosen, compiled, warmed
    # At least TRIAL_SECONDS of calls: at 0.4 ms a call, five (2 ms) kept PyTorch's pick where
    # the benchmark found a kernel 13% faster (the 14B's attention at 512 tokens, H100,
    # 2026-12-06).
    count = max(repeats, min(MAX_REPEATS, math.ceil(TRIAL_SECONDS / max(timed(1), 1e-6))))
    return timed(count) * 1e3 / count


# PyTorch's own function, which the attention hooks put back after each attention call.
PYTORCH_SDPA = F.scaled_dot_product_attention
# What PyTorch raises where none of the kernels allowed can run the inputs.
UNAVAILABLE = ("No available kernel", "No viable backend")


def first_that_runs(names: list, args: tuple, kwargs: dict, first_that_ran: dict, key: Any,
                    calls: dict) -> Any:
    """PyTorch's attention under the first kernel of ``names`` that runs these inputs.
    ``first_that_ran[key]`` keeps where that was, so later calls of the same kind start there
    (no exception a call); ``calls`` counts the calls each kernel ran."""
    last = None
    for index in range(first_that_ran.get(key, 0), len(names)):
        try:
            with sdpa_kernel([BACKENDS[names[index]]]):
                out = PYTORCH_SDPA(*args, **kwargs)
        except RuntimeError as e:  # this kernel cannot run these inputs: the next one
            if not any(m in str(e) for m in UNAVAILABLE):
                raise
            last = e
            continue
        first_that_ran[key] = index
        calls[names[index]] = calls.get(names[index], 0) + 1
        return out
    raise last


def _kind(value: Any) -> Any:
    """What of an argument decides which kernels can run it: a tensor's shape, dtype, device
    and strides; any other value itself (is_causal, dropout_p, scale, enable_gqa)."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device, value.stride())
    return value if isinstance(value, (bool, int, float, str, type(None))) else type(value)


class AttentionBackend:
    """The choice for one wrapped model: ``mode``, ``backend`` (the kernel's name, or None for
    PyTorch's order), ``timings_ms`` (``"auto"``: each kernel's time, or why it could not
    run), ``report()``. ``note(kind, message)`` records what was decided."""

    def __init__(self, mode: Any, note: Callable[[str, str], None], repeats: int = 5):
        if mode not in MODES:
            raise InvalidArgumentError(
                f"trainstream.wrap: attention={mode!r} must be one of {MODES}")
        self.mode, self._note, self._repeats = mode, note, repeats
        self.backend = mode if mode in BACKENDS else None
        self.timings_ms: dict = {}
        self._handles: list = []
        self._depth = 0       # attention modules' calls under way
        self.calls: dict = {}  # kernel -> calls it ran
        self._first_that_ran: dict = {}  # (kernels, inputs' kind) -> index of the one that ran

    # -- the choice ----------------------------------------------------------------------

    def _measure(self, args: tuple, kwargs: dict) -> None:
        """"auto": times the kernels and PyTorch's own pick on this call's shapes, each
        TRIALS times in turn (a slow moment of the machine then costs one trial, not a
        kernel's whole chance), and keeps the fastest."""
        # Under deterministic mode PyTorch's own pick may be a kernel that mode leaves out.
        names = ORDER + ([] if torch.are_deterministic_algorithms_enabled() else [DEFAULT])
        for _ in range(TRIALS):
            for name in names:
                if isinstance(self.timings_ms.get(name), str):
                    continue  # it could not run these shapes
                try:
                    ms = round(_time_kernel(name, args, kwargs, self._repeats), 4)
                except RuntimeError as e:  # this kernel cannot run these shapes here
                    self.timings_ms[name] = f"not available: {str(e).splitlines()[0][:160]}"
                    continue
                self.timings_ms[name] = min(ms, self.timings_ms.get(name, ms))
        timed = {n: t for n, t in self.timings_ms.items() if isinstance(t, float)}
        if not timed:
            self.backend = None
            self._note("attention", "attention='auto': no kernel could be timed; PyTorch "
                                    "chooses")
            return
        self.backend = min(timed, key=timed.get)
        q = args[0]
        self._note("attention", f"attention='auto': {self.backend} on {tuple(q.shape)} "
                                f"{str(q.dtype).removeprefix('torch.')} "
                                + ", ".join(f"{n} {t} ms" for n, t in timed.items()),
                   **{f"{n}_ms": t for n, t in timed.items()})

    def _kernels(self) -> list | None:
        """The kernels, in order, a call may use now (None: PyTorch's own order)."""
        if self.backend is None:
            return None
        if self.mode == "auto":
            if self.backend == DEFAULT and not torch.are_deterministic_algorithms_enabled():
                return None  # PyTorch's own pick was the fastest
            timed = sorted((t, n) for n, t in self.timings_ms.items()
                           if isinstance(t, float) and n != DEFAULT)
            names = [n for _, n in timed] + [n for n in ORDER if n not in self.timings_ms]
        else:
            names = [self.backend] + [n for n in ORDER if n != self.backend]
        return [BACKENDS[n] for n in allowed(names)]

    # -- applying it ---------------------------------------------------------------------

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        """F.scaled_dot_product_attention inside an attention module's call."""
        if (self.mode == "auto" and not self.timings_ms and torch.is_grad_enabled()
                and len(args) >= 3 and isinstance(args[0], torch.Tensor)
                and args[0].requires_grad):
            self._measure(args, kwargs)  # the first training call: on its own shapes
        kernels = self._kernels()
        if not kernels:
            if self.backend == DEFAULT:  # "auto" kept PyTorch's own pick
                self.calls[DEFAULT] = self.calls.get(DEFAULT, 0) + 1
            return PYTORCH_SDPA(*args, **kwargs)
        # Where the first kernels cannot run inputs of this kind, later calls like it start at
        # the one that could (no exception a call).
        key = (tuple(kernels), *(_kind(a) for a in args),
               tuple(sorted((k, _kind(v)) for k, v in kwargs.items())))
        return first_that_runs([NAMES[k] for k in kernels], args, kwargs,
                               self._first_that_ran, key, self.calls)

    def _before(self, module: Any, args: Any) -> None:
        self._depth += 1
        F.scaled_dot_product_attention = self._call

    def _after(self, module: Any, args: Any, output: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            F.scaled_dot_product_attention = PYTORCH_SDPA

    def install(self, modules: list) -> None:
        """Around each of ``modules`` (those that run attention)."""
        if self.mode is None:
            return
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(self._before))
            self._handles.append(module.register_forward_hook(self._after, always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def report(self) -> dict:
        return {"mode": self.mode, "backend": self.backend, "timings_ms": dict(self.timings_ms),
                "kernels_now": [NAMES[k] for k in (self._kernels() or [])],
                "calls": dict(self.calls)}


def attention_modules(model: torch.nn.Module, blocks: list) -> list:
    """The modules that run attention: those whose class names say so (Hugging Face's
    ``*Attention``, the examples' ``Attention``), in the layer stack or, without one, anywhere
    in the model; else the blocks themselves."""
    within = [m for b in blocks for m in b.modules() if m is not b] if blocks else \
        list(model.modules())
    found = [m for m in within if type(m).__name__.endswith("Attention")]
    return found or list(blocks)
