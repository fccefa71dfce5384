# SPDX-License-Identifier: Apache-2.0
"""trainstreamd's Prometheus endpoint (--metrics_listen): off unless asked, the same families
`tsctl metrics` prints, read at each scrape, and a daemon that cannot listen where it was told
stops at once with why; each job's PCIe totals, as its sessions' heartbeats carry them."""

import os
import re
import socket
import subprocess
import time
import urllib.request

import pytest

import trainstream
from conftest import prometheus_samples, wait_until


def _families(text):
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def _endpoint(daemon):
    found = re.search(r"serving Prometheus metrics at (http://\S+/metrics)", daemon.log())
    assert found, daemon.log()
    return found.group(1)


def _scrape(url):
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        return reply.read().decode()


def _listening_tcp_inodes():
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            with open(table) as f:
                for row in f.read().splitlines()[1:]:
                    fields = row.split()
                    if fields[3] == "0A":  # TCP_LISTEN
                        inodes.add(fields[9])
    return inodes


def _process_socket_inodes(pid):
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def test_the_endpoint_serves_the_daemons_state_at_each_scrape(start_daemon, tsctl_binary):
    import torch

    from trainstream import HostOptimizer, ParameterSpec

    daemon = start_daemon("--memory_budget=256M", "--lease_ms=1500",
                          "--metrics_listen=127.0.0.1:0")
    url = _endpoint(daemon)
    # Where it listens, with the port it got, as tsctl status says it.
    status = subprocess.run([tsctl_binary, f"--socket={daemon.socket}", "status"],
                            capture_output=True, text=True, timeout=30)
    assert re.search(rf"^metrics:\s+{re.escape(url)}$", status.stdout, re.MULTILINE), status.stdout
    before = prometheus_samples(_scrape(url))
    assert before["trainstream_up"] == 1 and before["trainstream_sessions"] == 0
    assert before['trainstream_events_total{kind="daemon.start"}'] == 1
    with trainstream.connect(daemon.socket, job_id="scraped") as client:
        client.allocate("g", 5000, tag="grad")
        opt = HostOptimizer(client, [ParameterSpec("w", (1000,))])
        opt.load_weights([torch.zeros(1000)])
        opt.step([torch.ones(1000)])
        opt.step([torch.ones(1000)])
        text = _scrape(url)
        samples = prometheus_samples(text)
        # Read now, not at start: the session, its buffer and its job's steps are there.
        assert samples["trainstream_sessions"] == 1
        assert samples["trainstream_memory_budget_bytes"] == 256 << 20
        assert samples['trainstream_memory_tag_bytes{tag="grad"}'] == 5000
        assert samples['trainstream_optimizer_steps_total{job="scraped"}'] == 2
        assert samples['trainstream_events_total{kind="session.open"}'] == 1
        assert samples["trainstream_uptime_seconds"] > before["trainstream_uptime_seconds"]
        # The families tsctl metrics prints (as root, an administrator), and prometheus-cpp's
        # own about the exposer.
        printed = subprocess.run([tsctl_binary, f"--socket={daemon.socket}", "metrics"],
                                 capture_output=True, text=True, timeout=30)
        assert printed.returncode == 0, printed.stderr
        served = _families(text)
        assert _families(printed.stdout) <= served
        assert {f for f in served if not f.startswith("trainstream_")} <= {
            "exposer_transferred_bytes_total", "exposer_scrapes_total",
            "exposer_request_latencies"}
        # The same label sets, whichever way they were read.
        assert {k for k in prometheus_samples(printed.stdout) if "optimizer" in k} == \
            {k for k in samples if "optimizer" in k}
    after = prometheus_samples(_scrape(url))
    assert after["trainstream_sessions"] == 0
    assert after['trainstream_events_total{kind="session.closed"}'] == 1


def test_a_drain_shows_on_the_endpoint_until_the_daemon_stops(start_daemon, tsctl_binary):
    daemon = start_daemon("--memory_budget=64M", "--metrics_listen=127.0.0.1:0")
    url = _endpoint(daemon)
    with trainstream.connect(daemon.socket, job_id="draining"):
        drained = subprocess.run([tsctl_binary, f"--socket={daemon.socket}", "drain"],
                                 capture_output=True, text=True, timeout=30)
        assert drained.returncode == 0, drained.stderr
        samples = prometheus_samples(_scrape(url))
        assert samples["trainstream_draining"] == 1 and samples["trainstream_sessions"] == 1
    assert daemon.process.wait(timeout=15) == 0
    with pytest.raises(OSError):  # the endpoint went with the daemon
        _scrape(url)


def test_no_endpoint_unless_asked(daemon, tsctl_binary):
    assert "Prometheus" not in daemon.log()
    status = subprocess.run([tsctl_binary, f"--socket={daemon.socket}", "status"],
                            capture_output=True, text=True, timeout=30)
    assert status.returncode == 0 and "metrics" not in status.stdout, status.stdout
    listening = _listening_tcp_inodes() & _process_socket_inodes(daemon.process.pid)
    assert not listening, "the daemon listens on TCP though no --metrics_listen was given"


def test_an_address_it_cannot_use_stops_the_daemon_with_why(trainstreamd_binary, tmp_path):
    os.chmod(tmp_path, 0o700)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        for flag, code, why in [
            ("--metrics_listen=9478", 2, "HOST:PORT"),
            ("--metrics_listen=example.org:80", 2, "numeric IPv4"),
            ("--metrics_listen=127.0.0.1:70000", 2, "0 to 65535"),
            (f"--metrics_listen=127.0.0.1:{port}", 1, "cannot listen there"),
        ]:
            sock = tmp_path / "d.sock"
            run = subprocess.run([trainstreamd_binary, f"--socket={sock}", "--memory_budget=64M",
                                  flag], capture_output=True, text=True, timeout=30)
            assert run.returncode == code, (flag, run.stdout, run.stderr)
            assert why in run.stderr, (flag, run.stderr)
            # Refused before it served anyone: no socket left behind.
            assert not any(tmp_path.iterdir()), (flag, list(tmp_path.iterdir()))
    finally:
        taken.close()


def test_jobs_pcie_totals_come_with_their_sessions_heartbeats(start_daemon):
    # A lease of 1.5 s: heartbeats every 375 ms carry the totals.
    daemon = start_daemon("--memory_budget=256M", "--lease_ms=1500",
                          "--metrics_listen=127.0.0.1:0")
    url = _endpoint(daemon)

    def scraped():
        return prometheus_samples(_scrape(url))

    h2d = 'trainstream_job_h2d_bytes_total{job="moved",uid="%d"}' % os.getuid()
    d2h = 'trainstream_job_d2h_bytes_total{job="moved",uid="%d"}' % os.getuid()
    with trainstream.connect(daemon.socket, job_id="moved") as rank0, \
            trainstream.connect(daemon.socket, job_id="moved") as rank1:
        assert h2d not in scraped(), "a job that reported nothing has no row"
        rank0.set_transfer_totals(3_000_000_000, 1000)
        assert wait_until(lambda: scraped().get(h2d) == 3_000_000_000, 10), "rank 0's report"
        # Running totals: the next adds its difference; another rank adds its own.
        rank0.set_transfer_totals(3_000_000_500, 1500)
        rank1.set_transfer_totals(7, 0)
        assert wait_until(lambda: scraped().get(h2d) == 3_000_000_507, 10), "both reports"
        assert scraped()[d2h] == 1500
        # Totals that go down are refused (the heartbeat says so; the lease still renews):
        # the job's total does not move, and the session lives on.
        rank1.set_transfer_totals(1, 0)
        time.sleep(1.0)
        assert scraped()[h2d] == 3_000_000_507
        rank1.allocate("still-alive", 4096)
    # The job's last session ended: forgotten.
    assert wait_until(lambda: h2d not in scraped(), 10), "the job to be forgotten"


def test_wrap_hands_its_pcie_totals_to_the_daemon(start_daemon):
    import torch

    daemon = start_daemon("--memory_budget=256M", "--lease_ms=1500",
                          "--metrics_listen=127.0.0.1:0")
    url = _endpoint(daemon)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).to(device)
    model, opt = trainstream.wrap(model, lr=1e-3, device=device, socket=daemon.socket,
                                  job_id="wrapped", offload=True)
    try:
        for _ in range(3):
            model(torch.randn(4, 64, device=device)).sum().backward()
            opt.step()
            opt.zero_grad()
        mine = trainstream.memory_report(model)["transfers"]  # this model's, by the process
        key = 'trainstream_job_h2d_bytes_total{job="wrapped",uid="%d"}' % os.getuid()
        # After the steps the hook set the totals; the next heartbeat carries them.
        def reported():
            samples = prometheus_samples(_scrape(url))
            return samples if key in samples else None

        got = wait_until(reported, 10)
        assert got, "wrap's totals never reached the daemon"
        assert got[key] == mine["h2d_bytes"]
        assert got[key.replace("h2d", "d2h")] == mine["d2h_bytes"]
        if device == "cuda":  # gradients out, weights back: something crossed
            assert mine["h2d_bytes"] > 0 and mine["d2h_bytes"] > 0
    finally:
        trainstream.unwrap(model)
