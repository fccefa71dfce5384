# SPDX-License-Identifier: Apache-2.0
"""A private trainstreamd started by this process when no daemon answers."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from .. import _trainstream
from ..errors import DaemonUnavailableError


def find_daemon_binary() -> str:
    """Path of trainstreamd: $TRAINSTREAMD, next to this interpreter, or on the PATH."""
    candidates = [os.environ.get("TRAINSTREAMD", "")]
    candidates.append(os.path.join(os.path.dirname(sys.executable), "trainstreamd"))
    candidates.append(shutil.which("trainstreamd") or "")
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    raise DaemonUnavailableError(
        "no trainstreamd binary found (looked at $TRAINSTREAMD, beside "
        f"{sys.executable} and on PATH); install the trainstream package with pip"
    )


class EmbeddedDaemon:
    """Starts ``trainstreamd`` on a private socket and stops it at exit.

    The daemon is told this process's pid and exits by itself if this process dies, so a
    killed training process leaves nothing running.
    """

    def __init__(self, start_timeout_s: float = 20.0, extra_args: list[str] | None = None,
                 directory: str | None = None, stop_timeout_s: float = 10.0,
                 before_stop: Any = None):
        """``directory``: where its socket and log go (made by the caller, this user's alone;
        removed at stop); default a new one. ``stop_timeout_s``: how long its drain may take
        at exit before it is killed. ``before_stop``: called first at stop (closes this
        process's own sessions, which the drain would otherwise wait for)."""
        self._before_stop = before_stop
        base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        self.directory = directory or tempfile.mkdtemp(prefix="trainstream-", dir=base)
        self.stop_timeout_s = stop_timeout_s
        self.socket_path = os.path.join(self.directory, "trainstreamd.sock")
        self.log_path = os.path.join(self.directory, "trainstreamd.log")
        binary = find_daemon_binary()
        args = [binary, f"--socket={self.socket_path}", f"--parent_pid={os.getpid()}"]
        args += extra_args or []
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        atexit.register(self.stop)
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.process.poll() is not None:
                raise DaemonUnavailableError(
                    f"the embedded trainstreamd exited with status {self.process.returncode}: "
                    f"{self.log_tail()}"
                )
            try:
                _trainstream.ping_daemon(self.socket_path)
                return
            except DaemonUnavailableError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise DaemonUnavailableError(
                        f"the embedded trainstreamd did not answer within {start_timeout_s} s; "
                        f"log: {self.log_tail()}"
                    ) from None
                time.sleep(0.02)

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-lines:]).decode(errors="replace").strip()
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM (the daemon drains: it waits for its open sessions, then exits 0), then
        SIGKILL after ``timeout_s`` (default ``stop_timeout_s``)."""
        timeout_s = self.stop_timeout_s if timeout_s is None else timeout_s
        if self.process.poll() is None and self._before_stop is not None:
            self._before_stop()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if not self._log.closed:
            self._log.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        return self.process.returncode
