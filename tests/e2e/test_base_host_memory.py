# SPDX-License-Identifier: Apache-2.0
"""Host memory of a quantized model as large as the machine allows: ``load_model`` of a
checkpoint quantizes while reading, and ``load_model(random_weights=True)`` layer by layer, so
that neither ever holds a full-precision copy of the model. Measured as resident sets (peak
RSS) of the processes that hold it, in fresh processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

HERE = os.path.dirname(os.path.abspath(__file__))
# Many thin layers: the model's bytes are in its decoder layers (as a 70B's are), and the
# largest single layer (what one draw holds for a moment in fp32) is a few percent of them.
CONFIG = dict(vocab_size=512, hidden_size=512, intermediate_size=2048, num_hidden_layers=24,
              num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
              tie_word_embeddings=False)

# Runs in a fresh process: its peak resident set before and after load_model, and what the
# model holds.
_MEASURE = textwrap.dedent("""
    import json, sys, torch, trainstream
    def peak():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
    path, random_weights, socket = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
    daemon_pid = int(sys.argv[4])
    def daemon_peak():
        with open(f"/proc/{daemon_pid}/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
    client = trainstream.connect(socket, job_id="host-memory")
    # A first load of a one-layer model of the same kind: the code (transformers' modules,
    # the quantizer's threads) is in memory before the baseline is taken.
    warm = trainstream.load_model(sys.argv[5], quantize="nf4", device="cpu", client=client,
                                  random_weights=True, progress=False)
    warm(torch.randint(0, 512, (1, 8)))
    del warm
    for pid in ("self", daemon_pid):  # the peaks restart from the resident sets now
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    before, daemon_before = peak(), daemon_peak()
    model = trainstream.load_model(path, quantize="nf4", device="cpu", client=client,
                                   random_weights=random_weights, progress=False)
    after, daemon_after = peak(), daemon_peak()
    stored = sum(t.numel() * t.element_size()
                 for m in model.modules() if isinstance(m, trainstream.BaseLinear)
                 for t in (m.data, m.scales))
    others = sum(p.numel() * p.element_size() for p in model.parameters())
    bf16 = sum(m.in_features * m.out_features * 2 for m in model.modules()
               if isinstance(m, trainstream.BaseLinear))
    logits = model(torch.randint(0, 512, (1, 8))).logits
    print(json.dumps(dict(process=after - before, daemon=daemon_after - daemon_before,
                          stored=stored, others=others, bf16=bf16,
                          finite=bool(torch.isfinite(logits).all()))))
""")


def _config(tmp_path, **changes) -> str:
    import transformers

    transformers.Qwen2Config(**{**CONFIG, **changes}).save_pretrained(str(tmp_path))
    return str(tmp_path)


def _measure(path: str, random_weights: bool, daemon, tmp_path) -> dict:
    warm = _config(tmp_path / "warm", num_hidden_layers=1)
    out = subprocess.run([sys.executable, "-c", _MEASURE, path, "1" if random_weights else "0",
                          daemon.socket, str(daemon.pid()), warm],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_random_weights_hold_the_quantized_size_not_a_full_precision_copy(daemon, tmp_path):
    m = _measure(_config(tmp_path), True, daemon, tmp_path)
    assert m["finite"]
    quantized = m["stored"] + m["others"]
    assert m["stored"] < m["bf16"] / 3  # NF4: about a quarter of bf16, scales included
    # The quantized bytes are written into the daemon's shared memory from this process (its
    # resident set counts them); the draws of one layer at a time come and go.
    assert m["stored"] <= m["process"] <= 1.1 * quantized, m


def test_a_checkpoint_is_quantized_while_read_within_its_quantized_size(daemon, tmp_path):
    import transformers

    path = _config(tmp_path)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**CONFIG))
    safetensors_torch.save_file({k: v.to(torch.bfloat16).contiguous()
                                 for k, v in model.state_dict().items()},
                                str(tmp_path / "model.safetensors"))
    del model
    m = _measure(path, False, daemon, tmp_path)
    assert m["finite"]
    quantized = m["stored"] + m["others"]
    # The daemon holds the base, read by up to 8 threads a window at a time (16 MiB of the
    # file and its values as fp32: 48 MiB each); the process maps it and holds only the
    # embeddings, norms and head it dequantized, and the model's modules (a fixed cost: 32 MiB
    # for both). A bf16 copy would be 4 times the NF4 bytes.
    windows = min(8, os.cpu_count() or 1) * (48 << 20)
    assert m["daemon"] + m["process"] <= 1.1 * quantized + windows + (32 << 20), m
    assert m["daemon"] >= m["stored"]  # the base is the daemon's
