# SPDX-License-Identifier: Apache-2.0
"""``wrap(attention="auto")``'s pick against PyTorch's own, on the attention shapes of
Qwen2.5-7B and -14B (grouped-query, causal, bf16) at 512, 2,048 and 8,192 tokens: one forward
and backward of ``F.scaled_dot_product_attention`` with PyTorch's default choice, with each
kernel alone, and with the kernel "auto" keeps (AttentionBackend's own measurement).

    python bench/attention.py [--cases qwen7b_2k ...] [--repeats 20] [--rounds 3]
        [--json out.json]

Each configuration is timed in rounds, in turn (a warm-up round first), and keeps its fastest
round of ``--repeats`` calls.

The bound beside them: the attention's matmul FLOPs (causal: half of 4*b*h*s^2*d forward,
2.5 times that with backward) over the bf16 matmul rate measured in the same run. Without a
GPU, ``--cases tiny`` runs a small shape on the CPU (timings that do not count)."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from step_bench import write_results  # noqa: E402

# heads, key/value heads, head_dim, tokens (batch 1)
CASES = {f"{m}_{n}": dict(heads=h, kv=kv, dim=128, tokens=t, batch=1)
         for m, h, kv in (("qwen7b", 28, 4), ("qwen14b", 40, 8))
         for n, t in (("512", 512), ("2k", 2048), ("8k", 8192))}
CASES["tiny"] = dict(heads=4, kv=2, dim=32, tokens=128, batch=2)


def _inputs(case: dict, device: str, dtype: torch.dtype) -> tuple:
    g = torch.Generator(device=device).manual_seed(0)
    b, s, d = case["batch"], case["tokens"], case["dim"]
    q = torch.randn(b, case["heads"], s, d, generator=g, device=device, dtype=dtype)
    k = torch.randn(b, case["kv"], s, d, generator=g, device=device, dtype=dtype)
    v = torch.randn(b, case["kv"], s, d, generator=g, device=device, dtype=dtype)
    return q, k, v


def _timed(q, k, v, kernels, repeats: int) -> float | str:
    """Milliseconds of forward and backward (GQA expanded as transformers' sdpa path does)."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))

    def once():
        kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if kernels is None:
            out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
        else:
            with sdpa_kernel(kernels):
                out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
        out.backward(torch.ones_like(out))

    try:
        once()
    except RuntimeError as e:
        return f"not available: {str(e).splitlines()[0][:120]}"
    if q.is_cuda:
        torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(repeats):
        once()
    if q.is_cuda:
        torch.cuda.synchronize()
    return round((time.perf_counter() - began) * 1e3 / repeats, 4)


def _timed_in_rounds(q, k, v, repeats: int, rounds: int) -> dict:
    """``{"default": ms, kernel: ms or why not}``: a warm-up round, then ``rounds`` rounds that
    time each configuration once in turn; each keeps its fastest round. The first
    configuration timed no longer pays for the run's first calls, nor a slow moment of the
    machine for one kernel's whole chance."""
    from trainstream.integrations.attention_backend import BACKENDS

    configurations = {"default": None, **{name: [b] for name, b in BACKENDS.items()}}
    best: dict = {}
    for round_ in range(rounds + 1):
        for name, kernels in configurations.items():
            if isinstance(best.get(name), str):
                continue  # it could not run these shapes
            ms = _timed(q, k, v, kernels, 1 if round_ == 0 else repeats)
            if round_ == 0 or isinstance(ms, str):
                best[name] = ms if isinstance(ms, str) else float("inf")
                continue
            best[name] = min(ms, best[name])
    return best


def _matmul_tflops(device: str, dtype: torch.dtype) -> float:
    n = 8192 if device == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(10):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n ** 3 * 10 / (time.perf_counter() - began) / 1e12


def main() -> None:
    from trainstream.integrations.attention_backend import AttentionBackend

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=[c for c in CASES if c != "tiny"],
                        choices=list(CASES))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tflops = _matmul_tflops(device, dtype)
    print(f"{device}: {str(dtype).removeprefix('torch.')} matmul {tflops:.1f} TFLOP/s")
    rows = []
    for name in args.cases:
        case = CASES[name]
        q, k, v = _inputs(case, device, dtype)
        row = {"case": name, **case, **{f"{config}_ms": ms for config, ms in _timed_in_rounds(
            q, k, v, args.repeats, args.rounds).items()}}
        chooser = AttentionBackend("auto", lambda kind, message, **numbers: None)
        rep = case["heads"] // case["kv"]
        with torch.enable_grad():
            chooser._measure((q.requires_grad_(True), k.repeat_interleave(rep, 1),
                              v.repeat_interleave(rep, 1)), {"is_causal": True})
        row["auto_pick"] = chooser.backend
        # Its own trials (the kernel alone, GQA expanded before it): where they rank the kernels
        # otherwise than the rounds above, this says so.
        row["auto_trials_ms"] = dict(chooser.timings_ms)
        row["auto_ms"] = row.get(f"{chooser.backend}_ms") if chooser.backend else None
        b, h, s, d = case["batch"], case["heads"], case["tokens"], case["dim"]
        flops = 2.5 * 4 * b * h * s * s * d / 2  # causal: half the score matrix
        row["bound_ms"] = round(flops / (tflops * 1e12) * 1e3, 4)
        rows.append(row)
        timed = {k_: v_ for k_, v_ in row.items() if k_.endswith("_ms") and
                 isinstance(v_, float) and k_ not in ("bound_ms", "auto_ms")}
        print(f"\n== {name}: {case}")
        for key, value in timed.items():
            print(f"  {key[:-3]:10s} {value:9.3f} ms")
        for key in ("flash_ms", "efficient_ms", "cudnn_ms", "math_ms"):
            if isinstance(row[key], str):
                print(f"  {key[:-3]:10s} {row[key]}")
        speed = (f", {row['default_ms'] / row['auto_ms']:.2f}x PyTorch's default pick"
                 if isinstance(row["auto_ms"], float) and isinstance(row["default_ms"], float)
                 else "")
        print(f"  auto picks {row['auto_pick']}{speed}; bound {row['bound_ms']:.3f} ms "
              f"(matmul FLOPs at {tflops:.1f} TFLOP/s)")
        print("  auto's own trials: " + ", ".join(
            f"{k_} {v_:.3f} ms" if isinstance(v_, float) else f"{k_} not available"
            for k_, v_ in row["auto_trials_ms"].items()))
    if args.json:
        write_results(args.json, "attention", rows, matmul_tflops=round(tflops, 2))


if __name__ == "__main__":
    main()
