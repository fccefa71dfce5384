# SPDX-License-Identifier: Apache-2.0
"""torchrun with 2 processes through wrap() equals 1 process on the same global batch; so do
2 "machines" of 2 ranks, each machine with its own daemon."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap

import pytest

import trainstream

torch = pytest.importorskip("torch")
MODELS = os.path.join(os.path.dirname(__file__), "..", "models")

SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist, trainstream
    sys.path.insert(0, sys.argv[1])
    from tiny_gpt import TinyGPT, batch, loss_fn
    out = sys.argv[2]
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    torch.manual_seed(0)
    model = TinyGPT()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                                  max_grad_norm=1.0, device="cpu")
    for step in range(6):
        x, y = batch(step, size=8)          # the global batch of this step
        share = slice(rank * 8 // world, (rank + 1) * 8 // world)
        loss_fn(model, x[share], y[share]).backward()
        opt.step()
        opt.zero_grad()
    # One write of the whole line: the ranks share the pipe, and print() may write the text
    # and its newline apart, between which the other rank's line lands.
    sys.stdout.flush()
    os.write(1, (f"rank {rank} socket {model._trainstream_session.client.socket_path} job "
                 f"{opt.stats()['job_id']}\\n").encode())
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, out)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
""")


def _one_and_two_processes(env, tmp_path):
    """The script run alone and under torchrun with 2 processes, with ``env``: torchrun's
    completed process (its ranks' lines in stdout); both runs' weights are checked equal."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    single = subprocess.run([sys.executable, str(script), MODELS, str(tmp_path / "one.pt")],
                            env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", str(script), MODELS, str(tmp_path / "two.pt")]
    two = subprocess.run(torchrun, env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    one, both = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    worst = max((one[k] - both[k]).abs().max().item() for k in one)
    assert worst <= 1e-5, worst
    assert "Traceback" not in two.stderr
    return two


def _ranks(two, field):
    """{rank: its ``field`` (socket or job)} from the line each rank wrote."""
    found = re.findall(r"rank (\d+) socket (\S+) job (\S+)", two.stdout)
    ranks = {rank: socket if field == "socket" else job for rank, socket, job in found}
    assert set(ranks) == {"0", "1"}, f"stdout:\n{two.stdout[-3000:]}\nstderr:\n{two.stderr[-3000:]}"
    return ranks


@pytest.mark.parametrize("shared_memory", ["1", "0"])
def test_torchrun_two_processes_equal_one_on_the_global_batch(daemon, tmp_path, shared_memory,
                                                              tsctl_binary):
    # TRAINSTREAM_SHM=0: each rank keeps its own copy of the state in the daemon and the
    # ranks all-reduce their gradients over gloo; the same training either way.
    env = dict(os.environ, TRAINSTREAM_SOCKET=daemon.socket, OMP_NUM_THREADS="1",
               TRAINSTREAM_SHM=shared_memory)
    jobs = _ranks(_one_and_two_processes(env, tmp_path), "job")
    if shared_memory == "0":
        assert jobs["0"].endswith("-rank0") and jobs["1"].endswith("-rank1"), jobs
    else:
        assert jobs["0"] == jobs["1"], jobs
    # The run ended cleanly: tsctl lists its job as finished, not failed (issue 50).
    listed = json.loads(subprocess.run([tsctl_binary, f"--socket={daemon.socket}", "--json",
                                        "optimizers"], capture_output=True, text=True,
                                       check=True).stdout)
    states = {o["job_id"]: o["state"] for o in listed.get("optimizers", [])}
    assert {job: states.get(job) for job in set(jobs.values())} == {
        job: "finished" for job in set(jobs.values())}, states


def test_torchrun_with_no_daemon_running_shares_one_private_daemon(tmp_path):
    # No daemon anywhere: the local rank 0 starts one for the job, in a directory named after
    # it; the other rank waits for it there. Both train in one job (equal to one process), and
    # the daemon is gone with the job.
    runtime = pathlib.Path(tempfile.mkdtemp(prefix="tsrt-", dir="/tmp"))  # a socket's path is short
    env = {k: v for k, v in os.environ.items() if k != "TRAINSTREAM_SOCKET"}
    env.update(OMP_NUM_THREADS="1", XDG_RUNTIME_DIR=str(runtime),
               TRAINSTREAM_SYSTEM_SOCKET=str(tmp_path / "no-system-daemon.sock"))
    sockets = _ranks(_one_and_two_processes(env, tmp_path), "socket")
    assert set(sockets) == {"0", "1"} and sockets["0"] == sockets["1"], sockets
    assert sockets["0"].startswith(str(runtime / f"trainstream-{os.getuid()}-torchrun-"))
    assert not os.path.exists(sockets["0"])  # rank 0 stopped it at exit
    shutil.rmtree(runtime)


@pytest.fixture
def short_runtime_dir(monkeypatch):
    """An XDG_RUNTIME_DIR short enough for a socket's path (a pytest tmp_path is not)."""
    runtime = tempfile.mkdtemp(prefix="tsrt-", dir="/tmp")
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)
    yield pathlib.Path(runtime)
    shutil.rmtree(runtime, ignore_errors=True)


def test_a_job_directory_of_another_owner_or_mode_is_refused(short_runtime_dir):
    from trainstream.transport import job_daemon

    tmp_path = short_runtime_dir
    directory = job_daemon.job_directory("torchrun-x")
    assert directory.startswith(str(tmp_path))
    os.mkdir(directory, 0o755)
    with pytest.raises(trainstream.PermissionDeniedError, match="is not a directory of uid"):
        job_daemon.start_or_find(0, 2, "torchrun-x")
    os.rmdir(directory)
    os.symlink(str(tmp_path), directory)
    with pytest.raises(trainstream.PermissionDeniedError, match="is not a directory of uid"):
        job_daemon.start_or_find(1, 2, "torchrun-x")


def test_a_rank_whose_rank_0_never_starts_the_daemon_says_so(short_runtime_dir, monkeypatch):
    from trainstream.transport import job_daemon

    monkeypatch.setattr(job_daemon, "WAIT_S", 0.5)
    with pytest.raises(trainstream.DaemonUnavailableError,
                       match="local rank 0 of job 'torchrun-y' .2 ranks on this machine. did "
                             "not start"):
        job_daemon.start_or_find(1, 2, "torchrun-y")


@pytest.mark.parametrize("environ, expected", [
    ({}, None),
    ({"LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "a"}, None),
    ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "a"},
     (1, 2, "torchrun-a")),
    ({"SLURM_NTASKS_PER_NODE": "4", "SLURM_LOCALID": "3", "SLURM_JOB_ID": "7"},
     (3, 4, "slurm-7.0")),
])
def test_which_processes_share_a_private_daemon(environ, expected):
    from trainstream.transport.job_daemon import launcher_job

    assert launcher_job(environ) == expected


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_machines_with_their_own_daemons_equal_one_process(start_daemon, tsctl_binary,
                                                                tmp_path):
    # Each "machine" has its own daemon, which sums its two ranks' gradients; the machines' rank
    # 0s all-reduce those sums with torch.distributed before each daemon updates.
    machines = [start_daemon("--memory_budget=512M"), start_daemon("--memory_budget=512M")]
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    base = dict(os.environ, OMP_NUM_THREADS="1")
    single = subprocess.run([sys.executable, str(script), MODELS, str(tmp_path / "one.pt")],
                            env=dict(base, TRAINSTREAM_SOCKET=machines[0].socket),
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr
    port = free_port()
    procs = []
    for rank in range(4):
        env = dict(base, RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank % 2),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TORCHELASTIC_RUN_ID="two-machines",
                   TRAINSTREAM_SOCKET=machines[rank // 2].socket)
        procs.append(subprocess.Popen([sys.executable, str(script), MODELS,
                                       str(tmp_path / "four.pt")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    one, four = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "four.pt")
    worst = max((one[k] - four[k]).abs().max().item() for k in one)
    assert worst <= 1e-5, worst
    # Each machine's daemon ran its own job: one optimizer state per machine, 6 steps each.
    for d in machines:
        listed = subprocess.run([tsctl_binary, f"--socket={d.socket}", "optimizers", "--json"],
                                capture_output=True, text=True, timeout=30)
        jobs = {o["job_id"]: o for o in json.loads(listed.stdout).get("optimizers", [])}
        job = jobs["torchrun-two-machines"]
        assert int(job["step"]) == 6 and job["spec"]["machines"] == 2


@pytest.mark.parametrize("environ, expected", [
    # torchrun
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "abc"},
     (1, 2, "torchrun-abc")),
    # srun: 4 tasks on each of 2 nodes, this one the third of its node
    ({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3", "SLURM_LOCALID": "2",
      "SLURM_NTASKS_PER_NODE": "4(x2)"}, (2, 4, "slurm-77.3")),
    ({"SLURM_JOB_ID": "77", "SLURM_NTASKS_PER_NODE": "4"}, (5 % 4, 4, "slurm-77.0")),
    # torchrun inside a Slurm allocation: torchrun's variables win
    ({"SLURM_JOB_ID": "77", "SLURM_NTASKS_PER_NODE": "1", "LOCAL_RANK": "0",
      "LOCAL_WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "r"}, (0, 8, "torchrun-r")),
    # a bare process group: every rank on this machine
    ({"MASTER_ADDR": "h", "MASTER_PORT": "9"}, (5, 8, "torchrun-h-9")),
])
def test_the_launchers_variables_place_a_rank_on_its_machine(environ, expected):
    from trainstream.transport.launcher import launcher_topology

    assert launcher_topology(environ, 5, 8) == expected
