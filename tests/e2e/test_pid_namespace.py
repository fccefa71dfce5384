# SPDX-License-Identifier: Apache-2.0
"""A client in a PID namespace of its own (any container without hostPID) opens a session and
uses the daemon's memory, and trains a small model through wrap() exactly as a process in the
host's namespace does: the daemon knows it by the kernel's credentials alone (SO_PEERCRED, its
pid translated into the daemon's namespace) and says the pid the client reported beside them,
where it was refused before ("pid 1 in the request is not the caller's pid")."""

from __future__ import annotations

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


def _unshare_works() -> str:
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True, text=True)
    return "" if probe.returncode == 0 else f"unshare --pid is not permitted here: {probe.stderr}"


def test_a_client_in_its_own_pid_namespace_is_served(daemon):
    why = _unshare_works()
    if why:
        pytest.skip(why)
    out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                          CLIENT, daemon.socket], capture_output=True, text=True, timeout=60)
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


TRAINER = textwrap.dedent("""
    import os, sys, torch, trainstream
    torch.manual_seed(0)
    model, opt = trainstream.wrap(torch.nn.Linear(16, 1), lr=0.05, device="cpu", offload=True,
                                  socket=sys.argv[1], job_id=sys.argv[2])
    x = torch.randn(64, 16)
    y = x.sum(1, keepdim=True)
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    trainstream.unwrap(model)
    print(os.getpid(), *losses, flush=True)
""")


def test_a_client_in_its_own_pid_namespace_trains_as_one_outside_does(daemon):
    why = _unshare_works()
    if why:
        pytest.skip(why)
    inside = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                             TRAINER, daemon.socket, "contained-train"],
                            capture_output=True, text=True, timeout=120)
    assert inside.returncode == 0, inside.stderr
    outside = subprocess.run([sys.executable, "-c", TRAINER, daemon.socket, "host-train"],
                             capture_output=True, text=True, timeout=120)
    assert outside.returncode == 0, outside.stderr
    pid, *losses = inside.stdout.split()
    assert int(pid) == 1
    assert float(losses[-1]) < 0.5 * float(losses[0]), losses  # it learned
    # The daemon's optimizer ran its steps exactly as for a process in the host's namespace.
    assert losses == outside.stdout.split()[1:]
