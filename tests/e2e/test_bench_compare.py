# SPDX-License-Identifier: Apache-2.0
"""bench/compare.py, the comparison with other engines, checked on the CPU: its --tiny self-check
runs the stock and wrap() engines each in a process of its own (a LoRA case with gradient
accumulation), and every row it writes says what ran or why not; the table's choice of the
fastest other engine that fits, and our ratio to it, on rows made up here."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "bench", "compare.py")


def _compare_module():
    spec = importlib.util.spec_from_file_location("bench_compare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_self_check_writes_a_row_per_engine(tmp_path, trainstreamd_binary):
    pytest.importorskip("torch")
    pytest.importorskip("transformers", reason="transformers is not installed "
                        "(scripts/bootstrap.sh installs it)")
    pytest.importorskip("peft", reason="peft is not installed (scripts/bootstrap.sh installs it)")
    out = tmp_path / "compare.json"
    env = dict(os.environ, TRAINSTREAMD=trainstreamd_binary)
    # bnb, ds2 and ao: rows without a process (not applicable, or needs CUDA).
    result = subprocess.run(
        [sys.executable, SCRIPT, "--tiny", "--device", "cpu", "--cases", "mistral7b_lora_1k_ga4",
         "--modes", "stock", "stock_cap", "wrap", "wrap_rc", "bnb", "ds2", "ao", "--steps", "3",
         "--json", str(out), "--timeout", "150"],
        capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["bench"] == "compare" and data["tiny"] and data["device"] == "cpu"
    assert data["vram_cap_gib"] == 24 and "commit" in data and "date" in data
    rows = {r["mode"]: r for r in data["rows"]}
    assert all(r["status"] in _compare_module().STATUSES for r in rows.values())
    assert set(rows) == {"stock", "stock_cap", "wrap", "wrap_rc", "bnb", "ds2", "ao"}
    for mode in ("stock", "stock_cap", "wrap", "wrap_rc"):
        row = rows[mode]
        assert row["status"] == "ok", (mode, row.get("reason"), row.get("log_tail"))
        assert row["complete"] and row["accum"] == 4 and row["preset"] == "tiny-mistral"
        assert len(row["losses"]) == 3 and all(math.isfinite(v) for v in row["losses"])
        assert len(row["step_times_s"]) == 3 and row["step_s"] > 0
        assert row["measured_steps"][1] == 3
    assert rows["wrap"]["engine"].startswith("trainstream")
    assert rows["wrap"]["wrap_options"] == {"accumulation_steps": 4}
    assert rows["wrap_rc"]["wrap_options"] == {"recompute": True, "activation_offload": False,
                                               "accumulation_steps": 4}
    assert rows["wrap"]["settled_at"] is not None
    # The same model, batches and loop: the first step's loss is the same model's on the same
    # batches, and the updates that follow are AdamW's on both sides.
    assert rows["stock_cap"]["losses"] == rows["stock"]["losses"]
    for mode in ("wrap", "wrap_rc"):
        assert abs(rows[mode]["losses"][0] - rows["stock"]["losses"][0]) < 1e-3
        assert rows[mode]["max_loss_diff_vs_stock"] < 0.02
    assert rows["bnb"]["status"] == "not_applicable" and "bf16-base" in rows["bnb"]["reason"]
    assert rows["ao"]["status"] == "not_applicable" and "LoRA" in rows["ao"]["reason"]
    assert rows["ds2"]["status"] == "needs_cuda" and "CUDA" in rows["ds2"]["reason"]
    # Stock without the cap is the reference, never the engine to beat.
    assert "fastest other that fits: stock_cap" in result.stdout, result.stdout[-3000:]
    assert rows["wrap"]["best_other"]["mode"] == "stock_cap"

    report = subprocess.run([sys.executable, SCRIPT, "--report", str(out)], capture_output=True,
                            text=True, timeout=60)
    assert report.returncode == 0, report.stderr[-2000:]
    assert "mistral7b_lora_1k_ga4" in report.stdout and "needs_cuda" in report.stdout


def test_applicability_and_the_fastest_other_engine():
    compare = _compare_module()
    full, lora, nf4 = (compare.CASES[c] for c in ("qwen1.5b_full", "qwen14b_lora_512",
                                                  "qwen14b_nf4_512"))
    assert compare.applies("bnb", full, "cuda")[0] == "not_applicable"
    assert "full fine-tune" in compare.applies("bnb", full, "cuda")[1]
    assert compare.applies("bnb", lora, "cuda")[0] == "not_applicable"
    assert compare.applies("bnb_ckpt", nf4, "cuda") is None
    assert compare.applies("wrap_nf4", nf4, "cuda") is None
    assert compare.applies("wrap", nf4, "cuda")[0] == "not_applicable"
    assert compare.applies("stock", nf4, "cuda") is None  # the reference runs everywhere
    assert compare.applies("ao", lora, "cuda")[0] == "not_applicable"
    # The 72B NF4 case: only an engine that builds the base a layer at a time may take it;
    # the others say which memory the bf16 model does not fit in (all of them, here).
    big = compare.CASES["qwen72b_nf4_2k"]
    assert compare.applies("wrap_nf4", big, "cuda") is None
    refused = compare.applies("bnb_ckpt", big, "cuda")
    assert refused[0] == "refused" and "the bf16 model (145 GB)" in refused[1]
    assert compare.applies("bnb_ckpt", big, "cpu", tiny=True) is None  # tiny: a tiny model
    assert compare.applies("slice8", big, "cuda") is None
    assert compare.applies("slice8", nf4, "cuda")[0] == "not_applicable"
    # Its compute, all resident: the 16-layer slice plus 64 more layers at the slices' rate.
    slices = {"slice8": {"step_s": 1.0, "preset": "qwen2.5-72b"},
              "slice16": {"step_s": 1.8, "preset": "qwen2.5-72b"}}
    assert compare._extrapolated_compute(slices) == pytest.approx(1.8 + 0.1 * 64)
    assert compare._extrapolated_compute({"slice8": slices["slice8"]}) is None
    assert compare.applies("ao", full, "cuda") is None
    assert compare.applies("ds3_ckpt", lora, "cuda") is None
    for mode in ("ds2", "ds3", "fsdp2", "ao", "ts041"):
        assert compare.applies(mode, full, "cpu")[0] == "needs_cuda"
    assert set(compare.MODES) >= {"stock", "stock_cap", "stock_ckpt", "wrap", "wrap_rc",
                                  "wrap_nf4", "ts041", "bnb", "bnb_ckpt", "ds2", "ds3", "ao",
                                  "fsdp2"}

    def row(mode, status="ok", step=None, reserved=10.0, **more):
        return {"case": "c", "mode": mode, "status": status, "step_s": step,
                "peak_reserved_gib": reserved, "losses": [2.0, 1.5], **more}

    rows = [row("stock", step=0.1, reserved=40.0),  # no cap: never the one to beat
            row("stock_cap", "oom"),
            row("stock_ckpt", step=0.5),
            row("ds2_ckpt", step=0.4),
            row("ds3", step=0.3, reserved=30.0),  # over the cap: does not fit
            row("wrap", step=0.2, h2d_bytes=10**9, d2h_bytes=10**9),
            row("wrap_nf4", step=0.05),  # another base: compared with NF4 engines only
            row("bnb", step=0.1)]
    bandwidth = {"h2d_gbps": 50.0, "d2h_gbps": 50.0, "both_each_way_gbps": 40.0}
    compare._analyse(rows, bandwidth, 24)
    wrap = rows[5]
    assert wrap["best_other"] == {"mode": "ds2_ckpt", "step_s": 0.4}
    assert wrap["vs_best_other"] == 0.5
    assert wrap["bound"]["lower_bound_s"] == 0.1  # stock's 0.1 s over PCIe's 0.025 s
    assert wrap["step_over_bound"] == 2.0
    assert rows[6]["best_other"]["mode"] == "bnb"
    table = compare._table(rows, [bandwidth], 24)
    assert "fastest other that fits: ds2_ckpt 0.4000 s; ours/that = 0.50x" in table
    assert "fastest other that fits: bnb 0.1000 s; ours/that = 0.50x" in table
