# SPDX-License-Identifier: Apache-2.0
"""One private trainstreamd for a launcher's ranks on this machine (torchrun, Slurm's srun),
when no daemon is running: the local rank 0 starts it in a directory named after the job, the
other ranks wait for its socket there. Without this, each rank would start a daemon of its own
and the job's ranks, which must share one optimizer state and one base, would never meet."""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tempfile
import time
from typing import Any

from .. import _trainstream
from ..errors import DaemonUnavailableError, PermissionDeniedError
from .embedded import EmbeddedDaemon
from .launcher import launcher_topology

# How long ranks other than the local rank 0 wait for the job's daemon (rank 0 may still be
# importing torch), and how long its drain may take at rank 0's exit (the other ranks' last
# sessions end then).
WAIT_S = float(os.environ.get("TRAINSTREAM_JOB_DAEMON_WAIT_S", "120"))
DRAIN_S = 60.0


def launcher_job(environ: Any) -> tuple | None:
    """(local rank, ranks on this machine, job name) when a launcher placed more than one rank
    of this job on this machine; None otherwise (one process: a daemon of its own)."""
    if not any(k in environ for k in ("LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                                      "SLURM_NTASKS_PER_NODE")):
        return None
    local_rank, local_world, run = launcher_topology(
        environ, int(environ.get("RANK", 0)), int(environ.get("WORLD_SIZE", 1)))
    return (local_rank, local_world, run) if local_world > 1 else None


def job_directory(run: str) -> str:
    """Where the job's daemon lives: under XDG_RUNTIME_DIR, or the temporary directory where
    that is too deep for a socket's path (108 bytes at most)."""
    digest = hashlib.sha1(run.encode()).hexdigest()[:10]
    name = f"trainstream-{os.getuid()}-{re.sub(r'[^A-Za-z0-9._-]', '_', run)[:24]}-{digest}"
    bases = [os.environ.get("XDG_RUNTIME_DIR"), tempfile.gettempdir(), "/tmp"]
    for base in bases:
        if base and len(os.path.join(base, name, "trainstreamd.sock")) < 100:
            return os.path.join(base, name)
    return os.path.join("/tmp", name)


def _check_owned(directory: str) -> None:
    """The directory is a real one, this user's, closed to others: a socket in it is the job's
    own (in a shared /tmp, another user could have made the name first)."""
    info = os.lstat(directory)
    if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
            or info.st_mode & 0o077):
        raise PermissionDeniedError(
            f"{directory} (for this job's private trainstreamd) is not a directory of uid "
            f"{os.getuid()} alone (owner uid {info.st_uid}, mode {info.st_mode & 0o7777:04o}); "
            "remove it, or set XDG_RUNTIME_DIR to a directory of your own")


def _answers(socket_path: str) -> bool:
    try:
        _trainstream.ping_daemon(socket_path)
        return True
    except DaemonUnavailableError:
        return False


def start_or_find(local_rank: int, local_world: int, run: str, before_stop: Any = None) -> tuple:
    """(socket path, the EmbeddedDaemon this process started or None) of the job's daemon;
    ``before_stop`` as for EmbeddedDaemon."""
    directory = job_directory(run)
    socket_path = os.path.join(directory, "trainstreamd.sock")
    if local_rank == 0:
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass
        _check_owned(directory)
        if _answers(socket_path):
            return socket_path, None  # a daemon this job started already (a restarted rank 0)
        if os.path.lexists(socket_path):
            os.unlink(socket_path)  # left by a run that was killed
        daemon = EmbeddedDaemon(directory=directory, stop_timeout_s=DRAIN_S,
                                before_stop=before_stop)
        return daemon.socket_path, daemon
    deadline = time.monotonic() + WAIT_S
    while True:
        if os.path.isdir(directory):
            _check_owned(directory)
            if _answers(socket_path):
                return socket_path, None
        if time.monotonic() > deadline:
            raise DaemonUnavailableError(
                f"no trainstreamd is running, and local rank 0 of job '{run}' ({local_world} "
                f"ranks on this machine) did not start the job's own at {socket_path} within "
                f"{WAIT_S:.0f} s; start the system service (trainstreamd.service) or name a "
                "running daemon in TRAINSTREAM_SOCKET")
        time.sleep(0.1)
