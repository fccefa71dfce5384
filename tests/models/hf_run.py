# SPDX-License-Identifier: Apache-2.0
"""One engine training one Hugging Face model of examples/hf_models.py, in a process of its
own (a VRAM cap applies to the whole process), printing a JSON line: each step's loss, peak
allocated and reserved VRAM, VRAM held between steps, for wrap() the plan's state, and where
the process's time went. ``--engine stock_pair`` trains the model twice in one process, with
torch's fused and its foreach AdamW (the two stock runs a tolerance is measured from), and
prints one line for each.

    python hf_run.py --preset small-qwen2 --tune full --engine wrap --cap-gib 2.5 --steps 60
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

STARTED = time.perf_counter()
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
import hf_models  # noqa: E402


def train(args, engine: str) -> dict:
    """Builds the model afresh (the same seed each time) and trains it with one engine."""
    began = time.perf_counter()
    dtype = torch.float32 if args.tune == "full" else torch.bfloat16
    wrapped = engine == "wrap"
    model, _ = hf_models.build(args.preset, args.tune, dtype,
                               device="cpu" if wrapped else "cuda", init_device="cuda")
    torch.cuda.empty_cache()
    if args.cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.cap_gib * 2**30 / total, 0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                            fused=engine == "stock", foreach=engine != "stock")
    built = time.perf_counter()
    session = None
    if wrapped:
        import trainstream

        model, opt = trainstream.wrap(model, opt, device="cuda")
        session = model._trainstream_session
    wrapped_at = time.perf_counter()
    if args.memory_peak:
        # Every allocation from here on with its Python stack: what was live at the peak, and
        # at an out-of-memory error, by the code that allocated it.
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                        "..", "bench"))
        import memory_peak

        memory_peak.start(entries=2_000_000)
    out = {"engine": engine, "losses": [], "peak_allocated": [], "peak_reserved": [],
           "held": [], "settled_at": None, "error": None}
    try:
        for s in range(args.steps):
            x = hf_models.batch(args.preset, args.batch, args.seq, s, "cuda")
            torch.cuda.reset_peak_memory_stats()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bool(args.autocast)):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            allocated = torch.cuda.max_memory_allocated()
            reserved = torch.cuda.max_memory_reserved()
            opt.step()
            opt.zero_grad()
            out["losses"].append(loss.item())
            out["peak_allocated"].append(max(allocated, torch.cuda.max_memory_allocated()))
            out["peak_reserved"].append(max(reserved, torch.cuda.max_memory_reserved()))
            out["held"].append(torch.cuda.memory_allocated())
            if session is not None and out["settled_at"] is None and not session.adapting:
                out["settled_at"] = s + 1
    except torch.OutOfMemoryError as e:
        out["error"] = f"out of memory at step {len(out['losses'])}: {str(e)[:300]}"
    except Exception as e:  # any other failure is reported the same way, with where it rose
        where = traceback.format_exc(limit=-3)[-1200:]
        out["error"] = f"{type(e).__name__} at step {len(out['losses'])}: {str(e)[:300]}\n{where}"
    out["nonfinite"] = sum(not math.isfinite(v) for v in out["losses"])
    if args.memory_peak:
        out["memory_peak"] = memory_peak.report(top=25)
    if session is not None:
        out["events"] = [(e["kind"], e["message"][:300]) for e in session.events]
        import trainstream

        trainstream.unwrap(model)
    out["seconds"] = {"build": round(built - began, 2), "wrap": round(wrapped_at - built, 2),
                      "steps": round(time.perf_counter() - wrapped_at, 2)}
    del model, opt
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", required=True)
    parser.add_argument("--tune", default="full")
    parser.add_argument("--engine", default="wrap",
                        choices=["stock", "stock_foreach", "stock_pair", "wrap"])
    parser.add_argument("--cap-gib", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--autocast", type=int, default=1)
    parser.add_argument("--memory-peak", action="store_true",
                        help="say what was live at the peak (and at an out-of-memory error) "
                             "by the code that allocated it (bench/memory_peak.py)")
    args = parser.parse_args()
    engines = ["stock", "stock_foreach"] if args.engine == "stock_pair" else [args.engine]
    for engine in engines:
        out = train(args, engine)
        out["seconds"]["imports"] = IMPORTS_S  # torch and transformers, once a process
        print(json.dumps(out), flush=True)


IMPORTS_S = round(time.perf_counter() - STARTED, 2)

if __name__ == "__main__":
    main()
