# SPDX-License-Identifier: Apache-2.0
"""Another uid can neither open, list nor map a session of the first; tsctl run by it shows only
its own sessions. Needs root to create the second user."""

import json
import os
import pwd
import subprocess
import sys
import textwrap

import pytest

import trainstream

OTHER = "tstest-other"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creating a second user needs root")


@pytest.fixture(scope="module")
def other_user():
    try:
        pwd.getpwnam(OTHER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        OTHER], check=True)
    return OTHER


ATTACK = textwrap.dedent("""
    import json, os, socket, sys
    sys.path.insert(0, sys.argv[3])
    import grpc
    from tsapi import trainstream_pb2 as pb, trainstream_pb2_grpc as rpc
    path, victim = sys.argv[1], sys.argv[2]
    stub = rpc.TrainStreamStub(grpc.insecure_channel("unix:" + path))
    out = {}
    def code(f):
        try:
            f()
            return "OK"
        except grpc.RpcError as e:
            return e.code().name + ": " + e.details()
    out["lookup"] = code(lambda: stub.LookupBuffer(pb.LookupBufferRequest(session_id=victim, name="secret")))
    out["alloc"] = code(lambda: stub.AllocateBuffer(pb.AllocateBufferRequest(session_id=victim, name="x", bytes=8)))
    out["close"] = code(lambda: stub.CloseSession(pb.CloseSessionRequest(session_id=victim)))
    out["heartbeat"] = code(lambda: stub.Heartbeat(pb.HeartbeatRequest(session_id=victim)))
    out["report"] = code(lambda: stub.ReportEvent(pb.ReportEventRequest(session_id=victim, kind="forged")))
    out["plan"] = code(lambda: stub.PlanHostMemory(pb.PlanHostMemoryRequest(session_id=victim, bytes=1)))
    out["plan_rows"] = [p.job_id for p in stub.GetMemory(pb.GetMemoryRequest()).plans]
    out["sessions"] = [s.session_id for s in stub.ListSessions(pb.ListSessionsRequest()).sessions]
    out["memory_uids"] = [r.key for r in stub.GetMemory(pb.GetMemoryRequest()).by_uid]
    out["events"] = [e.session_id for e in stub.StreamEvents(pb.StreamEventsRequest()) if e.session_id]
    # Try to map the victim's segments over the data socket, attaching with the victim's id.
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path + ".data")
    s.send(pb.DataRequest(attach=pb.DataRequest.Attach(session_id=victim, attach_token=b"0" * 32)).SerializeToString())
    out["attach"] = pb.DataReply.FromString(s.recv(65536)).code
    s.send(pb.DataRequest(get_segment=pb.DataRequest.GetSegment(segment_id=1)).SerializeToString())
    out["segment"] = pb.DataReply.FromString(s.recv(65536)).code
    # And its own session works
    mine = stub.OpenSession(pb.OpenSessionRequest(job_id="job", pid=os.getpid())).session_id
    out["own_sessions"] = [x.session_id for x in stub.ListSessions(pb.ListSessionsRequest()).sessions]
    out["mine"] = mine
    print(json.dumps(out))
""")


def test_another_uid_can_neither_see_nor_touch(start_daemon, proto_modules, other_user,
                                                tsctl_binary):
    d = start_daemon("--memory_budget=128M", socket_mode="0666")
    with trainstream.connect(d.socket, job_id="job") as owner:
        owner.allocate("secret", 4096).memoryview()[:6] = b"secret"
        owner.plan_host_memory(1 << 20)  # the owner's plan is not the other user's to see
        result = subprocess.run(
            [sys.executable, "-c", ATTACK, d.socket, owner.session_id, proto_modules],
            user=other_user, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        for op in ("lookup", "alloc", "close", "heartbeat", "report", "plan"):
            assert out[op].startswith("PERMISSION_DENIED"), (op, out[op])
        assert out["sessions"] == []
        assert out["memory_uids"] == []
        assert out["plan_rows"] == []
        assert owner.session_id not in out["events"]
        assert out["attach"] == 7  # PERMISSION_DENIED
        assert out["segment"] == 9  # FAILED_PRECONDITION: not attached, nothing handed out
        assert out["own_sessions"] == [out["mine"]]
        # The owner's session is untouched.
        assert bytes(owner.lookup("secret").memoryview()[:6]) == b"secret"

        tsctl = subprocess.run([tsctl_binary, f"--socket={d.socket}", "sessions", "--json"],
                               user=other_user, capture_output=True, text=True, timeout=30)
        assert tsctl.returncode == 0, tsctl.stderr
        listed = [s["session_id"] for s in json.loads(tsctl.stdout).get("sessions", [])]
        assert owner.session_id not in listed
        root_view = subprocess.run([tsctl_binary, f"--socket={d.socket}", "sessions", "--json"],
                                   capture_output=True, text=True, timeout=30)
        assert owner.session_id in root_view.stdout
