# SPDX-License-Identifier: Apache-2.0
"""Data-parallel ranks of one job share one optimizer state in the daemon."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import trainstream

torch = pytest.importorskip("torch")

SHAPES = [(33, 7), (1000,), (5,)]
STEPS = 8

RANK = textwrap.dedent("""
    import json, os, sys, time, torch, trainstream
    from trainstream import HostOptimizer, ParameterSpec
    socket, job, rank, world, mode, out = sys.argv[1:7]
    rank, world = int(rank), int(world)
    shapes = json.loads(os.environ["TS_SHAPES"])
    steps = int(os.environ["TS_STEPS"])
    c = trainstream.connect(socket, job_id=job, rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) for s in shapes]
    opt = HostOptimizer(c, [ParameterSpec(f"p{i}", tuple(s)) for i, s in enumerate(shapes)],
                        groups=[dict(lr=1e-2, weight_decay=0.1)], timeout_s=20)
    if opt.initialize:
        opt.load_weights(init)
    try:
        for step in range(steps):
            if mode == "die" and step == 2:
                print("dying", flush=True)
                os.kill(os.getpid(), 9)
            gen = torch.Generator().manual_seed(1000 * step + rank)
            grads = [torch.randn(s, generator=gen) for s in shapes]
            if mode == "diverge" and step == 1:
                opt.iteration += 1  # posts iteration 3 while the job is at 2
            opt.step(grads)
        torch.save([opt.master(i).clone() for i in range(len(shapes))], out)
        if mode == "close":
            c.close()
        print("ok", flush=True)
    except trainstream.TrainStreamError as e:
        print("error:", type(e).__name__, e, flush=True)
        sys.exit(3)
""")


def run_ranks(daemon, tmp_path, world, modes=None, job="dp"):
    env = dict(os.environ, TS_SHAPES=json.dumps(SHAPES), TS_STEPS=str(STEPS))
    procs = []
    for r in range(world):
        mode = (modes or {}).get(r, "normal")
        procs.append(subprocess.Popen(
            [sys.executable, "-c", RANK, daemon.socket, job, str(r), str(world), mode,
             str(tmp_path / f"rank{r}.pt")], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        outs.append((p.returncode, out, err))
    return outs


def reference(world):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        grads = []
        for r in range(world):
            gen = torch.Generator().manual_seed(1000 * step + r)
            grads.append([torch.randn(s, generator=gen) for s in SHAPES])
        for i, p in enumerate(params):
            p.grad = sum(gs[i] for gs in grads) / world  # the global batch's mean gradient
        opt.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_equal_one_process_on_the_global_batch(daemon, tmp_path, world):
    outs = run_ranks(daemon, tmp_path, world, job=f"dp{world}")
    for rc, out, err in outs:
        assert rc == 0, (out, err)
    expected = reference(world)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for got in results:
        assert all(torch.equal(a, b) for a, b in zip(got, results[0]))  # one shared state
        assert max((a - b).abs().max().item() for a, b in zip(got, expected)) <= 1e-6
    with trainstream.connect(daemon.socket, job_id=f"dp{world}") as c:
        # one optimizer state for the whole job, not one per rank
        state = [r for r in c.memory()["by_session"] if r["key"] == "optimizer"]
        assert len(state) == 1


def optimizer_state(tsctl_binary, socket, job):
    """The job's optimizer state as `tsctl optimizers --json` lists it."""
    listed = subprocess.run([tsctl_binary, f"--socket={socket}", "--json", "optimizers"],
                            capture_output=True, text=True, check=True).stdout
    (info,) = [o for o in json.loads(listed).get("optimizers", []) if o["job_id"] == job]
    return info["state"]


# "exit": each rank's process ends without closing its session, as a torchrun script does;
# "close": each closes it first.
@pytest.mark.parametrize("ending", ["exit", "close"])
def test_a_job_whose_ranks_all_end_cleanly_is_listed_as_finished(daemon, tmp_path, ending,
                                                                  tsctl_binary):
    outs = run_ranks(daemon, tmp_path, 2, modes={0: ending, 1: ending}, job=f"ends-{ending}")
    for rc, out, err in outs:
        assert rc == 0, (out, err)
    # Kept for the retention (a restart may re-attach), and not a failure.
    assert optimizer_state(tsctl_binary, daemon.socket, f"ends-{ending}") == "finished"


def test_a_rank_that_dies_fails_the_job_cleanly(daemon, tmp_path, tsctl_binary):
    start = time.monotonic()
    outs = run_ranks(daemon, tmp_path, 2, modes={1: "die"}, job="dies")
    assert outs[1][0] == -signal.SIGKILL
    rc, out, err = outs[0]
    assert rc == 3, (out, err)
    assert "rank 1 died" in out
    assert time.monotonic() - start < 30  # reported, not a hang until the timeout
    # The other rank then ended cleanly: the job stays failed, with why.
    state = optimizer_state(tsctl_binary, daemon.socket, "dies")
    assert state.startswith("failed: ") and "rank 1 died" in state, state


def test_a_rank_that_diverges_is_reported_to_all(daemon, tmp_path):
    outs = run_ranks(daemon, tmp_path, 2, modes={1: "diverge"}, job="diverges")
    for rc, out, err in outs:
        assert rc == 3, (out, err)
        assert "skipped or repeated a step" in out
