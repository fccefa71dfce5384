# SPDX-License-Identifier: Apache-2.0
"""The Hugging Face examples run as a user runs them (tiny models on the CPU here): each exits 0
and prints what it promises."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (scripts/bootstrap.sh "
                                           "installs it)")
pytest.importorskip("peft", reason="peft is not installed (scripts/bootstrap.sh installs it)")

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, on any machine
    done = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *args],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_hf_finetune_beside_the_stock_trainer():
    out = _run("hf_finetune.py", "--model", "tiny-llama", "--steps", "3", "--compare")
    difference = float(out.split("largest loss difference:")[1].split()[0])
    assert difference < 1e-3, out
    assert "ts_host_state_gb=" in out


def test_dpo_lora_learns_the_preferences():
    out = _run("dpo_lora.py", "--steps", "10")
    assert "the preferences were learned" in out, out


def test_lora_over_a_quantized_shared_base():
    out = _run("lora_large_model.py", "--random", "tiny-qwen2", "--quantize", "nf4",
               "--steps", "2")
    assert "(nf4): losses [" in out and "MiB in the daemon, shared by 1 process" in out, out


@pytest.mark.parametrize("lora", [False, True])
def test_verify_ram_offload_passes(lora):
    out = _run("verify_ram_offload.py", *(["--lora"] if lora else []))
    assert out.count("PASS  ") == 4 and "verdict: PASS" in out, out
