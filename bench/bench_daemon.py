# SPDX-License-Identifier: Apache-2.0
"""A private trainstreamd for one benchmark run, and each configuration in a fresh process."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator

import trainstream


@contextlib.contextmanager
def private_daemon(memory_budget: str) -> Iterator[str]:
    """Starts trainstreamd on a temporary socket, yields the socket path, stops it after."""
    directory = tempfile.mkdtemp(prefix="ts-bench-")
    socket = os.path.join(directory, "d.sock")
    daemon = subprocess.Popen([shutil.which("trainstreamd") or "trainstreamd", f"--socket={socket}",
                               f"--memory_budget={memory_budget}", "--log_level=warning"])
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


def run_worker(script: str, mode: str, case: str, socket: str | None, timeout: int) -> dict:
    """Runs ``script --worker MODE --case CASE`` in a fresh Python process (nothing one
    configuration allocates reaches the next) and returns the JSON row it prints last."""
    env = dict(os.environ)
    if socket:
        env["TRAINSTREAM_SOCKET"] = socket
    try:
        result = subprocess.run([sys.executable, script, "--worker", mode, "--case", case],
                                capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "failed": True, "stderr": f"timed out after {timeout} s"}
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        return {"mode": mode, "failed": True, "stderr": result.stderr[-3000:]}
    return json.loads(lines[-1])
