# SPDX-License-Identifier: Apache-2.0
"""trainstream against what people already run to fit a model under a VRAM cap: each engine in
a fresh process, on the same Hugging Face model (a published config, random weights, from
examples/hf_models.py), the same batches, the same LoRA (PEFT, r=16, alpha 32, every attention
and MLP projection), the same learning rate and loop, and the same per-process VRAM cap
(24 GiB, torch.cuda.set_per_process_memory_fraction):

  loss = model(input_ids=x, labels=x).loss; (loss / accumulation).backward(); ...; opt.step()

Engines (--modes; "_ckpt": the same with the model's own gradient checkpointing,
model.gradient_checkpointing_enable(use_reentrant=False), as a user under a cap turns it on):

  stock        no cap: the model on the GPU, torch's fused AdamW (the reference losses)
  stock_cap    the same under the cap
  stock_ckpt   the same under the cap with gradient checkpointing
  wrap         trainstream.wrap(model, opt, device="cuda"), every other option at its default
  wrap_rc      the same with recompute=True, activation_offload=False
  wrap_nf4     the same as wrap with quantize="nf4" (the NF4 cases)
  wrap_nf4_resident  the same with param_offload=False: every NF4 block stays in VRAM
  ts041        TrainStream 0.4.1 (PyPI), quantize="none", imported from its own folder (--ts041)
  ts041_nf4    the same with quantize="nf4" (the NF4 cases)
  bnb[_ckpt]   bitsandbytes QLoRA: every Linear of the decoder blocks replaced by an NF4
               bnb.nn.Linear4bit (compute bf16, no double quantization: what
               BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
               bnb_4bit_compute_dtype=torch.bfloat16) loads), then PEFT's
               prepare_model_for_kbit_training and get_peft_model, as users do (the NF4 cases)
  ds2[_ckpt]   DeepSpeed ZeRO-2, optimizer offloaded to the CPU (DeepSpeedCPUAdam), bf16,
               one process without the launcher (RANK=0, WORLD_SIZE=1, deepspeed.initialize)
  ds3[_ckpt]   DeepSpeed ZeRO-3, parameters and optimizer offloaded to the CPU, bf16 (the model
               partitioned by deepspeed.zero.Init(module=...) before deepspeed.initialize)
  ao[_ckpt]    torchao.optim.CPUOffloadOptimizer(params, torch.optim.AdamW,
               offload_gradients=True unless the case accumulates) (full fine-tunes)
  fsdp2[_ckpt] FSDP2 fully_shard of every decoder block and the root with CPUOffloadPolicy(),
               world size 1 over cpu:gloo,cuda:nccl (bf16 MixedPrecisionPolicy where the case
               runs under autocast), torch's AdamW on the CPU

An engine that does not apply to a case, or that needs CUDA on a CPU run, gets a row saying
so. Bf16-base engines are compared with each other, NF4-base engines (bnb, wrap_nf4,
ts041_nf4) with each other; stock runs on every case as the reference (on the NF4 cases it is
the bf16 model: their losses differ by the quantization).

Every row records the engine and its version, each step's loss, each step's time, the step
time (median after warm-up; for wrap() rows, after its memory plan settles, as hf_models.py
detects it: the first step after which the session no longer adapts), the peak VRAM of the
whole run after the model is built (max_memory_allocated and max_memory_reserved, readings
kept across every reset of the peak counters), and for a row that did not train, its status
(oom, refused, import_error, not_applicable, needs_cuda, timeout, crashed, error, skipped)
and reason. The table gives, for each case, the fastest other engine that fits under the cap
and our step's ratio to it, and the lower bound of wrap() rows: max(stock's step in the same
run, the bytes wrap() moved over PCIe a step / the pinned bandwidth measured in the same run,
and for full fine-tunes the host pass: 16 bytes a trained parameter, its fp32 moments read and
written once, / the host memory bandwidth measured in the same run).

Peers are imported from their own folders, prepended to sys.path only in their engine's
process: --peers DIR holds bnb/, ds/ and ao/ (wheels, unpacked by this script into a
temporary folder, or folders already unpacked with pip install --target), --ts041 the
unpacked 0.4.1 sdist (scripts/fetch_peers.sh fetches both).

    python bench/compare.py [--cases llama8b_lora_4k ...] [--modes stock wrap ...]
        [--steps 20] [--warmup 3] [--peer-steps 8] [--json out.json] [--peers .whl]
        [--ts041 .peers/trainstream-0.4.1] [--timeout 900] [--deadline-s 560]
    python bench/compare.py --tiny [--device cpu|cuda] ...   (tiny models: a self-check)
    python bench/compare.py --report a.json b.json           (one table from several runs)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import hashlib
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "examples"))

VRAM_CAP_GIB = 24

# The issue's cases: the preset, full fine-tune or LoRA, the weights' dtype, bf16 autocast,
# batch x sequence, backward passes per step, the base engines compare on ("bf16" or "nf4"),
# the learning rate, and the tiny preset of the same family for --tiny.
CASES = {
    "llama8b_lora_4k": dict(preset="llama-3.1-8b", tune="lora", dtype="bfloat16",
                            autocast=False, batch=1, seq=4096, accum=1, kind="bf16", lr=1e-4,
                            tiny="tiny-llama"),
    "mistral7b_lora_1k_ga4": dict(preset="mistral-7b", tune="lora", dtype="bfloat16",
                                  autocast=False, batch=1, seq=1024, accum=4, kind="bf16",
                                  lr=1e-4, tiny="tiny-mistral"),
    "gemma2b_full": dict(preset="gemma-2-2b", tune="full", dtype="float32", autocast=True,
                         batch=2, seq=1024, accum=1, kind="bf16", lr=2e-5, tiny="tiny-gemma2"),
    "qwen1.5b_full": dict(preset="qwen2.5-1.5b", tune="full", dtype="float32", autocast=True,
                          batch=4, seq=512, accum=1, kind="bf16", lr=2e-5, tiny="tiny-qwen2"),
    "qwen14b_nf4_512": dict(preset="qwen2.5-14b", tune="lora", dtype="bfloat16",
                            autocast=False, batch=1, seq=512, accum=1, kind="nf4", lr=1e-4,
                            tiny="tiny-qwen2"),
    "qwen14b_nf4_2k": dict(preset="qwen2.5-14b", tune="lora", dtype="bfloat16", autocast=False,
                           batch=1, seq=2048, accum=1, kind="nf4", lr=1e-4, tiny="tiny-qwen2"),
    "phi3_lora_2k": dict(preset="phi-3-mini", tune="lora", dtype="bfloat16", autocast=False,
                         batch=2, seq=2048, accum=1, kind="bf16", lr=1e-4, tiny="tiny-phi3"),
    "qwen14b_lora_512": dict(preset="qwen2.5-14b", tune="lora", dtype="bfloat16",
                             autocast=False, batch=1, seq=512, accum=1, kind="bf16", lr=1e-4,
                             tiny="tiny-qwen2"),
    "qwen14b_lora_2k": dict(preset="qwen2.5-14b", tune="lora", dtype="bfloat16",
                            autocast=False, batch=1, seq=2048, accum=1, kind="bf16", lr=1e-4,
                            tiny="tiny-qwen2"),
    # Issue 49's 8B full fine-tunes: bf16 weights (an fp32 8B is 32 GB in the worker before
    # any engine takes it), every weight trained; host memory decides who can run them.
    "llama8b_full_4k": dict(preset="llama-3.1-8b", tune="full", dtype="bfloat16",
                            autocast=False, batch=1, seq=4096, accum=1, kind="bf16", lr=2e-5,
                            tiny="tiny-llama", host_bytes_per_parameter=True),
    "llama8b_full_4x1k": dict(preset="llama-3.1-8b", tune="full", dtype="bfloat16",
                              autocast=False, batch=4, seq=1024, accum=1, kind="bf16", lr=2e-5,
                              tiny="tiny-llama", host_bytes_per_parameter=True),
    # Issue 49's largest: 72B in NF4 (about 40 GB) under the 24 GiB cap. random_base: built
    # layer by layer (load_model(random_weights=True)), never whole in bf16, for the engines
    # that take a quantized base; the others need the bf16 model in host memory first.
    "qwen72b_nf4_2k": dict(preset="qwen2.5-72b", tune="lora", dtype="bfloat16",
                           autocast=False, batch=1, seq=2048, accum=1, kind="nf4", lr=1e-4,
                           tiny="tiny-qwen2", random_base=True),
}
TINY_SEQ = 32

# engine: what builds and trains; kind: the bases it compares on ("any": stock, the reference);
# peer: the --peers subfolder its process imports from; ours: a trainstream (main) row.
MODES = {
    "stock": dict(engine="stock", kind="any", capped=False),
    "stock_cap": dict(engine="stock", kind="bf16"),
    "stock_ckpt": dict(engine="stock", kind="bf16", ckpt=True),
    "wrap": dict(engine="wrap", kind="bf16", ours=True),
    "wrap_rc": dict(engine="wrap", kind="bf16", ours=True,
                    options=dict(recompute=True, activation_offload=False)),
    "wrap_nf4": dict(engine="wrap", kind="nf4", ours=True, options=dict(quantize="nf4")),
    # Every NF4 block kept in VRAM (before quantized blocks streamed, the only plan): what
    # streaming them must beat when activations get the VRAM they free.
    "wrap_nf4_resident": dict(engine="wrap", kind="nf4", ours=True,
                              options=dict(quantize="nf4", param_offload=False)),
    # The compute of a case too large for any engine to hold resident (random_base cases):
    # the first 8 and 16 of its layers, all in VRAM, nothing paged or recomputed; the whole
    # model's compute is extrapolated from the two (constant parts cancel). References for
    # the bound, never engines to beat.
    "slice8": dict(engine="wrap", kind="nf4", reference=True, layers=8, random_only=True,
                   options=dict(param_offload=False, activation_offload=False,
                                recompute=False)),
    "slice16": dict(engine="wrap", kind="nf4", reference=True, layers=16, random_only=True,
                    options=dict(param_offload=False, activation_offload=False,
                                 recompute=False)),
    "ts041": dict(engine="ts041", kind="bf16", cuda=True, slow=True),
    "ts041_nf4": dict(engine="ts041", kind="nf4", cuda=True, slow=True),
    "bnb": dict(engine="bnb", kind="nf4", peer="bnb"),
    "bnb_ckpt": dict(engine="bnb", kind="nf4", peer="bnb", ckpt=True),
    "ds2": dict(engine="ds2", kind="bf16", peer="ds", cuda=True),
    "ds2_ckpt": dict(engine="ds2", kind="bf16", peer="ds", cuda=True, ckpt=True),
    "ds3": dict(engine="ds3", kind="bf16", peer="ds", cuda=True, slow=True),
    "ds3_ckpt": dict(engine="ds3", kind="bf16", peer="ds", cuda=True, slow=True, ckpt=True),
    "ao": dict(engine="ao", kind="bf16", peer="ao", cuda=True, full_only=True),
    "ao_ckpt": dict(engine="ao", kind="bf16", peer="ao", cuda=True, full_only=True, ckpt=True),
    "fsdp2": dict(engine="fsdp2", kind="bf16", cuda=True, slow=True),
    "fsdp2_ckpt": dict(engine="fsdp2", kind="bf16", cuda=True, slow=True, ckpt=True),
}
# What a row says of its run ("ok": it trained every step).
STATUSES = ("ok", "oom", "refused", "import_error", "not_applicable", "needs_cuda", "timeout",
            "crashed", "error", "skipped")


def applies(mode: str, case: dict, device: str, tiny: bool = False) -> tuple[str, str] | None:
    """(status, reason) when ``mode`` does not run ``case`` on ``device``; None when it does."""
    spec = MODES[mode]
    if spec.get("random_only") and not case.get("random_base"):
        return ("not_applicable", "a compute slice of a model too large to hold resident "
                "(the random_base cases)")
    if spec["kind"] == "nf4" and case["kind"] != "nf4":
        if case["tune"] == "full":
            return ("not_applicable", "an NF4-base engine on a full fine-tune: 4-bit weights "
                    "do not train, and every weight trains here")
        return ("not_applicable", "an NF4-base engine on a bf16-base case (NF4 engines are "
                "compared on the *_nf4 cases)")
    if spec["kind"] == "bf16" and case["kind"] == "nf4":
        return ("not_applicable", "a bf16-base engine on an NF4-base case (its bf16 "
                "counterpart is the qwen14b_lora_* case)")
    if spec.get("full_only") and case["tune"] != "full":
        return ("not_applicable", "CPUOffloadOptimizer moves only optimizer state off the GPU: "
                "a LoRA run's is its adapters' (megabytes) and the base stays on the GPU, "
                "which is stock_cap's row")
    if device != "cuda" and spec.get("cuda"):
        return ("needs_cuda", f"{spec['engine']} needs a CUDA GPU; this run is on the CPU")
    if case.get("random_base") and not tiny and not (spec["engine"] == "wrap"
                                                     and case["kind"] == "nf4"):
        # Every other engine builds the bf16 model first (bitsandbytes quantizes it on the
        # GPU, DeepSpeed partitions it from host memory): say so when it cannot hold it.
        need, have = _bf16_bytes(case["preset"]), _host_memory_bytes()
        room = have if spec["engine"] != "bnb" else _gpu_memory_bytes() or have
        if need > 0.9 * room:
            where = "GPU" if spec["engine"] == "bnb" and _gpu_memory_bytes() else "host"
            return ("refused", f"the bf16 model ({need / 1e9:.0f} GB) does not fit this "
                    f"machine's {where} memory ({room / 1e9:.0f} GB), which "
                    f"{spec['engine']} builds it in before it quantizes or partitions it")
    if case.get("host_bytes_per_parameter") and not tiny and device == "cuda":
        # A full fine-tune whose optimizer state lives in host memory: an engine that pins
        # more than the machine has is refused here, with the numbers, rather than left to
        # the kernel's OOM killer (which may take the daemon with it).
        per = _PEER_HOST_BYTES_PER_PARAMETER.get(spec["engine"])
        if per:
            need, have = per * _parameter_count(case["preset"]), _host_memory_bytes()
            if need > 0.9 * have:
                return ("refused", f"{spec['engine']} holds about {per} bytes a parameter in "
                        f"host memory for a full fine-tune: {need / 1e9:.0f} GB, over 90% of "
                        f"this machine's {have / 1e9:.0f} GB")
    return None


# Host memory a full fine-tune pins per parameter, by engine (our estimate, not a measurement):
# the fp32 master weights and both moments (12 bytes), plus the bf16 gradient buffers (ZeRO-2)
# and parameter copies (ZeRO-3, FSDP2) each keeps there.
_PEER_HOST_BYTES_PER_PARAMETER = {"ds2": 14, "ds3": 16, "ao": 12, "fsdp2": 16}


def _parameter_count(preset: str) -> int:
    return _bf16_bytes(preset) // 2


@functools.cache
def _bf16_bytes(preset: str) -> int:
    """Bytes of ``preset``'s weights in bf16, from a model built on the meta device (once a
    preset: a 72B model takes seconds to build even there, and each refused tool asks)."""
    import torch

    import hf_models

    with torch.device("meta"):
        model, _ = hf_models.build(preset, "full", torch.bfloat16, device="meta",
                                   init_device="meta")
    return sum(p.numel() * 2 for p in model.parameters())


def _host_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))


def _gpu_memory_bytes() -> int:
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0


# ---------------------------------------------------------------------------------------------
# The worker: one engine, one case, in a process of its own.
# ---------------------------------------------------------------------------------------------

class _Peaks:
    """The whole run's peak VRAM: torch's counters, plus what they held before every
    reset_peak_memory_stats() (wrap()'s memory plan resets them while it measures)."""

    def __init__(self, torch, cuda: bool):
        self.torch, self.cuda = torch, cuda
        self.allocated = self.reserved = 0
        if not cuda:
            return
        original = torch.cuda.reset_peak_memory_stats

        def reset(*args, **kwargs):
            self.fold()
            return original(*args, **kwargs)

        torch.cuda.reset_peak_memory_stats = reset
        torch.cuda.memory.reset_peak_memory_stats = reset
        self._original = original

    def fold(self) -> None:
        if self.cuda:
            self.allocated = max(self.allocated, self.torch.cuda.max_memory_allocated())
            self.reserved = max(self.reserved, self.torch.cuda.max_memory_reserved())

    def start(self) -> None:
        """From here on (the model built, the cap set)."""
        if self.cuda:
            self._original()
            self.allocated = self.reserved = 0

    def gib(self) -> tuple:
        self.fold()
        return (round(self.allocated / 2**30, 2), round(self.reserved / 2**30, 2))


def _blocks(model):
    """The repeated decoder layers: the ModuleList holding the most parameters."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def _lora_config(preset: str):
    import hf_models
    from peft import LoraConfig

    # examples/hf_models.build()'s LoRA, exactly.
    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                      target_modules=list(hf_models.PRESETS[preset].lora_targets))


def _random_nf4_base(preset: str, dtype, device: str, row: dict, layers: int | None = None):
    """A random NF4 base of ``preset`` (its first ``layers`` decoder layers, or all) with
    examples/hf_models.build()'s LoRA, drawn a layer at a time into the daemon's memory
    (load_model(random_weights=True)), its quantized bytes kept there (keep_on_host): wrap()
    then streams the blocks that do not fit."""
    import trainstream
    from peft import get_peft_model

    import hf_models

    folder = tempfile.mkdtemp(prefix="compare-config-")
    config = hf_models.config_of(preset)
    if layers:
        config.num_hidden_layers = layers
        total = hf_models.PRESETS[preset].config["num_hidden_layers"]
        row["notes"].append(f"the first {layers} of {total} layers")
    config.save_pretrained(folder)
    model = trainstream.load_model(folder, quantize="nf4", device=device, dtype=dtype,
                                   keep_on_host=True, random_weights=True)
    base = model._trainstream_random_base
    row["notes"].append(f"random NF4 base: {base.stored_bytes / 1e9:.1f} GB drawn and quantized "
                        f"in {base.seconds:.0f} s into the daemon's memory")
    shutil.rmtree(folder, ignore_errors=True)
    return get_peft_model(model, _lora_config(preset))


def _to_nf4(model, device: str, notes: list) -> None:
    """Every nn.Linear of the decoder blocks becomes a bnb.nn.Linear4bit holding its weights
    in NF4 (blocks of 64, no double quantization, compute in bf16: what transformers' loader
    makes of BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    bnb_4bit_compute_dtype=torch.bfloat16); the embeddings and the head stay as they are, as
    the loader keeps lm_head). Quantized on ``device`` layer by layer."""
    import bitsandbytes as bnb
    import torch

    count = 0
    for block in _blocks(model):
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear:
                    continue
                with torch.device("meta"):
                    layer = bnb.nn.Linear4bit(child.in_features, child.out_features,
                                              bias=child.bias is not None,
                                              compute_dtype=torch.bfloat16,
                                              compress_statistics=False, quant_type="nf4",
                                              quant_storage=torch.uint8)
                layer.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False,
                                                 compress_statistics=False, quant_type="nf4",
                                                 quant_storage=torch.uint8,
                                                 module=layer).to(device)
                if child.bias is not None:
                    layer.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
                layer.train(child.training)
                setattr(parent, name, layer)
                count += 1
    # What transformers sets on a model it loaded in 4 bits; PEFT reads it.
    model.is_loaded_in_4bit = True
    notes.append(f"{count} decoder Linear layers as bnb Linear4bit nf4 (blocksize 64, no "
                 "double quant, compute bf16); embeddings and lm_head unquantized")


def _ds_config(case: dict, stage: int) -> dict:
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True, "contiguous_gradients": True}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": case["batch"],
            "gradient_accumulation_steps": case["accum"],
            "bf16": {"enabled": True},
            # torch.optim.AdamW's defaults, as the other engines run it.
            "optimizer": {"type": "AdamW", "params": {"lr": case["lr"], "betas": [0.9, 0.999],
                                                       "eps": 1e-8, "weight_decay": 0.01}},
            "zero_optimization": zero, "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False}


def _pcie_bytes(model) -> tuple:
    """Bytes wrap() moved over PCIe since it began (to the GPU, back), as memory_report()
    counts them."""
    import trainstream

    pcie = trainstream.memory_report(model)["pcie"]
    return int(pcie["to_device_bytes"]), int(pcie["to_host_bytes"])


def _save(row: dict, path: str) -> None:
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(row, f)
    os.replace(tmp, path)


def _classify(e: BaseException) -> str:
    text = f"{type(e).__name__} {e}".lower()
    if isinstance(e, ImportError):
        return "import_error"
    if "outofmemory" in text or "out of memory" in text:
        return "oom"
    if isinstance(e, MemoryError) or type(e).__name__ == "MemoryPlanError":
        return "refused"  # a plan that said, up front, that it cannot fit
    return "error"


def _worker(args) -> dict:
    mode, spec = args.worker, MODES[args.worker]
    case = dict(CASES[args.case])
    preset = case["tiny"] if args.tiny else case["preset"]
    if args.tiny:
        case.update(batch=min(case["batch"], 2), seq=TINY_SEQ)
    row: dict = {"mode": mode, "case": args.case, "preset": preset, "tiny": args.tiny,
                 "device": args.device, **{k: case[k] for k in ("tune", "dtype", "autocast",
                                                                 "batch", "seq", "accum",
                                                                 "kind", "lr")},
                 "status": "ok", "reason": None, "phase": "import", "notes": [],
                 "losses": [], "step_times_s": [], "peaks_gib": [], "complete": False}
    if args.peer_path:  # before anything imports: the peer's folder first, in this process only
        sys.path.insert(0, args.peer_path)
        row["peer_path"] = args.peer_path
    try:
        _train(row, mode, spec, case, preset, args)
    except BaseException as e:  # noqa: BLE001 - the row says what failed and where
        row["status"] = _classify(e)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        row["reason"] = f"{row['phase']}: {type(e).__name__}: {first[:400]}"
        row["traceback"] = traceback.format_exc()[-3000:]
    row["complete"] = True
    _save(row, args.row_file)
    dist = sys.modules.get("torch.distributed")  # DeepSpeed's and FSDP2's group, closed
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the row is written; only the exit is left
        pass
    return row


def _train(row: dict, mode: str, spec: dict, case: dict, preset: str, args) -> None:
    import torch  # first: trainstream's native module wants torch loaded before it

    import hf_models

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("--device cuda, and torch sees no CUDA GPU")
    device = args.device
    engine = spec["engine"]
    dtype = getattr(torch, case["dtype"])
    versions = {"torch": torch.__version__}
    for name in ("transformers", "peft"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            pass
    row["versions"] = versions
    peaks = _Peaks(torch, cuda)
    total = torch.cuda.get_device_properties(0).total_memory if cuda else 0

    def cap() -> None:
        if cuda:
            torch.cuda.empty_cache()
            if spec.get("capped", True):
                torch.cuda.set_per_process_memory_fraction(
                    min(1.0, VRAM_CAP_GIB * 2**30 / total), 0)
            peaks.start()
        elif spec.get("capped", True):
            row["notes"].append("no VRAM cap on the CPU")

    # Build: drawn on the device (a GPU draws a 14B model's weights in seconds), then where
    # the engine wants it. The cap comes after: what the engine itself holds is measured.
    row["phase"] = "build"
    began = time.perf_counter()
    if engine == "bnb":
        import bitsandbytes  # noqa: F401  (an import error says so before the build)

        versions["bitsandbytes"] = bitsandbytes.__version__
        model, _ = hf_models.build(preset, "full", dtype, device=device, init_device=device)
        for p in model.parameters():
            p.requires_grad_(False)
        _to_nf4(model, device, row["notes"])
    elif engine == "stock" and not spec.get("capped", True):
        model, _ = hf_models.build(preset, case["tune"], dtype, device=device,
                                   init_device=device)
    elif case.get("random_base") and not args.tiny:
        model = _random_nf4_base(preset, dtype, device, row, spec.get("layers"))
    else:
        model, _ = hf_models.build(preset, case["tune"], dtype, device="cpu",
                                   init_device=device)
    # Training builds no key/value cache (wrap() turns it off itself; the same for everyone).
    model.config.use_cache = False
    model.train()
    if engine == "stock" and case["kind"] == "nf4":
        row["notes"].append("the bf16 base: the reference of the NF4 engines' losses")
    row["build_s"] = round(time.perf_counter() - began, 1)
    cap()

    row["phase"] = "setup"
    began = time.perf_counter()
    accum = case["accum"]
    session = None
    ds_engine = None
    ckpt_kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    if spec.get("ckpt") and engine not in ("bnb",):
        model.gradient_checkpointing_enable(**ckpt_kwargs)
        row["notes"].append("gradient checkpointing (use_reentrant=False)")

    def params():
        return [p for p in model.parameters() if p.requires_grad]

    if engine == "stock":
        model.to(device)
        opt = torch.optim.AdamW(params(), lr=case["lr"], fused=cuda)
        row["engine"] = f"torch {torch.__version__}"
    elif engine == "wrap":
        import trainstream

        versions["trainstream"] = getattr(trainstream, "__version__", "main")
        opt = torch.optim.AdamW(params(), lr=case["lr"])
        options = dict(spec.get("options", {}))
        if accum > 1:
            options["accumulation_steps"] = accum
        model, opt = trainstream.wrap(model, opt, device=device, **options)
        session = model._trainstream_session
        row["engine"] = f"trainstream {versions['trainstream']} from {trainstream.__file__}"
        row["wrap_options"] = options
    elif engine == "ts041":
        import trainstream

        if not trainstream.__version__.startswith("0.4"):  # never this package in its place
            raise ImportError(f"trainstream {trainstream.__version__} from "
                              f"{trainstream.__file__}: not TrainStream 0.4.1 (--ts041)")
        versions["trainstream"] = trainstream.__version__
        opt = torch.optim.AdamW(params(), lr=case["lr"])
        options = dict(quantize="nf4" if mode == "ts041_nf4" else "none")
        if accum > 1:
            options["accumulation_steps"] = accum
        model, opt = trainstream.wrap(model, opt, device=device, **options)
        row["engine"] = f"trainstream {trainstream.__version__} from {trainstream.__file__}"
    elif engine == "bnb":
        import bitsandbytes
        from peft import get_peft_model, prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=bool(spec.get("ckpt")), **ckpt_kwargs)
        model = get_peft_model(model, _lora_config(preset))
        if spec.get("ckpt"):
            row["notes"].append("gradient checkpointing through prepare_model_for_kbit_training "
                                "(use_reentrant=False)")
        opt = torch.optim.AdamW(params(), lr=case["lr"], fused=cuda)
        row["engine"] = f"bitsandbytes {bitsandbytes.__version__} from {bitsandbytes.__file__}"
    elif engine in ("ds2", "ds3"):
        import deepspeed

        versions["deepspeed"] = deepspeed.__version__
        config = _ds_config(case, 2 if engine == "ds2" else 3)
        row["ds_config"] = config
        deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False)
        if engine == "ds3":
            # bf16 as the engine casts ZeRO-2's model (it leaves a ZeRO-Init model as it is),
            # then partitioned to the CPU from here, never whole on the GPU.
            model.to(torch.bfloat16)
            deepspeed.zero.Init(module=model, config_dict_or_path=config)
        ds_engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=params(),
                                                    config=config)
        row["notes"].append(f"optimizer: {type(opt).__name__} over "
                            f"{type(getattr(opt, 'optimizer', opt)).__name__}")
        row["engine"] = f"deepspeed {deepspeed.__version__} from {deepspeed.__file__}"
    elif engine == "ao":
        import torchao
        from torchao.optim import CPUOffloadOptimizer

        versions["torchao"] = torchao.__version__
        model.to(device)
        offload_gradients = accum == 1  # torchao: not compatible with gradient accumulation
        opt = CPUOffloadOptimizer(params(), torch.optim.AdamW,
                                  offload_gradients=offload_gradients, lr=case["lr"])
        row["notes"].append(f"offload_gradients={offload_gradients}")
        row["engine"] = f"torchao {torchao.__version__} from {torchao.__file__}"
    elif engine == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0,
                                world_size=1)
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if case["autocast"] else MixedPrecisionPolicy())
        for block in _blocks(model):
            fully_shard(block, offload_policy=CPUOffloadPolicy(), mp_policy=mp)
        fully_shard(model, offload_policy=CPUOffloadPolicy(), mp_policy=mp)
        try:  # the fastest CPU AdamW torch offers, when it takes the sharded parameters
            opt = torch.optim.AdamW(params(), lr=case["lr"], fused=True)
            row["notes"].append("AdamW fused (CPU)")
        except Exception:  # noqa: BLE001
            opt = torch.optim.AdamW(params(), lr=case["lr"])
            row["notes"].append("AdamW default (CPU)")
        row["engine"] = f"torch {torch.__version__} FSDP2 CPUOffloadPolicy"
    else:
        raise ValueError(mode)
    row["setup_s"] = round(time.perf_counter() - began, 1)
    row["trainable"] = sum(getattr(p, "ds_numel", p.numel()) for p in params())
    row["setup_peak_gib"] = list(peaks.gib())

    steps = args.steps
    losses, times, step_peaks = row["losses"], row["step_times_s"], row["peaks_gib"]
    pcie, events, seen, settled_at = [], [], 0, None
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=case["autocast"])
    for s in range(steps):
        row["phase"] = f"step {s}"
        xs = [hf_models.batch(preset, case["batch"], case["seq"], s * accum + m, device)
              for m in range(accum)]
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        micro = []
        for x in xs:
            if ds_engine is not None:
                with autocast:
                    loss = ds_engine(input_ids=x, labels=x).loss
                ds_engine.backward(loss)  # DeepSpeed divides by its accumulation itself
                ds_engine.step()  # steps the optimizer at the accumulation boundary only
            else:
                with autocast:
                    loss = model(input_ids=x, labels=x).loss
                (loss / accum if accum > 1 else loss).backward()
            micro.append(loss.detach())
        peaks.fold()  # the forward and backward's peak, before step() (a plan may reset it)
        if ds_engine is None:
            opt.step()
            opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        times.append(round(time.perf_counter() - start, 4))
        losses.append(float(sum(float(v) for v in micro) / len(micro)))
        if cuda:
            step_peaks.append(list(peaks.gib()) + [round(torch.cuda.memory_allocated() / 2**30,
                                                          2)])
        if session is not None:
            for e in session.events[seen:]:
                events.append({"step": s, "kind": e["kind"], "message": e["message"][:300]})
            seen = len(session.events)
            if settled_at is None and not session.adapting:
                settled_at = s + 1
            if cuda:
                pcie.append(_pcie_bytes(model))
        _save(row, args.row_file)
    row["phase"] = "done"

    # The step: the median after warm-up; wrap() rows from the step after the plan settled.
    first = min(args.warmup, max(0, steps - 1))
    if session is not None:
        row["settled_at"] = settled_at
        row["events"] = events
        if settled_at is None:
            first = steps - max(1, steps // 3)
            row["notes"].append(f"the plan had not settled after {steps} steps: the step is "
                                f"the median of the last {steps - first}")
        else:
            first = max(first, settled_at)
            if first >= steps:
                first = steps - max(1, steps // 3)
                row["notes"].append(f"settled at step {settled_at}: too late for {steps} steps; "
                                    f"the median of the last {steps - first}")
        if len(pcie) == steps and steps - first >= 1:
            before = pcie[first - 1] if first > 0 else (0, 0)
            row["h2d_bytes"] = (pcie[-1][0] - before[0]) // (steps - first)
            row["d2h_bytes"] = (pcie[-1][1] - before[1]) // (steps - first)
    measured = times[first:]
    row["measured_steps"] = [first, steps]
    row["step_s"] = round(statistics.median(measured), 4) if measured else None
    row["peak_allocated_gib"], row["peak_reserved_gib"] = peaks.gib() if cuda else (None, None)
    row["nonfinite_losses"] = sum(not math.isfinite(v) for v in losses)


def host_stream_bandwidth(gib: float = 2.0, repeats: int = 5) -> float:
    """Host memory bandwidth, GB/s, of an in-place pass over fp32 values on every core (each
    byte read and written once, as the host AdamW pass does): the bound of a full fine-tune's
    optimizer state that lives in host memory."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        x = torch.ones(int(gib * 2**30) // 4)
        x.mul_(1.0)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            x.mul_(1.0)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return round(2 * x.numel() * 4 / statistics.median(times) / 1e9, 2)


# Host memory bytes a full fine-tune's step moves per trained parameter at least, where its
# AdamW state lives in host memory: both fp32 moments read and written once (the master weight
# may stay on the GPU, updated there from staged moments).
HOST_BYTES_PER_PARAMETER = 16


def _worker_bandwidth() -> dict:
    """The pinned host<->device bandwidth the benches measure their PCIe bounds against
    (step_bench.pinned_bandwidth), in a process of its own."""
    import torch

    from step_bench import pinned_bandwidth

    out = pinned_bandwidth()
    out["host_stream_gbps"] = host_stream_bandwidth()
    out["gpu"] = torch.cuda.get_device_name(0)
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["total_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return out


# ---------------------------------------------------------------------------------------------
# The parent: one process per engine and case, the table.
# ---------------------------------------------------------------------------------------------

def _unpack_wheels(folder: str, group: str) -> str:
    """A folder of wheels, unpacked once into a temporary folder (pip install --target without
    pip: the purelib/platlib trees, no scripts); a folder without wheels as it is."""
    wheels = sorted(glob.glob(os.path.join(folder, "*.whl")))
    if not wheels:
        return folder
    key = hashlib.sha1("".join(f"{os.path.basename(w)}:{os.path.getsize(w)};"
                               for w in wheels).encode()).hexdigest()[:12]
    site = os.path.join(tempfile.gettempdir(), f"trainstream-compare-{group}-{key}")
    if os.path.exists(os.path.join(site, ".complete")):
        return site
    shutil.rmtree(site, ignore_errors=True)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                name = info.filename
                parts = name.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue  # scripts, headers, data: not needed to import
                    name = "/".join(parts[2:])
                if not name or name.endswith("/"):
                    continue
                target = os.path.join(site, name)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with z.open(info) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    open(os.path.join(site, ".complete"), "w").close()
    return site


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(mode: str, case: str, args, steps: int, timeout: float, socket_path: str | None,
         peer_path: str | None) -> dict:
    spec = MODES[mode]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if socket_path and spec["engine"] == "wrap":
        env["TRAINSTREAM_SOCKET"] = socket_path
    if spec["engine"] == "ts041":
        env.setdefault("TRAINSTREAM_CACHE_DIR", os.path.join(tempfile.gettempdir(), "ts041"))
        env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    if spec["engine"] in ("ds2", "ds3"):  # one process, no launcher
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                   WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        env.setdefault("DS_SKIP_CUDA_CHECK", "1")  # nvcc's minor version against torch's
    work = tempfile.mkdtemp(prefix="compare-")
    row_file = os.path.join(work, "row.json")
    log_path = os.path.join(work, "log.txt")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--case", case,
           "--steps", str(steps), "--warmup", str(args.warmup), "--device", args.device,
           "--row-file", row_file]
    if args.tiny:
        cmd.append("--tiny")
    if peer_path:
        cmd += ["--peer-path", peer_path]
    began = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker and what it started (compilers)
            code = proc.wait()
            timed_out = True
    with open(log_path, errors="replace") as f:
        log_tail = f.read()[-4000:]
    row = None
    if os.path.exists(row_file):
        with open(row_file) as f:
            row = json.load(f)
    shutil.rmtree(work, ignore_errors=True)
    if row is None:
        row = {"mode": mode, "case": case, "losses": [], "step_times_s": []}
    row["wall_s"] = round(time.perf_counter() - began, 1)
    if timed_out and row.get("complete"):
        row.setdefault("notes", []).append(f"killed after {timeout:.0f} s: it had finished "
                                           "(its row is complete) but did not exit")
    elif timed_out:
        row["status"] = "timeout"
        row["reason"] = (f"timed out after {timeout:.0f} s, at {row.get('phase', 'start')} "
                         f"({len(row.get('step_times_s', []))} steps done)")
    elif not row.get("complete"):
        row["status"] = "crashed"
        row["reason"] = (f"exit {code} at {row.get('phase', 'start')}: "
                         f"{(log_tail.strip().splitlines() or ['?'])[-1][:300]}")
    if row.get("status") != "ok":
        row["log_tail"] = log_tail[-3000:]
    return row


def _short(row: dict) -> str:
    keys = ("case", "mode", "status", "step_s", "peak_allocated_gib", "peak_reserved_gib",
            "settled_at", "setup_s", "wall_s", "reason")
    return json.dumps({k: row.get(k) for k in keys if row.get(k) is not None})


def _fits(row: dict, cap: float) -> bool:
    if row.get("status") != "ok" or not row.get("step_s"):
        return False
    if row.get("nonfinite_losses"):
        return False
    reserved = row.get("peak_reserved_gib")
    return reserved is None or reserved <= cap + 0.01


def _extrapolated_compute(modes: dict) -> float | None:
    """A random_base case's compute, all resident, from its 8- and 16-layer slices: t16 +
    (t16 - t8) per 8 layers for the rest (the embeddings, head and loss counted once)."""
    eight, sixteen = modes.get("slice8", {}), modes.get("slice16", {})
    if not (eight.get("step_s") and sixteen.get("step_s")):
        return None
    import hf_models

    layers = hf_models.PRESETS[sixteen["preset"]].config["num_hidden_layers"]
    per_layer = (sixteen["step_s"] - eight["step_s"]) / 8
    return round(sixteen["step_s"] + per_layer * (layers - 16), 4)


def _analyse(rows: list, bandwidth: dict | None, cap: float) -> None:
    """In place, per case: each row's largest loss difference from stock's; for wrap() rows
    the lower bound and the ratio to the fastest other engine that fits."""
    by_case: dict = {}
    for row in rows:
        by_case.setdefault(row["case"], {})[row["mode"]] = row
    for case, modes in by_case.items():
        stock = modes.get("stock", {})
        ref = stock.get("losses") or []
        for mode, row in modes.items():
            mine = row.get("losses") or []
            n = min(len(ref), len(mine))
            if mode != "stock" and n:
                row["max_loss_diff_vs_stock"] = round(max(abs(a - b) for a, b in
                                                          zip(ref[:n], mine[:n])), 5)
        others = [r for m, r in modes.items()
                  if m != "stock" and not MODES.get(m, {}).get("ours")
                  and not MODES.get(m, {}).get("reference") and _fits(r, cap)]
        compute_s = stock.get("step_s") or _extrapolated_compute(modes)
        for mode, row in modes.items():
            if not MODES.get(mode, {}).get("ours") or not row.get("step_s"):
                continue
            peers = [r for r in others if MODES[r["mode"]]["kind"] == MODES[mode]["kind"]]
            if peers:
                best = min(peers, key=lambda r: r["step_s"])
                row["best_other"] = {"mode": best["mode"], "step_s": best["step_s"]}
                row["vs_best_other"] = round(row["step_s"] / best["step_s"], 3)
            if bandwidth and "h2d_bytes" in row:
                h2d = row["h2d_bytes"] / (bandwidth["h2d_gbps"] * 1e9)
                d2h = row["d2h_bytes"] / (bandwidth["d2h_gbps"] * 1e9)
                both = ((row["h2d_bytes"] + row["d2h_bytes"])
                        / (2e9 * bandwidth["both_each_way_gbps"])
                        if bandwidth.get("both_each_way_gbps") else 0.0)
                compute = compute_s
                row["bound"] = {"pcie_s": round(max(h2d, d2h, both), 4), "compute_s": compute,
                                "h2d_gbps": bandwidth["h2d_gbps"]}
                host = 0.0
                if row.get("tune") == "full" and bandwidth.get("host_stream_gbps"):
                    # A full fine-tune's state beyond the cap: its moments cross host memory.
                    host = (row.get("trainable", 0) * HOST_BYTES_PER_PARAMETER
                            / (bandwidth["host_stream_gbps"] * 1e9))
                    row["bound"].update(host_s=round(host, 4),
                                        host_gbps=bandwidth["host_stream_gbps"])
                row["bound"]["lower_bound_s"] = round(max(compute or 0.0,
                                                          row["bound"]["pcie_s"], host), 4)
                if row["bound"]["lower_bound_s"]:
                    row["step_over_bound"] = round(row["step_s"] /
                                                   row["bound"]["lower_bound_s"], 3)


def _table(rows: list, bandwidths: list, cap: float) -> str:
    out = [f"{'case':22} {'mode':11} {'status':14} {'step s':>8} {'alloc':>6} {'resv':>6} "
           f"{'settled':>7} {'dloss':>8} {'/best':>6} {'/bound':>6}  reason / engine"]
    order = {m: i for i, m in enumerate(MODES)}
    cases = list(dict.fromkeys(r["case"] for r in rows))
    for case in cases:
        mine = sorted((r for r in rows if r["case"] == case),
                      key=lambda r: order.get(r["mode"], 99))
        for r in mine:
            def f(v, spec="", dash="-"):
                return dash if v is None else format(v, spec)
            tail = r.get("reason") or r.get("engine") or ""
            out.append(f"{case:22} {r['mode']:11} {r.get('status', '?'):14} "
                       f"{f(r.get('step_s'), '.4f'):>8} {f(r.get('peak_allocated_gib')):>6} "
                       f"{f(r.get('peak_reserved_gib')):>6} {f(r.get('settled_at')):>7} "
                       f"{f(r.get('max_loss_diff_vs_stock')):>8} "
                       f"{f(r.get('vs_best_other'), '.2f'):>6} "
                       f"{f(r.get('step_over_bound'), '.2f'):>6}  {tail[:90]}")
        ours = [r for r in mine if MODES.get(r["mode"], {}).get("ours") and _fits(r, cap)]
        for kind in ("bf16", "nf4"):
            ours_k = [r for r in ours if MODES[r["mode"]]["kind"] == kind]
            others = [r for r in mine if MODES.get(r["mode"], {}).get("kind") == kind
                      and not MODES[r["mode"]].get("ours") and _fits(r, cap)]
            if not ours_k and not others:
                continue
            best_ours = min(ours_k, key=lambda r: r["step_s"]) if ours_k else None
            best = min(others, key=lambda r: r["step_s"]) if others else None
            line = f"  {case} ({kind} base): "
            line += (f"ours best {best_ours['mode']} {best_ours['step_s']:.4f} s"
                     if best_ours else "no wrap() row fits")
            line += (f"; fastest other that fits: {best['mode']} {best['step_s']:.4f} s"
                     if best else "; no other engine fits under the cap")
            if best_ours and best:
                line += f"; ours/that = {best_ours['step_s'] / best['step_s']:.2f}x"
            bound = (best_ours or {}).get("bound")
            if bound:
                line += (f"; bound {bound['lower_bound_s']:.4f} s (compute "
                         f"{bound['compute_s']} s, PCIe {bound['pcie_s']} s at "
                         f"{bound['h2d_gbps']} GB/s" + (
                             f", host memory {bound['host_s']} s: {HOST_BYTES_PER_PARAMETER} "
                             f"bytes a parameter at {bound['host_gbps']} GB/s"
                             if "host_s" in bound else "") + ")")
            out.append(line)
    for bw in bandwidths:
        if bw:
            out.append(f"pinned copies ({bw.get('gpu', '?')}): host->device {bw['h2d_gbps']} "
                       f"GB/s, device->host {bw['d2h_gbps']} GB/s, both at once "
                       f"{bw.get('both_each_way_gbps')} GB/s each way")
    out.append(f"(cap {cap} GiB a process; alloc/resv: peak GiB over the whole run; dloss: "
               "largest step-wise loss difference from stock's; /best: our step over the "
               "fastest other engine of the same base that fits; /bound: over max(stock's "
               "step, wrap()'s PCIe bytes a step / the pinned bandwidth, a full fine-tune's "
               f"{HOST_BYTES_PER_PARAMETER} bytes a parameter / the host memory bandwidth))")
    return "\n".join(out)


def _commit() -> str:
    if os.environ.get("TS_COMMIT"):
        return os.environ["TS_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "bench",
                                "examples", "shim_python"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return head + ("+dirty" if head and dirty else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def _find_daemon() -> str | None:
    for c in (os.environ.get("TRAINSTREAMD"),
              os.path.join(os.path.dirname(sys.executable), "trainstreamd"),
              shutil.which("trainstreamd")):
        if c and os.access(c, os.X_OK):
            return c
    return None


def _report(paths: list) -> None:
    rows: dict = {}
    bandwidths, cap = [], VRAM_CAP_GIB
    for path in paths:  # a later file's row replaces an earlier one's (same case and mode)
        with open(path) as f:
            result = json.load(f)
        cap = result.get("vram_cap_gib", cap)
        bandwidths.append(result.get("bandwidth"))
        for row in result["rows"]:
            rows[(row["case"], row["mode"])] = row
    merged = list(rows.values())
    print(_table(merged, bandwidths, cap))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--steps", type=int, default=None,
                        help="steps an engine trains (default 20; 4 with --tiny)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="steps left out of the median (default 3; 1 with --tiny)")
    parser.add_argument("--peer-steps", type=int, default=8,
                        help="steps of the engines that stream every weight every step "
                             "(ts041, ds3, fsdp2): seconds a step, fewer tell the same")
    parser.add_argument("--json", default="", help="the results, rewritten after every row")
    parser.add_argument("--peers", default=os.path.join(REPO, ".whl"),
                        help="folder of the peers' folders: bnb/, ds/, ao/ (wheels or "
                             "unpacked), each on sys.path only in its engine's process")
    parser.add_argument("--ts041", default=os.path.join(REPO, ".peers", "trainstream-0.4.1"),
                        help="TrainStream 0.4.1's unpacked sdist (scripts/fetch_peers.sh)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds an engine may take")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="seconds the whole run may take: engines that would start past "
                             "it are skipped (their rows say so)")
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny preset of each case's family (a self-check)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda, or cpu with --tiny")
    parser.add_argument("--report", nargs="+", default=None, metavar="JSON",
                        help="print the table of earlier runs' results (later files win)")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--case", default="", help=argparse.SUPPRESS)
    parser.add_argument("--row-file", default="", help=argparse.SUPPRESS)
    parser.add_argument("--peer-path", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device is None:
        args.device = "cpu" if args.tiny else "cuda"
    if args.steps is None:
        args.steps = 4 if args.tiny else 20
    if args.warmup is None:
        args.warmup = 1 if args.tiny else 3
    if args.worker == "bandwidth":
        print(json.dumps(_worker_bandwidth()), flush=True)
        return
    if args.worker:
        row = _worker(args)
        print(json.dumps({k: row.get(k) for k in ("mode", "case", "status", "step_s",
                                                    "reason")}), flush=True)
        return
    if args.report:
        _report(args.report)
        return

    started = time.perf_counter()
    deadline = started + args.deadline_s if args.deadline_s else None
    result = {"bench": "compare", "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
              "commit": _commit(), "python": platform.python_version(),
              "vram_cap_gib": VRAM_CAP_GIB, "device": args.device, "tiny": args.tiny,
              "steps": args.steps, "warmup": args.warmup, "peer_steps": args.peer_steps,
              "argv": sys.argv[1:], "bandwidth": None, "rows": []}

    def write() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    if args.device == "cuda":
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                              "bandwidth"], capture_output=True, text=True, timeout=300)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode == 0 and lines:
            result["bandwidth"] = json.loads(lines[-1])
            bw = result["bandwidth"]
            result.update(gpu=bw.get("gpu"), torch=bw.get("torch"))
            print(f"pinned copies ({bw['gpu']}): host->device {bw['h2d_gbps']} GB/s, "
                  f"device->host {bw['d2h_gbps']} GB/s", flush=True)
        else:
            print(f"the bandwidth worker failed: {out.stderr[-2000:]}", flush=True)
    write()

    # Each peer's folder, unpacked once here (not in the timed worker).
    peer_sites: dict = {}

    def peer_path(mode: str) -> str | None:
        spec = MODES[mode]
        if spec["engine"] == "ts041":
            return os.path.abspath(args.ts041)
        group = spec.get("peer")
        if not group:
            return None
        if group not in peer_sites:
            folder = os.path.join(args.peers, group)
            peer_sites[group] = (_unpack_wheels(os.path.abspath(folder), group)
                                 if os.path.isdir(folder) else None)
        return peer_sites[group]

    planned = [(c, m, applies(m, CASES[c], args.device, args.tiny))
               for c in args.cases for m in args.modes]
    need_daemon = any(MODES[m]["engine"] == "wrap" and why is None for _, m, why in planned)
    with contextlib.ExitStack() as stack:
        socket_path = None
        if need_daemon:  # one private trainstreamd for every wrap() row
            found = _find_daemon()
            if found:  # bench_daemon starts it by name
                os.environ["PATH"] = os.path.dirname(found) + os.pathsep + os.environ["PATH"]
            from bench_daemon import private_daemon

            fd, config = tempfile.mkstemp(prefix="compare-daemon-", suffix=".conf")
            stack.callback(os.unlink, config)
            with os.fdopen(fd, "w") as f:
                f.write("optimizer_retention_s: 1\n")  # each engine admitted against the machine
            socket_path = stack.enter_context(private_daemon("85%", f"--config={config}"))
        for case, mode, why in planned:
            if why is not None:
                row = {"mode": mode, "case": case, "status": why[0], "reason": why[1],
                       "losses": []}
            else:
                steps = args.steps
                if MODES[mode].get("slow"):
                    steps = min(steps, args.peer_steps)
                timeout = args.timeout
                if deadline is not None:
                    timeout = min(timeout, deadline - time.perf_counter() - 5)
                if timeout < 20:
                    row = {"mode": mode, "case": case, "status": "skipped",
                           "reason": "the run's --deadline-s came first", "losses": []}
                elif MODES[mode]["engine"] == "ts041" and not os.path.isdir(args.ts041):
                    row = {"mode": mode, "case": case, "status": "import_error", "losses": [],
                           "reason": f"no TrainStream 0.4.1 at {args.ts041} (--ts041; "
                                     "scripts/fetch_peers.sh fetches it)"}
                else:
                    row = _run(mode, case, args, steps, timeout, socket_path, peer_path(mode))
            row.update(mode=mode, case=case)
            result["rows"].append(row)
            print(_short(row), flush=True)
            _analyse(result["rows"], result["bandwidth"], VRAM_CAP_GIB)
            write()
    result["wall_s"] = round(time.perf_counter() - started, 1)
    write()
    print()
    print(_table(result["rows"], [result["bandwidth"]], VRAM_CAP_GIB))


if __name__ == "__main__":
    main()
