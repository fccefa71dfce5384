# SPDX-License-Identifier: Apache-2.0
"""What the checks of deploy/ share: the daemon's config schema, compiled for Python."""

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
PROTO = REPO / "daemon" / "config" / "daemon_config.proto"


@pytest.fixture(scope="session")
def daemon_config_pb2(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """daemon_config.proto compiled with grpc_tools.protoc and imported."""
    pytest.importorskip(
        "grpc_tools.protoc",
        reason="grpcio-tools is not installed (scripts/bootstrap.sh puts it in /opt/trainstream/venv)",
    )
    out = tmp_path_factory.mktemp("daemon_config_pb2")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"--proto_path={PROTO.parent}",
            f"--python_out={out}",
            str(PROTO),
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


