# SPDX-License-Identifier: Apache-2.0
"""Admission: jobs plan their host memory with the daemon before allocating it; a plan that
does not fit is refused with the numbers (or waits for room), and wrap() plans its job."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

import trainstream

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from tiny_gpt import TinyGPT  # noqa: E402

MiB = 1 << 20


def test_competing_plans_are_refused_then_admitted_when_room_frees(start_daemon, tsctl_binary):
    d = start_daemon("--memory_budget=512M")
    first = trainstream.connect(d.socket, job_id="first")
    second = trainstream.connect(d.socket, job_id="second")
    plan = first.plan_host_memory(300 * MiB)
    assert plan["planned_bytes"] == str(300 * MiB) or int(plan["planned_bytes"]) == 300 * MiB
    with pytest.raises(trainstream.ResourceExhaustedError) as refused:
        second.plan_host_memory(300 * MiB)
    message = str(refused.value)
    assert "job 'second' plans 0.29 GiB" in message and "your job 'first'" in message
    assert "leaving 0.21 GiB" in message
    # The planned memory is the first job's: the second cannot allocate into it either.
    with pytest.raises(trainstream.ResourceExhaustedError, match="planned by other jobs"):
        second.allocate("big", 256 * MiB)
    shown = subprocess.run([tsctl_binary, f"--socket={d.socket}", "memory"], capture_output=True,
                           text=True, timeout=30).stdout
    assert "plans by job" in shown and "first" in shown
    # The first job ends a moment later; a second plan that waits is admitted then.
    threading.Timer(0.5, first.close).start()
    start = time.monotonic()
    second.plan_host_memory(300 * MiB, wait_s=10)
    assert 0.3 < time.monotonic() - start < 8
    kinds = [e["kind"] for e in second.events()]
    assert "arena.plan_refused" in kinds and "arena.plan" in kinds
    second.close()


def test_wrap_is_refused_up_front_when_the_machine_cannot_hold_the_job(start_daemon, monkeypatch):
    d = start_daemon("--memory_budget=128M")
    monkeypatch.setenv("TRAINSTREAM_SOCKET", d.socket)
    other = trainstream.connect(d.socket, job_id="other")
    other.plan_host_memory(100 * MiB)
    with pytest.raises(MemoryError, match="trainstream.wrap: this run needs .* GiB of host memory"):
        trainstream.wrap(TinyGPT(), device="cpu", job_id="refused")
    # Nothing of the refused job stays behind: no plan, no session.
    assert [p["job_id"] for p in other.memory().get("plans", [])] == ["other"]
    assert "refused" not in str(other.sessions())
    other.close()
    model, opt = trainstream.wrap(TinyGPT(), device="cpu", job_id="admitted")
    kinds = [e["kind"] for e in trainstream.memory_report(model)["events"]]
    assert "client.wrap.admitted" in kinds and "arena.plan" in kinds
    trainstream.unwrap(model)


def _plans(start_daemon, model, config: str = "") -> tuple[int, int]:
    """The model's job's host memory with fp32 and with bf16 moments, as a daemon counts it."""
    from trainstream.optim.host_plan import job_host_bytes

    from trainstream.options import OptimizerOptions

    options = OptimizerOptions()
    with trainstream.connect(start_daemon(config=config).socket, job_id="sizing") as c:
        return (job_host_bytes(c, model, "float32", options, 1, 1),
                job_host_bytes(c, model, "bfloat16", options, 1, 1))


def test_moments_go_to_bf16_when_fp32_ones_do_not_fit(start_daemon, monkeypatch):
    model = TinyGPT(dim=512, heads=8, layers=4)
    fp32, bf16 = _plans(start_daemon, model)
    assert bf16 < fp32
    d = start_daemon(f"--memory_budget={(fp32 + bf16) // 2 // MiB}M")
    monkeypatch.setenv("TRAINSTREAM_SOCKET", d.socket)
    model, opt = trainstream.wrap(model, device="cpu")
    events = {e["kind"]: e["message"] for e in model._trainstream_session.events}
    assert events["wrap.plan"].startswith("moments in bf16: with fp32 moments this run needs")
    assert "(bfloat16 moments; " in events["wrap.admitted"]
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    per = float(events["wrap.admitted"].split("moments; ")[1].split(" bytes")[0])
    assert per == pytest.approx(bf16 / trained, abs=0.06)  # the plan, per trained parameter
    x = torch.randint(0, 128, (2, 33))
    model(x[:, :-1]).sum().backward()
    opt.step()
    trainstream.unwrap(model)
    # Asked for by name, fp32 moments are refused rather than changed; the refusal gives the
    # bytes per trained parameter, and what bf16 moments would need.
    with pytest.raises(MemoryError, match="this run needs") as refused:
        trainstream.wrap(TinyGPT(dim=512, heads=8, layers=4), device="cpu",
                         moment_dtype="float32")
    message = str(refused.value)
    assert f"{fp32 / trained:.1f} bytes per trained parameter" in message
    assert f"moment_dtype='bfloat16' ({bf16 / 2**30:.2f} GiB, " in message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_state_asked_for_in_vram_under_moments_made_bf16_says_why_they_are(start_daemon,
                                                                           monkeypatch):
    # Blocks staged through the GPU need fp32 moments; when moment_dtype="auto" fell back to
    # bf16 ones because the daemon refused fp32, the refusal says so, with the daemon's numbers.
    model = TinyGPT(dim=512, heads=8, layers=4)
    fp32, bf16 = _plans(start_daemon, model)
    d = start_daemon(f"--memory_budget={(fp32 + bf16) // 2 // MiB}M")
    monkeypatch.setenv("TRAINSTREAM_SOCKET", d.socket)
    with pytest.raises(ValueError) as refused:
        trainstream.wrap(model.cuda(), device="cuda", staged_state_blocks=1)
    message = str(refused.value)
    assert "staged_state_blocks=1: bf16 moments are the daemon's" in message
    assert "moment_dtype='auto' chose bf16 moments: with fp32 moments this run needs" in message
    # The refused wrap() left no plan behind: the same job without staging is admitted (two
    # bf16 plans would not fit this budget).
    assert 2 * bf16 > (fp32 + bf16) // 2
    model, opt = trainstream.wrap(TinyGPT(dim=512, heads=8, layers=4).cuda(), device="cuda")
    assert model._trainstream_session.optimizer.rules.moment_dtype == torch.bfloat16
    trainstream.unwrap(model)


def test_the_plan_is_what_the_job_then_holds_under_the_daemons_own_rounding(start_daemon,
                                                                           monkeypatch):
    # wrap() plans its job's host memory with numbers the daemon computes with the code that
    # allocates (EstimateHostMemory), never with a copy of its rounding in Python: whatever the
    # segment sizes, the plan is exactly what the optimizer's buffers then take, and a change
    # of the daemon's rounding changes the plan.
    planned = {}
    for segments in ("",  # the defaults: 64 MiB shared segments, 2 MiB granularity
                     'shared_segment_size: "8M"\nsegment_granularity: "4M"\n',
                     'shared_segment_size: "128M"\nsegment_granularity: "128M"\n'):
        d = start_daemon(config=segments)
        monkeypatch.setenv("TRAINSTREAM_SOCKET", d.socket)
        # A 4.6 MB embedding: shared under 64 MiB segments, one of its own under 8 MiB ones.
        model, opt = trainstream.wrap(TinyGPT(vocab=12000, dim=96, heads=4, layers=3),
                                      device="cpu", job_id="exact")
        with trainstream.connect(d.socket, job_id="observer") as c:
            plan, = [p for p in c.memory()["plans"] if p["job_id"] == "exact"]
        trainstream.unwrap(model)
        assert int(plan["planned_bytes"]) == int(plan["used_bytes"]), segments
        planned[segments] = int(plan["planned_bytes"])
    assert len(set(planned.values())) == 3, planned
