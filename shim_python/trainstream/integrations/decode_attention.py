# SPDX-License-Identifier: Apache-2.0
"""The attention kernel of decoding: the calls that bring one new position a sequence.

PyTorch's pick on Hopper for bf16 is cuDNN's attention, whose execution plan is built for each
new key length and cached by it. Prefill builds one plan; decoding brings a new length at every
token, so every token pays a plan (and a layout of keys and values it has not seen pays
another). ``"auto"`` therefore times the candidates as decoding meets them: each timed call on
a key length not used before (the keys and values of the call narrowed to it), in rounds, each
candidate once a round, the fastest round kept; PyTorch's own pick is one of the candidates, so
it stays where it is the fastest. Calls that are not decoding (prefill, training) go where they
went before.

The choice applies to the ``F.scaled_dot_product_attention`` calls made inside the model's
attention modules (forward hooks route them here), for one cache only when ``gated``: the
cache arms it in its ``update()``, which the attention module calls just before attention."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from ..errors import InvalidArgumentError
from .attention_backend import (BACKENDS, DEFAULT, MODES, ORDER, PYTORCH_SDPA, allowed,
                                attention_modules, first_that_runs)

# Timed calls a candidate in each round, each on a key length of its own; rounds after the
# warm-up round (one call each).
CALLS, ROUNDS = 3, 2
# The trial takes this many lengths below the first decoding call's: a shorter context waits
# for a later call (PyTorch's pick until then).
TRIAL_LENGTHS = (ROUNDS * CALLS + 1) * (len(ORDER) + 1)


class DecodeAttention:
    """``DecodeAttention(mode, gated=False, trial_devices=("cuda",))``, then
    ``install(model)``: ``mode`` is ``"auto"``, a kernel's name (``"flash"``, ``"efficient"``,
    ``"cudnn"``, ``"math"``: tried first, PyTorch's order after it) or None (PyTorch's pick).
    ``report()`` says what was chosen, the trial's timings and the calls each kernel ran."""

    def __init__(self, mode: Any, gated: bool = False, trial_devices: tuple = ("cuda",)):
        if mode not in MODES:
            raise InvalidArgumentError(f"attention={mode!r} must be one of {MODES}")
        self.mode, self.gated, self._trial_devices = mode, gated, trial_devices
        self.backend = mode if mode in BACKENDS else None
        self.decided = mode != "auto"
        self.timings_ms: dict = {}
        self.calls: dict = {}
        self.note = ""
        # Gated: the positions the gating cache's update took in the attention call under way
        # (0: the call does not read that cache).
        self.armed = 0
        self._handles: list = []
        self._saved: list = []  # the function each attention module's call replaced
        self._groups: list = []  # and each one's query heads a key/value head
        self._first_that_ran: dict = {}
        self._router = self._call  # one bound method: what is in place is told by identity

    # -- hooks ---------------------------------------------------------------------------

    def install(self, model: torch.nn.Module) -> None:
        """Around each attention module of ``model``. Installed after ``wrap(attention=...)``,
        decoding calls come here first and the others go on to wrap's choice."""
        if self.mode is None:
            return
        for module in attention_modules(model, []):
            self._handles.append(module.register_forward_pre_hook(self._before))
            # First among the post-hooks: what was replaced is put back before the hooks
            # installed earlier put back theirs.
            self._handles.append(module.register_forward_hook(self._after, prepend=True,
                                                              always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _before(self, module: Any, args: Any) -> None:
        self._saved.append(F.scaled_dot_product_attention)
        self._groups.append(getattr(module, "num_key_value_groups", 1))
        F.scaled_dot_product_attention = self._router

    def _after(self, module: Any, args: Any, output: Any) -> None:
        previous = self._saved.pop() if self._saved else PYTORCH_SDPA
        if self._groups:
            self._groups.pop()
        if F.scaled_dot_product_attention is self._router:
            F.scaled_dot_product_attention = previous
        self.armed = 0

    # -- the calls -----------------------------------------------------------------------

    def _decoding(self, args: tuple) -> bool:
        """Whether this call brings one new position a sequence. A gating cache knows (how many
        its update took); else the shapes tell: one query position, or as many as the key/value
        groups where transformers packs a grouped-query decode into the query's length."""
        if self.gated:
            return self.armed == 1
        if len(args) < 3 or not all(isinstance(a, torch.Tensor) and a.dim() >= 3
                                    for a in args[:3]):
            return False
        positions, keys = args[0].shape[-2], args[1].shape[-2]
        groups = self._groups[-1] if self._groups else 1
        return keys > positions and positions in (1, groups)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        # An attention module inside another one saved this very function: what the outermost
        # replaced is what the other calls go to.
        previous = next((f for f in reversed(self._saved) if f is not self._router),
                        PYTORCH_SDPA)
        if len(args) < 3 or not self._decoding(args):
            return previous(*args, **kwargs)
        query = args[0]
        if not self.decided:
            self._decide(args, kwargs)
        if self.backend in (None, DEFAULT) or not self.decided:
            self.calls[DEFAULT] = self.calls.get(DEFAULT, 0) + 1
            return previous(*args, **kwargs)
        names = allowed([self.backend] + [n for n in ORDER if n != self.backend])
        key = (tuple(names), query.dtype, query.device.type,
               isinstance(args[3] if len(args) > 3 else kwargs.get("attn_mask"), torch.Tensor))
        return first_that_runs(names, args, kwargs, self._first_that_ran, key, self.calls)

    # -- "auto" --------------------------------------------------------------------------

    def _decide(self, args: tuple, kwargs: dict) -> None:
        query, keys = args[0], args[1]
        if query.device.type not in self._trial_devices:
            self.decided, self.backend = True, DEFAULT
            self.note = (f"PyTorch's pick on {query.device.type}: the kernel matters where "
                         "cuDNN builds a plan for every new length (CUDA)")
            return
        length = keys.shape[-2]
        if length <= TRIAL_LENGTHS:
            return  # too short a context to time on lengths of its own: a later call does
        candidates = allowed([n for n in ORDER if n != "math"])
        if not torch.are_deterministic_algorithms_enabled():
            candidates.append(DEFAULT)
        lengths = iter(range(length - 1, 0, -1))
        for round_ in range(ROUNDS + 1):
            for name in candidates:
                if isinstance(self.timings_ms.get(name), str):
                    continue  # it could not run these inputs
                try:
                    ms = _time_on_new_lengths(name, args, kwargs, lengths,
                                              1 if round_ == 0 else CALLS)
                except RuntimeError as e:  # any refusal or failure leaves it out of the choice
                    self.timings_ms[name] = f"not available: {str(e).splitlines()[0][:160]}"
                    continue
                if round_:
                    self.timings_ms[name] = round(min(ms, self.timings_ms.get(name, ms)), 4)
        timed = {n: t for n, t in self.timings_ms.items() if isinstance(t, float)}
        self.decided = True
        self.backend = min(timed, key=timed.get) if timed else DEFAULT
        self.note = (f"{self.backend} for decoding, timed on {tuple(query.shape)} "
                     f"{str(query.dtype).removeprefix('torch.')} at key lengths below {length}, "
                     "each call on a length of its own: "
                     + ", ".join(f"{n} {t} ms" for n, t in timed.items()))

    def report(self) -> dict:
        return {"mode": self.mode, "backend": self.backend, "decided": self.decided,
                "timings_ms": dict(self.timings_ms), "calls": dict(self.calls),
                "note": self.note}


def _time_on_new_lengths(name: str, args: tuple, kwargs: dict, lengths: Any,
                         calls: int) -> float:
    """Milliseconds a call of kernel ``name`` (``"default"``: PyTorch's pick) takes, each of
    ``calls`` calls on the next key length of ``lengths``: the keys, values and a mask over
    them narrowed to it, as decoding would have called it earlier."""
    query, keys, values = args[:3]
    full = keys.shape[-2]
    cuda = query.is_cuda
    if cuda:
        torch.cuda.synchronize(query.device)
    began = time.perf_counter()
    with torch.no_grad():
        for _ in range(calls):
            n = next(lengths)
            rest = [a.narrow(-1, 0, n) if isinstance(a, torch.Tensor) and a.dim() and
                    a.shape[-1] == full else a for a in args[3:]]
            named = {k: (v.narrow(-1, 0, n) if isinstance(v, torch.Tensor) and v.dim() and
                         v.shape[-1] == full else v) for k, v in kwargs.items()}
            call = (query, keys.narrow(-2, 0, n), values.narrow(-2, 0, n), *rest)
            if name == DEFAULT:
                PYTORCH_SDPA(*call, **named)
            else:
                with sdpa_kernel([BACKENDS[name]]):
                    PYTORCH_SDPA(*call, **named)
    if cuda:
        torch.cuda.synchronize(query.device)
    return (time.perf_counter() - began) * 1e3 / calls


__all__ = ["DecodeAttention", "MODES"]
