"""Shared fixtures: tiny random Llama / Qwen2 models built in-process and saved in HF format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _step_cost_cache(tmp_path_factory):
    """The engine's step-cost cache (:mod:`specdec.engine.cost_profile`) in a file of this test session:
    tests neither read a developer's cached costs nor write them. (Only that file: the zoo's converted
    models stay in their cache, converting them again costs minutes.)"""
    import os

    old = os.environ.get("SPECDEC_STEP_COSTS")
    os.environ["SPECDEC_STEP_COSTS"] = str(tmp_path_factory.mktemp("step_costs") / "step_costs.json")
    yield
    if old is None:
        os.environ.pop("SPECDEC_STEP_COSTS", None)
    else:
        os.environ["SPECDEC_STEP_COSTS"] = old


@pytest.fixture(scope="session", autouse=True)
def _no_huge_pages():
    """Engines built by the tests leave their memory on the pages it has (``huge_pages="auto"`` reads
    ``SPECDEC_HUGE_PAGES=0``): collapsing a SmolLM2 engine's weights costs 2-4 s, and the suite builds
    many; tests/engine/test_huge_pages.py asks for it by name."""
    import os

    old = os.environ.get("SPECDEC_HUGE_PAGES")
    os.environ["SPECDEC_HUGE_PAGES"] = "0"
    yield
    if old is None:
        os.environ.pop("SPECDEC_HUGE_PAGES", None)
    else:
        os.environ["SPECDEC_HUGE_PAGES"] = old


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


def save_target_and_draft(root: Path, vocab_size: int, target_seed: int, draft_seed: int):
    """Two tiny random Llamas (4 heads, 2 KV heads, untied) saved as ``root / "target"`` and
    ``root / "draft"``, for the distribution tests; returns the target (transformers, float32)."""
    target = make_tiny_hf_model("llama", 4, 2, False, vocab_size=vocab_size, seed=target_seed)
    draft = make_tiny_hf_model("llama", 4, 2, False, vocab_size=vocab_size, seed=draft_seed)
    target.save_pretrained(root / "target", safe_serialization=True)
    draft.save_pretrained(root / "draft", safe_serialization=True)
    return target


def save_random_eagle_head(target_dir: Path, out: Path, seed: int = 12, std: float = 0.3) -> Path:
    """A random EAGLE head (weights ~ N(0, ``std``), norms included) for the tiny target saved in
    ``target_dir``, saved to ``out`` in this library's head layout; returns ``out``."""
    from specdec.drafters.heads import HeadConfig, arch_fields, build_heads, save_heads
    from specdec.models.config import ModelArchConfig

    arch = ModelArchConfig.from_pretrained(target_dir)
    cfg = HeadConfig(
        method="eagle", target="tiny", hidden_size=arch.hidden_size, vocab_size=arch.vocab_size,
        arch=arch_fields(arch),
    )  # fmt: skip
    torch.manual_seed(seed)
    head = build_heads(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, std)
    save_heads(head, cfg, out)
    return out


def first_three_logits(
    model, prompt: list[int], vocab_size: int, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits for t1 ``[V]``, t2 given t1 ``[V, V]`` and t3 given t1, t2 ``[V, V, V]`` after
    ``prompt``, from one forward in ``dtype`` over every ``prompt + [a, b]``."""
    import copy

    m = copy.deepcopy(model).to(dtype)
    n, v = len(prompt), vocab_size
    seqs = torch.tensor([prompt + [a, b] for a in range(v) for b in range(v)])  # row a * V + b
    with torch.no_grad():
        logits = m(seqs).logits
    return logits[0, n - 1], logits[::v, n], logits[:, n + 1].reshape(v, v, v)


def first_two_token_counts(
    llm, prompt: list[int], vocab_size: int, batch: int, calls: int, seed_base: int = 0
):
    """``[V, V]`` counts of the first two sampled tokens over ``calls`` generate calls of ``batch``
    copies of ``prompt`` at temperature 1 (odd rows seeded ``seed_base + call * batch + i``, even rows
    from the engine's generator): the sample the distribution tests compare with the exact joint.

    Repeating a test over engine seeds? Vary ``seed_base`` too: the seeded half of the sample does not
    depend on the engine's seed, so with a fixed ``seed_base`` the repeats share that half and their
    p-values are not independent (issue 19: a fixed half at p = 0.02 made p < 0.004 look common)."""
    from sampling.params import SamplingParams
    from tests.stats import counts_of

    samples = []
    for call in range(calls):
        params = [
            SamplingParams(
                temperature=1.0,
                max_tokens=3,
                ignore_eos=True,
                seed=seed_base + call * batch + i if i % 2 else None,
            )
            for i in range(batch)
        ]
        for out in llm.generate([{"prompt_token_ids": prompt}] * batch, params):
            samples.append(out.outputs[0].token_ids[:2])
    return counts_of(samples, (vocab_size, vocab_size))


@pytest.fixture(scope="module")
def fast_cpu_settings():
    """For tests of many tiny tensors: one intra-op thread (threads only add overhead, ~100x on a loaded
    2-core machine), and the objects alive now frozen out of the cyclic GC, whose full collections
    otherwise rescan them while the engine allocates per request. Restored afterwards."""
    import gc

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
    torch.set_num_threads(before)


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


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """transformers' greedy ``generate`` continuation of one prompt (no padding)."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


SMOL_QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paper clip.",
    "Translate 'good morning, how are you?' into French and Spanish, then explain the grammar of each "
    "translation in detail for a beginner who has never studied either language.",
]
SYSTEM = "You are a concise, helpful assistant. Answer accurately and do not invent facts."


@pytest.fixture(scope="session")
def smol_reference(smollm2_dir):
    """Chat prompts sharing a system prompt, and transformers' greedy continuations (64 tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.llm import chat_token_ids

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = []
    for q in SMOL_QUESTIONS:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        prompts.append(chat_token_ids(tok, msgs))
    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    refs = [hf_greedy(hf_model, p, 64, eos=tok.eos_token_id) for p in prompts]
    return prompts, refs


def save_tiny_text_models(root: Path) -> dict[str, Path]:
    """Tiny random Llamas that come with a tokenizer (the in-process byte-level BPE of
    ``tests/test_grammar_helpers.py``, 265 tokens, EOS 0), saved under ``root``: ``"target"`` and
    ``"draft"`` (same vocabulary, another seed), and ``"draft-other-vocab"`` (vocabulary 128)."""
    from tests.test_grammar_helpers import tiny_byte_level_tokenizer

    tok = tiny_byte_level_tokenizer()
    dirs = {}
    for name, vocab, seed in (("target", len(tok), 0), ("draft", len(tok), 1), ("draft-other-vocab", 128, 2)):
        d = root / name
        model = make_tiny_hf_model("llama", 4, 2, False, vocab_size=vocab, seed=seed)
        model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id  # not a byte
        model.save_pretrained(d, safe_serialization=True)
        tok.save_pretrained(d)
        dirs[name] = d
    return dirs


@pytest.fixture(scope="session")
def tiny_text_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """:func:`save_tiny_text_models`, once per session: string prompts, stop strings and grammars without
    the real model."""
    return save_tiny_text_models(tmp_path_factory.mktemp("tiny_text_models"))


def save_permutation_target(directory: Path, vocab_size: int, shift: int) -> torch.Tensor:
    """A one-layer Llama whose greedy next token is ``(x + shift) % vocab_size``, saved to ``directory``:
    hidden size = vocabulary, embeddings ``sqrt(V) * I``, attention and MLP outputs zeroed (so the
    residual stream stays ``sqrt(V) onehot(x)``), LM head the permutation. Returns the permutation
    matrix ``P`` ``[V, V]`` (``P @ onehot(x) = onehot(x + shift)``), for heads built to copy it."""
    import math

    from transformers import LlamaConfig, LlamaForCausalLM

    h = vocab_size
    config = LlamaConfig(
        vocab_size=h,
        hidden_size=h,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).float().eval()
    perm = torch.zeros(h, h)
    perm[(torch.arange(h) + shift) % h, torch.arange(h)] = 1.0
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(math.sqrt(h) * torch.eye(h))
        model.lm_head.weight.copy_(perm)
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(directory)
    return perm
