# SPDX-License-Identifier: Apache-2.0
"""Hugging Face causal LMs through trainstreamd, where a Hugging Face user looks for them.
``load_model(name_or_path, quantize=...)`` builds the model from its config without allocating
its weights, has trainstreamd hold the checkpoint once (bf16 or quantized), and takes every
frozen weight from that one copy; adapters (PEFT LoRA, or your own) added afterwards train as
usual. ``wrap_hf`` is ``wrap()`` over the decoder's layers. ``TrainStreamTrainer`` and
``TrainStreamCallback`` (trainer.py) and ``TrainStreamCache`` (generation.py) are imported when
first asked for: they need ``transformers``, which ``import trainstream`` does not."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..frozen.linear import attach_base
from ..frozen.store import load_base
from ..errors import (FailedPreconditionError, InvalidArgumentError, NotFoundError,
                      ResourceExhaustedError)
from ..memory.blocks import find_blocks
from ..options import check_device, check_load_model
from ..wrap import wrap
# Where TrainStream 0.6's users import them from, beside load_model.
from .logprobs import causal_lm_logprobs, reference_logprobs

__all__ = ["TrainStreamCache", "TrainStreamCallback", "TrainStreamTrainer", "causal_lm_logprobs",
           "decoder_layers", "load_model", "reference_logprobs", "resolve_checkpoint", "wrap_hf"]
_NEED_TRANSFORMERS = ("TrainStreamCache", "TrainStreamCallback", "TrainStreamTrainer")


def __getattr__(name: str) -> Any:
    if name in _NEED_TRANSFORMERS:
        try:
            if name == "TrainStreamCache":
                from .generation import TrainStreamCache as found
            else:
                from . import trainer
                found = getattr(trainer, name)
        except ImportError as e:
            raise ImportError(f"trainstream.integrations.huggingface.{name} needs transformers "
                              "(pip install 'trainstream[hf]')") from e
        return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def decoder_layers(model: torch.nn.Module) -> list:
    """The decoder's repeated layers of a transformers model (through a PEFT wrapper): the
    ``nn.ModuleList`` holding ``config.num_hidden_layers`` of them, the outermost such. Models
    without that config field get :func:`trainstream.find_blocks`' answer."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    count = getattr(getattr(inner, "config", None), "num_hidden_layers", None)
    if count:
        lists = [(name.count("."), name, m) for name, m in inner.named_modules()
                 if isinstance(m, torch.nn.ModuleList) and len(m) == count]
        if lists:
            return list(min(lists, key=lambda t: (t[0], t[1]))[2])
    return find_blocks(inner)


def wrap_hf(model: torch.nn.Module, optimizer: Any = None, **options: Any):
    """``trainstream.wrap()`` with ``blocks`` set to the decoder's layers
    (:func:`decoder_layers`); returns ``(model, optimizer)``. ``options``: any ``wrap()``
    option (``blocks`` given here wins)."""
    if "blocks" not in options:
        layers = decoder_layers(model)
        if not layers:
            raise InvalidArgumentError(
                f"wrap_hf: {type(model).__name__} has no stack of decoder layers to find; pass "
                "blocks=[...] (or use trainstream.wrap)")
        options["blocks"] = layers
    return wrap(model, optimizer, **options)


def _materialize_computed_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Buffers a model computes at construction (rotary frequencies) are in no checkpoint:
    modules holding them on the meta device are built again on ``device``."""
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        config = getattr(module, "config", None)
        try:
            # Built under the device: whatever the class's signature (it changes between
            # transformers versions), what it computes lands there.
            with torch.device(device):
                rebuilt = type(module)(config=config)
        except TypeError as e:
            raise FailedPreconditionError(
                f"load_model: {name} ({type(module).__name__}) computes buffers the checkpoint "
                f"does not hold, and could not be rebuilt: {e}") from e
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, rebuilt)


def _random_quantized(config: Any, fmt: str, dtype: torch.dtype, device: torch.device,
                      keep_on_host: bool, client: Any, progress: bool, block: int,
                      fp8_matmul: Any, outliers: Any, trust_remote_code: bool) -> torch.nn.Module:
    """load_model(random_weights=True) in a quantized format: built on the meta device, then
    each decoder layer's linear layers drawn and quantized into a daemon buffer of their own
    (frozen/random_base.py), so that host memory holds the quantized size and no more; the
    embeddings, norms and head drawn on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    from ..frozen.random_base import materialize_random, quantize_random_layers
    from ..memory.quantization import quantizable_layers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    model = model.to(dtype)
    model.requires_grad_(False)
    layers = decoder_layers(model)
    names = set(quantizable_layers(model, layers))
    groups = [[f"{prefix}.{n}" if n else prefix for n, m in layer.named_modules()
               if (f"{prefix}.{n}" if n else prefix) in names]
              for layer in layers
              for prefix in [next(k for k, m in model.named_modules() if m is layer)]]
    if client is None:
        from ..transport.client import connect

        client = connect(job_id=f"random-base-{os.getpid()}")
    std = float(getattr(config, "initializer_range", 0.02))

    def said(done: int, total: int, nbytes: int) -> None:
        if progress and (done == total or done % max(1, total // 10) == 0):
            print(f"trainstream: random {fmt} weights: {done}/{total} layers, "
                  f"{nbytes / 1e9:.2f} GB", flush=True)

    base = quantize_random_layers(model, groups, fmt, block, std, device, keep_on_host, client,
                                  fp8_matmul=fp8_matmul, outliers=outliers, progress=said)
    materialize_random(model, device, std)
    _materialize_computed_buffers(model, device)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model._trainstream_random_base = base  # its buffers live as long as the model
    model._trainstream_loaded = 0
    model.trainstream_format = fmt
    return model


def resolve_checkpoint(name_or_path: str, cache_dir: str | None = None,
                       config_only: bool = False) -> str:
    """The local folder of ``name_or_path``: the folder itself, or a Hub id (``org/name``)
    found in the local Hugging Face cache (``cache_dir``, else the default one), as
    ``from_pretrained`` would find it offline. Nothing is downloaded: the daemon reads the
    files, and a download belongs to the user."""
    if os.path.isdir(name_or_path):
        return name_or_path
    if os.path.exists(name_or_path):
        raise InvalidArgumentError(f"load_model: {name_or_path} is a file; give the checkpoint's "
                                   "folder (config.json beside its .safetensors)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError as e:
        raise NotFoundError(f"load_model: {name_or_path} is not a folder, and huggingface_hub "
                            "(which finds Hub ids in the local cache) is not installed") from e
    try:
        return snapshot_download(name_or_path, local_files_only=True, cache_dir=cache_dir,
                                 allow_patterns=["*.json"] if config_only else [
                                     "*.json", "*.safetensors", "*.model", "*.txt"])
    except HFValidationError as e:
        raise NotFoundError(f"load_model: {name_or_path} is neither a folder nor a Hub id") from e
    except LocalEntryNotFoundError as e:
        cache = cache_dir or os.environ.get("HF_HUB_CACHE") or os.environ.get(
            "HF_HOME") or "~/.cache/huggingface"
        raise NotFoundError(
            f"load_model: {name_or_path} is not a folder, nor a model in the local Hugging Face "
            f"cache ({cache}); trainstream does not download: fetch it first "
            f"(hf download {name_or_path})") from e


# quantize="auto" weighs these, in this order: the first the daemon has room for.
AUTO_FORMATS = ("bf16", "int8", "nf4")


def _room(client: Any, ram_fraction: float) -> int:
    """``ram_fraction`` of the host memory the daemon could still give this user: its budget
    less what is committed, within this user's quota less what they hold (the daemon's own
    accounting)."""
    memory = client.memory()
    free = int(memory.get("budget_bytes", 0)) - int(memory.get("committed_bytes", 0))
    quota = int(memory.get("uid_quota_bytes", 0) or 0)
    if quota:
        mine = sum(int(r.get("bytes", 0)) for r in memory.get("by_uid", [])
                   if str(r.get("key")) == str(os.getuid()))
        free = min(free, quota - mine)
    return int(max(0, free) * ram_fraction)


def choose_format(path: str, client: Any, block: int, ram_fraction: float) -> tuple:
    """``quantize="auto"``: the first of bf16, int8, NF4 that this user's processes already hold,
    or whose size as the daemon would store it (its own layout, LoadBase with plan_only) fits in
    ``ram_fraction`` of the host memory the daemon could give; (format, why)."""
    room = _room(client, ram_fraction)
    sizes = []
    for fmt in AUTO_FORMATS:
        info = client.load_base(os.path.abspath(path), fmt, 0 if fmt == "bf16" else block, [], "",
                                plan_only=True)
        need = int(info["stored_bytes"])
        sizes.append(f"{fmt} {need / 1e9:.2f} GB")
        if info["state"] in ("ready", "loading"):
            return fmt, f"{fmt}: this user's processes hold that base already"
        if need <= room:
            return fmt, (f"{fmt}: {need / 1e9:.2f} GB fits in {room / 1e9:.2f} GB "
                         f"({ram_fraction:.0%} of what the daemon could still give)" +
                         (f"; not {', '.join(sizes[:-1])}" if len(sizes) > 1 else ""))
    raise ResourceExhaustedError(
        f"load_model: {path} does not fit in {room / 1e9:.2f} GB ({ram_fraction:.0%} of the "
        f"host memory the daemon could still give) in any format ({', '.join(sizes)}); raise "
        "ram_fraction, end other jobs, or give the daemon a larger --memory_budget")


def load_model(name_or_path: str, quantize: Any = "auto", device: Any = None,
               dtype: torch.dtype = torch.bfloat16, keep_on_host: bool = False,
               client: Any = None, progress: bool = True,
               fp8_matmul: Any = "auto", gpu_pool: bool = False, quant_block_size: int = 0,
               trust_remote_code: bool = False, cache_dir: str | None = None,
               random_weights: bool = False, ram_fraction: float = 0.85, outliers: Any = 0,
               **config_overrides: Any) -> torch.nn.Module:
    """A causal LM from a Hugging Face checkpoint (a folder with config.json and .safetensors,
    or a Hub id found in the local cache: :func:`resolve_checkpoint`), frozen, its weights from
    the daemon's shared base: bf16 (``quantize=None``, ``"none"`` or ``False``) or ``"int8"``,
    ``"nf4"``, ``"fp8"``, ``"nvfp4"`` for the block weights (embeddings, norms and the head stay
    as the checkpoint has them), ``quant_block_size`` values a scale (0: the format's default).
    ``quantize="auto"`` (the default): bf16 if it fits in ``ram_fraction`` of the host memory
    the daemon could still give this user, else int8, else NF4 (:func:`choose_format`; an
    identical base already held costs nothing and is taken). Every process loading the same
    checkpoint and format uses the one host copy. ``device``: the first GPU when there is one,
    else the CPU. ``random_weights=True``: the architecture from the config alone, with random
    weights (no checkpoint read, nothing shared); with a format named in ``quantize``, each
    decoder layer's linear weights are drawn and quantized a layer at a time into a daemon
    buffer (host memory holds the quantized size, so a 70B-class model in NF4 builds on a
    machine that could never hold it in bf16; ``keep_on_host=True`` leaves them there for
    ``wrap()`` to stream). ``config_overrides`` set fields of the model's config
    (``attn_implementation="sdpa"``, say). PEFT's
    ``get_peft_model`` takes the result in every format: its frozen layers are linear layers to
    PEFT. ``fp8_matmul``, ``gpu_pool`` (one VRAM copy per GPU), ``outliers`` (fp8 on FP8
    tensor cores): see :func:`attach_base`."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:  # an optional dependency: only this function needs it
        raise FailedPreconditionError("load_model needs the transformers package") from e
    check_load_model(quantize, dtype, ram_fraction, quant_block_size, config_overrides)
    check_device("load_model", device)
    if quantize in (None, False, "none"):
        quantize = "bf16"
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    path = resolve_checkpoint(name_or_path, cache_dir, config_only=random_weights)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    for key, value in config_overrides.items():
        if not hasattr(config, key) and not key.startswith("attn_implementation"):
            raise InvalidArgumentError(f"load_model: {type(config).__name__} has no field "
                                       f"{key!r} to set")
        setattr(config, key, value)
    if random_weights and quantize not in ("auto", "bf16"):
        return _random_quantized(config, quantize, dtype, device, keep_on_host, client,
                                 progress, quant_block_size, fp8_matmul, outliers,
                                 trust_remote_code)
    if random_weights:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        model = model.to(dtype)
        model.requires_grad_(False)
        model._trainstream_loaded = 0
        model.trainstream_format = "bf16"
        return model
    if client is None:
        from ..transport.client import connect

        client = connect(job_id=f"base-{os.getpid()}")
    fmt = quantize
    if quantize == "auto":
        fmt, why = choose_format(path, client, quant_block_size, ram_fraction)
        client.report_event("load_model.quantize", f"load_model {name_or_path}: {why}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    model = model.to(dtype)
    model.requires_grad_(False)
    base = load_base(path, format=fmt, block=quant_block_size, client=client, progress=progress)
    taken = attach_base(model, base, device=device, keep_on_host=keep_on_host,
                        fp8_matmul=fp8_matmul, gpu_pool=gpu_pool, outliers=outliers)
    _materialize_computed_buffers(model, device)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if t.is_meta]
    if left:
        raise FailedPreconditionError(
            f"load_model: {len(left)} tensors are in neither {path} nor the model's own "
            f"computed buffers, e.g. {', '.join(left[:5])}")
    model._trainstream_loaded = taken
    model.trainstream_format = fmt
    return model
