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
    out["estimate"] = code(lambda: stub.EstimateHostMemory(
        pb.EstimateHostMemoryRequest(session_id=victim, other_buffers=[8])))
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
    opened = stub.OpenSession(pb.OpenSessionRequest(job_id="job", pid=os.getpid()))
    mine = opened.session_id
    out["own_sessions"] = [x.session_id for x in stub.ListSessions(pb.ListSessionsRequest()).sessions]
    out["mine"] = mine
    # The victim's shared base: not listed, not readable, not loadable from its private path,
    # and its segments not handed to a session of this uid, even an attached one.
    base_id, base_path, segments = int(sys.argv[4]), sys.argv[5], json.loads(sys.argv[6])
    out["bases"] = [b.base_id for b in stub.ListBases(pb.ListBasesRequest()).bases]
    out["get_base_victim"] = code(lambda: stub.GetBase(pb.GetBaseRequest(session_id=victim, base_id=base_id)))
    out["get_base"] = code(lambda: stub.GetBase(pb.GetBaseRequest(session_id=mine, base_id=base_id)))
    out["load_base"] = code(lambda: stub.LoadBase(pb.LoadBaseRequest(session_id=mine, path=base_path)))
    # Through a link of its own to the victim's file: the daemon opens it with this uid's rights.
    import tempfile
    link = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    os.symlink(base_path, link)
    out["load_base_link"] = code(lambda: stub.LoadBase(pb.LoadBaseRequest(session_id=mine, path=link)))
    out["detach_base"] = code(lambda: stub.DetachBase(pb.DetachBaseRequest(session_id=mine, base_id=base_id)))
    own = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    own.connect(path + ".data")
    own.send(pb.DataRequest(attach=pb.DataRequest.Attach(session_id=mine, attach_token=opened.attach_token)).SerializeToString())
    out["own_attach"] = pb.DataReply.FromString(own.recv(65536)).code
    out["base_segments"] = []
    for segment in segments:
        own.send(pb.DataRequest(get_segment=pb.DataRequest.GetSegment(segment_id=segment)).SerializeToString())
        out["base_segments"].append(pb.DataReply.FromString(own.recv(65536)).code)
    # The victim's GPU pool (a real one where the machine has a GPU): not listed, not placed,
    # released or handed over to this uid.
    pool_id = int(sys.argv[7])
    uuid = "GPU-00000000-1111-2222-3333-444444444444"
    out["pools"] = [p.pool_id for p in stub.ListGpuPools(pb.ListGpuPoolsRequest()).pools]
    out["place_victim"] = code(lambda: stub.PlaceBaseOnGpu(pb.PlaceBaseOnGpuRequest(session_id=victim, base_id=base_id, gpu_uuid=uuid)))
    out["place"] = code(lambda: stub.PlaceBaseOnGpu(pb.PlaceBaseOnGpuRequest(session_id=mine, base_id=base_id, gpu_uuid=uuid)))
    out["release_pool"] = code(lambda: stub.ReleaseGpuPool(pb.ReleaseGpuPoolRequest(session_id=mine, pool_id=pool_id)))
    own.send(pb.DataRequest(import_pool=pb.DataRequest.ImportPool(pool_id=pool_id)).SerializeToString())
    out["import_pool"] = pb.DataReply.FromString(own.recv(65536)).code
    print(json.dumps(out))
""")


def test_another_uid_can_neither_see_nor_touch(start_daemon, proto_modules, other_user,
                                                tsctl_binary, tmp_path):
    d = start_daemon("--memory_budget=128M", socket_mode="0666")
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    private = tmp_path / "model.safetensors"  # under the owner's 0700 pytest folder
    safetensors_torch.save_file({"w": torch.ones(64, 64)}, str(private))
    with trainstream.connect(d.socket, job_id="job") as owner:
        owner.allocate("secret", 4096).memoryview()[:6] = b"secret"
        owner.plan_host_memory(1 << 20)  # the owner's plan is not the other user's to see
        base = trainstream.load_base(str(private), client=owner, progress=False)
        segments = [int(b["segment_id"]) for b in base.info()["buffers"]]
        pool_id = base.on_gpu().pool_id if torch.cuda.is_available() else 1
        result = subprocess.run(
            [sys.executable, "-c", ATTACK, d.socket, owner.session_id, proto_modules,
             str(base.id), str(private), json.dumps(segments), str(pool_id)],
            user=other_user, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        for op in ("lookup", "alloc", "close", "heartbeat", "report", "plan", "estimate"):
            assert out[op].startswith("PERMISSION_DENIED"), (op, out[op])
        assert out["sessions"] == []
        assert out["memory_uids"] == []
        assert out["plan_rows"] == []
        assert owner.session_id not in out["events"]
        assert out["attach"] == 7  # PERMISSION_DENIED
        assert out["segment"] == 9  # FAILED_PRECONDITION: not attached, nothing handed out
        assert out["own_sessions"] == [out["mine"]]
        assert out["bases"] == []
        assert out["get_base_victim"].startswith("PERMISSION_DENIED"), out["get_base_victim"]
        assert out["get_base"].startswith("NOT_FOUND"), out["get_base"]
        assert out["load_base"].startswith("PERMISSION_DENIED"), out["load_base"]
        assert out["load_base_link"].startswith("PERMISSION_DENIED"), out["load_base_link"]
        assert out["detach_base"].startswith("NOT_FOUND"), out["detach_base"]
        assert out["own_attach"] == 0 and segments
        assert out["base_segments"] == [5] * len(segments)  # NOT_FOUND: not its base
        assert int(base.info()["users"]) == 1  # the owner's base is untouched
        assert out["pools"] == []
        assert out["place_victim"].startswith("PERMISSION_DENIED"), out["place_victim"]
        assert out["place"].startswith("NOT_FOUND"), out["place"]  # not attached to it
        assert out["release_pool"].startswith("NOT_FOUND"), out["release_pool"]
        assert out["import_pool"] == 5  # NOT_FOUND: not an importer of it
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


CORRUPT_OWN_RING = textwrap.dedent("""
    import ctypes, os, sys, time
    sys.path.insert(0, sys.argv[2])
    import trainstream
    s = trainstream.connect(sys.argv[1], embedded=False)
    print(s.session_id, flush=True)
    # The to-daemon ring's head (ipc/doorbell_ring.cc: header, then its control block) jumps
    # a million ahead, and the daemon is woken without a message: it sees an impossible index.
    line = [l for l in open("/proc/self/maps") if "trainstream-doorbell" in l][0]
    ctypes.c_uint64.from_address(int(line.split("-")[0], 16) + 64).value += 10**6
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]":
                os.write(int(fd), (1).to_bytes(8, "little"))
        except OSError:
            pass
    time.sleep(1.0)
""")


def test_a_protocol_error_is_the_sessions_owners_to_see(start_daemon, other_user, tsctl_binary):
    """A session whose client breaks its doorbell ring is ended, and the event that says so
    (doorbell.protocol_error, with the session's id) is its owner's: another user's tsctl
    never shows it."""
    d = start_daemon("--memory_budget=128M", socket_mode="0666")
    package = os.path.dirname(os.path.dirname(trainstream.__file__))
    broken = subprocess.run([sys.executable, "-c", CORRUPT_OWN_RING, d.socket, package],
                            capture_output=True, text=True, timeout=60)
    assert broken.returncode == 0, broken.stderr
    session = broken.stdout.split()[0]

    def events(**run):
        out = subprocess.run([tsctl_binary, f"--socket={d.socket}", "--json", "events"],
                             capture_output=True, text=True, timeout=30, **run)
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]

    mine = [e for e in events() if e["kind"] == "doorbell.protocol_error"]
    assert [e["session_id"] for e in mine] == [session]
    theirs = events(user=other_user)
    assert not any(e["kind"] == "doorbell.protocol_error" for e in theirs)
    assert all(e.get("session_id", "") != session for e in theirs)
