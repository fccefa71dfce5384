# SPDX-License-Identifier: Apache-2.0
"""Checks deploy/container/ and deploy/kubernetes/ without a container engine or a cluster (this
machine has neither): the image's run-time stage installs the package of every library the two
binaries link; the DaemonSet mounts the socket folder its config names, probes that socket,
gives a drain the time the config allows, and holds the memory budget it pins; and each of its
documents is what the API server accepts, field by field (the API's own schemas, offline)."""

import re
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = REPO / "deploy" / "container" / "Containerfile"
MANIFEST = REPO / "deploy" / "kubernetes" / "trainstreamd.yaml"
# In debian:12-slim already (Priority: required).
BASE_IMAGE_PACKAGES = {"libc6", "libgcc-s1", "zlib1g"}


def _runtime_packages() -> set[str]:
    """The packages the last stage's apt-get install names."""
    last_stage = CONTAINERFILE.read_text().rsplit("\nFROM ", 1)[1]
    install = re.search(r"apt-get install -y --no-install-recommends(.*?)&&", last_stage,
                        flags=re.DOTALL)
    assert install, "the run-time stage installs no packages"
    return set(install.group(1).replace("\\", " ").split())


def _package_of(library: str) -> str:
    """The Debian package that holds `library` (by its path or, under merged /usr, the other)."""
    candidates = {library, str(Path(library).resolve())}
    for path in list(candidates):
        if path.startswith("/usr/lib/"):
            candidates.add(path[len("/usr"):])
        elif path.startswith("/lib/"):
            candidates.add("/usr" + path)
    for path in candidates:
        found = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True, check=False)
        if found.returncode == 0:
            return found.stdout.split(":", 1)[0]
    raise AssertionError(f"no Debian package holds {library}")


@pytest.mark.parametrize("name", ["trainstreamd", "tsctl"])
def test_the_image_holds_every_library_the_binaries_link(name, trainstreamd_binary,
                                                          tsctl_binary):
    binary = trainstreamd_binary if name == "trainstreamd" else tsctl_binary
    with open(binary, "rb") as f:
        if f.read(4) != b"\x7fELF":
            # A repaired wheel's bin/ holds launchers, and its libraries are its own copies: the
            # image is built from the tree, whose binaries are what this compares.
            pytest.skip(f"{binary} is a wheel's launcher, not the tree's binary; set "
                        f"{name.upper()} to the build's {name}")
    linked = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    libraries = re.findall(r"=> (/\S+)", linked)
    assert libraries, linked
    needed = {_package_of(library) for library in libraries}
    missing = needed - _runtime_packages() - BASE_IMAGE_PACKAGES
    assert not missing, f"{name} links libraries of {sorted(missing)}, which the image lacks"


def _documents() -> dict:
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text())}


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    number, unit = re.fullmatch(r"(\d+)([KMGT])i?", text).groups()
    return int(number) * units[unit]


def test_the_daemonset_serves_its_configs_socket_to_the_node(daemon_config_pb2: ModuleType):
    from google.protobuf import text_format

    docs = _documents()
    assert set(docs) == {"Namespace", "ConfigMap", "DaemonSet"}
    config = text_format.Parse(docs["ConfigMap"]["data"]["trainstreamd.conf"],
                               daemon_config_pb2.DaemonConfig())
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}

    # The sockets land in the node's folder that client pods mount.
    folder = str(Path(config.socket_path).parent)
    assert volumes[mounts[folder]]["hostPath"]["path"] == folder
    # The config the daemon reads is the ConfigMap's.
    config_arg = next(a for a in container["args"] if a.startswith("--config="))
    config_path = Path(config_arg.split("=", 1)[1])
    assert volumes[mounts[str(config_path.parent)]]["configMap"]["name"] == \
        docs["ConfigMap"]["metadata"]["name"]
    assert config_path.name in docs["ConfigMap"]["data"]
    # The image's entry point reads the same file.
    assert f'"--config={config_path}"' in CONTAINERFILE.read_text()
    # Each probe asks the daemon on that socket.
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        command = container[probe]["exec"]["command"]
        assert command[0] == "/usr/bin/tsctl" and command[-1] == "status", probe
        assert f"--socket={config.socket_path}" in command, probe
    # A drain ends before the kubelet's SIGKILL.
    assert pod["terminationGracePeriodSeconds"] > config.drain_timeout_s
    # Pinned memory: the capability to lock it, and a limit that holds the budget.
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
    assert _bytes(container["resources"]["limits"]["memory"]) > _bytes(config.memory_budget)
    # The sockets' group is the one the manifest tells client pods to join.
    group = container["securityContext"]["runAsGroup"]
    assert f"supplementalGroups: [{group}]" in MANIFEST.read_text()
    assert config.socket_mode == "0660"


# The oldest Kubernetes release still maintained upstream when this was written, and the newest
# whose schemas kubernetes-validate carries.
@pytest.mark.parametrize("release", ["1.32", "latest"])
def test_each_document_is_valid_for_the_api_server_with_no_unknown_field(release):
    # The API's own OpenAPI schemas, bundled (no cluster, no network). Strict: an unknown or
    # misspelt field fails here, where `kubectl apply` would reject it or drop it without a word.
    validator = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not "
                                    "installed (scripts/bootstrap.sh installs it)")
    version = validator.latest_version() if release == "latest" else release
    for document in yaml.safe_load_all(MANIFEST.read_text()):
        validator.validate(document, version, strict=True)


def test_the_validation_catches_a_misspelt_field():
    validator = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not "
                                    "installed (scripts/bootstrap.sh installs it)")
    daemonset = _documents()["DaemonSet"]
    daemonset["spec"]["template"]["spec"]["containers"][0]["imagePulPolicy"] = "Always"
    with pytest.raises(validator.ValidationError, match="imagePulPolicy"):
        validator.validate(daemonset, validator.latest_version(), strict=True)
