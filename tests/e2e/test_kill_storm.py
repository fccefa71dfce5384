# SPDX-License-Identifier: Apache-2.0
"""Clients SIGKILLed at every stage of their life (before they attach, while allocating,
mid-step, mid-checkpoint) cost the daemon nothing: it stays up, its reserved bytes and
descriptors come back to what they were, and a job training beside the storm computes exactly
the losses it computes alone. Sized for CI (12 kills, four at a time); ``TS_LONG=1`` kills 320
and prints the figures (``TS_SHOW=1`` prints them for the short run)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import trainstream
from conftest import wait_until

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from tiny_gpt import TinyGPT, train_steps  # noqa: E402

MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models")

# A client that says where it is before each stage: the storm kills it on a chosen word.
VICTIM = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[3])
    import torch, trainstream
    from tiny_gpt import TinyGPT, batch, loss_fn
    def say(word):
        print(word, flush=True)
    say("started")
    model, opt = trainstream.wrap(TinyGPT(layers=2), lr=1e-3, device="cpu", offload=True,
                                  socket=sys.argv[1], job_id=sys.argv[2])
    say("attached")
    session = model._trainstream_session
    buffers = []
    for i in range(4):
        say("allocating")
        buffers.append(session.client.allocate(f"extra{i}", 4 << 20, tag="victim"))
    for i in range(1000):
        say("stepping")
        x, y = batch(i, device="cpu")
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        if i % 3 == 2:
            say("saving")
            opt.save(os.path.join(os.path.dirname(sys.argv[1]), sys.argv[2] + ".safetensors"))
""")
STAGES = ["started", "attached", "allocating", "stepping", "saving"]


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _kill_on(word: str, victim: subprocess.Popen, rng: random.Random) -> bool:
    """Reads the victim's words until ``word`` (then a moment more, so the kill lands inside
    the stage) and SIGKILLs it; False if it ended first."""
    for line in victim.stdout:
        if line.strip() == word:
            time.sleep(rng.uniform(0.0, 0.02))
            victim.send_signal(signal.SIGKILL)
            return True
    return False


def _storm(socket: str, kills: int, at_once: int, stages: dict) -> None:
    """Starts ``at_once`` victims at a time and kills each on its stage word."""
    rng = random.Random(28)
    for r in range(kills // at_once):
        victims = []
        for k in range(at_once):
            stage = STAGES[(r * at_once + k) % len(STAGES)]
            victims.append((stage, subprocess.Popen(
                [sys.executable, "-c", VICTIM, socket, f"victim-{r}-{k}", MODELS],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)))
        for stage, victim in victims:
            if _kill_on(stage, victim, rng):
                stages[stage] += 1
            victim.wait()


def test_a_kill_storm_costs_the_daemon_and_a_survivor_nothing(start_daemon):
    long_run = os.environ.get("TS_LONG") == "1"
    kills, at_once = (320, 8) if long_run else (12, 4)
    # Killed jobs' optimizer state is kept a second for a restart to re-attach (10 minutes by
    # default): then it goes too, and the reserved bytes can come all the way back.
    daemon = start_daemon("--memory_budget=2G", "--lease_ms=1500",
                          config="optimizer_retention_s: 1\n")
    torch.manual_seed(0)
    model, opt = trainstream.wrap(TinyGPT(layers=2), lr=1e-3, device="cpu", offload=True,
                                  socket=daemon.socket, job_id="survivor")
    client = model._trainstream_session.client
    assert wait_until(lambda: len(client.sessions()) == 1, 5)
    reserved = client.status()["reserved_bytes"]
    fds = _descriptors(daemon.process.pid)

    stages = {s: 0 for s in STAGES}
    storm = threading.Thread(target=_storm, args=(daemon.socket, kills, at_once, stages))
    started = time.monotonic()
    storm.start()
    beside = []
    while storm.is_alive():  # the survivor trains through the whole storm
        beside += train_steps(model, opt, 1, start=len(beside))
    storm.join()
    seconds = time.monotonic() - started
    # Their sockets close or their leases end (1.5 s), their jobs' state a second later.
    assert wait_until(lambda: len(client.sessions()) == 1
                      and client.status()["reserved_bytes"] <= reserved, 20), (
        client.sessions(), client.status()["reserved_bytes"], reserved)
    assert wait_until(lambda: _descriptors(daemon.process.pid) <= fds, 10), (
        _descriptors(daemon.process.pid), fds)
    assert daemon.process.poll() is None
    assert sum(stages.values()) == kills, stages
    trainstream.unwrap(model)

    # The same job alone, from the same seed, on the same daemon: bit-identical losses.
    torch.manual_seed(0)
    alone_model, alone_opt = trainstream.wrap(TinyGPT(layers=2), lr=1e-3, device="cpu",
                                              offload=True, socket=daemon.socket, job_id="alone")
    alone = train_steps(alone_model, alone_opt, len(beside))
    trainstream.unwrap(alone_model)
    assert beside == alone
    if long_run or os.environ.get("TS_SHOW"):
        print(f"\n{kills} clients SIGKILLed in {seconds:.0f} s, {at_once} at a time "
              f"({', '.join(f'{n} {s}' for s, n in stages.items())}): reserved bytes back to "
              f"{reserved}, descriptors back to {fds}; the survivor's {len(beside)} steps "
              "bit-identical to its run alone")
