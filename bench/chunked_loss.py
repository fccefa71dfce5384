# SPDX-License-Identifier: Apache-2.0
"""The causal-LM loss wrap() puts on Hugging Face models
(shim_python/trainstream/integrations/chunked_loss.py) against transformers' ForCausalLMLoss, on
bf16 logits as a model under autocast or in bf16 makes them: the VRAM each needs beyond the logits
(forward and backward), its time, and the differences in loss and gradient. Two of ours: the CUDA
kernels (kernels/cuda/cross_entropy.cu, what runs on a GPU) and the same chunks in torch operations
(what runs where the kernels do not apply). Bounds: memory, the gradient itself (2 bytes a logit);
time, the bytes the kernels must move (the logits read twice, the gradient written) over a
device-to-device copy's bandwidth measured in the same run.

Needs the built package (pip install .) for the kernels.

    python bench/chunked_loss.py [--positions 2048] [--vocab 32064 152064] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_gbps(device: torch.device) -> float:
    """A device-to-device copy of 1 GiB: read and written bytes over its time."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    times = []
    for _ in range(5):
        began = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - began)
    return 2 * src.numel() / min(times) / 1e9


def _measure(fn, logits0: torch.Tensor, labels: torch.Tensor, vocab: int, repeats: int) -> dict:
    device = logits0.device
    times, peaks = [], []
    result = None
    for _ in range(repeats + 1):  # the first warms the kernels
        logits = logits0.detach().clone().requires_grad_(True)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        began = time.perf_counter()
        loss = fn(logits, labels, vocab)
        loss.backward()
        _sync(device)
        times.append(time.perf_counter() - began)
        if device.type == "cuda":
            peaks.append(torch.cuda.max_memory_allocated(device) - base)
        result = (loss.detach().float(), logits.grad)
        del logits, loss
    return {"seconds": statistics.median(times[1:]), "peak_beyond_logits": max(peaks or [0]),
            "loss": result[0], "grad": result[1]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32064, 152064])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    from transformers.loss.loss_utils import ForCausalLMLoss

    from trainstream.integrations import chunked_loss

    def torch_chunks(logits, labels, vocab):
        kernels = chunked_loss._kernels
        chunked_loss._kernels = lambda: None
        try:
            return chunked_loss.causal_lm_loss(logits, labels, vocab)
        finally:
            chunked_loss._kernels = kernels

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gbps = _copy_gbps(device) if device.type == "cuda" else 0.0
    rows = []
    for vocab in args.vocab:
        g = torch.Generator(device=device).manual_seed(0)
        logits = (3 * torch.randn(1, args.positions, vocab, generator=g, device=device)).to(
            torch.bfloat16)
        labels = torch.randint(0, vocab, (1, args.positions), generator=g, device=device)
        stock = _measure(ForCausalLMLoss, logits, labels, vocab, args.repeats)
        ours = {"kernel": _measure(chunked_loss.causal_lm_loss, logits, labels, vocab,
                                   args.repeats),
                "chunked": _measure(torch_chunks, logits, labels, vocab, args.repeats)}
        logit_count = args.positions * vocab
        row = {"positions": args.positions, "vocab": vocab, "logits_gib": 2 * logit_count / 2**30,
               "grad_bound_gib": 2 * logit_count / 2**30,
               "time_bound_s": 6 * logit_count / (gbps * 1e9) if gbps else None,
               "kernels_applied": chunked_loss.kernels_apply(device, torch.bfloat16),
               "stock_s": stock["seconds"], "stock_peak_gib": stock["peak_beyond_logits"] / 2**30}
        for name, m in ours.items():
            row[f"{name}_s"] = m["seconds"]
            row[f"{name}_peak_gib"] = m["peak_beyond_logits"] / 2**30
            row[f"{name}_loss_diff"] = abs(stock["loss"] - m["loss"]).item()
            row[f"{name}_grad_max_diff"] = (stock["grad"].float()
                                            - m["grad"].float()).abs().max().item()
        rows.append(row)
        del logits, labels, stock, ours
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else ''})"
          f", device copy {gbps:.0f} GB/s")
    print(f"{'positions x vocab':>20} {'engine':>9} {'peak GiB':>9} {'bound GiB':>9} "
          f"{'ms':>7} {'bound ms':>8} {'x bound':>7} {'dloss':>9} {'dgrad':>9}")
    for r in rows:
        bound = r["time_bound_s"]
        for name in ("stock", "kernel", "chunked"):
            if name == "kernel" and not r["kernels_applied"]:
                continue  # no CUDA kernels here: the same chunks as "chunked"
            seconds = r[f"{name}_s"]
            times = f"{seconds / bound:.1f}" if bound else "-"
            diffs = (f"{r[name + '_loss_diff']:>9.2e} {r[name + '_grad_max_diff']:>9.2e}"
                     if name != "stock" else f"{'':>9} {'':>9}")
            print(f"{r['positions']:>9} x {r['vocab']:<8} {name:>9} "
                  f"{r[name + '_peak_gib']:>9.3f} {r['grad_bound_gib']:>9.3f} "
                  f"{1e3 * seconds:>7.2f} {f'{1e3 * bound:.2f}' if bound else '-':>8} "
                  f"{times:>7} {diffs}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "chunked_loss", "date": time.strftime("%Y-%m-%d"),
                       "host": platform.node(), "torch": torch.__version__,
                       "commit": os.environ.get("TS_COMMIT", ""), "device_copy_gbps": gbps,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
