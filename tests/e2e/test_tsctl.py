# SPDX-License-Identifier: Apache-2.0
"""tsctl against a real daemon: tables, --json, exit codes, and the no-daemon message."""

import json
import subprocess

import trainstream
from conftest import prometheus_samples


def tsctl(binary, *args):
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=30)


def test_subcommands_show_the_session(daemon, tsctl_binary):
    with trainstream.connect(daemon.socket, job_id="cli") as client:
        client.allocate("g", 5000, tag="grad")
        sock = f"--socket={daemon.socket}"
        status = tsctl(tsctl_binary, sock, "status")
        assert status.returncode == 0, status.stderr
        assert "0.1.0" in status.stdout and "256 MiB budget" in status.stdout
        sessions = tsctl(tsctl_binary, sock, "sessions")
        assert client.session_id in sessions.stdout and "cli" in sessions.stdout
        memory = json.loads(tsctl(tsctl_binary, sock, "memory", "--json").stdout)
        assert int(memory["budget_bytes"]) == 256 << 20
        assert any(r["key"] == "grad" and int(r["bytes"]) == 5000 for r in memory["by_tag"])
        events = tsctl(tsctl_binary, sock, "events", "--json")
        kinds = [json.loads(line)["kind"] for line in events.stdout.splitlines()]
        assert "daemon.start" in kinds and "session.open" in kinds


def test_exit_codes(tmp_path, tsctl_binary):
    missing = str(tmp_path / "none.sock")
    gone = tsctl(tsctl_binary, f"--socket={missing}", "status")
    assert gone.returncode == 3
    assert missing in gone.stderr
    assert tsctl(tsctl_binary).returncode == 2
    assert tsctl(tsctl_binary, "frobnicate").returncode == 2
    assert tsctl(tsctl_binary, "--help").returncode == 0


def test_optimizers_shows_each_jobs_figures(daemon, tsctl_binary):
    import torch

    from trainstream import HostOptimizer, ParameterSpec

    with trainstream.connect(daemon.socket, job_id="shown") as client:
        opt = HostOptimizer(client, [ParameterSpec("w", (1000,))])
        opt.load_weights([torch.zeros(1000)])
        opt.step([torch.ones(1000)])
        sock = f"--socket={daemon.socket}"
        table = tsctl(tsctl_binary, sock, "optimizers")
        assert table.returncode == 0, table.stderr
        assert "shown" in table.stdout and "adamw/fp32" in table.stdout and "ready" in table.stdout
        listed = json.loads(tsctl(tsctl_binary, sock, "optimizers", "--json").stdout)
        (info,) = listed["optimizers"]
        assert int(info["step"]) == 1 and int(info["params"]) == 1000
        assert float(info["last_step"]["gbps"]) > 0
        assert "ROLLED BACK" in table.stdout


def test_optimizers_counts_the_steps_that_rolled_back(daemon, tsctl_binary):
    import torch

    from trainstream import HostOptimizer, ParameterSpec

    with trainstream.connect(daemon.socket, job_id="clipped") as client:
        # Clipped every step (norm 31.6 over a limit of 1), speculating every step.
        opt = HostOptimizer(client, [ParameterSpec("w", (1000,))], max_grad_norm=1.0,
                            eager_updates=True)
        opt.load_weights([torch.zeros(1000)])
        for _ in range(3):
            opt.step([torch.ones(1000)])
        sock = f"--socket={daemon.socket}"
        listed = json.loads(tsctl(tsctl_binary, sock, "optimizers", "--json").stdout)
        (info,) = listed["optimizers"]
        assert int(info["speculated_steps"]) == 3 and int(info["rolled_back_steps"]) == 3
        assert info["last_step"]["rolled_back"] is True
        row = next(line for line in tsctl(tsctl_binary, sock, "optimizers").stdout.splitlines()
                   if line.startswith("clipped"))
        assert " 3/3 " in row


def test_both_binaries_say_their_release_and_their_flags(tsctl_binary, trainstreamd_binary):
    """--version on both binaries; trainstreamd's --help lists its own flags (Abseil's default
    listed none: "No flags matched"), not Abseil's."""
    release = trainstream.__version__
    for binary, name in ((tsctl_binary, "tsctl"), (trainstreamd_binary, "trainstreamd")):
        version = tsctl(binary, "--version")
        assert version.returncode == 0 and version.stdout.strip() == f"{name} {release}", version
    helped = tsctl(trainstreamd_binary, "--help")
    text = helped.stdout + helped.stderr
    assert "No flags matched" not in text
    for flag in ("--memory_budget", "--uid_quota", "--socket", "--config", "--lease_ms"):
        assert flag in text, text
    assert "--flagfile" not in text  # Abseil's own flags stay out of it
    assert "--version" in tsctl(tsctl_binary, "--help").stdout


def test_following_events_fails_when_the_daemon_goes_away(daemon, tsctl_binary):
    """`tsctl events -f` streams until the daemon ends the stream: then it exits 3 (no daemon)
    with the reason, so that a script waiting on it sees a failure, not a clean exit."""
    follower = subprocess.Popen([tsctl_binary, f"--socket={daemon.socket}", "events", "-f"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert follower.stdout.readline()  # it is following (the daemon's first event came)
        daemon.stop()
        code = follower.wait(timeout=20)
        said = follower.stderr.read()
    finally:
        follower.kill()
    assert code == 3, (code, said)
    assert said.startswith("tsctl: "), said


def test_metrics_say_what_the_daemon_holds_and_when_it_is_gone(start_daemon, tsctl_binary,
                                                                tmp_path):
    import time

    import torch

    from trainstream import HostOptimizer, ParameterSpec

    daemon = start_daemon("--memory_budget=256M", "--lease_ms=1500")
    sock = f"--socket={daemon.socket}"
    with trainstream.connect(daemon.socket, job_id="metrics") as client:
        client.allocate("g", 5000, tag="grad")
        opt = HostOptimizer(client, [ParameterSpec("w", (1000,))])
        opt.load_weights([torch.zeros(1000)])
        opt.step([torch.ones(1000)])
        once = tsctl(tsctl_binary, sock, "metrics")
        assert once.returncode == 0, once.stderr
        samples = prometheus_samples(once.stdout)
        assert samples["trainstream_up"] == 1 and samples["trainstream_sessions"] >= 1
        assert samples["trainstream_memory_budget_bytes"] == 256 << 20
        assert samples['trainstream_memory_tag_bytes{tag="grad"}'] == 5000
        assert samples['trainstream_optimizer_steps_total{job="metrics"}'] == 1
        assert samples['trainstream_optimizer_failed{job="metrics"}'] == 0
    # For node_exporter's textfile collector: rewritten whole every interval.
    textfile = tmp_path / "trainstream.prom"
    writer = subprocess.Popen([tsctl_binary, sock, "metrics", f"--textfile={textfile}",
                               "--interval=1"])
    try:
        deadline = time.time() + 20
        while not textfile.exists() and time.time() < deadline:
            time.sleep(0.1)
        first = prometheus_samples(textfile.read_text())["trainstream_uptime_seconds"]
        while (prometheus_samples(textfile.read_text())["trainstream_uptime_seconds"] == first
               and time.time() < deadline):
            time.sleep(0.2)
        assert prometheus_samples(textfile.read_text())["trainstream_uptime_seconds"] > first
        # The daemon stops: the next write says so, and the writer keeps going.
        daemon.stop()
        while prometheus_samples(textfile.read_text()).get("trainstream_up") != 0 and \
                time.time() < deadline:
            time.sleep(0.2)
        text = textfile.read_text()
        assert prometheus_samples(text)["trainstream_up"] == 0 and "did not answer" in text
        assert writer.poll() is None
    finally:
        writer.kill()
        writer.wait()
    gone = tsctl(tsctl_binary, sock, "metrics")
    assert gone.returncode == 3 and prometheus_samples(gone.stdout) == {"trainstream_up": 0}
    bad = tsctl(tsctl_binary, sock, "metrics", "--interval=5")
    assert bad.returncode == 2 and "name one" in bad.stderr
    assert tsctl(tsctl_binary, sock, "metrics", "--textfile=/tmp/x.txt").returncode == 2


def test_drain_waits_for_the_open_session_then_the_daemon_exits(daemon, tsctl_binary):
    """tsctl drain does what SIGTERM does: new sessions are refused at once, the open one is
    waited for, and the daemon exits 0 when it closes; --wait returns once it has."""
    sock = f"--socket={daemon.socket}"
    client = trainstream.connect(daemon.socket, job_id="drained")
    drained = tsctl(tsctl_binary, sock, "drain", "--json")
    assert drained.returncode == 0, drained.stderr
    assert json.loads(drained.stdout)["sessions"] == 1
    status = json.loads(tsctl(tsctl_binary, sock, "status", "--json").stdout)
    assert status["draining"] is True
    refused = subprocess.run([tsctl_binary, sock, "events", "--json"], capture_output=True,
                             text=True, timeout=30)
    kinds = [json.loads(line)["kind"] for line in refused.stdout.splitlines()]
    assert "daemon.drain_requested" in kinds and "daemon.draining" in kinds
    assert daemon.process.poll() is None  # the open session holds the drain
    waiting = subprocess.Popen([tsctl_binary, sock, "drain", "--wait"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    client.close()
    out, err = waiting.communicate(timeout=30)
    assert waiting.returncode == 0, err
    assert "the daemon has stopped" in out
    assert daemon.process.wait(15) == 0
    assert tsctl(tsctl_binary, sock, "drain").returncode == 3  # no daemon left to ask
