# SPDX-License-Identifier: Apache-2.0
"""What ``wrap()`` set up for a model, and the log of what it decided (``events``, the
daemon's event log, stdout with ``verbose=True``)."""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from .optim.offload_adamw import OffloadAdamW
from .options import WrapOptions


@dataclass(eq=False)  # a session is compared by identity (kept in weak sets)
class TrainStreamSession:
    """What ``wrap()`` set up for a model: ``model._trainstream_session``."""

    client: Any
    optimizer: OffloadAdamW
    config: WrapOptions
    events: list = field(default_factory=list)
    pager: Any = None  # memory.pager.BlockPager when blocks page weights or activations
    recompute: Any = None  # memory.recompute.Recompute when blocks may recompute their forward
    plan: Any = None   # trainstream.memory.adaptive.AdaptivePlan when the memory plan adapts
    frozen: Any = None  # host copies of frozen weights that stream
    cache_switch: Any = None  # the hooks that keep training forwards from building a cache
    loss_switch: Any = None   # the models whose causal-LM loss wrap() computes in chunks
    attention: Any = None     # integrations.attention_backend.AttentionBackend (attention=)
    transfer_report: Any = None  # the optimizer's step hook that hands the daemon PCIe totals
    # The VRAM the memory plan keeps the step under (bytes; None: no plan, as on the CPU).
    vram_target: int | None = None

    @property
    def adapting(self) -> bool:
        """True while offload='auto' is still measuring the first steps."""
        return self.optimizer.switch_pending or bool(self.plan and self.plan.adapting)

    @property
    def steps(self) -> int:
        """Optimizer steps so far."""
        return self.optimizer.steps

    @property
    def peer(self) -> None:
        """TrainStream 0.6's peer-GPU pools: None, as on one GPU (GPU pools of shared bases
        are the daemon's: trainstream.gpu_pools())."""
        return None

    def note(self, kind: str, message: str, **numbers: float) -> None:
        """Records a decision: here, in the daemon's event log (``tsctl events``), and on
        stdout with ``verbose=True``."""
        event = {"time": time.time(), "kind": kind, "message": message, "numbers": numbers}
        self.events.append(event)
        try:
            self.client.report_event(kind, message[:1024], **numbers)
        except Exception as e:  # the decision stands; only its copy in the daemon's log is lost
            event["not_reported"] = str(e)
        if self.config.connection.verbose:
            print(f"trainstream: {kind}: {message}")


def session_of(model: Any) -> TrainStreamSession | None:
    """The session wrap() made for ``model`` (kept on it as ``model._trainstream_session``),
    None for a model it did not wrap."""
    return getattr(model, "_trainstream_session", None)


# This process's sessions (for transfer_stats): those of wrapped models, and the PCIe bytes of
# those unwrapped since, so that the process's totals only grow.
_live: "weakref.WeakSet[TrainStreamSession]" = weakref.WeakSet()
_retired: dict = {}  # device -> [bytes to the device, bytes to the host]


def live_sessions() -> list:
    return list(_live)


def retired_bytes(device: str) -> tuple:
    to_device, to_host = _retired.get(device, (0, 0))
    return to_device, to_host


def attach(model: Any, session: TrainStreamSession | None,
           retire: Any = None) -> None:
    """Keeps ``session`` on ``model`` (None: takes it off, at unwrap(); ``retire(session)``
    gives the (device, bytes to the device, bytes to the host) it moved, kept for the
    process's totals)."""
    if session is None:
        old = session_of(model)
        if old is not None:
            if retire is not None and old in _live:
                device, to_device, to_host = retire(old)
                totals = _retired.setdefault(device, [0, 0])
                totals[0] += to_device
                totals[1] += to_host
            _live.discard(old)
            del model._trainstream_session
    else:
        model._trainstream_session = session
        _live.add(session)
