# SPDX-License-Identifier: Apache-2.0
"""Checks the files in deploy/: the systemd unit passes `systemd-analyze verify` without a warning
about it, and the example config parses as a DaemonConfig and agrees with the unit."""

import os
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "deploy" / "trainstreamd.service"
CONFIG = REPO / "deploy" / "trainstreamd.conf"

UNIT_NAME = UNIT.name
EXEC_START = "/usr/bin/trainstreamd --config=/etc/trainstream/trainstreamd.conf"
# sockaddr_un.sun_path holds 108 bytes, the terminating NUL included.
MAX_SOCKET_PATH = 107

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def _daemon_binary() -> str:
    """The binary ExecStart names during the check: verify requires that it exists."""
    built = os.environ.get("TRAINSTREAMD")
    if built:
        assert os.path.isfile(built) and os.access(built, os.X_OK), (
            f"TRAINSTREAMD={built!r} is not an executable file"
        )
        return os.path.abspath(built)
    return "/bin/true"


def _unit_value(text: str, key: str) -> str:
    values = re.findall(rf"^{key}=(.*)$", text, flags=re.MULTILINE)
    assert len(values) == 1, f"{UNIT_NAME}: expected one {key}=, found {values}"
    return values[0].strip()


METRICS_UNIT = REPO / "deploy" / "trainstream-metrics.service"
SOCKET_UNIT = REPO / "deploy" / "trainstreamd.socket"


def test_metrics_unit_writes_a_prom_file_the_collector_reads() -> None:
    text = METRICS_UNIT.read_text()
    exec_start = _unit_value(text, "ExecStart").split()
    assert exec_start[0] == "/usr/bin/tsctl" and "metrics" in exec_start
    # node_exporter's textfile collector reads only *.prom, in the directory the unit may write.
    textfile = next(a.split("=", 1)[1] for a in exec_start if a.startswith("--textfile="))
    assert textfile.endswith(".prom")
    assert os.path.dirname(textfile) == _unit_value(text, "ReadWritePaths")
    assert f"--socket={_config_socket()}" in exec_start


def _config_socket() -> str:
    return re.search(r'^socket_path: "(.*)"$', CONFIG.read_text(), flags=re.MULTILINE).group(1)


def _unit_to_verify(unit: Path) -> str:
    """The unit's text with its ExecStart binary one that exists here (verify requires it)."""
    text = unit.read_text()
    if unit == UNIT:
        assert _unit_value(text, "ExecStart") == EXEC_START
        binary = _daemon_binary()
        quoted = f'"{binary}"' if re.search(r"\s", binary) else binary
        return text.replace(f"ExecStart={EXEC_START.split()[0]}", f"ExecStart={quoted}", 1)
    return text.replace("ExecStart=/usr/bin/tsctl", "ExecStart=/bin/true", 1)


@pytest.mark.parametrize("unit", [UNIT, METRICS_UNIT, SOCKET_UNIT], ids=lambda u: u.name)
def test_unit_passes_systemd_analyze_verify(tmp_path: Path, unit: Path) -> None:
    # Skipped here rather than for the whole module: the config test below needs no systemd.
    if SYSTEMD_ANALYZE is None:
        pytest.skip("systemd-analyze not found (Debian package `systemd`); cannot verify the unit")

    copy = tmp_path / unit.name
    if unit == SOCKET_UNIT:
        # A socket unit is checked with the service it starts beside it.
        copy.write_text(unit.read_text())
        (tmp_path / UNIT.name).write_text(_unit_to_verify(UNIT))
    else:
        copy.write_text(_unit_to_verify(unit))

    # --recursive-errors=one: the exit status is about our unit, not about the host's units.
    # --man=no: don't depend on man pages being installed.
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--recursive-errors=one", "--man=no", str(copy)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = result.stdout + result.stderr
    ours = [line for line in output.splitlines() if unit.name in line]
    assert result.returncode == 0, f"systemd-analyze verify exited {result.returncode}:\n{output}"
    assert not ours, "systemd-analyze verify warned about the unit:\n" + "\n".join(ours)
    if unit == UNIT:
        # Its exposure (0 none, 10 unprotected): 3.7 before the network namespace and the
        # address-family, /proc and system-call restrictions; 1.2 with them.
        security = subprocess.run([SYSTEMD_ANALYZE, "security", "--offline=yes", "--no-pager",
                                   str(copy)], capture_output=True, text=True, timeout=120,
                                  check=False)
        found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", security.stdout)
        assert found, security.stdout + security.stderr
        assert float(found.group(1)) <= 1.5, security.stdout


def test_example_config_parses(daemon_config_pb2: ModuleType) -> None:
    from google.protobuf import text_format

    # Parse rejects unknown fields, so a misspelt key in the example fails here.
    config = text_format.Parse(CONFIG.read_text(), daemon_config_pb2.DaemonConfig())

    assert config.socket_mode == "0660"
    assert config.lease_ms > 0
    assert config.socket_path == "/run/trainstream/trainstreamd.sock"
    assert len((config.socket_path + ".data").encode()) <= MAX_SOCKET_PATH
    assert config.admin_group == "trainstream-admin"
    assert config.drain_timeout_s > 0

    # The unit must give the drain time to finish before systemd escalates to SIGKILL,
    # and must create the directory the sockets live in.
    unit = UNIT.read_text()
    stop = re.fullmatch(r"(\d+)s?", _unit_value(unit, "TimeoutStopSec"))
    assert stop is not None, "TimeoutStopSec should be plain seconds"
    assert int(stop.group(1)) > config.drain_timeout_s
    runtime_dir = "/run/" + _unit_value(unit, "RuntimeDirectory")
    assert os.path.dirname(config.socket_path) == runtime_dir


def test_socket_unit_listens_where_the_config_says_and_outlives_the_daemon() -> None:
    """The daemon serves the sockets it is passed only as a pair at <path> and <path>.data (it
    refuses anything else); the service keeps its runtime folder on stop, or the folder would
    take the socket unit's sockets with it."""
    socket_unit, service = SOCKET_UNIT.read_text(), UNIT.read_text()
    config_text = CONFIG.read_text()
    path = _config_socket()
    assert _unit_value(socket_unit, "ListenStream") == path
    assert _unit_value(socket_unit, "ListenSequentialPacket") == path + ".data"
    mode = re.search(r'^socket_mode: "(.*)"$', config_text, flags=re.MULTILINE).group(1)
    assert _unit_value(socket_unit, "SocketMode") == mode
    assert _unit_value(socket_unit, "SocketUser") == _unit_value(service, "User")
    assert _unit_value(socket_unit, "SocketGroup") == _unit_value(service, "Group")
    assert _unit_value(service, "RuntimeDirectoryPreserve") == "yes"
    assert _unit_value(service, "Also") == SOCKET_UNIT.name
    assert _unit_value(socket_unit, "WantedBy") == "sockets.target"



METRICS_DROP_IN = REPO / "deploy" / "trainstreamd-metrics-endpoint.conf"


def test_the_metrics_drop_in_opens_the_loopback_alone(tmp_path: Path) -> None:
    """The unit gives the daemon no network; the drop-in that lets metrics_listen serve gives it
    the loopback and nothing else, and the unit stays well protected with it."""
    text = METRICS_DROP_IN.read_text()
    assert _unit_value(text, "IPAddressDeny") == "any"
    assert _unit_value(text, "IPAddressAllow") == "localhost"
    assert _unit_value(text, "PrivateNetwork") == "no"
    # The shipped config leaves the endpoint off: the unit alone would refuse its socket.
    assert not re.search(r"^metrics_listen:", CONFIG.read_text(), flags=re.MULTILINE)
    suggested = re.search(r'^# metrics_listen: "(.*)"$', CONFIG.read_text(), flags=re.MULTILINE)
    assert suggested and suggested.group(1).startswith("127.0.0.1:"), "suggest the loopback"
    if SYSTEMD_ANALYZE is None:
        pytest.skip("systemd-analyze not found (Debian package `systemd`); cannot verify the unit")
    (tmp_path / UNIT.name).write_text(_unit_to_verify(UNIT))
    drop_ins = tmp_path / f"{UNIT.name}.d"
    drop_ins.mkdir()
    (drop_ins / "metrics-endpoint.conf").write_text(text)
    result = subprocess.run([SYSTEMD_ANALYZE, "verify", "--recursive-errors=one", "--man=no",
                             str(tmp_path / UNIT.name)], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    security = subprocess.run([SYSTEMD_ANALYZE, "security", "--offline=yes", "--no-pager",
                               str(tmp_path / UNIT.name)], capture_output=True, text=True,
                              timeout=120, check=False)
    # The drop-in is read: the host's network shows, allowed to the loopback only.
    assert "only localhost entries" in security.stdout, security.stdout
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", security.stdout)
    assert found, security.stdout + security.stderr
    # 1.2 without the drop-in; 1.9 with it (the host's network namespace, loopback only).
    assert float(found.group(1)) <= 2.0, security.stdout
