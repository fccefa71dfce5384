# SPDX-License-Identifier: Apache-2.0
"""A private trainstreamd for one benchmark run."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Iterator

import trainstream


@contextlib.contextmanager
def private_daemon(memory_budget: str, *flags: str) -> Iterator[str]:
    """Starts trainstreamd on a temporary socket (with `flags` added), yields the socket path,
    stops it after."""
    directory = tempfile.mkdtemp(prefix="ts-bench-")
    socket = os.path.join(directory, "d.sock")
    daemon = subprocess.Popen([shutil.which("trainstreamd") or "trainstreamd", f"--socket={socket}",
                               f"--memory_budget={memory_budget}", "--log_level=warning",
                               *flags])
    try:
        for _ in range(500):
            try:
                trainstream._trainstream.ping_daemon(socket)
                break
            except trainstream.DaemonUnavailableError:
                time.sleep(0.02)
        yield socket
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
        shutil.rmtree(directory, ignore_errors=True)

