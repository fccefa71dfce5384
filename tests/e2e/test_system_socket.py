# SPDX-License-Identifier: Apache-2.0
"""The system daemon for users other than root: a user of the socket's group finds it with no
socket named and trains through it, seeing only its own sessions; a user outside the group is
told why it was refused and which group to join, and trains on a private daemon instead; tsctl
finds the system daemon the same way and says the same when it cannot. A daemon run as the
service's own account, as the shipped unit runs it, reads and writes the caller's checkpoints
through descriptors the caller opened: files it could never open itself. Needs root to create
the users and the group."""

import grp
import json
import os
import pwd
import subprocess
import sys
import textwrap

import pytest

import trainstream

GROUP, MEMBER, OUTSIDER = "tstest-users", "tstest-member", "tstest-outsider"
SERVICE = "trainstream"  # the account deploy/trainstream.sysusers makes; clients trust it

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creating users and a group needs root")


@pytest.fixture(scope="module")
def users():
    try:
        grp.getgrnam(GROUP)
    except KeyError:
        subprocess.run(["groupadd", "--system", GROUP], check=True)
    for user, groups in ((MEMBER, [GROUP]), (OUTSIDER, [])):
        try:
            pwd.getpwnam(user)
        except KeyError:
            extra = ["--groups", ",".join(groups)] if groups else []
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                            "/usr/sbin/nologin", *extra, user], check=True)
    return {MEMBER: [GROUP], OUTSIDER: []}


@pytest.fixture
def system_daemon(start_daemon):
    """A daemon as deploy/ runs one: its sockets mode 0660, owned by the users' group."""
    d = start_daemon("--memory_budget=256M", socket_mode="0660")
    gid = grp.getgrnam(GROUP).gr_gid
    for path in (d.socket, d.socket + ".data"):
        os.chown(path, -1, gid)
    return d


@pytest.fixture
def service_daemon(users, start_daemon):
    """A daemon as the shipped unit runs one: as the service's own account, which cannot read
    the users' private files, its sockets mode 0660 in the users' group."""
    try:
        pwd.getpwnam(SERVICE)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", SERVICE], check=True)
    d = start_daemon("--memory_budget=256M", socket_mode="0660", user=SERVICE)
    gid = grp.getgrnam(GROUP).gr_gid
    for path in (d.socket, d.socket + ".data"):
        os.chown(path, -1, gid)
    return d


TRAIN = textwrap.dedent("""
    import json, warnings
    import torch, trainstream
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model, opt = trainstream.wrap(torch.nn.Linear(16, 16), lr=1e-2, device="cpu")
    x = torch.ones(4, 16)
    losses = []
    for _ in range(3):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    client = model._trainstream_session.client
    print(json.dumps({"socket": client.socket_path, "session": client.session_id,
                      "sessions": [s["session_id"] for s in client.sessions()],
                      "losses": losses, "said": [str(w.message) for w in said]}))
""")


def _run_as(user, groups, system_socket, *args):
    env = {"PATH": os.environ["PATH"], "TRAINSTREAM_SYSTEM_SOCKET": system_socket,
           "HOME": "/tmp"}
    return subprocess.run(list(args), user=user, group=pwd.getpwnam(user).pw_gid,
                          extra_groups=groups, env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_member_of_the_group_trains_through_the_system_daemon(users, system_daemon):
    with trainstream.connect(system_daemon.socket, job_id="root-job") as owner:
        run = _run_as(MEMBER, users[MEMBER], system_daemon.socket, sys.executable, "-c", TRAIN)
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout.splitlines()[-1])
        assert out["socket"] == system_daemon.socket
        assert out["said"] == []
        assert out["losses"][-1] < out["losses"][0]
        assert out["sessions"] == [out["session"]]  # root's session is not the member's to see
        assert owner.session_id not in out["sessions"]


def test_a_user_outside_the_group_is_told_why_and_trains_on_a_private_daemon(users,
                                                                            system_daemon):
    run = _run_as(OUTSIDER, users[OUTSIDER], system_daemon.socket, sys.executable, "-c", TRAIN)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["socket"] != system_daemon.socket
    assert out["losses"][-1] < out["losses"][0]
    said = " ".join(out["said"])
    assert f"{system_daemon.socket} refuses {OUTSIDER}" in said, out["said"]
    assert f"group {GROUP}" in said and f"usermod -aG {GROUP} {OUTSIDER}" in said, said
    assert "private daemon" in said


def test_tsctl_finds_the_system_daemon_or_says_why_not(users, system_daemon, tsctl_binary):
    member = _run_as(MEMBER, users[MEMBER], system_daemon.socket, tsctl_binary, "status",
                     "--json")
    assert member.returncode == 0, member.stderr
    assert json.loads(member.stdout)["version"]
    # A user of the daemon may not stop it for everyone else.
    drain = _run_as(MEMBER, users[MEMBER], system_daemon.socket, tsctl_binary, "drain")
    assert drain.returncode == 1 and "may not" in drain.stderr, (drain.stdout, drain.stderr)
    assert system_daemon.process.poll() is None
    outsider = _run_as(OUTSIDER, users[OUTSIDER], system_daemon.socket, tsctl_binary, "status")
    assert outsider.returncode == 3, (outsider.stdout, outsider.stderr)
    assert f"refuses {OUTSIDER}" in outsider.stderr and f"usermod -aG {GROUP}" in outsider.stderr


CALLER_FILES = textwrap.dedent("""
    import json, os, sys, tempfile
    import torch, trainstream
    from safetensors.torch import save_file
    sys.path.insert(0, sys.argv[1])
    import grpc
    from tsapi import trainstream_pb2 as pb, trainstream_pb2_grpc as rpc
    home = tempfile.mkdtemp()  # mode 0700: nobody else may even enter it
    path = os.path.join(home, "model.safetensors")
    save_file({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, path)
    os.chmod(path, 0o600)  # as save_pretrained leaves a file under a umask of 077
    out = {}
    client = trainstream.connect(job_id="caller-files")
    out["socket"] = client.socket_path
    base = trainstream.load_base(path, client=client, progress=False)
    out["base"] = base.tensor("w").float().tolist()
    base.close()
    # The same request naming the path alone: the daemon's own rights do not reach the file.
    stub = rpc.TrainStreamStub(grpc.insecure_channel("unix:" + client.socket_path))
    try:
        stub.LoadBase(pb.LoadBaseRequest(session_id=client.session_id, path=path))
        out["by_path"] = "OK"
    except grpc.RpcError as e:
        out["by_path"] = e.code().name + ": " + e.details()
    # A shard the caller itself cannot open is not read for it either.
    shards = tempfile.mkdtemp()
    for n in (1, 2):
        save_file({f"w{n}": torch.ones(4)}, os.path.join(shards, f"model-{n}.safetensors"))
    with open(os.path.join(shards, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"w1": "model-1.safetensors", "w2": "model-2.safetensors"}}, f)
    os.chmod(os.path.join(shards, "model-2.safetensors"), 0)
    try:
        trainstream.load_base(shards, client=client, progress=False)
        out["unreadable_shard"] = "loaded"
    except trainstream.TrainStreamError as e:
        out["unreadable_shard"] = type(e).__name__ + ": " + str(e)
    # The optimizer's checkpoint: the caller's file, in the caller's folder.
    model, opt = trainstream.wrap(torch.nn.Linear(4, 4), lr=1e-2, device="cpu")
    x = torch.ones(2, 4)
    model(x).square().mean().backward(); opt.step(); opt.zero_grad()
    saved = os.path.join(home, "opt.safetensors")
    opt.save(saved)
    st = os.stat(saved)
    out["saved"] = {"uid": st.st_uid, "mode": st.st_mode & 0o777}
    out["left"] = sorted(n for n in os.listdir(home) if ".tmp-" in n)
    before = [p.detach().clone() for p in model.parameters()]
    model(x).square().mean().backward(); opt.step(); opt.zero_grad()
    moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.load(saved)
    out["restored"] = moved and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    print(json.dumps(out))
""")


def test_the_service_account_reads_and_writes_the_callers_files_through_its_descriptors(
        users, service_daemon, proto_modules):
    run = _run_as(MEMBER, users[MEMBER], service_daemon.socket, sys.executable, "-c",
                  CALLER_FILES, proto_modules)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["socket"] == service_daemon.socket
    assert out["base"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert out["by_path"].startswith("PERMISSION_DENIED"), out["by_path"]
    assert out["unreadable_shard"].startswith("NotFoundError"), out["unreadable_shard"]
    assert "model-2.safetensors is not among the 2 files the client opened" in \
        out["unreadable_shard"]
    assert out["saved"] == {"uid": pwd.getpwnam(MEMBER).pw_uid, "mode": 0o600}
    assert out["left"] == []
    assert out["restored"]
