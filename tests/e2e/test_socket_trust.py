# SPDX-License-Identifier: Apache-2.0
"""Socket squatting: another local user makes the socket's directory first, or runs a daemon of
its own where a client looks, and reads what the client hands over. A client checks the socket's
directory and the daemon's uid (SO_PEERCRED) before its first request; a daemon refuses to
listen in a directory another user made. Needs root to act as the second user."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time

import pytest

import trainstream

OTHER = "tstest-squatter"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="acting as a second user needs root")


@pytest.fixture(scope="module")
def squatter():
    try:
        entry = pwd.getpwnam(OTHER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        OTHER], check=True)
        entry = pwd.getpwnam(OTHER)
    return entry


def _as(entry):
    def drop():
        os.setgid(entry.pw_gid)
        os.setuid(entry.pw_uid)
    return drop


def _serve(binary, socket, user=None):
    """A trainstreamd on ``socket``, as ``user`` (a pwd entry) or as we are; waits for it."""
    config = tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False)
    config.write('socket_mode: "0666"\ndrain_timeout_s: 1\n')
    config.close()
    os.chmod(config.name, 0o644)
    daemon = subprocess.Popen([binary, f"--socket={socket}", f"--config={config.name}"],
                              preexec_fn=_as(user) if user else None,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while not os.path.exists(socket + ".data"):
        if daemon.poll() is not None or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return daemon


def _stop(daemon):
    if daemon.poll() is None:
        daemon.terminate()
    daemon.wait(10)


def test_client_refuses_a_daemon_in_a_directory_another_user_made(trainstreamd_binary,
                                                                   squatter):
    directory = tempfile.mkdtemp(prefix="ts-squat-")
    os.chown(directory, squatter.pw_uid, squatter.pw_gid)
    os.chmod(directory, 0o755)
    socket = os.path.join(directory, "trainstreamd.sock")
    daemon = _serve(trainstreamd_binary, socket, squatter)
    try:
        assert daemon.poll() is None, daemon.stdout.read().decode()
        with pytest.raises(trainstream.PermissionDeniedError,
                           match=f"belongs to uid {squatter.pw_uid}"):
            trainstream.connect(socket=socket, embedded=False)
    finally:
        _stop(daemon)
        shutil.rmtree(directory, ignore_errors=True)


def test_client_refuses_a_daemon_another_user_runs(trainstreamd_binary, squatter):
    """A shared sticky directory (as /tmp is) passes the directory check: the daemon's uid,
    read from the kernel, is what refuses it."""
    directory = tempfile.mkdtemp(prefix="ts-sticky-")
    os.chmod(directory, 0o1777)
    socket = os.path.join(directory, "trainstreamd.sock")
    daemon = _serve(trainstreamd_binary, socket, squatter)
    try:
        assert daemon.poll() is None, daemon.stdout.read().decode()
        with pytest.raises(trainstream.PermissionDeniedError,
                           match=f"runs as uid {squatter.pw_uid}"):
            trainstream.connect(socket=socket, embedded=False)
        # Our own daemon in the same directory is trusted.
        own_socket = os.path.join(directory, "own.sock")
        own = _serve(trainstreamd_binary, own_socket)
        try:
            with trainstream.connect(socket=own_socket, embedded=False) as client:
                assert client.session_id
        finally:
            _stop(own)
    finally:
        _stop(daemon)
        shutil.rmtree(directory, ignore_errors=True)


def test_daemon_refuses_to_listen_in_a_directory_another_user_made(trainstreamd_binary,
                                                                   squatter):
    directory = tempfile.mkdtemp(prefix="ts-squat-")
    os.chown(directory, squatter.pw_uid, squatter.pw_gid)
    try:
        daemon = _serve(trainstreamd_binary, os.path.join(directory, "d.sock"))
        out, _ = daemon.communicate(timeout=10)
        assert daemon.returncode != 0
        assert f"belongs to uid {squatter.pw_uid}" in out.decode()
        os.chown(directory, 0, 0)
        os.chmod(directory, 0o777)  # ours, but anyone may replace what is in it
        daemon = _serve(trainstreamd_binary, os.path.join(directory, "d.sock"))
        out, _ = daemon.communicate(timeout=10)
        assert daemon.returncode != 0 and "writable by others" in out.decode()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
