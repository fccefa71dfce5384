# SPDX-License-Identifier: Apache-2.0
"""The daemon speaks systemd's protocols. Notify (the unit's Type=notify): READY=1 once clients
can connect, STOPPING=1 from the moment a drain starts, each with a STATUS line, read here from
the datagram socket a service manager would hand it in $NOTIFY_SOCKET. Socket activation
(deploy/trainstreamd.socket): it serves the listening sockets it is passed ($LISTEN_PID,
$LISTEN_FDS, descriptors 3 and 4), leaves them in place when it stops, and a restarted daemon
serves the same ones; sockets that are not what the unit must declare are refused by name."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

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


# What systemd does between fork and exec: the sockets onto descriptors 3 and 4 and the
# variables that say they are this process's; then exec, keeping the pid.
ACTIVATE = """
import fcntl, os, sys
high = [fcntl.fcntl(int(fd), fcntl.F_DUPFD, 10) for fd in sys.argv[1:3]]
for n, fd in enumerate(high):
    os.dup2(fd, 3 + n, inheritable=True)
for fd in set(high) | {int(fd) for fd in sys.argv[1:3]} - {3, 4}:
    os.close(fd)
count = len(high) if sys.argv[1] != sys.argv[2] else 1
if count == 1:
    os.close(4)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS=str(count))
os.execv(sys.argv[3], sys.argv[3:])
"""


def _activated(binary, control, data, notify_path, *args):
    return subprocess.Popen(
        [sys.executable, "-c", ACTIVATE, str(control.fileno()), str(data.fileno()), binary,
         "--memory_budget=64M", "--log_level=warning", *args],
        pass_fds=(control.fileno(), data.fileno()),
        env={**os.environ, "NOTIFY_SOCKET": notify_path}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)


def _listening(path, kind):
    s = socket.socket(socket.AF_UNIX, kind)
    s.bind(path)
    s.listen(64)
    os.chmod(path, 0o600)
    return s


def test_socket_activation_serves_the_managers_sockets_across_restarts(trainstreamd_binary):
    directory = tempfile.mkdtemp(prefix="tsd-activate-")
    path = os.path.join(directory, "d.sock")
    notify_path = os.path.join(directory, "notify")
    processes = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as manager, \
            _listening(path, socket.SOCK_STREAM) as control, \
            _listening(path + ".data", socket.SOCK_SEQPACKET) as data:
        manager.bind(notify_path)
        try:
            first = _activated(trainstreamd_binary, control, data, notify_path,
                               f"--socket={directory}/configured.sock")
            processes.append(first)
            ready = _messages(manager, "READY", 15)
            assert ready["STATUS"] == f"serving {path} (socket-activated)"
            with trainstream.connect(path, job_id="activated") as client:
                assert client.socket_path == path
                assert [s["session_id"] for s in client.sessions()] == [client.session_id]
            first.send_signal(signal.SIGTERM)
            out, _ = first.communicate(timeout=15)
            assert first.returncode == 0, out
            assert f"serving the sockets the service manager passed, at {path}" in out
            # The manager's sockets stay: a client that connects now waits in the backlog.
            assert os.path.exists(path) and os.path.exists(path + ".data")
            assert not os.path.exists(f"{directory}/configured.sock")
            waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            waiting.connect(path)
            second = _activated(trainstreamd_binary, control, data, notify_path)
            processes.append(second)
            _messages(manager, "READY", 15)
            with trainstream.connect(path, job_id="restarted") as client:
                assert client.sessions()[0]["session_id"] == client.session_id
            waiting.close()
            second.send_signal(signal.SIGTERM)
            assert second.wait(15) == 0
        finally:
            for p in processes:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("case", ["one socket", "two of a kind", "data elsewhere"])
def test_sockets_the_unit_should_not_have_passed_are_refused_by_name(trainstreamd_binary, case):
    directory = tempfile.mkdtemp(prefix="tsd-activate-")
    path = os.path.join(directory, "d.sock")
    second_kind = socket.SOCK_STREAM if case == "two of a kind" else socket.SOCK_SEQPACKET
    second_path = path + ("-other.data" if case == "data elsewhere" else ".data")
    try:
        with _listening(path, socket.SOCK_STREAM) as control, \
                _listening(second_path, second_kind) as data:
            process = _activated(trainstreamd_binary, control,
                                 control if case == "one socket" else data,
                                 os.path.join(directory, "no-manager"))
            out, _ = process.communicate(timeout=15)
        assert process.returncode == 2, out
        assert "ListenStream=<path> and ListenSequentialPacket=<path>.data" in out, out
        want = {"one socket": "passed 1 sockets", "two of a kind": "not the one stream",
                "data elsewhere": f"the data socket is at {second_path}"}[case]
        assert want in out, out
    finally:
        shutil.rmtree(directory, ignore_errors=True)
