# SPDX-License-Identifier: Apache-2.0
"""The daemon speaks systemd's notify protocol (the unit's Type=notify): READY=1 once clients can
connect, STOPPING=1 from the moment a drain starts, each with a STATUS line. Read here from the
datagram socket a service manager would hand it in $NOTIFY_SOCKET."""

import os
import shutil
import signal
import socket
import subprocess
import tempfile

import trainstream


def _messages(sock: socket.socket, want: str, timeout: float) -> dict:
    """The next notification that carries ``want``, as a dict of its lines."""
    sock.settimeout(timeout)
    while True:
        fields = dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines() if line)
        if want in fields:
            return fields


def test_ready_once_serving_and_stopping_when_the_drain_starts(trainstreamd_binary):
    directory = tempfile.mkdtemp(prefix="tsd-notify-")
    notify_path = os.path.join(directory, "notify")
    daemon_socket = os.path.join(directory, "d.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as manager:
        manager.bind(notify_path)
        process = subprocess.Popen(
            [trainstreamd_binary, f"--socket={daemon_socket}", "--memory_budget=64M",
             "--log_level=warning"],
            env={**os.environ, "NOTIFY_SOCKET": notify_path},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            ready = _messages(manager, "READY", 15)
            assert ready["READY"] == "1"
            assert ready["STATUS"] == f"serving {daemon_socket}"
            # Ready means ready: a client connects at once, no retrying.
            client = trainstream.connect(daemon_socket)
            process.send_signal(signal.SIGTERM)
            stopping = _messages(manager, "STOPPING", 10)
            assert stopping["STOPPING"] == "1"
            assert stopping["STATUS"].startswith("draining")
            assert process.poll() is None  # the open session holds the drain
            client.close()
            assert process.wait(15) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            shutil.rmtree(directory, ignore_errors=True)
