# SPDX-License-Identifier: Apache-2.0
"""trainstreamd's log lines: under systemd (stderr is the stream $JOURNAL_STREAM names) each
carries the syslog priority journald files it under; a failure is an error, a refusal a
warning; elsewhere the lines are plain."""

from __future__ import annotations

import os
import signal
import subprocess
import time


def _run_daemon(binary, tmp_path, journal: bool) -> list[str]:
    log_path = tmp_path / "stderr.log"
    with open(log_path, "w") as log:
        env = dict(os.environ)
        env.pop("JOURNAL_STREAM", None)
        if journal:
            st = os.fstat(log.fileno())
            env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        daemon = subprocess.Popen([binary, f"--socket={tmp_path / 'd.sock'}",
                                   "--memory_budget=64M", "--config="], stderr=log, env=env)
        try:
            deadline = time.monotonic() + 20
            while "daemon.start" not in log_path.read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=20)
    return log_path.read_text().splitlines()


def test_lines_carry_their_priority_for_the_journal(trainstreamd_binary, tmp_path):
    lines = _run_daemon(trainstreamd_binary, tmp_path, journal=True)
    started = [line for line in lines if "daemon.start" in line]
    assert started and started[0].startswith("<6>trainstreamd info: "), lines
    assert all(line[:3] in ("<3>", "<4>", "<6>", "<7>") for line in lines), lines


def test_lines_are_plain_when_stderr_is_not_the_journal(trainstreamd_binary, tmp_path):
    lines = _run_daemon(trainstreamd_binary, tmp_path, journal=False)
    assert any(line.startswith("trainstreamd info: daemon.start") for line in lines), lines
    assert not any(line.startswith("<") for line in lines), lines
