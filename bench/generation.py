# SPDX-License-Identifier: Apache-2.0
"""Generation with a long context through ``TrainStreamCache`` (half the layers' keys and values
in the daemon's pinned pages) against transformers' own ``DynamicCache`` (all in VRAM) and its
offloaded ``DynamicCache(offloading=True)``: new tokens a second and the VRAM the cache took,
each engine in a fresh process, greedy decoding of the same prompt, the outputs compared.

    python bench/generation.py [--cases qwen7b_8k ...] [--modes dynamic offloaded trainstream]
        [--json out.json]

A case's bound: the bytes each new token must bring from host memory (the offloaded layers'
keys and values) over the pinned copy bandwidth measured in the same run. On a machine without
a GPU, ``--cases tiny`` runs the tiny Llama on the CPU (timings that do not count).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from step_bench import (add_worker_arguments, answered_as_worker, run_worker,  # noqa: E402
                        write_results)

CASES = {
    "qwen7b_8k": dict(preset="qwen2.5-7b", prompt=8192, new=128, batch=1),
    "llama8b_16k": dict(preset="llama-3.1-8b", prompt=16384, new=128, batch=1),
    "tiny": dict(preset="tiny-llama", prompt=96, new=16, batch=2),
}
# "_auto": transformers' DynamicCache with the decoding kernel TrainStreamCache's
# attention="auto" picks (DecodeAttention); "trainstream_pytorch": ours with PyTorch's pick.
MODES = ("dynamic", "dynamic_auto", "offloaded", "trainstream", "trainstream_pytorch",
         "trainstream_resident")
# TS_BENCH_PROFILE=1: each engine's decoding also runs under torch.profiler and cProfile (the
# ops and the Python functions that took the most time, in the row and printed).
PROFILE = os.environ.get("TS_BENCH_PROFILE") == "1"


def host_syncs(run) -> list:
    """The calls that made the CPU wait for the GPU while ``run()`` decoded (torch's sync debug
    mode, one warning each, counted by where they came from): a wait per token or layer takes
    away the CPU's run-ahead, which a decoding loop bound by its operator calls lives on."""
    import collections
    import warnings

    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    where = collections.Counter(f"{os.path.basename(w.filename)}:{w.lineno} {str(w.message)[:80]}"
                                for w in caught)
    return [f"{count} x {site}" for site, count in where.most_common(8)]


class TokenClock:
    """A stopping criterion that never stops: it notes when ``generate`` finished each token.
    transformers' own criteria already wait for the GPU there, so the marks are the tokens'."""

    def __init__(self):
        self.marks = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.marks.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def token_spread(gaps: list) -> dict:
    """How a decode's time is spread over its tokens: the median and the slowest, and the mean
    of the first and the last quarter (a decode that slows as it goes shows there)."""
    if not gaps:
        return {}
    ordered = sorted(gaps)
    quarter = max(1, len(gaps) // 4)
    ms = lambda v: round(v * 1e3, 2)  # noqa: E731
    return {"median": ms(ordered[len(ordered) // 2]), "p90": ms(ordered[int(len(ordered) * 0.9)]),
            "max": ms(ordered[-1]), "first_quarter": ms(sum(gaps[:quarter]) / quarter),
            "last_quarter": ms(sum(gaps[-quarter:]) / quarter), "count": len(gaps)}


def worker(mode: str, case: dict) -> dict:
    import hf_models
    import transformers

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model, _ = hf_models.build(case["preset"], "full", torch.bfloat16 if cuda else torch.float32,
                               device=device, init_device=device)
    model.eval()
    prompt = hf_models.batch(case["preset"], case["batch"], case["prompt"], 0, device)
    total = case["prompt"] + case["new"]
    layers = model.config.num_hidden_layers
    chooser = None
    if mode == "dynamic_auto":
        from trainstream.integrations.decode_attention import DecodeAttention

        chooser = DecodeAttention("auto")
        chooser.install(model)
    if mode.startswith("trainstream"):
        from trainstream.integrations.huggingface import TrainStreamCache

        # "trainstream_resident": every layer in VRAM, what the cache costs without paging.
        ours = TrainStreamCache(model, max_tokens=total,
                                resident_layers=layers if mode.endswith("resident")
                                else layers // 2,
                                attention=None if mode.endswith("pytorch") else "auto")
        chooser = ours._decode_attention

    def fresh_cache():
        # transformers' caches are made anew for each prompt (reset() keeps their length on
        # some versions); ours keeps its pages and slots across reset().
        if mode.startswith("dynamic"):
            return transformers.DynamicCache(config=model.config)
        if mode == "offloaded":
            return transformers.DynamicCache(config=model.config, offloading=True)
        ours.reset()
        return ours
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    weights = torch.cuda.memory_allocated() if cuda else 0
    clock = TokenClock()

    def timed(new_tokens: int) -> tuple:
        cache = fresh_cache()
        if cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        clock.marks = [began]
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, past_key_values=cache,
                             stopping_criteria=transformers.StoppingCriteriaList([clock]))
        if cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - began

    with torch.no_grad():
        # Warm: kernels chosen, the cache's memory taken, and a first decoding step, where
        # attention="auto" times its candidates (once a cache: not in the rows' figures).
        timed(2)
        first, prefill = timed(1)
        out, whole = timed(case["new"])
        gaps = [b - a for a, b in zip(clock.marks[1:], clock.marks[2:])]
        # The same lengths again: what each new length cost the first time (cuDNN's plan for
        # it, built once and cached) is gone from this one.
        _, again = timed(case["new"])
    row = {"mode": mode, **case, "tokens": out[0, -case["new"]:].tolist()[:32],
           "first_token": int(first[0, -1]), "prefill_s": round(prefill, 4),
           "decode_tokens_per_s": round(case["batch"] * (case["new"] - 1)
                                        / max(1e-9, whole - prefill), 2),
           "peak_over_weights_gib": round((torch.cuda.max_memory_allocated() - weights) / 2**30, 3)
           if cuda else 0.0,
           "decode_again_tokens_per_s": round(case["batch"] * (case["new"] - 1)
                                              / max(1e-9, again - prefill), 2),
           "token_ms": token_spread(gaps),
           "attention": chooser.report() if chooser is not None else None}
    if PROFILE:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with torch.no_grad(), profile(activities=activities) as prof:
            timed(16)
        row["profile"] = prof.key_averages().table(
            sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=18)
        row["profile_cpu"] = prof.key_averages().table(sort_by="self_cpu_time_total",
                                                       row_limit=18)
        from step_bench import python_profile

        with torch.no_grad():
            row["profile_python"] = python_profile(lambda: timed(16))
        if cuda:
            row["host_syncs"] = host_syncs(lambda: timed(4))
    if mode.startswith("trainstream"):
        row["memory"] = ours.kv.memory()
        row["stats"] = dict(ours.kv.stats)
        ours.kv.close()
    return row


def _agreement(tokens: list, reference: list) -> int:
    """How many tokens ``tokens`` shares with ``reference`` before they first differ."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(reference))


def _kernel(row: dict):
    """The decoding attention a row ran: the kernel attention="auto" chose, or None for
    PyTorch's own pick."""
    backend = (row.get("attention") or {}).get("backend")
    return None if backend == "default" else backend


def _same_kernel(by_mode: dict, row: dict) -> str | None:
    """The DynamicCache mode (all in VRAM) that decoded with the same kernel as ``row``."""
    return next((mode for mode in ("dynamic", "dynamic_auto") if mode in by_mode
                 and not by_mode[mode].get("failed") and _kernel(by_mode[mode]) == _kernel(row)),
                None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["qwen7b_8k"], choices=list(CASES))
    parser.add_argument("--timeout", type=int, default=900)
    add_worker_arguments(parser)
    args = parser.parse_args()
    if answered_as_worker(args, worker, CASES):
        return
    bandwidth = None
    if torch.cuda.is_available():
        from step_bench import pinned_bandwidth

        bandwidth = pinned_bandwidth()
        print(f"pinned copies: host->device {bandwidth['h2d_gbps']} GB/s", flush=True)
    rows = []
    for name in args.cases:
        by_mode = {}
        # transformers' offloaded cache copies on CUDA streams: a GPU's alone.
        for mode in [m for m in args.modes or MODES
                     if torch.cuda.is_available() or m != "offloaded"]:
            row = run_worker(__file__, mode, name, None, args.timeout)
            row["case"] = name
            by_mode[mode] = row
            rows.append(row)
        print(f"\n== {name}: {CASES[name]}")
        reference = by_mode.get("dynamic", {}).get("tokens")
        for mode, row in by_mode.items():
            if row.get("failed"):
                print(f"  {mode:12s} failed: {row.get('stderr', '').strip().splitlines()[-1:]}")
                continue
            same = ""
            if reference is not None:
                # Random weights leave near ties between tokens: kernels that sum in another
                # order (a strided slot, cuDNN's attention against flash) may part ways early.
                # So a row is also compared with DynamicCache under its own decoding kernel.
                same = f", first {_agreement(row['tokens'], reference)} of {len(reference)} " \
                       "tokens as DynamicCache's"
                twin = _same_kernel(by_mode, row)
                if twin and twin not in ("dynamic", mode):
                    same += (f", {_agreement(row['tokens'], by_mode[twin]['tokens'])} as "
                             f"{twin}'s (the same decoding kernel)")
            if row.get("profile"):
                print(row["profile"] + "\n" + row["profile_cpu"] + "\n"
                      + row.get("profile_python", ""))
            if row.get("host_syncs") is not None:
                print(f"  {mode} waited for the GPU {len(row['host_syncs'])} ways in 4 tokens: "
                      + ("; ".join(row["host_syncs"]) or "none"))
            print(f"  {mode:12s} {row['decode_tokens_per_s']:9.2f} new tokens/s, prefill "
                  f"{row['prefill_s']:.3f} s, VRAM over the weights "
                  f"{row['peak_over_weights_gib']:.2f} GiB{same}")
            print(f"  {'':12s} the same lengths again: {row['decode_again_tokens_per_s']:.2f} new "
                  "tokens/s")
            if row.get("attention"):
                print(f"  {'':12s} decoding attention: {row['attention']['backend']} "
                      f"({row['attention']['note'] or row['attention']['mode']})")
            if row.get("token_ms"):
                spread = row["token_ms"]
                print(f"  {'':12s} ms a decoded token: median {spread['median']}, p90 "
                      f"{spread['p90']}, max {spread['max']}; first quarter "
                      f"{spread['first_quarter']}, last {spread['last_quarter']}")
        ours = by_mode.get("trainstream", {})
        if bandwidth and "memory" in ours:
            # Each new token reads every offloaded layer's keys and values back once: the
            # pages, at the context's end.
            per_token = ours["memory"]["host_page_bytes"]
            bound = per_token / (bandwidth["h2d_gbps"] * 1e9)
            print(f"  bound: {per_token / 2**30:.2f} GiB over PCIe a token at "
                  f"{bandwidth['h2d_gbps']} GB/s = {1 / bound:.1f} tokens/s at most (batch 1)")
    if args.json:
        write_results(args.json, "generation", rows, bandwidth=bandwidth)


if __name__ == "__main__":
    main()
