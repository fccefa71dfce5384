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
from ..errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from ..memory.blocks import find_blocks
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


def resolve_checkpoint(name_or_path: str, cache_dir: str | None = None) -> str:
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
                                 allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    except HFValidationError as e:
        raise NotFoundError(f"load_model: {name_or_path} is neither a folder nor a Hub id") from e
    except LocalEntryNotFoundError as e:
        cache = cache_dir or os.environ.get("HF_HUB_CACHE") or os.environ.get(
            "HF_HOME") or "~/.cache/huggingface"
        raise NotFoundError(
            f"load_model: {name_or_path} is not a folder, nor a model in the local Hugging Face "
            f"cache ({cache}); trainstream does not download: fetch it first "
            f"(hf download {name_or_path})") from e


def load_model(name_or_path: str, quantize: str | None = None, device: Any = None,
               dtype: torch.dtype = torch.bfloat16, keep_on_host: bool = False,
               client: Any = None, progress: bool = True,
               fp8_matmul: Any = "auto", gpu_pool: bool = False, quant_block_size: int = 0,
               trust_remote_code: bool = False, cache_dir: str | None = None,
               **config_overrides: Any) -> torch.nn.Module:
    """A causal LM from a Hugging Face checkpoint (a folder with config.json and .safetensors,
    or a Hub id found in the local cache: :func:`resolve_checkpoint`), frozen, its weights from
    the daemon's shared base: bf16 (``quantize=None``) or ``"int8"``, ``"nf4"``, ``"fp8"``,
    ``"nvfp4"`` for the block weights (embeddings, norms and the head stay as the checkpoint
    has them), ``quant_block_size`` values a scale (0: the format's default). Every process
    loading the same checkpoint and format uses the one host copy. ``device``: the first GPU
    when there is one, else the CPU. ``config_overrides`` set fields of the model's config
    (``attn_implementation="sdpa"``, say). PEFT's ``get_peft_model`` takes the result in every
    format: its frozen layers are linear layers to PEFT. ``fp8_matmul``, ``gpu_pool`` (one VRAM
    copy per GPU): see :func:`attach_base`."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:  # an optional dependency: only this function needs it
        raise FailedPreconditionError("load_model needs the transformers package") from e
    fmt = quantize or "bf16"
    if fmt not in ("bf16", "int8", "nf4", "fp8", "nvfp4"):
        raise InvalidArgumentError(f"quantize={quantize!r} is not one of None, 'int8', 'nf4', "
                                   "'fp8', 'nvfp4'")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    path = resolve_checkpoint(name_or_path, cache_dir)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    for key, value in config_overrides.items():
        if not hasattr(config, key) and not key.startswith("attn_implementation"):
            raise InvalidArgumentError(f"load_model: {type(config).__name__} has no field "
                                       f"{key!r} to set")
        setattr(config, key, value)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    model = model.to(dtype)
    model.requires_grad_(False)
    base = load_base(path, format=fmt, block=quant_block_size, client=client, progress=progress)
    taken = attach_base(model, base, device=device, keep_on_host=keep_on_host,
                        fp8_matmul=fp8_matmul, gpu_pool=gpu_pool)
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
    return model
