# SPDX-License-Identifier: Apache-2.0
"""One job's checkpoint must not stall another's steps. A save holds its job's lock through the
write and fsync; the housekeeping thread once waited on that lock while holding the registry's,
which the doorbell thread needs for every job's gradients: another user's steps stalled for the
whole save (1.7-3.5 s during a 1.13 GiB save, against 0.06 ms round trips). Sized here for CI (a
576 MB checkpoint); `TS_LONG=1` saves 1.2 GB, prints the figures and holds them to the target: no
step more than 10 ms over its median alone."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

import trainstream

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from tiny_gpt import TinyGPT, batch, loss_fn  # noqa: E402


def test_a_checkpoint_stalls_no_other_jobs_steps(start_daemon, tmp_path, request):
    long_run = os.environ.get("TS_LONG") == "1"
    side = 10_000 if long_run else 6_928  # 100M or 48M parameters: 1.2 GB or 576 MB saved
    daemon = start_daemon("--memory_budget=4G" if long_run else "--memory_budget=2G")
    big = torch.nn.Linear(side, side, bias=False)
    big_model, big_opt = trainstream.wrap(big, lr=1e-4, device="cpu", offload=True,
                                          socket=daemon.socket, job_id="big")
    big_model(torch.randn(2, side)).sum().backward()
    big_opt.step()
    big_opt.zero_grad()

    # The other job computes on the CPU here (a GPU job would not): on one torch thread, so that
    # its figure is the daemon's doing. With one thread a core, the save's writer took a core
    # from torch's pool, whose parallel regions then waited up to 0.2 s for a descheduled
    # worker, in forward and backward alike (dev VM, 2 cores: worst 221 ms, against 16.6 ms on
    # one thread; the daemon's part, step(), stayed under 15 ms in both).
    request.addfinalizer(lambda threads=torch.get_num_threads(): torch.set_num_threads(threads))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    small, small_opt = trainstream.wrap(TinyGPT(layers=1), lr=1e-3, device="cpu", offload=True,
                                        socket=daemon.socket, job_id="small")

    def step(i):
        x, y = batch(i, device="cpu")
        loss_fn(small, x, y).backward()
        small_opt.step()
        small_opt.zero_grad()

    for i in range(5):
        step(i)  # warm
    # The steps' own time with no save running: what a stall is measured against.
    alone = []
    for i in range(5, 45):
        start = time.perf_counter()
        step(i)
        alone.append(time.perf_counter() - start)
    baseline = sorted(alone)[len(alone) // 2]
    saves = []

    # Saved again until a second has gone: a fast disk writes the CI size in well under the
    # 200 ms between housekeeping passes, which the stall needed to meet.
    def save():
        began = time.perf_counter()
        while not saves or time.perf_counter() - began < 1.0:
            start = time.perf_counter()
            big_opt.save(str(tmp_path / "big.safetensors"))
            saves.append(time.perf_counter() - start)

    saver = threading.Thread(target=save)
    saver.start()
    times, slow, i = [], [], 45
    began = time.perf_counter()
    while saver.is_alive():
        start = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - start)
        if times[-1] > 4 * baseline:  # when in the save the slow ones ran
            slow.append((round(start - began, 2), round(1e3 * times[-1], 1)))
        i += 1
    saver.join()
    assert times, "the save ended before a step could run beside it"
    saving = sum(saves)
    assert saving > 0.9, f"the saves took {saving:.2f} s: too short to meet housekeeping"
    worst = max(times)
    if long_run or os.environ.get("TS_SHOW"):
        print(f"\n{len(saves)} checkpoints of {side * side * 12 / 1e9:.2f} GB, "
              f"{', '.join(f'{s:.2f}' for s in saves)} s; the other job's steps alone: median "
              f"{baseline * 1e3:.1f} ms, worst {max(alone) * 1e3:.1f} ms; {len(times)} steps "
              f"beside the save: median {sorted(times)[len(times) // 2] * 1e3:.1f} ms, worst "
              f"{worst * 1e3:.1f} ms (the worst {1e3 * (worst - baseline):.1f} ms over the "
              f"median alone); steps over 4x that median (seconds into the save, ms): {slow}")
    # Stalled, the worst step lasted the whole save (2.27 s of a 2.46 s save, 8 steps beside
    # it); now it is CPU noise on a small CI machine (a 2-core run: median 58 ms, worst 0.44 s
    # beside a 5.1 s save, with a build running).
    assert worst < 0.5 * max(saves), (worst, saves, len(times))
    if long_run:  # the figure the README gives, and its target
        assert worst - baseline < 0.010, (worst, baseline, saves)
    trainstream.unwrap(small)
    trainstream.unwrap(big_model)
