# SPDX-License-Identifier: Apache-2.0
"""Hugging Face ``transformers`` models as people fine-tune them, with random weights: the
published configs of several families (and tiny versions of each for a CPU), full fine-tuning
or PEFT LoRA on every projection. The model matrix of the tests and of bench/hf_models.py.

    model, trainable = build("qwen2.5-1.5b", tune="full", dtype=torch.float32)
    loss = model(input_ids=x, labels=x).loss
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Preset:
    family: str          # the transformers architecture: "qwen2", "llama", "phi3"
    config: dict         # the config's shape fields, as published
    lora_targets: tuple  # the projections PEFT adapts (every linear layer of a block)


_QWEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PHI3 = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

# The published configs' shape fields (hidden sizes, heads, vocabulary, tied head); the rest is
# each family's default.
PRESETS = {
    "qwen2.5-1.5b": Preset("qwen2", dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=32768, tie_word_embeddings=True), _QWEN),
    "qwen2.5-7b": Preset("qwen2", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=32768, tie_word_embeddings=False), _QWEN),
    "qwen2.5-14b": Preset("qwen2", dict(
        vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
        num_attention_heads=40, num_key_value_heads=8, rope_theta=1e6, rms_norm_eps=1e-5,
        max_position_embeddings=32768, tie_word_embeddings=False), _QWEN),
    # The 70B class (issue 49's largest models): 80 layers of hidden 8192.
    "qwen2.5-72b": Preset("qwen2", dict(
        vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=32768, tie_word_embeddings=False), _QWEN),
    "llama-3.1-70b": Preset("llama", dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, rope_theta=5e5, rms_norm_eps=1e-5,
        max_position_embeddings=131072, tie_word_embeddings=False), _QWEN),
    "llama-3.2-3b": Preset("llama", dict(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128, rope_theta=5e5,
        rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=True), _QWEN),
    "llama-3.1-8b": Preset("llama", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rope_theta=5e5, rms_norm_eps=1e-5,
        max_position_embeddings=131072, tie_word_embeddings=False), _QWEN),
    "phi-3-mini": Preset("phi3", dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, rope_theta=1e4, rms_norm_eps=1e-5,
        max_position_embeddings=4096, tie_word_embeddings=False), _PHI3),
    # Mistral-7B-v0.3 (no sliding window) and Gemma-2-2B (bench/compare.py's cases).
    "mistral-7b": Preset("mistral", dict(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
        rms_norm_eps=1e-5, max_position_embeddings=32768, sliding_window=None,
        tie_word_embeddings=False), _QWEN),
    "gemma-2-2b": Preset("gemma2", dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        hidden_activation="gelu_pytorch_tanh", rope_theta=1e4, rms_norm_eps=1e-6,
        max_position_embeddings=8192, sliding_window=4096, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, tie_word_embeddings=True), _QWEN),
    # Small versions (about 0.1-0.2B parameters): the GPU tests' matrix, quick on one GPU.
    "small-qwen2": Preset("qwen2", dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
        tie_word_embeddings=True), _QWEN),
    "small-llama": Preset("llama", dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        max_position_embeddings=4096, tie_word_embeddings=False), _QWEN),
    "small-phi3": Preset("phi3", dict(
        vocab_size=32064, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096,
        tie_word_embeddings=False), _PHI3),
    # Tiny versions of each family, for a CPU (CI) and quick GPU tests.
    "tiny-qwen2": Preset("qwen2", dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True), _QWEN),
    "tiny-llama": Preset("llama", dict(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False), _QWEN),
    "tiny-phi3": Preset("phi3", dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2), _PHI3),
    "tiny-mistral": Preset("mistral", dict(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        sliding_window=None, tie_word_embeddings=False), _QWEN),
    "tiny-gemma2": Preset("gemma2", dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        max_position_embeddings=256, sliding_window=16, tie_word_embeddings=True), _QWEN),
}

_CLASSES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "llama": ("LlamaConfig", "LlamaForCausalLM"),
            "phi3": ("Phi3Config", "Phi3ForCausalLM"),
            "mistral": ("MistralConfig", "MistralForCausalLM"),
            "gemma2": ("Gemma2Config", "Gemma2ForCausalLM")}


def config_of(name: str):
    import transformers

    preset = PRESETS[name]
    config_class, _ = _CLASSES[preset.family]
    return getattr(transformers, config_class)(**preset.config)


def build(name: str, tune: str = "full", dtype: torch.dtype = torch.float32,
          device: str = "cpu", init_device: str | None = None, lora_r: int = 16,
          seed: int = 0) -> tuple[torch.nn.Module, int]:
    """(model, trainable parameter count). ``tune``: "full" (every weight trains) or "lora"
    (PEFT LoRA of rank ``lora_r`` on every projection of every block, the base frozen).
    ``init_device``: where the random weights are drawn (a GPU draws a 14B model's in
    seconds); the model is then moved to ``device``."""
    import transformers

    preset = PRESETS[name]
    _, model_class = _CLASSES[preset.family]
    config = config_of(name)
    torch.manual_seed(seed)
    with torch.device(init_device or device):
        model = getattr(transformers, model_class)(config).to(dtype)
    if tune == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0,
            target_modules=list(preset.lora_targets)))
    elif tune != "full":
        raise ValueError(f"tune={tune!r}: 'full' or 'lora'")
    model.to(device)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model, trainable


def batch(name: str, batch_size: int, seq: int, step: int, device: str = "cpu") -> torch.Tensor:
    """Token ids for ``step``: the same for every engine and run."""
    vocab = PRESETS[name].config["vocab_size"]
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (batch_size, seq), generator=g).to(device)
