"""Shared fixtures: tiny random Llama / Qwen2 models built in-process and saved in HF format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY_CONFIGS = {
    # name: (family, heads, kv_heads, tie)
    "llama-gqa3-tied": ("llama", 6, 2, True),
    "llama-mha-untied": ("llama", 4, 4, False),
    "qwen2-gqa2-untied": ("qwen2", 4, 2, False),
    "qwen2-mqa-tied": ("qwen2", 4, 1, True),
}


def make_tiny_hf_model(
    family: str, heads: int, kv_heads: int, tie: bool, vocab_size: int = 128, seed: int = 0
):
    """A randomly initialised transformers model of the given family (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    head_dim = 16
    common = dict(
        vocab_size=vocab_size,
        hidden_size=heads * head_dim,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    if family == "llama":
        config = LlamaConfig(**common, rope_theta=10000.0)
        model = LlamaForCausalLM(config)
    else:
        config = Qwen2Config(**common, rope_theta=1000000.0)
        model = Qwen2ForCausalLM(config)
    # Larger-than-default init so the logits are far from uniform and attention matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model.float().eval()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Every tiny config saved as an HF-format directory (safetensors), keyed by name."""
    root = tmp_path_factory.mktemp("tiny_models")
    dirs = {}
    for name, (family, heads, kv_heads, tie) in TINY_CONFIGS.items():
        model = make_tiny_hf_model(family, heads, kv_heads, tie)
        d = root / name
        model.save_pretrained(d, safe_serialization=True)
        dirs[name] = d
    return dirs


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct, fetched and converted once into the specdec cache."""
    from specdec.zoo import resolve_model

    return resolve_model("smollm2-135m-instruct")
