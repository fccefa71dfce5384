# SPDX-License-Identifier: Apache-2.0
"""A killed client, a stopped daemon, SIGTERM draining, and the embedded daemon."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import trainstream
from conftest import wait_until

HOLDER = textwrap.dedent("""
    import sys, time, trainstream
    c = trainstream.connect(sys.argv[1], job_id="victim")
    b = c.allocate("held", 32 << 20, tag="victim")
    b.memoryview()[:4] = b"busy"
    print(c.session_id, flush=True)
    time.sleep(600)
""")


def test_sigkilled_client_is_reclaimed_within_two_seconds(daemon):
    with trainstream.connect(daemon.socket, job_id="bystander") as bystander:
        mine = bystander.allocate("mine", 1 << 20)
        mine.memoryview()[:3] = b"abc"
        victim = subprocess.Popen([sys.executable, "-c", HOLDER, daemon.socket],
                                  stdout=subprocess.PIPE, text=True)
        session_id = victim.stdout.readline().strip()
        assert session_id.startswith("s-")
        assert wait_until(lambda: len(bystander.sessions()) == 2, 5)
        before = bystander.status()["reserved_bytes"]
        victim.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        victim.wait()
        gone = wait_until(
            lambda: bystander.status()["reserved_bytes"] < before
            and len(bystander.sessions()) == 1, 2.0)
        elapsed = time.monotonic() - killed_at
        assert gone, f"memory not reclaimed {elapsed:.2f}s after SIGKILL"
        assert elapsed < 2.0
        reclaimed = [e for e in bystander.events() if e["kind"] == "session.reclaimed"]
        assert reclaimed and reclaimed[-1]["session_id"] == session_id
        assert reclaimed[-1]["numbers"]["released_bytes"] == 32 << 20
        # the bystander's session and bytes are untouched
        assert bytes(bystander.lookup("mine").memoryview()[:3]) == b"abc"
        bystander.ping()


def test_silent_client_loses_its_lease(daemon, stub, pb):
    # A session opened over raw gRPC that never attaches or heartbeats: the lease (1.5 s) ends it.
    reply = stub.OpenSession(pb.OpenSessionRequest(job_id="silent", pid=os.getpid()))
    with trainstream.connect(daemon.socket) as observer:
        assert wait_until(lambda: len(observer.sessions()) == 1, 4)
        reasons = [e["message"] for e in observer.events() if e["session_id"] == reply.session_id]
        assert any("lease expired" in m for m in reasons)


def health(socket: str) -> bytes:
    """The standard grpc.health.v1 Check for our service, as raw bytes (08 01 is
    SERVING, 08 02 NOT_SERVING), so the test needs no generated health stubs."""
    import grpc

    service = b"trainstream.v1.TrainStream"
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        return check(b"\x0a" + bytes([len(service)]) + service, timeout=5)


def test_sigterm_drains_and_exits_zero(daemon):
    client = trainstream.connect(daemon.socket)
    client.allocate("x", 4096)
    assert health(daemon.socket) == b"\x08\x01"
    daemon.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert health(daemon.socket) == b"\x08\x02"  # draining: not serving new work
    with pytest.raises(trainstream.DaemonUnavailableError, match="shutting down"):
        trainstream.connect(daemon.socket)
    assert daemon.process.poll() is None  # still waiting for the open session
    client.close()
    assert daemon.process.wait(10) == 0
    assert "daemon.stop" in daemon.log()
    assert not os.path.exists(daemon.socket)


def test_sigterm_with_a_stuck_client_ends_at_the_drain_timeout(daemon):
    client = trainstream.connect(daemon.socket)
    daemon.process.send_signal(signal.SIGTERM)
    assert daemon.process.wait(15) == 0  # drain_timeout_s is 5 in the test config
    with pytest.raises(trainstream.DaemonUnavailableError):
        for _ in range(100):  # the heartbeat thread notices within a lease period
            client.allocate("after", 64)
            time.sleep(0.05)


def test_daemon_gone_is_a_clear_error_not_a_hang(daemon):
    client = trainstream.connect(daemon.socket, rpc_timeout_s=3)
    daemon.stop(signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(trainstream.DaemonUnavailableError, match=daemon.socket):
        client.allocate("x", 64)
    assert time.monotonic() - start < 5


def test_no_daemon_message_names_the_socket(tmp_path):
    path = str(tmp_path / "nobody.sock")
    with pytest.raises(trainstream.DaemonUnavailableError, match="nobody.sock"):
        trainstream.connect(path)


EMBEDDED = textwrap.dedent("""
    import os, sys, trainstream
    os.environ.pop("TRAINSTREAM_SOCKET", None)
    c = trainstream.connect()
    assert c.embedded, "expected a private daemon"
    b = c.allocate("x", 1 << 20)
    c.ping()
    print(c.socket_path, c._embedded.process.pid, flush=True)
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), 9)
""")


def test_a_named_socket_without_a_daemon_is_an_error_not_a_private_daemon(tmp_path,
                                                                         monkeypatch):
    """TRAINSTREAM_SOCKET names the daemon a job is meant for: where none answers, connect()
    says so, naming the variable, rather than starting a private daemon that trains apart."""
    monkeypatch.setenv("TRAINSTREAM_SOCKET", str(tmp_path / "meant.sock"))
    with pytest.raises(trainstream.DaemonUnavailableError, match="meant.sock.*TRAINSTREAM_SOCKET"):
        trainstream.connect()
    assert not list(tmp_path.iterdir())  # no daemon was started there or beside it


def _default_socket_answers() -> bool:
    try:
        trainstream.connect(embedded=False).close()
        return True
    except trainstream.DaemonUnavailableError:
        return False


@pytest.mark.parametrize("ending", ["exit", "kill"])
def test_embedded_daemon_starts_and_stops_with_the_process(monkeypatch, ending):
    monkeypatch.delenv("TRAINSTREAM_SOCKET", raising=False)
    if _default_socket_answers():
        pytest.skip("a daemon answers at the default socket: connect() uses it, starting none")
    out = subprocess.run([sys.executable, "-c", EMBEDDED, "unused", ending],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout, out.stderr
    socket_path, pid = out.stdout.split()
    pid = int(pid)

    def gone():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie counts as gone: it is no longer serving
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"

    assert wait_until(gone, 5), "embedded trainstreamd outlived its process"
    if ending == "exit":
        assert not os.path.exists(socket_path)
