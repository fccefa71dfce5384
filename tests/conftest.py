# SPDX-License-Identifier: Apache-2.0
"""Fixtures: a real trainstreamd on a temporary socket, and a raw gRPC stub for it."""

from __future__ import annotations

import gc
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG_PROTO = REPO / "daemon" / "config" / "daemon_config.proto"


def _binary(name: str) -> str:
    env = os.environ.get(name.upper())
    candidates = [env] if env else []
    candidates += [os.path.join(os.path.dirname(sys.executable), name), shutil.which(name)]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise RuntimeError(f"{name} not found: pip install the package or set ${name.upper()}")


@pytest.fixture(scope="session")
def trainstreamd_binary() -> str:
    return _binary("trainstreamd")


@pytest.fixture(scope="session")
def tsctl_binary() -> str:
    return _binary("tsctl")


@pytest.fixture(scope="session")
def proto_modules():
    """trainstream.v1 Python stubs generated from proto/, in a world-readable folder (tests
    run code as another user too)."""
    # Looked for, not imported (see below).
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpcio-tools is not installed (scripts/bootstrap.sh installs it)")

    # Generated under the module name `tsapi` so it cannot shadow the trainstream package.
    out = tempfile.mkdtemp(prefix="ts-proto-")
    os.chmod(out, 0o755)
    src = os.path.join(out, "src", "tsapi")
    os.makedirs(src)
    shutil.copy(REPO / "proto/trainstream/v1/trainstream.proto", src)
    # In a process of its own: with grpc_tools' compiler loaded in this one (beside grpc,
    # google.protobuf and torch), importing trainstream's native module afterwards aborted on a
    # corrupted mutex (grpcio-tools 1.85), and a test may import it after this fixture.
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{os.path.join(out, 'src')}",
                    f"--python_out={out}", f"--grpc_python_out={out}",
                    os.path.join(src, "trainstream.proto")], check=True)
    shutil.rmtree(os.path.join(out, "src"))
    for root, dirs, files in os.walk(out):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o755)
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)
    sys.path.insert(0, out)
    from tsapi import trainstream_pb2, trainstream_pb2_grpc  # noqa: F401

    yield out
    shutil.rmtree(out, ignore_errors=True)


class Daemon:
    """A trainstreamd process on a private socket."""

    def __init__(self, binary: str, args: list[str], socket_mode: str = "0600",
                 config: str = "", user: str | None = None, prefix: tuple = ()):
        self.directory = tempfile.mkdtemp(prefix="tsd-")
        os.chmod(self.directory, 0o755)
        identity = {}
        if user is not None:  # as a system service runs it: its own account owns its sockets
            import pwd

            account = pwd.getpwnam(user)
            os.chown(self.directory, account.pw_uid, account.pw_gid)
            identity = dict(user=account.pw_uid, group=account.pw_gid, extra_groups=[])
        self.socket = os.path.join(self.directory, "d.sock")
        self.config = os.path.join(self.directory, "d.conf")
        with open(self.config, "w") as f:
            f.write(f'socket_mode: "{socket_mode}"\ndrain_timeout_s: 5\n{config}')
        self.log_path = os.path.join(self.directory, "d.log")
        self._log = open(self.log_path, "wb")
        self.prefix = tuple(prefix)
        self.process = subprocess.Popen(
            [*prefix, binary, f"--socket={self.socket}", f"--config={self.config}", *args],
            stdout=self._log, stderr=subprocess.STDOUT, **identity)
        deadline = time.monotonic() + 15
        while not os.path.exists(self.socket + ".data") or not os.path.exists(self.socket):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"trainstreamd did not start: {self.log()}")
            time.sleep(0.02)
        self.wait_ready()

    def wait_ready(self) -> None:
        import trainstream

        deadline = time.monotonic() + 10
        while True:
            try:
                trainstream._trainstream.ping_daemon(self.socket)
                return
            except trainstream.DaemonUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def pid(self) -> int:
        """The daemon's pid: under a prefix, the prefix's child (``unshare`` ignores SIGTERM)."""
        if self.prefix:
            try:
                with open(f"/proc/{self.process.pid}/task/{self.process.pid}/children") as f:
                    children = f.read().split()
                if children:
                    return int(children[0])
            except OSError:
                pass
        return self.process.pid

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.process.poll() is None:
            try:
                os.kill(self.pid(), sig)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Keeps each phase's report on the test item, for fixtures to see how the test went."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def start_daemon(trainstreamd_binary, request):
    started: list[Daemon] = []

    def start(*args: str, socket_mode: str = "0600", config: str = "",
              user: str | None = None, prefix: tuple = ()) -> Daemon:
        """A daemon with these flags; ``config``: more lines of its config file; ``user``: the
        account it runs as (root's test process starts it); ``prefix``: a command it runs
        under (such as ``unshare``), which passes the stop signal on."""
        d = Daemon(trainstreamd_binary, list(args), socket_mode, config, user, prefix)
        started.append(d)
        return d

    yield start
    # A test's optimizers are often cyclic garbage by now; collected here, they leave the set
    # whose VRAM-held state goes back to the daemon at exit (after this daemon is gone).
    gc.collect()
    failed = getattr(request.node, "report_call", None)
    for d in started:
        d.stop()
        if failed is not None and failed.failed:
            # What the daemon said is half of why a test failed (a session it ended, and why):
            # shown in the test's report, since the folder goes next.
            tail = "\n".join(d.log().splitlines()[-60:])
            print(f"\n--- {d.log_path} (last 60 lines) ---\n{tail}")
        d.cleanup()


@pytest.fixture
def daemon(start_daemon) -> Daemon:
    return start_daemon("--memory_budget=256M", "--lease_ms=1500")


@pytest.fixture
def daemon_socket(daemon, monkeypatch):
    """The test daemon as $TRAINSTREAM_SOCKET: connect() and wrap() with no socket named use it."""
    monkeypatch.setenv("TRAINSTREAM_SOCKET", daemon.socket)
    return daemon.socket


@pytest.fixture
def stub(daemon, proto_modules):
    import grpc
    from tsapi import trainstream_pb2_grpc

    channel = grpc.insecure_channel(f"unix:{daemon.socket}")
    yield trainstream_pb2_grpc.TrainStreamStub(channel)
    channel.close()


@pytest.fixture
def pb(proto_modules):
    from tsapi import trainstream_pb2

    return trainstream_pb2


def wait_until(predicate, timeout: float, interval: float = 0.02):
    """Polls `predicate` until it is truthy; returns its value or the last falsy one."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


def prometheus_samples(text: str) -> dict:
    """{name{labels}: value} of Prometheus' text format (HELP, TYPE and comments left out)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


# The daemon's config schema (daemon/config/daemon_config.proto) for the checks of deploy/.
@pytest.fixture(scope="session")
def daemon_config_pb2(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """daemon_config.proto compiled with grpc_tools.protoc and imported."""
    pytest.importorskip(
        "grpc_tools.protoc",
        reason="grpcio-tools is not installed (scripts/bootstrap.sh puts it in "
               "/opt/trainstream/venv)",
    )
    out = tmp_path_factory.mktemp("daemon_config_pb2")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"--proto_path={CONFIG_PROTO.parent}",
            f"--python_out={out}",
            str(CONFIG_PROTO),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"protoc failed:\n{result.stdout}{result.stderr}"
    spec = importlib.util.spec_from_file_location("daemon_config_pb2", out / "daemon_config_pb2.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


