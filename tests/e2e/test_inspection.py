# SPDX-License-Identifier: Apache-2.0
"""TrainStream 0.6's inspection calls against a real daemon: pinned_stats(),
memory_report() with and without a model, transfer_stats(), session.peer, and reserve_pinned()
refused with what replaces it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import trainstream

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from tiny_gpt import TinyGPT, train_steps  # noqa: E402


def test_pinned_stats_and_the_report_without_a_model_come_from_the_daemon(daemon_socket):
    with trainstream.connect() as client:
        client.allocate("held", 3 << 20, tag="inspect")
        stats = trainstream.pinned_stats()
        assert stats["daemon"] == daemon_socket
        assert stats["by_tag"].get("inspect") == 3 << 20
        assert stats["process_bytes"] >= 3 << 20 and stats["arena_used"] >= 3 << 20
        assert stats["arena_bytes"] >= stats["arena_used"]  # segments hold the buffers
        assert 0 < stats["arena_cap"] <= stats["budget_bytes"] == 256 << 20
        assert stats["arena_slabs"] >= 1 and stats["arena_fallbacks"] == 0
        report = trainstream.memory_report()
        assert report["pinned_by_tag"]["inspect"] == 3 << 20
        assert report["pinned"]["process_bytes"] == stats["process_bytes"]
        assert ("gpu" in report) == torch.cuda.is_available()
    # Closed: the process holds nothing, the daemon still answers.
    assert trainstream.pinned_stats()["process_bytes"] == 0


def test_with_no_daemon_pinned_stats_says_so_and_starts_none(tmp_path):
    script = textwrap.dedent("""
        import trainstream
        stats = trainstream.pinned_stats()
        assert stats["daemon"] is None and stats["arena_bytes"] == 0, stats
        assert trainstream.memory_report()["pinned"]["daemon"] is None
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRAINSTREAM_SOCKET"}
    env.update(TRAINSTREAM_SYSTEM_SOCKET=str(tmp_path / "none.sock"),
               XDG_RUNTIME_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
    assert not list(tmp_path.glob("trainstream-*"))  # no private daemon was started


def test_transfer_stats_count_every_wrapped_model_of_the_process(daemon_socket):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    before = trainstream.transfer_stats(device)
    model = TinyGPT().to(device)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), offload=True,
                                  device=device)
    train_steps(model, opt, 2, device)
    during = trainstream.transfer_stats(device)
    assert during["device"] == (str(torch.device("cuda", torch.cuda.current_device()))
                                if device == "cuda" else "cpu")
    assert during["sessions"] == before["sessions"] + 1
    report = trainstream.memory_report(model)
    assert report["transfers"] == {"h2d_bytes": report["pcie"]["to_device_bytes"],
                                   "d2h_bytes": report["pcie"]["to_host_bytes"]}
    assert during["h2d_bytes"] - before["h2d_bytes"] == report["pcie"]["to_device_bytes"]
    assert during["d2h_bytes"] - before["d2h_bytes"] == report["pcie"]["to_host_bytes"]
    if device == "cuda":  # gradients went out and updates came back
        assert report["pcie"]["to_host_bytes"] > 0 and report["pcie"]["to_device_bytes"] > 0
    assert model._trainstream_session.peer is None
    assert set(report["resident"]) == {"param_bytes", "slot_bytes", "optimizer_state_bytes"}
    assert {"quantize", "bounce_bytes", "peer_bytes", "peer_blocks"} <= set(report["params"])
    trainstream.unwrap(model)
    after = trainstream.transfer_stats(device)
    # Unwrapped, the model's bytes stay in the process's totals.
    assert after["sessions"] == before["sessions"]
    assert (after["h2d_bytes"], after["d2h_bytes"]) == (during["h2d_bytes"], during["d2h_bytes"])


def test_reserve_pinned_says_what_replaces_it(daemon_socket):
    with pytest.raises(trainstream.FailedPreconditionError,
                       match="wrap\\(host_arena=<bytes>\\) reserves"):
        trainstream.reserve_pinned(1 << 30)
