# SPDX-License-Identifier: Apache-2.0
"""Descriptor floods: one user opening connections without end once took the daemon to 20,000
descriptors, after which its accept loops spun and root's tsctl got no answer. Now a uid holds
at most max_connections_per_uid connections on each socket (root and the admin group are never
capped), and a daemon out of descriptors closes what it cannot take instead of spinning.
Needs root to act as the second user."""

from __future__ import annotations

import json
import os
import pwd
import resource
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

OTHER = "tstest-flood"
CAP = 12

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="acting as a second user needs root")

FLOOD = textwrap.dedent("""
    import json, socket, sys, time
    path, count = sys.argv[1], int(sys.argv[2])
    held = {"control": [], "data": []}
    for kind, target, type_ in (("control", path, socket.SOCK_STREAM),
                                ("data", path + ".data", socket.SOCK_SEQPACKET)):
        for _ in range(count):
            s = socket.socket(socket.AF_UNIX, type_)
            s.settimeout(5)  # a daemon that stopped accepting would leave connect() waiting
            try:
                s.connect(target)
            except OSError:
                continue
            s.setblocking(True)
            held[kind].append(s)
    time.sleep(1.0)  # the daemon has accepted (and closed what it refuses) by now
    def still_open(s):
        try:
            return s.recv(4096, socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False
    print(json.dumps({k: sum(still_open(s) for s in v) for k, v in held.items()}), flush=True)
    sys.stdin.readline()  # held until the test has looked
""")


@pytest.fixture(scope="module")
def other_user():
    try:
        return pwd.getpwnam(OTHER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        OTHER], check=True)
        return pwd.getpwnam(OTHER)


def _daemon(binary, files_limit=None):
    directory = tempfile.mkdtemp(prefix="ts-flood-")
    os.chmod(directory, 0o755)
    socket = os.path.join(directory, "d.sock")
    config = os.path.join(directory, "d.conf")
    with open(config, "w") as f:
        f.write(f'socket_mode: "0666"\ndrain_timeout_s: 1\nmax_connections_per_uid: {CAP}\n')

    def limit():
        if files_limit:
            resource.setrlimit(resource.RLIMIT_NOFILE, (files_limit, files_limit))

    daemon = subprocess.Popen([binary, f"--socket={socket}", f"--config={config}"],
                              preexec_fn=limit, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while not os.path.exists(socket + ".data"):
        assert daemon.poll() is None and time.monotonic() < deadline, daemon.stdout.read()
        time.sleep(0.02)
    return daemon, socket, directory


def _release(flood):
    """Lets the flood script end (it holds its connections until told)."""
    flood.stdin.write("done\n")
    flood.stdin.flush()
    flood.wait(10)


def _fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def _cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tsctl_status(tsctl, socket):
    return subprocess.run([tsctl, f"--socket={socket}", "--json", "status"], capture_output=True,
                          text=True, timeout=10)


def test_one_user_cannot_take_the_daemons_descriptors(trainstreamd_binary, tsctl_binary,
                                                      other_user):
    daemon, socket, directory = _daemon(trainstreamd_binary)
    flood = None
    try:
        baseline = _fds(daemon.pid)
        user = other_user

        long_run = os.environ.get("TS_LONG") == "1"
        attempts = 10_000 if long_run else 5 * CAP  # on each of the two sockets

        def drop():
            # Room for the flood's own sockets (raised while still root), then the other user.
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            want = 2 * attempts + 64
            room = want if hard == resource.RLIM_INFINITY else min(want, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (room, hard))
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)

        cpu_before, began = _cpu_seconds(daemon.pid), time.monotonic()
        flood = subprocess.Popen([sys.executable, "-c", FLOOD, socket, str(attempts)],
                                 preexec_fn=drop, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        held = json.loads(flood.stdout.readline())
        flood_s, cpu_s = time.monotonic() - began, _cpu_seconds(daemon.pid) - cpu_before
        assert held == {"control": CAP, "data": CAP}, held
        fds = _fds(daemon.pid)
        assert fds <= baseline + 2 * CAP + 8
        asked = time.monotonic()
        status = _tsctl_status(tsctl_binary, socket)  # root is never capped
        answered_s = time.monotonic() - asked
        assert status.returncode == 0, status.stderr
        if long_run or os.environ.get("TS_SHOW"):
            print(f"\n{attempts} connections tried on each socket by another uid in "
                  f"{flood_s:.1f} s: {held['control']} and {held['data']} kept (the cap), the "
                  f"daemon at {fds} descriptors (was {baseline}), {cpu_s:.2f} s of its CPU; "
                  f"root's tsctl status answered in {1e3 * answered_s:.0f} ms")
        events = subprocess.run([tsctl_binary, f"--socket={socket}", "--json", "events"],
                                capture_output=True, text=True, timeout=10).stdout
        assert "daemon.connections_refused" in events
        _release(flood)
        # Their connections closed, the user connects again.
        again = subprocess.Popen([sys.executable, "-c", FLOOD, socket, "2"], preexec_fn=drop,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(again.stdout.readline()) == {"control": 2, "data": 2}
        _release(again)
    finally:
        if flood is not None and flood.poll() is None:
            flood.kill()
        daemon.terminate()
        daemon.wait(10)
        shutil.rmtree(directory, ignore_errors=True)


def test_out_of_descriptors_the_daemon_sheds_instead_of_spinning(trainstreamd_binary,
                                                                 tsctl_binary):
    """Root is never capped, so root's flood meets the descriptor limit itself (set low here):
    connections beyond it are closed at once, the daemon's CPU stays idle, and it answers again
    once the flood is gone."""
    daemon, socket, directory = _daemon(trainstreamd_binary, files_limit=128)
    flood = None
    try:
        flood = subprocess.Popen([sys.executable, "-c", FLOOD, socket, "150"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        held = json.loads(flood.stdout.readline())
        assert held["control"] + held["data"] < 300  # some were shed
        before = _cpu_seconds(daemon.pid)
        time.sleep(2.0)
        assert _cpu_seconds(daemon.pid) - before < 0.5  # no spin (it was 191% of a core)
        _release(flood)
        # Once the flood's connections are gone the daemon answers again (the descriptors
        # they held come back as it notices each close).
        deadline = time.monotonic() + 10
        while True:
            status = _tsctl_status(tsctl_binary, socket)
            if status.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert status.returncode == 0, (status.stderr, _fds(daemon.pid))
        assert daemon.poll() is None
    finally:
        if flood is not None and flood.poll() is None:
            flood.kill()
        daemon.terminate()
        daemon.wait(10)
        shutil.rmtree(directory, ignore_errors=True)
