# SPDX-License-Identifier: Apache-2.0
"""A client in a PID namespace of its own (any container without hostPID) opens a session and
uses the daemon's memory, and trains a small model through wrap() exactly as a process in the
host's namespace does: the daemon knows it by the kernel's credentials alone (SO_PEERCRED, its
pid translated into the daemon's namespace) and says the pid the client reported beside them,
where it was refused before ("pid 1 in the request is not the caller's pid")."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import trainstream

CLIENT = textwrap.dedent("""
    import os, sys, trainstream
    with trainstream.connect(sys.argv[1], job_id="contained", embedded=False) as c:
        buf = c.allocate("x", 1 << 20)
        print(os.getpid(), c.session_id, flush=True)
""")


PID_NAMESPACE = ("unshare", "--pid", "--fork", "--mount-proc")


def _unshare_works() -> str:
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    probe = subprocess.run([*PID_NAMESPACE, "true"],
                           capture_output=True, text=True)
    return "" if probe.returncode == 0 else f"unshare --pid is not permitted here: {probe.stderr}"


def test_a_client_in_its_own_pid_namespace_is_served(daemon):
    why = _unshare_works()
    if why:
        pytest.skip(why)
    out = subprocess.run([*PID_NAMESPACE, sys.executable, "-c", CLIENT, daemon.socket],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pid, session_id = out.stdout.split()
    assert int(pid) == 1  # the namespace's first process, as in a container
    with trainstream.connect(daemon.socket, embedded=False) as watcher:
        opened = [e for e in watcher.events()
                  if e["kind"] == "session.open" and e["session_id"] == session_id]
    assert opened, "the contained client's session was not opened"
    message = opened[0]["message"]
    assert "(pid 1 in its own PID namespace)" in message, message
    assert opened[0]["numbers"]["pid"] != 1  # the kernel's pid, in the daemon's namespace


# Seeded: prints its pid and 20 losses, the same bit for bit through any daemon.
TRAINER = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "examples",
                                       "linear_offload.py"))


def _train(socket: str, job: str, prefix: tuple = ()) -> list:
    """TRAINER as job ``job`` through the daemon on ``socket`` (under ``prefix``, a namespace of
    its own): its pid and losses, as printed."""
    out = subprocess.run([*prefix, sys.executable, TRAINER, socket, job], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_a_client_in_its_own_pid_namespace_trains_as_one_outside_does(daemon):
    why = _unshare_works()
    if why:
        pytest.skip(why)
    pid, *losses = _train(daemon.socket, "contained-train", PID_NAMESPACE)
    outside = _train(daemon.socket, "host-train")
    assert int(pid) == 1
    assert float(losses[-1]) < 0.5 * float(losses[0]), losses  # it learned
    # The daemon's optimizer ran its steps exactly as for a process in the host's namespace.
    assert losses == outside[1:]


def test_clients_outside_a_daemon_in_its_own_pid_namespace_train_as_beside_one(start_daemon):
    """The DaemonSet's case: trainstreamd in a PID namespace of its own (its pod's), its clients
    outside it (the host, other pods). The kernel gives the daemon pid 0 for each of them
    (SO_PEERCRED of a process it cannot see); they are served, known by uid and connection, and
    train exactly as clients of a daemon in their own namespace do. Refused before: "the
    connection's credentials are not known yet"."""
    why = _unshare_works()
    if why:
        pytest.skip(why)
    contained = start_daemon("--memory_budget=256M", "--lease_ms=1500",
                             prefix=("unshare", "--pid", "--fork", "--mount-proc",
                                     "--kill-child=SIGTERM"))
    beside = start_daemon("--memory_budget=256M", "--lease_ms=1500")
    host = _train(contained.socket, "from-the-host")
    pod = _train(contained.socket, "from-another-pod", PID_NAMESPACE)
    losses = _train(beside.socket, "reference")[1:]
    assert float(losses[-1]) < 0.5 * float(losses[0]), losses  # it learned
    assert host[1:] == losses
    assert pod[1:] == losses
    with trainstream.connect(contained.socket, embedded=False) as watcher:
        status = watcher.status()
        opened = {e["message"] for e in watcher.events() if e["kind"] == "session.open"}
    assert status["pid"] == 1  # the daemon is its namespace's first process, as in a pod
    # Each said as the kernel could not, with the pid the client gave in its own namespace.
    outside = "a process outside the daemon's PID namespace"
    host_pid = host[0]
    assert (f"{outside} (pid {host_pid} in its own) opened rank 0/1 of job 'from-the-host'"
            in opened), opened
    assert f"{outside} (pid 1 in its own) opened rank 0/1 of job 'from-another-pod'" in opened
    # Stopped as kubelet stops a pod (SIGTERM to its pid 1): it drains and exits cleanly.
    assert contained.stop() == 0
    assert "daemon.stop" in contained.log()


def test_a_client_that_mounts_the_daemons_socket_folder_elsewhere_trains(daemon, tmp_path):
    """A pod that mounts the daemon's hostPath socket folder at another path: the daemon names
    its data socket as it sees it, a path that does not exist in the client's mount namespace;
    the client finds the data socket beside the control socket it connected through (it failed
    before: "its directory ... does not exist")."""
    why = _unshare_works()
    if why:
        pytest.skip(why)
    folder = os.path.dirname(daemon.socket)
    elsewhere = tmp_path / "mounted-here"
    elsewhere.mkdir()
    # In a mount namespace of its own: the folder bound at another path, the daemon's own path
    # hidden under an empty tmpfs (as in a container that never had it).
    script = (f"mount --bind {folder} {elsewhere} && mount -t tmpfs none {folder} && "
              f"exec {sys.executable} \"$0\" {elsewhere}/{os.path.basename(daemon.socket)} "
              "mounted-elsewhere")
    moved = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                            TRAINER], capture_output=True, text=True, timeout=120)
    if "mount" in moved.stderr and "permission denied" in moved.stderr.lower():
        pytest.skip("mounts in a mount namespace of its own are not permitted here: "
                    f"{moved.stderr}")
    assert moved.returncode == 0, moved.stderr
    assert moved.stdout.split()[1:] == _train(daemon.socket, "beside")[1:]
