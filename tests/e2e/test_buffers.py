# SPDX-License-Identifier: Apache-2.0
"""Sessions and shared buffers through a real daemon."""

import os
import subprocess
import sys
import textwrap

import pytest

import trainstream
from conftest import wait_until


def test_connect_reports_status_and_session(daemon):
    with trainstream.connect(daemon.socket, job_id="j1") as client:
        status = client.status()
        assert status["version"] == trainstream.__version__
        assert status["sessions"] == 1
        assert status["budget_bytes"] == 256 << 20
        sessions = client.sessions()
        assert [s["session_id"] for s in sessions] == [client.session_id]
        assert sessions[0]["pid"] == os.getpid()
        assert sessions[0]["attached"] is True


def test_buffer_is_a_zero_copy_tensor_shared_with_the_job(daemon):
    import torch

    with trainstream.connect(daemon.socket, job_id="j1") as a, \
            trainstream.connect(daemon.socket, job_id="j1") as b:
        buf = a.allocate("weights", 4096 * 4, tag="master")
        t = buf.tensor(torch.float32)
        assert t.numel() == 4096
        t.copy_(torch.arange(4096, dtype=torch.float32))
        seen = b.lookup("weights").tensor(torch.float32)
        assert torch.equal(seen, torch.arange(4096, dtype=torch.float32))
        seen[0] = -1.0  # writes land in the one shared copy
        assert t[0].item() == -1.0
        assert t.data_ptr() == buf._native.address  # no copy was made


def test_other_jobs_do_not_see_the_buffer(daemon):
    with trainstream.connect(daemon.socket, job_id="j1") as a, \
            trainstream.connect(daemon.socket, job_id="j2") as b:
        a.allocate("secret", 64)
        with pytest.raises(trainstream.NotFoundError, match="no buffer named 'secret'"):
            b.lookup("secret")


WRITER = textwrap.dedent("""
    import sys, torch, trainstream
    with trainstream.connect(sys.argv[1], job_id="exchange") as client:
        buf = client.allocate("payload", 1 << 20, tag="test")
        buf.tensor(torch.int32).copy_(torch.arange(1 << 18, dtype=torch.int32) * 3)
        print("ready", flush=True)
        sys.stdin.readline()  # hold the session until told to go
""")


def test_two_processes_exchange_a_buffer(daemon):
    import torch

    writer = subprocess.Popen([sys.executable, "-c", WRITER, daemon.socket], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = writer.stdout.readline()
        assert line.strip() == "ready", writer.stderr.read() if writer.poll() is not None else line
        with trainstream.connect(daemon.socket, job_id="exchange") as reader:
            buf = reader.lookup("payload")
            assert buf.owner_session_id != reader.session_id
            got = buf.tensor(torch.int32)
            assert torch.equal(got, torch.arange(1 << 18, dtype=torch.int32) * 3)
    finally:
        writer.communicate("go\n", timeout=30)
    assert writer.returncode == 0


def test_free_and_reuse(daemon):
    with trainstream.connect(daemon.socket) as client:
        a = client.allocate("a", 8192)
        client.free(a)
        with pytest.raises(trainstream.NotFoundError):
            client.lookup("a")
        b = client.allocate("a", 8192)  # the name is free again
        assert b.nbytes == 8192


def test_sealed_buffer_is_read_only_everywhere(daemon):
    with trainstream.connect(daemon.socket, job_id="base") as owner, \
            trainstream.connect(daemon.socket, job_id="base") as other:
        buf = owner.allocate("frozen", 4096, sealable=True)
        buf.memoryview()[:5] = b"hello"
        sealed = owner.seal(buf)
        assert sealed.read_only
        view = other.lookup("frozen")
        assert view.read_only
        assert bytes(view.memoryview()[:5]) == b"hello"
        with pytest.raises(TypeError):
            view.memoryview()[0] = 1
        plain = owner.allocate("plain", 64)
        with pytest.raises(trainstream.FailedPreconditionError, match="sealable"):
            owner.seal(plain)


def test_budget_refusal_is_clear_and_an_event(daemon):
    with trainstream.connect(daemon.socket) as client:
        with pytest.raises(trainstream.ResourceExhaustedError, match="budget") as e:
            client.allocate("too-big", 300 << 20)
        assert "'too-big'" in str(e.value)
        assert isinstance(e.value, MemoryError)
        events = client.events()
        assert any(ev["kind"] == "arena.refused" for ev in events)
        client.allocate("fits", 1 << 20)  # and the daemon keeps serving


def test_one_user_leaves_room_for_others_by_default(daemon):
    # No --uid_quota: one uid may reserve 90% of the 256 MiB budget, so another user's job
    # always finds room; the refusal says which limit it met and how to raise it.
    with trainstream.connect(daemon.socket) as client:
        assert client.memory()["uid_quota_bytes"] == int(0.9 * (256 << 20))
        client.allocate("most", 160 << 20)
        with pytest.raises(trainstream.ResourceExhaustedError, match="per-user quota") as e:
            client.allocate("more", 80 << 20)  # 240 MiB: within the budget, over the quota
        assert "--uid_quota" in str(e.value)
        client.allocate("within", 64 << 20)


def test_memory_report_by_session_and_tag(daemon):
    with trainstream.connect(daemon.socket) as client:
        client.allocate("g", 1000, tag="grad")
        client.allocate("m", 3000, tag="master")
        report = client.memory()
        assert report["reserved_bytes"] >= 4000
        mine = [r for r in report["by_session"] if r["key"] == client.session_id]
        assert mine and mine[0]["bytes"] == 4000 and mine[0]["buffers"] == 2
        if os.getuid() == 0:  # admins see the tags
            tags = {r["key"]: r["bytes"] for r in report["by_tag"]}
            assert tags["grad"] == 1000 and tags["master"] == 3000


def test_closing_frees_everything(daemon):
    client = trainstream.connect(daemon.socket)
    client.allocate("x", 1 << 20)
    client.close()
    with trainstream.connect(daemon.socket) as observer:
        assert wait_until(lambda: observer.status()["reserved_bytes"] == 0, 2)
        assert any(e["kind"] == "session.closed" for e in observer.events())


def test_doorbell_round_trip(daemon):
    with trainstream.connect(daemon.socket) as client:
        for _ in range(100):
            assert client.ping() < 1.0
        client.ring(77, id=5)  # nobody handles kind 77: the daemon answers with an error
        notice = client.wait(2000)
        error = trainstream.transport.client.ERROR
        assert notice.kind == error and notice.id == 5 and notice.value == 3


def test_reported_events_are_limited_per_user_not_per_session(daemon):
    """30 sessions of one user once filled the 4,096-event ring in 3 s: the limit (600 a
    minute) now counts every session of a uid together."""
    sessions = [trainstream.connect(daemon.socket) for _ in range(3)]
    try:
        for i in range(600):
            sessions[i % 2].report_event("flood", "x")
        with pytest.raises(trainstream.ResourceExhaustedError, match="from all its sessions"):
            sessions[2].report_event("flood", "one more, from a session that sent none")
    finally:
        for s in sessions:
            s.close()
