"""Medusa and EAGLE drafters through the engine: greedy output equals plain greedy decoding token for token.

Two tiny targets:

- a random Llama with randomly initialised heads: drafts are mostly rejected (and sometimes accepted);
- a *permutation* target whose greedy next token is ``g(x) = (x + 5) mod V`` whatever the context (its
  attention and MLP outputs are zero, its embedding is ``sqrt(H)`` times the identity and its LM head the
  permutation matrix of ``g``), with heads built to copy it exactly: Medusa head k adds ``3 * P(g^k)``
  to the feature of ``x_t`` so that the LM head's argmax is ``g^{k+1}(x_t)``, and the EAGLE head passes
  the next token's embedding through (``FC = [I, 0]``, zero attention and MLP outputs), which is the
  target's next feature. Every draft is accepted.

Both run chains and trees, batch sizes 1 and 4.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from sampling.params import SamplingParams
from specdec import LLM
from specdec.drafters.heads import HeadConfig, arch_fields, build_heads, load_heads, save_heads
from specdec.errors import ConfigError, CorruptModelError, InvalidRequestError
from specdec.models.config import ModelArchConfig
from specdec.policies.registry import register_policy

VOCAB = 64
PERM_VOCAB = 32
SHIFT = 5


def _head_config(model_dir, method: str, num_heads: int = 4) -> HeadConfig:
    arch = ModelArchConfig.from_pretrained(model_dir)
    return HeadConfig(
        method=method,
        target=str(model_dir),
        hidden_size=arch.hidden_size,
        vocab_size=arch.vocab_size,
        num_heads=num_heads if method == "medusa" else 1,
        arch=arch_fields(arch) if method == "eagle" else None,
    )


@pytest.fixture(scope="module")
def random_setup(tmp_path_factory):
    from tests.conftest import make_tiny_hf_model

    root = tmp_path_factory.mktemp("learned_random")
    make_tiny_hf_model("llama", 6, 2, True, vocab_size=VOCAB, seed=5).save_pretrained(root / "target")
    torch.manual_seed(0)
    for method in ("medusa", "eagle"):
        cfg = _head_config(root / "target", method)
        heads = build_heads(cfg)
        with torch.no_grad():
            for p in heads.parameters():
                p.normal_(0, 0.2)
        save_heads(heads, cfg, root / method)
    return root


@pytest.fixture(scope="module")
def perm_setup(tmp_path_factory):
    from tests.conftest import save_permutation_target

    root = tmp_path_factory.mktemp("learned_perm")
    h = PERM_VOCAB
    perm = save_permutation_target(root / "target", h, SHIFT)

    medusa_cfg = _head_config(root / "target", "medusa")
    medusa = build_heads(medusa_cfg)
    with torch.no_grad():
        for k, block in enumerate(medusa.blocks, start=1):
            block.weight.copy_(3.0 * torch.linalg.matrix_power(perm, k))
            block.bias.zero_()
    save_heads(medusa, medusa_cfg, root / "medusa")

    eagle_cfg = _head_config(root / "target", "eagle")
    eagle = build_heads(eagle_cfg)
    with torch.no_grad():
        eagle.fc.weight.zero_()
        eagle.fc.weight[:, :h].copy_(torch.eye(h))
        eagle.fc.bias.zero_()
        eagle.layer.o_proj.weight.zero_()
        eagle.layer.down_proj.weight.zero_()
    save_heads(eagle, eagle_cfg, root / "eagle")
    return root


SPECS = {
    "medusa-chain": {"method": "medusa", "num_speculative_tokens": 3},
    "medusa-tree": {
        "method": "medusa",
        "num_speculative_tokens": 3,
        "tree": "static",
        "tree_choices": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]],
    },
    "eagle-chain": {"method": "eagle", "num_speculative_tokens": 4},
    "eagle-tree": {
        "method": "eagle",
        "num_speculative_tokens": 4,
        "tree": "dynamic",
        "tree_topk": 3,
        "max_tree_nodes": 10,
    },
}


def _prompts(n: int, vocab: int) -> list[list[int]]:
    return [[(11 * i + 5 * j) % (vocab - 3) + 3 for j in range(4 + 5 * i)] for i in range(n)]


def _run(target, prompts, max_tokens, spec=None):
    llm = LLM(target, skip_tokenizer_init=True, block_size=4, speculative_config=spec)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("batch", [1, 4])
def test_random_heads_greedy_equality(random_setup, name, batch):
    prompts = _prompts(batch, VOCAB)
    max_tokens = [19 + 4 * i for i in range(batch)]
    base, _ = _run(random_setup / "target", prompts, max_tokens)
    spec = dict(SPECS[name], model=str(random_setup / SPECS[name]["method"]))
    got, llm = _run(random_setup / "target", prompts, max_tokens, spec)
    assert got == base
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


@pytest.mark.parametrize("batch", [1, 3])
def test_paged_tree_drafting_equals_the_dense_reference(random_setup, monkeypatch, batch):
    """EAGLE-2 trees drafted level by level through the paged, tree-masked segment (the layer stack's
    path) propose the same trees as the dense reference path (float32, random heads), and both equal
    plain greedy decoding. Negative control: a mask that lets every fed node see all the others
    changes the drafts."""
    from specdec.drafters.eagle import EagleDrafter

    prompts = _prompts(batch, VOCAB)
    max_tokens = [17 + 3 * i for i in range(batch)]
    spec = dict(SPECS["eagle-tree"], model=str(random_setup / "eagle"))
    base, _ = _run(random_setup / "target", prompts, max_tokens)
    tree = EagleDrafter._tree

    def drafted(paged: bool, see_all: bool = False) -> list[tuple[list[int], list[int] | None]]:
        trees: list[tuple[list[int], list[int] | None]] = []

        def recording(self, x, root_feature):
            proposal = tree(self, x, root_feature)
            trees.append((list(proposal.token_ids), proposal.parents))
            return proposal

        monkeypatch.setattr(EagleDrafter, "_tree", recording)
        monkeypatch.setattr(EagleDrafter, "paged_tree", paged)
        if see_all:
            import specdec.drafters.eagle as eagle_module

            real = eagle_module.Segment

            def unmasked(*args, **kwargs):
                if kwargs.get("mask") is not None:
                    kwargs["mask"] = torch.ones_like(kwargs["mask"])
                return real(*args, **kwargs)

            monkeypatch.setattr(eagle_module, "Segment", unmasked)
        got, _ = _run(random_setup / "target", prompts, max_tokens, spec)
        assert got == base
        monkeypatch.undo()
        return trees

    paged, dense = drafted(True), drafted(False)
    assert len(paged) > 5 and any(len(p) > 4 for p, _ in paged)
    assert paged == dense
    assert drafted(True, see_all=True) != dense


@pytest.mark.parametrize("batch", [1, 4])
def test_eagle_chains_cut_by_draft_stop_probability_stay_greedy_equal(random_setup, batch):
    """``draft_stop_probability``: a chain stops after a draft whose head distribution gives its top token
    less than that probability. Greedy outputs equal plain decoding's, chains are cut (fewer draft tokens
    per step than k), and a threshold above every top-1 probability drafts exactly one token a step."""
    prompts = _prompts(batch, VOCAB)
    max_tokens = [19 + 4 * i for i in range(batch)]
    base, _ = _run(random_setup / "target", prompts, max_tokens)
    spec = {"method": "eagle", "num_speculative_tokens": 4, "model": str(random_setup / "eagle")}
    _, full = _run(random_setup / "target", prompts, max_tokens, spec)
    per_step_full = full.engine.spec_stats.num_draft_tokens / full.engine.spec_stats.num_drafts
    got, cut = _run(random_setup / "target", prompts, max_tokens, {**spec, "draft_stop_probability": 0.2})
    assert got == base
    stats = cut.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens / stats.num_drafts < per_step_full
    got, one = _run(random_setup / "target", prompts, max_tokens, {**spec, "draft_stop_probability": 0.999})
    assert got == base
    assert one.engine.spec_stats.num_draft_tokens == one.engine.spec_stats.num_drafts  # one draft a step


@pytest.mark.parametrize(
    ("value", "message"),
    [(0.0, "in \\(0, 1\\)"), (1.0, "in \\(0, 1\\)"), (True, "in \\(0, 1\\)"), ("0.5", "in \\(0, 1\\)")],
)
def test_draft_stop_probability_is_checked(value, message):
    from specdec.config import SpeculativeConfig
    from specdec.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig(method="eagle", draft_stop_probability=value)
    with pytest.raises(ConfigError, match="cuts chains"):
        SpeculativeConfig(method="eagle", tree="dynamic", draft_stop_probability=0.5)
    with pytest.raises(ConfigError, match="applies to method 'eagle' or 'eagle3' only"):
        SpeculativeConfig(method="ngram", draft_stop_probability=0.5)
    assert SpeculativeConfig(method="eagle3", draft_stop_probability=0.5).draft_stop_probability == 0.5


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_heads_take_the_targets_cpu_linears(random_setup, method):
    """A head's linears run the CPU GEMV kernel like the target's (a draft step is one or a few rows,
    where F.linear streams bfloat16 at half the kernel's speed); outputs stay plain decoding's."""
    from kernels import cpu_gemv
    from specdec.models.cpu_linear import GemvLinear

    prompts, max_tokens = _prompts(2, VOCAB), [12, 15]
    base, _ = _run(random_setup / "target", prompts, max_tokens)
    got, llm = _run(
        random_setup / "target", prompts, max_tokens, {"method": method, "model": str(random_setup / method)}
    )
    assert got == base
    drafter = llm.engine.drafter
    heads = drafter.heads if method == "medusa" else drafter.head
    kinds = {type(m) for m in heads.modules() if isinstance(m, (torch.nn.Linear, GemvLinear))}
    assert kinds == ({GemvLinear} if cpu_gemv.available() else {torch.nn.Linear})


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("batch", [1, 4])
def test_copying_heads_are_always_accepted(perm_setup, name, batch):
    prompts = _prompts(batch, PERM_VOCAB)
    max_tokens = [21 + 4 * i for i in range(batch)]
    base, _ = _run(perm_setup / "target", prompts, max_tokens)
    for p, out in zip(prompts, base):  # the target really is the permutation
        assert out[0] == (p[-1] + SHIFT) % PERM_VOCAB
        assert all(b == (a + SHIFT) % PERM_VOCAB for a, b in itertools.pairwise(out))
    spec = dict(SPECS[name], model=str(perm_setup / SPECS[name]["method"]))
    got, llm = _run(perm_setup / "target", prompts, max_tokens, spec)
    assert got == base
    stats = llm.engine.spec_stats
    k = spec["num_speculative_tokens"]
    # Every draft on the greedy path is accepted: full steps emit k + 1 tokens.
    assert stats.accepted_per_position[k - 1] > 0
    assert stats.mean_acceptance_length > 0.8 * (k + 1)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


@pytest.mark.parametrize("name", ["eagle-chain", "eagle-tree", "medusa-chain", "medusa-tree"])
def test_reduced_draft_vocabulary(perm_setup, name):
    """``draft_vocab`` (the EAGLE-2 head or Medusa drafting over a subset of the target's vocabulary):
    with the copying heads, a vocabulary holding the continuation's tokens keeps every first draft
    accepted, one without them gets no draft accepted, and the output is plain greedy decoding's either
    way."""
    prompts = _prompts(2, PERM_VOCAB)
    max_tokens = [21, 25]
    base, _ = _run(perm_setup / "target", prompts, max_tokens)
    needed = sorted({t for out in base for t in out})
    spec = dict(SPECS[name], model=str(perm_setup / SPECS[name]["method"]))
    k = spec["num_speculative_tokens"]
    got, llm = _run(perm_setup / "target", prompts, max_tokens, dict(spec, draft_vocab=needed))
    assert got == base and len(llm.engine.drafter.vocab) == len(needed) < PERM_VOCAB
    assert llm.engine.spec_stats.mean_acceptance_length > 0.8 * (k + 1)
    others = [t for t in range(PERM_VOCAB) if t not in needed]
    got, llm = _run(perm_setup / "target", prompts, max_tokens, dict(spec, draft_vocab=others))
    assert got == base
    assert llm.engine.spec_stats.num_drafts > 0 and llm.engine.spec_stats.num_accepted_tokens == 0


@pytest.mark.parametrize(
    ("name", "quantization", "reduced"),
    [
        ("eagle-chain", "int8", False),
        ("eagle-tree", "int8", True),
        ("medusa-chain", "int8", False),
        ("medusa-tree", "int8", True),
    ],
)
def test_quantized_heads(perm_setup, name, quantization, reduced):
    """``quantization`` for a head: its linears and the LM-head rows it drafts through (the whole
    vocabulary's, or ``draft_vocab``'s) are weight-only quantized; the copying heads' drafts stay right
    (acceptance as unquantized) and the output is plain greedy decoding's."""
    from specdec.quantization.linear import QuantizedLinear

    prompts, max_tokens = _prompts(2, PERM_VOCAB), [21, 25]
    base, _ = _run(perm_setup / "target", prompts, max_tokens)
    spec = dict(SPECS[name], model=str(perm_setup / SPECS[name]["method"]), quantization=quantization)
    if reduced:
        spec["draft_vocab"] = sorted({t for out in base for t in out})
    got, llm = _run(perm_setup / "target", prompts, max_tokens, spec)
    assert got == base
    k = spec["num_speculative_tokens"]
    assert llm.engine.spec_stats.mean_acceptance_length > 0.8 * (k + 1)
    drafter = llm.engine.drafter
    heads = drafter.heads if name.startswith("medusa") else drafter.head
    linears = [m for m in heads.modules() if isinstance(m, QuantizedLinear)]
    assert linears and not [m for m in heads.modules() if type(m) is torch.nn.Linear]
    assert drafter.vocab is not None and drafter.vocab.quantized is not None
    assert len(drafter.vocab) == (len(spec["draft_vocab"]) if reduced else PERM_VOCAB)
    assert type(llm.engine.model.lm_head) is not QuantizedLinear  # the target keeps its own


def test_a_head_quantization_that_does_not_fit_is_a_config_error(perm_setup):
    spec = dict(SPECS["eagle-chain"], model=str(perm_setup / "eagle"))
    spec["quantization"] = {"method": "int4", "group_size": 32}  # the head's MLP input is 48 wide
    with pytest.raises(ConfigError, match="int4 group_size 32 does not divide the input size 48"):
        _run(perm_setup / "target", [[3, 4, 5]], [4], spec)
    with pytest.raises(ConfigError, match="applies to method"):
        _run(perm_setup / "target", [[3, 4, 5]], [4], {"method": "ngram", "quantization": "int8"})


def test_draft_vocab_errors(random_setup, perm_setup):
    from specdec.config import SpeculativeConfig

    eagle = {"method": "eagle", "model": str(random_setup / "eagle")}
    for bad in ([], [1, -2], [1.5], [True], {"a": 1}):
        with pytest.raises(ConfigError, match="draft_vocab"):
            SpeculativeConfig(**eagle, draft_vocab=bad)
    only = r"draft_vocab=.* applies to method 'quantized_self' or 'medusa' or 'eagle' or 'hybrid' only"
    with pytest.raises(ConfigError, match=only):
        SpeculativeConfig(method="ngram", draft_vocab=[1, 2])
    with pytest.raises(ConfigError, match="outside the target's vocabulary"):
        LLM(
            random_setup / "target",
            skip_tokenizer_init=True,
            speculative_config=dict(eagle, draft_vocab=[3, VOCAB]),
        )
    tree = dict(eagle, tree="dynamic", tree_topk=3, draft_vocab=[3, 4])
    with pytest.raises(ConfigError, match="tree_topk=3 exceeds the draft vocabulary"):
        LLM(random_setup / "target", skip_tokenizer_init=True, speculative_config=tree)
    with pytest.raises(ConfigError, match="no draft heads named"):
        LLM(
            random_setup / "target",
            skip_tokenizer_init=True,
            speculative_config=dict(eagle, draft_vocab="nope"),
        )


def test_sampled_requests_run_with_trees(random_setup):
    """Sampled requests with a tree: tokens stay in range and seeded runs repeat (exactness itself is
    proven by tests/test_tree_verification.py)."""
    spec = dict(SPECS["eagle-tree"], model=str(random_setup / "eagle"))
    llm = LLM(random_setup / "target", skip_tokenizer_init=True, block_size=4, speculative_config=spec)
    sp = SamplingParams(temperature=0.8, max_tokens=15, seed=7, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts(3, VOCAB)]
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    b = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert a == b and all(len(x) == 15 and all(0 <= t < VOCAB for t in x) for x in a)


def test_head_errors(random_setup, perm_setup, tmp_path):
    target = random_setup / "target"
    with pytest.raises(ConfigError, match="no draft heads"):
        LLM(target, skip_tokenizer_init=True, speculative_config={"method": "eagle", "model": "nope"})
    with pytest.raises(ConfigError, match="medusa heads, not eagle"):
        LLM(
            target,
            skip_tokenizer_init=True,
            speculative_config={"method": "eagle", "model": str(random_setup / "medusa")},
        )
    with pytest.raises(InvalidRequestError, match="hidden size"):
        LLM(
            target,
            skip_tokenizer_init=True,
            speculative_config={"method": "medusa", "model": str(perm_setup / "medusa")},
        )
    with pytest.raises(ConfigError, match="needs method 'eagle'"):
        LLM(target, skip_tokenizer_init=True, speculative_config={"method": "medusa", "tree": "dynamic"})
    with pytest.raises(ConfigError, match="needs method"):
        LLM(target, skip_tokenizer_init=True, speculative_config={"method": "ngram", "tree": "static"})
    with pytest.raises(ValueError, match="only 4 Medusa heads"):
        LLM(
            target,
            skip_tokenizer_init=True,
            speculative_config={
                "method": "medusa",
                "model": str(random_setup / "medusa"),
                "num_speculative_tokens": 5,
            },
        )
    # A truncated weight file is a CorruptModelError naming the directory.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((random_setup / "eagle" / "config.json").read_text())
    (bad / "model.safetensors").write_bytes((random_setup / "eagle" / "model.safetensors").read_bytes()[:100])
    with pytest.raises(CorruptModelError, match="bad"):
        load_heads(str(bad), ModelArchConfig.from_pretrained(target), "eagle", torch.float32)


@pytest.mark.parametrize("name", ["medusa-tree", "eagle-chain", "eagle-tree"])
def test_prefix_caching_and_preemption(random_setup, name):
    """Shared prefixes (prefix-cache hits) and a KV pool so small that requests are preempted and
    recomputed: the drafters rebuild their state and the output stays plain greedy."""
    from specdec.kv_cache.manager import cdiv

    target = random_setup / "target"
    shared = _prompts(1, VOCAB)[0] * 3
    prompts = [shared + p for p in _prompts(4, VOCAB)]
    base, _ = _run(target, prompts, [24] * 4)
    spec = dict(SPECS[name], model=str(random_setup / SPECS[name]["method"]))
    from specdec.config import SpeculativeConfig

    slots = SpeculativeConfig(**spec).num_draft_slots
    need = cdiv(max(len(p) for p in prompts) + 24 - 1 + slots, 4)
    llm = LLM(target, skip_tokenizer_init=True, block_size=4, speculative_config=spec, num_kv_blocks=need + 2)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert got == base
    assert max(llm.engine.scheduler.num_preemptions_by_request.values()) >= 1
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


@pytest.mark.real_model
def test_smollm2_with_our_heads_greedy_equality(smollm2_dir, smol_reference):
    """The packaged SmolLM2 with the built-in Medusa, EAGLE and EAGLE-3 heads (loaded by name), float32:
    output equals transformers' greedy decoding token for token. Chains: the 5 prompts batched, then one
    alone; trees and the reduced vocabulary: 2 prompts batched (the suite's time)."""
    prompts, refs = smol_reference
    specs = [  # (speculative_config, prompts batched, then one alone)
        ({"method": "medusa", "num_speculative_tokens": 4}, 5, True),
        ({"method": "medusa", "num_speculative_tokens": 4, "tree": "static"}, 2, False),
        ({"method": "eagle", "num_speculative_tokens": 4}, 5, True),
        ({"method": "eagle", "num_speculative_tokens": 5, "tree": "dynamic"}, 2, False),
        ({"method": "eagle3", "num_speculative_tokens": 4}, 5, True),
        ({"method": "eagle3", "num_speculative_tokens": 5, "tree": "dynamic"}, 2, False),
        # The EAGLE-2 head over the EAGLE-3 head's 8,192-token draft vocabulary.
        (
            {"method": "eagle", "num_speculative_tokens": 4, "draft_vocab": "smollm2-135m-instruct-eagle3"},
            2,
            False,
        ),
    ]
    sp = SamplingParams(temperature=0, max_tokens=64)
    for spec, n, alone in specs:
        llm = LLM(smollm2_dir, dtype="float32", speculative_config=spec)
        batched = llm.generate([{"prompt_token_ids": p} for p in prompts[-n:]], sp)
        assert [o.outputs[0].token_ids for o in batched] == refs[-n:], spec
        if alone:
            single = llm.generate([{"prompt_token_ids": prompts[0]}], sp)
            assert single[0].outputs[0].token_ids == refs[0], spec
        assert llm.engine.spec_stats.num_accepted_tokens > 0, spec


def test_tree_and_head_config_errors(random_setup, tmp_path):
    """Found by a break-test pass: each of these used to pass construction and crash later, or raise a
    raw Python error."""
    import json

    from specdec.config import SpeculativeConfig

    target = random_setup / "target"
    medusa, eagle = str(random_setup / "medusa"), str(random_setup / "eagle")
    wide_static = {"method": "medusa", "model": medusa, "tree": "static", "tree_choices": [[0], [VOCAB]]}
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(target, skip_tokenizer_init=True, speculative_config=wide_static)
    wide_dynamic = {"method": "eagle", "model": eagle, "tree": "dynamic", "tree_topk": VOCAB + 1}
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(target, skip_tokenizer_init=True, speculative_config=wide_dynamic)
    for choices in ([[i] for i in range(65)], "01", [[0.7]], [[True]], [0, 1]):
        with pytest.raises(ConfigError, match="tree_choices"):
            SpeculativeConfig(method="medusa", tree="static", tree_choices=choices)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="model must be"):
        SpeculativeConfig(method="eagle", model=5)  # type: ignore[arg-type]
    raw = json.loads((random_setup / "eagle" / "config.json").read_text())
    arch = ModelArchConfig.from_pretrained(target)
    for broken in (
        {**raw, "arch": {k: v for k, v in raw["arch"].items() if k != "inv_freq"}},
        {**raw, "arch": "llama"},
        {**raw, "num_heads": 2.5},
        {**raw, "hidden_size": "96"},
    ):
        d = tmp_path / f"broken{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(broken))
        (d / "model.safetensors").write_bytes((random_setup / "eagle" / "model.safetensors").read_bytes())
        with pytest.raises(CorruptModelError):
            load_heads(str(d), arch, "eagle", torch.float32)


def test_hydra_drafter_group_passes_head_quantization():
    from hydra import compose, initialize_config_module

    from experiments.config import register_configs, to_experiment_config

    register_configs()
    with initialize_config_module("experiments.conf", version_base=None):
        cfg = to_experiment_config(
            compose("config", overrides=["drafter=eagle3", "drafter.quantization=int8"])
        )
        assert cfg.drafter.speculative_config()["quantization"] == "int8"
        cfg = to_experiment_config(compose("config", overrides=["drafter=medusa"]))
        assert "quantization" not in cfg.drafter.speculative_config()


@pytest.mark.parametrize("member", ["medusa", "eagle"])
def test_a_hybrid_reads_each_heads_first_draft_probability(random_setup, member):
    """As a hybrid member (drafting every step here) each head reports the probability of its first draft
    under its own distribution, a number in (0, 1], and outputs stay those of plain greedy decoding."""
    prompts = _prompts(3, VOCAB)
    base, _ = _run(random_setup / "target", prompts, [12, 12, 12])
    spec = {
        "method": "hybrid",
        "num_speculative_tokens": 3,
        "hybrid_members": [member, "ngram"],
        "model": str(random_setup / member),
        "hybrid_skip_outranked": False,
    }
    llm = LLM(random_setup / "target", skip_tokenizer_init=True, block_size=4, speculative_config=spec)
    head = llm.engine.drafter.members[0]
    seen: list[float | None] = []
    propose = head.propose

    def recording(batch):
        out = propose(batch)
        seen.extend(p.first_draft_prob for p in out if p.token_ids)
        return out

    head.propose = recording
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) for _ in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == base
    assert seen and all(p is not None and 0 < p <= 1 for p in seen)
    assert {kind for kind, _ in llm.engine.drafter.calibration[0]} == {"prob"}


@register_policy("test_eagle_late")
class _LateEaglePolicy:
    """No drafts until a request has written 6 tokens, then all it may; records each granted draft's
    ``draft_backlog`` and each step's reported catch-up."""

    def __init__(self, ctx) -> None:
        self.granted: list[tuple[str, int, int]] = []  # (request, its tokens, draft_backlog)
        self.catch_up: list[tuple[int, float]] = []  # per step: (catch_up_tokens, catch_up_s)

    def decide(self, batch):
        out = [x.max_drafts if x.request.num_output_tokens >= 6 else 0 for x in batch]
        self.granted += [
            (x.request.request_id, x.request.num_tokens, x.draft_backlog) for x, d in zip(batch, out) if d
        ]
        return out

    def observe_step(self, step) -> None:
        self.catch_up.append((step.catch_up_tokens, step.catch_up_s))


@pytest.mark.parametrize("hybrid", [False, True])
def test_an_eagle_head_reports_its_catch_up_to_the_policy(random_setup, hybrid):
    """An EAGLE head reads the committed tokens lazily: its first draft for a request computes head K/V for
    the whole prompt and the tokens since. It tells the policy that backlog before the step (the
    request's tokens less 2: the last feature rides in the drafting row, the newest token has none) and
    reports the rows it caught up and their share of the forward's seconds after it, as a draft model
    does, so a policy does not take a prompt's catch-up for the cost of drafting (goodput did: 8 ms per
    draft position learned from a first step, against 0.8 ms). Through a hybrid alike. Outputs stay plain
    greedy decoding's."""
    prompts = _prompts(3, VOCAB)
    base, _ = _run(random_setup / "target", prompts, [14, 14, 14])
    spec = {"method": "eagle", "num_speculative_tokens": 3, "model": str(random_setup / "eagle")}
    if hybrid:
        spec = {
            **spec,
            "method": "hybrid",
            "hybrid_members": ["eagle", "ngram"],
            "hybrid_skip_outranked": False,
        }
    got, llm = _run(random_setup / "target", prompts, [14, 14, 14], {**spec, "policy": "test_eagle_late"})
    assert got == base
    policy = llm.engine.policy
    first = {}
    for rid, num_tokens, backlog in policy.granted:
        first.setdefault(rid, (num_tokens, backlog))
    assert len(first) == 3 and all(backlog == n - 2 for n, backlog in first.values())
    assert {n - 6 for n, _ in first.values()} == {len(p) for p in prompts}
    # Every backlog granted was caught up and reported, in the steps that drafted.
    assert sum(b for _, _, b in policy.granted) == sum(n for n, _ in policy.catch_up) > 0
    assert all(s > 0 for n, s in policy.catch_up if n) and all(s == 0 for n, s in policy.catch_up if not n)


def test_eagle_state_copies_step_views_into_its_own_rows():
    """A request that never drafts appends a view of each step's features; every MAX_FEATURE_CHUNKS
    chunks they become one tensor of its own (the steps' whole tensors are no longer held), with the
    same rows at the same positions."""
    from specdec.drafters.eagle import MAX_FEATURE_CHUNKS, _EagleState

    state = _EagleState(num_computed=10, features_start=10)
    steps = [torch.randn(8, 6) for _ in range(MAX_FEATURE_CHUNKS + 5)]  # each step: 8 rows, ours is row 3
    for step in steps:
        state.append(step[3:4])
    assert len(state.features) == 1 + 5 and state.num_features == len(steps) == state.features_end - 10
    own = state.features[0].untyped_storage().data_ptr()
    assert all(own != s.untyped_storage().data_ptr() for s in steps)
    assert state.features[0].shape == (MAX_FEATURE_CHUNKS, 6)
    assert torch.equal(state.feature_rows(10, 10 + len(steps)), torch.stack([s[3] for s in steps]))
    assert torch.equal(state.feature_rows(12, 14), torch.stack([steps[2][3], steps[3][3]]))
