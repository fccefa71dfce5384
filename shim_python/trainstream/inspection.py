# SPDX-License-Identifier: Apache-2.0
"""TrainStream 0.6's process-wide inspection calls, answered where the facts are here:
``pinned_stats()`` from the daemon that owns the page-locked memory, ``transfer_stats()`` from
this process's sessions, ``reserve_pinned()`` refused with what replaces it."""

from __future__ import annotations

import os
from typing import Any

import torch

from .errors import DaemonUnavailableError, FailedPreconditionError, PermissionDeniedError
from .session import live_sessions, retired_bytes
from .transport import client as _client


def _device_name(device: Any) -> str:
    if device is None:
        if not torch.cuda.is_available():
            return "cpu"
        device = torch.cuda.current_device()
    device = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def pcie_bytes(session: Any) -> tuple[int, int]:
    """Bytes to the device and to the host since wrap(): streamed weights fetched, activations
    out and back, gradients out, updated weights back (on a GPU; after a switch to GPU AdamW
    nothing more crosses). Counted in this process: no call to the daemon."""
    pager, opt = session.pager, session.optimizer
    offloaded = pager.bytes_offloaded if pager else 0
    return ((pager.bytes_fetched if pager else 0) + offloaded + opt.bytes_to_device,
            offloaded + opt.bytes_to_host)


def session_transfers(session: Any) -> tuple:
    """(device, bytes to the device, bytes to the host) a wrapped model's session moved."""
    params = session.optimizer.trained_params
    device = str(params[0].device) if params else "cpu"
    to_device, to_host = pcie_bytes(session)
    return device, to_device, to_host


def transfer_stats(device: Any = None) -> dict:
    """Bytes trainstream moved between host memory and ``device`` (default the current GPU, or
    the CPU without one) in this process: streamed weights, paged activations out and back,
    gradients out and updated weights back, for every model wrapped so far (unwrapped ones
    included). ``sessions``: the wrapped models on that device now."""
    name = _device_name(device)
    to_device, to_host = retired_bytes(name)
    sessions = 0
    for session in live_sessions():
        where, down, up = session_transfers(session)
        if where == name:
            sessions += 1
            to_device += down
            to_host += up
    return {"device": name, "h2d_bytes": to_device, "d2h_bytes": to_host,
            "sessions": sessions}


def _daemon_client() -> tuple:
    """(a client of the daemon this process uses, whether it was opened here) or (None, False)
    when no daemon answers; never starts one."""
    clients = _client.open_clients()
    if clients:
        return clients[0], False
    try:
        path = os.environ.get("TRAINSTREAM_SOCKET") or _client.find_daemon_socket()
        return _client.connect(path, embedded=False), True
    except (DaemonUnavailableError, PermissionDeniedError):
        return None, False


def pinned_stats() -> dict:
    """The page-locked memory behind this process, from the daemon that owns it: ``arena_bytes``
    (what the daemon reserved for this user), ``arena_used`` (in this user's buffers),
    ``process_bytes`` (this process's buffers), ``arena_slabs`` (the daemon's segments),
    ``arena_cap`` (the most this user may reserve: the daemon's budget or the user's quota),
    ``arena_fallbacks`` (always 0: nothing is page-locked outside the daemon's segments),
    ``by_tag`` (bytes in buffers, by tag), ``daemon`` (its socket; None with no daemon)."""
    client, opened = _daemon_client()
    if client is None:
        return {"daemon": None, "arena_bytes": 0, "arena_used": 0, "process_bytes": 0,
                "arena_slabs": 0, "arena_cap": 0, "arena_fallbacks": 0, "by_tag": {}}
    try:
        memory = client.memory()
        mine = {c.session_id for c in _client.open_clients()}
    finally:
        if opened:
            client.close()
    uid = str(os.getuid())
    quota = int(memory.get("uid_quota_bytes", 0)) or int(memory.get("budget_bytes", 0))
    return {
        "daemon": client.socket_path,
        "arena_bytes": sum(int(r["bytes"]) for r in memory.get("by_uid", []) if r["key"] == uid),
        "arena_used": sum(int(r["bytes"]) for r in memory.get("by_session", [])),
        "process_bytes": sum(int(r["bytes"]) for r in memory.get("by_session", [])
                             if r["key"] in mine),
        "arena_slabs": int(memory.get("segments", 0)),
        "arena_cap": min(quota, int(memory.get("budget_bytes", 0))),
        "arena_fallbacks": 0,
        "budget_bytes": int(memory.get("budget_bytes", 0)),
        "committed_bytes": int(memory.get("committed_bytes", 0)),
        "by_tag": {r["key"]: int(r["bytes"]) for r in memory.get("by_tag", [])},
    }


def reserve_pinned(bytes_now: int, cap: int = 0, slab: int = 0) -> int:
    """TrainStream 0.6 page-locked an arena per process. Here the daemon owns page-locked
    memory for every process and reserves it as jobs ask: refused, saying what replaces it."""
    raise FailedPreconditionError(
        f"reserve_pinned({bytes_now}, cap={cap}, slab={slab}): page-locked memory is "
        "trainstreamd's, reserved per job as it allocates; wrap(host_arena=<bytes>) reserves "
        "a model's activation arena up front, and the daemon's --memory_budget and uid quota "
        "bound the whole (pinned_stats() shows them)")
