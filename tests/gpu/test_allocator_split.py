# SPDX-License-Identifier: Apache-2.0
"""The split limit the memory plan sets (max_split_size_mb) is kept above every segment the
caching allocator had already cut up. Below it, torch 2.11's allocator, at the process's cap,
hands a piece of such a segment to cudaFree: "CUDA error: invalid argument" in whatever
operation was allocating (the Qwen2.5-1.5B full fine-tune's embedding backward under a 24 GiB
cap, H200 2026-12-04). Each case runs in a process of its own: the cap and the allocator's
settings are process-wide."""

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine"),
]

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from trainstream.memory.allocator_split import LargeBlocksWhole
    M = 1 << 20
    cut = sys.argv[1] == "cut"
    x = torch.empty(900 * M, dtype=torch.uint8, device="cuda")
    del x  # a cached 900 MiB segment
    if cut:
        a = torch.empty(12 * M, dtype=torch.uint8, device="cuda")  # cuts it: 888 MiB free
    holder = LargeBlocksWhole()
    limit = holder.apply(2 * 296 * M)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(1500 * M / total)
    try:
        b = torch.empty(1000 * M, dtype=torch.uint8, device="cuda")
        outcome = "allocated"
    except torch.OutOfMemoryError:
        outcome = "out of memory"
    except Exception as e:
        outcome = type(e).__name__ + ": " + str(e).splitlines()[0]
    print(limit, holder.wanted_mib, outcome)
""")


def _run(case: str) -> list:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_ALLOC_CONF"}
    env["PYTORCH_CUDA_ALLOC_CONF"] = ""  # the user chose nothing: the plan's limit applies
    done = subprocess.run([sys.executable, "-c", SCRIPT, case], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    limit, wanted, outcome = done.stdout.split(maxsplit=2)
    return [int(limit), int(wanted), outcome.strip()]


def test_a_segment_cut_before_the_limit_keeps_the_limit_above_it():
    limit, wanted, outcome = _run("cut")
    assert (limit, wanted) == (901, 296)
    # At the cap the allocator may free cached blocks to make room: whole segments only.
    assert outcome in ("allocated", "out of memory"), outcome


def test_with_nothing_cut_the_limit_is_the_one_asked_for():
    limit, wanted, outcome = _run("whole")
    assert (limit, wanted) == (296, 0)
    assert outcome in ("allocated", "out of memory"), outcome
