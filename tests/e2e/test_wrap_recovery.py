# SPDX-License-Identifier: Apache-2.0
"""A training process killed mid-run; a new one re-attaches to the job's state in the daemon
and continues with no step lost: the trajectory equals an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

import trainstream
from conftest import wait_until

torch = pytest.importorskip("torch")
MODELS = os.path.join(os.path.dirname(__file__), "..", "models")
sys.path.insert(0, MODELS)
from tiny_gpt import TinyGPT  # noqa: E402


def runner(daemon, script_path, text: str):
    """run(*args): starts ``text`` as a training script against ``daemon``."""
    script_path.write_text(text)
    env = dict(os.environ, TRAINSTREAM_SOCKET=daemon.socket)

    def run(*args):
        return subprocess.Popen([sys.executable, str(script_path), MODELS, *map(str, args)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    return run


def kill_and_wait_gone(daemon, victim) -> None:
    """SIGKILL, then wait until the daemon has let go of the process's sessions."""
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    with trainstream.connect(daemon.socket, job_id="observer") as c:
        assert wait_until(lambda: all(s["pid"] != victim.pid for s in c.sessions()), 5)

SCRIPT = textwrap.dedent("""
    import sys, time, torch, trainstream
    sys.path.insert(0, sys.argv[1])
    from tiny_gpt import TinyGPT, batch, loss_fn
    job, first, last, out = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    torch.manual_seed(0)
    model = TinyGPT()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                                  job_id=job, device="cpu")
    assert opt.steps == first, (opt.steps, first)
    for step in range(first, last):
        x, y = batch(step)
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    print("done", opt.steps, flush=True)
    if out == "-":
        time.sleep(600)  # killed here, mid-run
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, out)
""")


def test_restarted_process_continues_the_trajectory(daemon, tmp_path):
    run = runner(daemon, tmp_path / "train.py", SCRIPT)
    straight = run("straight", 0, 10, tmp_path / "straight.pt")
    assert straight.wait(300) == 0, straight.stderr.read()

    victim = run("recover", 0, 5, "-")
    assert victim.stdout.readline().split() == ["done", "5"]
    kill_and_wait_gone(daemon, victim)

    resumed = run("recover", 5, 10, tmp_path / "resumed.pt")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert out.split() == ["done", "10"]
    a, b = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


VRAM_STATE_SCRIPT = textwrap.dedent("""
    import sys, time, torch, trainstream
    sys.path.insert(0, sys.argv[1])
    from tiny_gpt import TinyGPT, batch, loss_fn
    job, first, last, out = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    torch.manual_seed(0)
    model = TinyGPT().cuda()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                                  job_id=job, offload=True, gpu_state_blocks=1)
    assert opt.steps == first, (opt.steps, first)
    print("behind", len(getattr(opt, "behind_on_resume", [])), flush=True)
    for step in range(first, last):
        x, y = batch(step, device="cuda")
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    print("done", opt.steps, opt.stats()["gpu_state"]["tensors"] > 0, flush=True)
    if out == "-":
        time.sleep(600)  # killed here, mid-run
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, out)
    # Ends without unwrap(): the state held in VRAM goes back to the daemon at exit.
""")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_state_held_in_vram_goes_back_at_exit_and_a_kill_is_reported(daemon, tmp_path):
    run = runner(daemon, tmp_path / "train.py", VRAM_STATE_SCRIPT)
    straight = run("straight", 0, 10, tmp_path / "straight.pt")
    out, err = straight.communicate(timeout=300)
    assert straight.returncode == 0, err
    assert out.split()[-3:] == ["done", "10", "True"]
    # A process that ends without unwrap(): the next one resumes every tensor from step 5.
    first = run("exits", 0, 5, tmp_path / "first.pt")
    assert first.wait(300) == 0, first.stderr.read()
    resumed = run("exits", 5, 10, tmp_path / "resumed.pt")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert out.split()[:2] == ["behind", "0"] and out.split()[-2:] == ["10", "True"]
    a, b = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) <= 1e-5
    # A killed one keeps that part as of its move: the restart says so, in a warning and an
    # event, instead of resuming it silently.
    victim = run("killed", 0, 5, "-")
    assert victim.stdout.readline().split()[:2] == ["behind", "0"]
    assert victim.stdout.readline().split()[:2] == ["done", "5"]
    kill_and_wait_gone(daemon, victim)
    after = run("killed", 5, 6, tmp_path / "after.pt")
    out, err = after.communicate(timeout=300)
    assert after.returncode == 0, err
    assert int(out.split()[1]) > 0 and "tensors' state is older than that" in err


def test_a_refused_wrap_ends_only_a_job_it_made(daemon, tmp_path):
    # A process ran 3 steps of job "kept" and ended. Re-attaching with an option the model
    # cannot have is refused, and leaves that job's state where it was: the next process
    # resumes it at step 3. A refused wrap of a job of its own leaves nothing (test_wrap.py).
    run = runner(daemon, tmp_path / "train.py", SCRIPT)
    first = run("kept", 0, 3, tmp_path / "first.pt")
    assert first.wait(300) == 0, first.stderr.read()
    with pytest.raises(ValueError, match="gpu_state_blocks=1: a CPU model's updates"):
        trainstream.wrap(TinyGPT(), job_id="kept", device="cpu", gpu_state_blocks=1,
                         socket=daemon.socket)
    resumed = run("kept", 3, 5, tmp_path / "resumed.pt")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert out.split() == ["done", "5"]
    with trainstream.connect(daemon.socket, job_id="observer") as observer:
        assert not any(e["kind"] == "optimizer.ended" for e in observer.events())
