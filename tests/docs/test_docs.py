# SPDX-License-Identifier: Apache-2.0
"""The documentation site builds, and its examples run.

- ``mkdocs build --strict`` into a temporary folder: a broken link, a missing page, a
  mkdocstrings reference that does not resolve or a docstring it cannot parse fails the build.
- Every ```` ```python ```` block under ``docs/`` runs in a fresh interpreter on the CPU, with a
  timeout, unless the line before its fence is ``<!-- gpu -->`` (or ``<!-- gpu: why -->``):
  such blocks are reported as skipped, with that reason, where no GPU is present. The blocks
  that train call ``trainstream.wrap()``, which starts a private daemon itself.
- The options table is generated from ``ACCEPTED`` and names every option ``wrap()`` takes.

The blocks run two at a time (the test box has 2 cores), once per session; each test reads
its block's result.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BLOCK_TIMEOUT_S = 120
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```\s*$", re.S | re.M)
GPU_MARKER = re.compile(r"<!--\s*gpu(?::\s*(.*?))?\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    code: str
    gpu_reason: str | None  # None: runs on the CPU

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def python_blocks() -> list[Block]:
    blocks = []
    for path in sorted(DOCS.rglob("*.md")):
        text = path.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            before = text[:match.start()].rstrip("\n").splitlines()
            marker = GPU_MARKER.search(before[-1]) if before else None
            reason = None
            if marker:
                reason = marker.group(1) or "needs a CUDA GPU"
            line = text.count("\n", 0, match.start()) + 1
            blocks.append(Block(str(path.relative_to(DOCS)), line, match.group(1), reason))
    return blocks


BLOCKS = python_blocks()


def _gpu_present() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _run(block: Block, workdir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TRAINSTREAM_SOCKET", None)  # each block starts its own private daemon
    env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "") if block.gpu_reason else ""
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    workdir.mkdir(parents=True, exist_ok=True)
    script = workdir / "block.py"
    script.write_text(block.code, encoding="utf-8")
    try:
        return subprocess.run([sys.executable, str(script)], cwd=workdir, env=env,
                              capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(e.cmd, -1, e.stdout or "",
                                           f"timed out after {BLOCK_TIMEOUT_S} s")


@pytest.fixture(scope="session")
def block_results(tmp_path_factory):
    """Runs every block that can run here, two at a time; {name: CompletedProcess}."""
    gpu = _gpu_present()
    runnable = [b for b in BLOCKS if b.gpu_reason is None or gpu]
    base = tmp_path_factory.mktemp("doc_blocks")
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {b.name: pool.submit(_run, b, base / f"b{i}") for i, b in enumerate(runnable)}
        return {name: f.result() for name, f in futures.items()}


def test_docs_have_python_blocks_that_run_here():
    assert BLOCKS, "no python blocks found under docs/"
    assert [b for b in BLOCKS if b.gpu_reason is None], "every block is GPU-only"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_python_block_runs(block, block_results):
    if block.gpu_reason is not None and block.name not in block_results:
        pytest.skip(f"{block.name}: {block.gpu_reason} (marked <!-- gpu --> in the page)")
    result = block_results[block.name]
    assert result.returncode == 0, (
        f"{block.name} exited {result.returncode}\n--- code\n{block.code}\n--- stdout\n"
        f"{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-5000:]}")


def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed in this environment (scripts/bootstrap.sh "
                    "installs mkdocs, mkdocs-material and mkdocstrings[python])")
    for module in ("material", "mkdocstrings", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (scripts/bootstrap.sh installs it)")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert (tmp_path / "site" / "reference" / "options" / "index.html").is_file()
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert "Trains" in api and "model" in api  # wrap()'s docstring rendered


def test_options_table_names_every_option():
    spec = importlib.util.spec_from_file_location("options_table",
                                                  DOCS / "hooks" / "options_table.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    table = hook.options_table(str(ROOT))
    from trainstream.options import ACCEPTED

    names = re.findall(r"^\| `([a-z_]+)` \|", table, re.M)
    assert names == list(ACCEPTED), (names, list(ACCEPTED))
    assert "| `nonfinite` | `'guard'` | `'guard'`, `'ignore'`, `'skip'`, `'error'` |" in table
