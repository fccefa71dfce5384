# SPDX-License-Identifier: Apache-2.0
"""Quality per stored format: held-out perplexity of a small GPT whose frozen block weights come
from a shared base (bf16, int8, nf4, fp8, nvfp4), before and after a short LoRA fine-tune
through wrap(); computing in fp32, and for the FP8 tensor-core path (fp8_matmul) in bf16 beside
the bf16 base in bf16.

No package we could install ships a small pretrained causal LM (the Hugging Face hub is not
reachable from our machines), so the model is trained here first, on real text that ships with
Python: the standard library's modules (code and its comments, byte-level). Held out: the
modules from "n" on. The fine-tune is on another kind of text, the language reference in
pydoc_data/topics.py (its first 80%; the last 20% held out).

    python bench/quant_quality.py [--pretrain-steps 1000] [--finetune-steps 200]
                                  [--device cpu|cuda] [--json out.json]

Perplexity is the exponential of the mean next-byte cross entropy over fixed windows of the
held-out text; the ratio to bf16's is what each format costs.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import sys
import sysconfig
import tempfile
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)
from gpt import GPT, GPTConfig  # noqa: E402
from step_bench import add_worker_arguments, answered_as_worker, run_worker  # noqa: E402

CONFIG = GPTConfig(vocab=256, dim=128, heads=4, layers=4, context=128)
FORMATS = ["bf16", "int8", "nf4", "fp8", "nvfp4"]
# The same in bf16 compute: the bf16 base, and the fp8 base on FP8 tensor cores (fp8_matmul=True:
# weights requantized per row, inputs per token), each against the other; and that path with
# each call's largest 1% of input channels multiplied in bf16 (outliers=0.01).
VARIANTS = FORMATS + ["bf16/bf16", "fp8/tensor_cores", "fp8/outliers"]
BATCH, SEQ = 16, 128


def corpus() -> dict:
    """Byte tensors: pretrain / held-out (stdlib modules a-m / n-z) and finetune / its
    held-out (the language reference, 80 / 20)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))

    def read(paths, limit):
        data = b"".join(open(p, "rb").read() for p in paths)
        return torch.frombuffer(bytearray(data[:limit]), dtype=torch.uint8).long()

    early = [p for p in files if os.path.basename(p)[0].lower() < "n"]
    late = [p for p in files if os.path.basename(p)[0].lower() >= "n"]
    topics = open(os.path.join(stdlib, "pydoc_data", "topics.py"), "rb").read()
    cut = int(0.8 * len(topics))
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8).long()  # noqa: E731
    return {"pretrain": read(early, 4 << 20), "held_out": read(late, 1 << 20),
            "finetune": as_tensor(topics[:cut]), "finetune_held_out": as_tensor(topics[cut:])}


def batch(data: torch.Tensor, gen: torch.Generator, device: str) -> torch.Tensor:
    starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=gen)
    return torch.stack([data[s:s + SEQ + 1] for s in starts.tolist()]).to(device)


def loss_of(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())


@torch.no_grad()
def perplexity(model: nn.Module, data: torch.Tensor, device: str, windows: int = 96) -> float:
    starts = torch.linspace(0, len(data) - SEQ - 2, windows).long().tolist()
    losses = []
    for i in range(0, windows, BATCH):
        idx = torch.stack([data[s:s + SEQ + 1] for s in starts[i:i + BATCH]]).to(device)
        losses.append(loss_of(model, idx).item() * len(idx))
    return math.exp(sum(losses) / windows)


def pretrain(text: dict, steps: int, device: str) -> dict:
    torch.manual_seed(0)
    model = GPT(CONFIG).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss_of(model, batch(text["pretrain"], gen, device)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    # Each tensor its own copy (the head is tied to the embedding), in bf16 as checkpoints are.
    return {k: v.detach().to(torch.bfloat16).cpu().clone() for k, v in model.state_dict().items()}


class LoRA(nn.Module):
    """A frozen layer plus a trained low-rank update (B starts at zero: the base's output)."""

    def __init__(self, base: nn.Module, r: int = 8, alpha: float = 16.0,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(r, base.in_features, dtype=dtype)
                              / math.sqrt(base.in_features))
        self.b = nn.Parameter(torch.zeros(base.out_features, r, dtype=dtype))
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t() @ self.b.t()) * self.scale


def evaluate(variant: str, case: dict) -> dict:
    """One format ("fmt" computing in fp32; "fmt/bf16", "fp8/tensor_cores" or "fp8/outliers" in
    bf16), in a
    worker process of its own (its connections to the daemon end with it)."""
    import trainstream
    from safetensors import safe_open

    checkpoint, steps, device = case["checkpoint"], case["finetune_steps"], case["device"]
    text = corpus()
    with safe_open(checkpoint, "pt") as f:
        block_linears = [k for k in f.keys()
                         if k.startswith("blocks.") and len(f.get_slice(k).get_shape()) == 2]
    fmt, _, mode = variant.partition("/")
    dtype = torch.bfloat16 if mode else torch.float32
    base = trainstream.load_base(checkpoint, format=fmt, quantize=block_linears, progress=False)
    model = GPT(CONFIG).to(dtype)
    model.requires_grad_(False)
    taken = trainstream.attach_base(model, base, device=device,
                                    fp8_matmul=mode in ("tensor_cores", "outliers"),
                                    outliers=0.01 if mode == "outliers" else 0)
    model.to(device)
    row = {"format": variant, "compute": str(dtype).replace("torch.", ""),
           "quantized_layers": len([n for n in taken["linear"] if n in block_linears]),
           "base_bytes": base.stored_bytes,
           "held_out_ppl": perplexity(model, text["held_out"], device),
           "finetune_ppl_before": perplexity(model, text["finetune_held_out"], device)}
    row["tensor_core_layers"] = sum(
        1 for m in model.modules() if isinstance(m, trainstream.BaseLinear)
        and (m.matmul_choice or {}).get("path") == "scaled_mm")
    for block in model.blocks:
        block.attn.qkv = LoRA(block.attn.qkv, dtype=dtype).to(device)
        block.attn.out = LoRA(block.attn.out, dtype=dtype).to(device)
    torch.manual_seed(2)
    for module in model.modules():
        if isinstance(module, LoRA):
            nn.init.normal_(module.a, std=module.a.shape[1] ** -0.5)
    model, opt = trainstream.wrap(model, lr=1e-3)
    gen = torch.Generator().manual_seed(3)
    began = time.perf_counter()
    for _ in range(steps):
        loss_of(model, batch(text["finetune"], gen, device)).backward()
        opt.step()
        opt.zero_grad()
    row["finetune_s"] = round(time.perf_counter() - began, 1)
    row["finetune_ppl_after"] = perplexity(model, text["finetune_held_out"], device)
    trainstream.unwrap(model)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrain-steps", type=int, default=1000)
    parser.add_argument("--finetune-steps", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--formats", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--timeout", type=int, default=1800)
    add_worker_arguments(parser)
    args = parser.parse_args()
    # A worker is given its case by its parent, through the environment.
    if answered_as_worker(args, evaluate,
                          {"quality": json.loads(os.environ.get("TS_QUALITY_CASE", "{}"))}):
        return
    from bench_daemon import private_daemon
    from safetensors.torch import save_file

    text = corpus()
    print(f"text: pretrain {len(text['pretrain']) / 1e6:.1f} MB of stdlib modules a-m, held out "
          f"{len(text['held_out']) / 1e6:.1f} MB (n-z); fine-tune "
          f"{len(text['finetune']) / 1e6:.2f} MB of the language reference, held out "
          f"{len(text['finetune_held_out']) / 1e6:.2f} MB", flush=True)
    began = time.perf_counter()
    weights = pretrain(text, args.pretrain_steps, args.device)
    print(f"pretrained {args.pretrain_steps} steps in {time.perf_counter() - began:.0f} s "
          f"({sum(v.numel() for v in weights.values()) / 1e6:.2f}M parameters)", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as folder, private_daemon("2G") as socket:
        checkpoint = os.path.join(folder, "model.safetensors")
        save_file(weights, checkpoint)
        os.environ["TS_QUALITY_CASE"] = json.dumps(
            {"checkpoint": checkpoint, "finetune_steps": args.finetune_steps,
             "device": args.device})
        for fmt in args.formats:
            row = run_worker(os.path.abspath(__file__), fmt, "quality", socket, args.timeout)
            if row.get("failed"):
                print(f"{fmt:16s} failed: {row['stderr'][-800:]}", flush=True)
                continue
            rows.append(row)
            # Against the bf16 base computing in the same precision.
            same = "bf16/bf16" if "/" in fmt else "bf16"
            ref = next((r for r in rows if r["format"] == same), row)
            print(f"{fmt:16s} held-out ppl {row['held_out_ppl']:.3f} "
                  f"({row['held_out_ppl'] / ref['held_out_ppl']:.4f}x {same}); language reference "
                  f"{row['finetune_ppl_before']:.3f} -> {row['finetune_ppl_after']:.3f} after "
                  f"{args.finetune_steps} LoRA steps "
                  f"({row['finetune_ppl_after'] / ref['finetune_ppl_after']:.4f}x {same}'s); "
                  f"{row['quantized_layers']} layers from a {row['base_bytes'] / 1e6:.2f} MB base",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "quant_quality", "date": time.strftime("%Y-%m-%d"),
                       "host": platform.node(), "device": args.device, "torch": torch.__version__,
                       "python": platform.python_version(), "config": vars(CONFIG),
                       "pretrain_steps": args.pretrain_steps,
                       "finetune_steps": args.finetune_steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
