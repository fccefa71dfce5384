# SPDX-License-Identifier: Apache-2.0
"""The Python face of a daemon session: buffers as tensors, the doorbell, inspection."""

from __future__ import annotations

import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

from .. import _trainstream
from .embedded import EmbeddedDaemon
from .job_daemon import launcher_job, start_or_find
from ..errors import DaemonUnavailableError, InvalidArgumentError, PermissionDeniedError

# The client library's version (the daemon's own is in its status).
VERSION: str = _trainstream.__version__

def reply_dict(reply: Any) -> Any:
    """A reply of the native module (a class of read-only attributes, typed by the C++ client)
    as the dicts and lists its Python callers and users read by key. An absent part (None:
    a step's figures before the first step) is left out."""
    if isinstance(reply, list):
        return [reply_dict(r) for r in reply]
    if not type(reply).__module__.startswith("trainstream"):
        return reply  # a number, a string, a dict of numbers
    fields = _REPLY_FIELDS.get(type(reply))
    if fields is None:
        fields = _REPLY_FIELDS[type(reply)] = tuple(
            name for name, value in vars(type(reply)).items() if isinstance(value, property))
    return {name: reply_dict(value) for name in fields
            if (value := getattr(reply, name)) is not None}


_REPLY_FIELDS: dict[type, tuple[str, ...]] = {}


def in_one_registration(buffer: Any, offset: int, nbytes: int) -> bool:
    """Whether ``nbytes`` at ``offset`` in ``buffer`` (a daemon buffer, native or not) lie inside
    one of its segment's CUDA host registrations. A copy by raw pointers spanning two fails
    (cudaErrorInvalidValue); a segment is registered in pieces only when the driver refused it
    whole. Memory registered whole, or not at all, is one range."""
    piece = buffer.registration_piece_bytes
    if piece <= 0 or nbytes <= 0:
        return True
    start = buffer.offset + offset
    return start // piece == (start + nbytes - 1) // piece


# Doorbell kinds (client/ipc/doorbell_ring.h).
PING, PONG, GRADIENT_READY, UPDATE_DONE, ERROR = 1, 2, 10, 11, 255


@dataclass(frozen=True)
class Notice:
    """One doorbell message from the daemon."""

    kind: int
    id: int
    step: int
    value: int


class Buffer:
    """A named buffer in the daemon's shared memory, mapped into this process.

    ``tensor()`` views its bytes as a torch tensor without copying; copies to and from CUDA
    tensors run on the current stream and are DMA when the buffer is registered with CUDA.
    """

    def __init__(self, native: Any):
        self._native = native

    name = property(lambda self: self._native.name)
    nbytes = property(lambda self: self._native.nbytes)
    buffer_id = property(lambda self: self._native.buffer_id)
    tag = property(lambda self: self._native.tag)
    read_only = property(lambda self: self._native.read_only)
    owner_session_id = property(lambda self: self._native.owner_session_id)
    cuda_registered = property(lambda self: self._native.cuda_registered)
    offset = property(lambda self: self._native.offset)  # in its segment
    # A DMA copy of raw pointers must stay between two multiples of this from the segment's
    # start (the copy_* methods split their own); 0 when unregistered.
    registration_piece_bytes = property(lambda self: self._native.registration_piece_bytes)

    def memoryview(self) -> memoryview:
        """The bytes, shared with the daemon and every process that maps the buffer."""
        return memoryview(self._native)

    def tensor(self, dtype: Any = None, shape: Any = None) -> Any:
        """A zero-copy CPU tensor over the buffer (``torch.uint8`` by default)."""
        import torch
        import warnings

        dtype = dtype or torch.uint8
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = self.nbytes // itemsize
        with warnings.catch_warnings():
            # Sealed buffers are read-only: torch warns that it cannot enforce that.
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(self._native, dtype=dtype, count=count)
        return t.view(shape) if shape is not None else t

    def _check_cuda_tensor(self, t: Any, offset: int) -> int:
        if not t.is_cuda or not t.is_contiguous():
            raise InvalidArgumentError("expected a contiguous CUDA tensor")
        nbytes = t.numel() * t.element_size()
        if offset < 0 or offset + nbytes > self.nbytes:
            raise InvalidArgumentError(
                f"{nbytes} bytes at offset {offset} run past the end of buffer "
                f"'{self.name}' ({self.nbytes} bytes)"
            )
        return nbytes

    def copy_to_device(self, dst: Any, offset: int = 0, stream: Any = None) -> None:
        """Copies ``dst.nbytes`` bytes from ``offset`` into the CUDA tensor ``dst`` (async)."""
        import torch

        nbytes = self._check_cuda_tensor(dst, offset)
        stream = stream or torch.cuda.current_stream(dst.device)
        self._native.copy_to_device(offset, dst.data_ptr(), nbytes, stream.cuda_stream)

    def copy_from_device(self, src: Any, offset: int = 0, stream: Any = None) -> None:
        """Copies the CUDA tensor ``src`` into the buffer at ``offset`` (async)."""
        import torch

        nbytes = self._check_cuda_tensor(src, offset)
        stream = stream or torch.cuda.current_stream(src.device)
        self._native.copy_to_host(offset, src.data_ptr(), nbytes, stream.cuda_stream)

    def __repr__(self) -> str:
        mode = "read-only" if self.read_only else "read-write"
        return f"<trainstream.Buffer '{self.name}' {self.nbytes} bytes {mode}>"


class Client:
    """A session with trainstreamd. Use :func:`trainstream.connect` to make one."""

    def __init__(self, native: Any, embedded: EmbeddedDaemon | None):
        self._native = native
        self._embedded = embedded
        _open_clients.add(self)

    session_id = property(lambda self: self._native.id)
    # The native session, for the transport layer's other objects (the host optimizer).
    native_session = property(lambda self: self._native)
    socket_path = property(lambda self: self._native.socket_path)
    embedded = property(lambda self: self._embedded is not None)

    def allocate(self, name: str, nbytes: int, tag: str = "", alignment: int = 0,
                 sealable: bool = False) -> Buffer:
        """A new buffer of ``nbytes``, named uniquely within the job."""
        if nbytes < 0:
            raise InvalidArgumentError(f"nbytes must be positive, got {nbytes}")
        return Buffer(self._native.allocate(name, nbytes, tag, alignment, sealable))

    def lookup(self, name: str) -> Buffer:
        """A buffer of this session's job, by name (possibly another process's)."""
        return Buffer(self._native.lookup(name))

    def free(self, buffer: Buffer) -> None:
        self._native.free(buffer._native)

    def seal(self, buffer: Buffer) -> Buffer:
        """Makes a sealable buffer read-only for everyone; drop other views of it first."""
        import gc

        key = (buffer.buffer_id, buffer._native.segment_id, buffer.name)
        buffer._native = None
        gc.collect()  # views in reference cycles would keep the writable mapping alive
        return Buffer(self._native.seal(*key))

    def ring(self, kind: int, id: int = 0, step: int = 0, value: int = 0) -> None:
        """Posts a doorbell message to the daemon."""
        self._native.ring(kind, id, step, value)

    def wait(self, timeout_ms: int = -1) -> Notice:
        """The next doorbell message from the daemon."""
        return Notice(*self._native.wait(timeout_ms))

    def ping(self) -> float:
        """One doorbell round trip through the daemon, in seconds."""
        return self._native.ping()

    def status(self) -> dict:
        return reply_dict(self._native.status())

    def sessions(self) -> list:
        return reply_dict(self._native.sessions())

    def memory(self) -> dict:
        return reply_dict(self._native.memory())

    def events(self, since: int = 0) -> list:
        return reply_dict(self._native.events(since))

    def plan_host_memory(self, nbytes: int, wait_s: float = 0.0) -> dict:
        """Admission: declares all the host memory this job will hold (0 drops the plan). The
        daemon keeps it for the job, or raises :class:`ResourceExhaustedError` with the numbers
        (after waiting up to ``wait_s`` for other jobs to make room)."""
        return reply_dict(self._native.plan_host_memory(int(nbytes), float(wait_s)))

    # Shared bases and their GPU pools (frozen/ builds on these).
    def load_base(self, path: str, format: str, block: int, quantize: list, name: str,
                  plan_only: bool = False) -> dict:
        """Asks the daemon for the base of the checkpoint at ``path``; its state, "loading"
        while the daemon reads it. ``plan_only``: only the bytes it would be stored in (state
        "planned"), from the daemon's own layout; nothing is loaded."""
        return reply_dict(self._native.load_base(path, format, block, list(quantize), name,
                                                 plan_only))

    def base_info(self, base_id: int) -> dict:
        """The daemon's view of base ``base_id`` now (state, progress, users, tensors)."""
        return reply_dict(self._native.base(int(base_id)))

    def map_base(self, base_id: int) -> list:
        """Maps a ready base's buffers into this process, read-only: one buffer object each."""
        return self._native.map_base(int(base_id))

    def detach_base(self, base_id: int) -> None:
        """This session stops using base ``base_id``."""
        self._native.detach_base(int(base_id))

    def bases(self) -> list:
        """This user's bases in the daemon (all users' for an admin)."""
        return reply_dict(self._native.bases())

    def place_base_on_gpu(self, base_id: int, device_uuid: str) -> dict:
        """Asks the daemon to hold base ``base_id`` in its pool on the GPU named by UUID
        (copied there the first time): the pool's id and the base's buffer offsets in it."""
        return reply_dict(self._native.place_base_on_gpu(int(base_id), device_uuid))

    def import_gpu_pool(self, pool_id: int, device_index: int) -> Any:
        """Maps GPU pool ``pool_id`` into this process on CUDA device ``device_index``."""
        return self._native.import_gpu_pool(int(pool_id), int(device_index))

    def release_gpu_pool(self, pool_id: int) -> None:
        """This process stops using GPU pool ``pool_id``."""
        self._native.release_gpu_pool(int(pool_id))

    def gpu_pools(self) -> dict:
        """The daemon's GPU pools of this user: {"pools": [...], "note": ...}."""
        return reply_dict(self._native.gpu_pools())

    def set_transfer_totals(self, h2d_bytes: int, d2h_bytes: int) -> None:
        """What this session moved to and from its GPU so far, by this process's count: the
        session's heartbeats carry it to the daemon, for its metrics. No round trip."""
        self._native.set_transfer_totals(int(h2d_bytes), int(d2h_bytes))

    def report_event(self, kind: str, message: str, **numbers: float) -> int:
        """Records a decision in the daemon's event log under this session (as
        ``client.<kind>``), where ``tsctl events`` shows it; returns its sequence number."""
        return self._native.report_event(kind, message,
                                         [(k, float(v)) for k, v in sorted(numbers.items())])

    def close(self, end_job: bool = False) -> None:
        """Closes the session; the daemon frees what it owned. ``end_job``: the job's
        optimizer state goes too when no other session of the job is open (otherwise it is
        kept a while, for a restarted process to re-attach)."""
        _open_clients.discard(self)
        if self._native is not None:
            self._native.close(end_job)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_embedded_daemon: EmbeddedDaemon | None = None
# This process's sessions: a private daemon it started drains them at exit, and would wait for
# them to end until its drain timeout if they were still open then.
_open_clients: "weakref.WeakSet[Client]" = weakref.WeakSet()


def open_clients() -> list:
    """This process's sessions not yet closed."""
    return list(_open_clients)


def find_daemon_socket() -> str:
    """The socket of the system daemon or this user's, whichever answers (no daemon started);
    DaemonUnavailableError or PermissionDeniedError, with why, when none does."""
    return _trainstream.find_daemon_socket()


def close_open_clients() -> None:
    """Closes every session of this process still open (at exit, before its private daemon
    stops; every other exit handler of trainstream has run by then)."""
    for client in list(_open_clients):
        try:
            client.close()
        except Exception:  # noqa: BLE001 - a session the daemon already ended
            pass


def connect(socket: str | None = None, job_id: str = "", rank: int = 0, world_size: int = 1,
            embedded: bool = True, rpc_timeout_s: float = 10.0,
            register_with_cuda: bool = True) -> Client:
    """Opens a session with trainstreamd.

    Uses ``socket`` or ``$TRAINSTREAM_SOCKET`` when one is named; otherwise the system daemon
    (``/run/trainstream/trainstreamd.sock``, which users of group ``trainstream`` may reach) and
    then, for users other than root, the per-user one. If neither answers and ``embedded`` is
    true, starts a private daemon for this process (once) and uses it exactly as it would a
    shared one; it stops when the process exits. The ranks a launcher put on this machine
    share one such daemon (job_daemon.py), which the local rank 0 starts. A system socket
    that refuses this user is said in a warning, with the group to join. A socket named where
    no daemon answers is an error: the job was meant for that daemon, and a private one would
    train apart from it.
    """
    global _embedded_daemon
    named = socket or os.environ.get("TRAINSTREAM_SOCKET") or None
    daemon = None
    if named is not None:
        path = named
        try:
            _trainstream.ping_daemon(path)
        except DaemonUnavailableError as e:
            if socket is None:
                raise DaemonUnavailableError(
                    f"{e} (the socket TRAINSTREAM_SOCKET names; unset it to let this process "
                    "start a private daemon)") from e
            raise
    else:
        try:
            path = _trainstream.find_daemon_socket()
        except (DaemonUnavailableError, PermissionDeniedError) as e:
            if not embedded:
                raise
            if isinstance(e, PermissionDeniedError):
                warnings.warn(f"trainstream: {e}; this process starts a private daemon instead",
                              stacklevel=2)
            job = launcher_job(os.environ)
            if _embedded_daemon is None or _embedded_daemon.process.poll() is not None:
                if job is not None:
                    # The launcher's ranks on this machine share one private daemon.
                    path, _embedded_daemon = start_or_find(*job, before_stop=close_open_clients)
                else:
                    _embedded_daemon = EmbeddedDaemon(before_stop=close_open_clients)
            daemon = _embedded_daemon
            path = daemon.socket_path if daemon is not None else path
    native = _trainstream.Session(path, job_id, rank, world_size, rpc_timeout_s,
                                  register_with_cuda)
    return Client(native, daemon)
