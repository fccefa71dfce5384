# SPDX-License-Identifier: Apache-2.0
"""The system daemon for users other than root: a user of the socket's group finds it with no
socket named and trains through it, seeing only its own sessions; a user outside the group is
told why it was refused and which group to join, and trains on a private daemon instead; tsctl
finds the system daemon the same way and says the same when it cannot. Needs root to create
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
    outsider = _run_as(OUTSIDER, users[OUTSIDER], system_daemon.socket, tsctl_binary, "status")
    assert outsider.returncode == 3, (outsider.stdout, outsider.stderr)
    assert f"refuses {OUTSIDER}" in outsider.stderr and f"usermod -aG {GROUP}" in outsider.stderr
