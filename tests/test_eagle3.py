"""EAGLE-3 (``method="eagle3"``): the target's fused layers, the head, the training-time test, the drafter.

- The features the engine hands over are transformers' ``hidden_states`` of the chosen layers.
- The training-time test computes, for every root and step, exactly what chain drafting computes (a
  naive step-by-step dense run of the head).
- A hand-built copying head on a permutation target drafts every first token right: greedy outputs equal
  plain decoding and every first draft is accepted (chains and trees), through ``d2t``.
- A random head with a reduced draft vocabulary: greedy equality, drafts only from the draft vocabulary.
- Sampled requests (chains draw from the draft distribution, zero outside the draft vocabulary; trees
  deterministic): the first three tokens follow the target's exact distribution (chi-square, alpha =
  1e-3), and reporting the unmasked distribution as ``draft_probs`` (a drafter lying about ``q``) is
  rejected by the same test.
- Training on a tiny target reloads to identical outputs; bad configurations are clear errors.
"""

from __future__ import annotations

import json

import pytest
import torch

from sampling.params import SamplingParams
from specdec import LLM
from specdec.drafters.eagle3_head import Eagle3Head, check_vocab_maps, default_feature_layers, vocab_maps
from specdec.drafters.heads import HeadConfig, arch_fields, save_heads
from specdec.errors import ConfigError, CorruptModelError, InvalidRequestError
from specdec.models.config import ModelArchConfig
from tests.test_learned_drafters import _prompts, _run

VOCAB = 64
PERM_VOCAB = 32
SHIFT = 5

pytestmark = pytest.mark.usefixtures("fast_cpu_settings")


def _save_head(head: Eagle3Head, target_dir, out) -> None:
    arch = head.arch
    cfg = HeadConfig(
        method="eagle3",
        target=str(target_dir),
        hidden_size=arch.hidden_size,
        vocab_size=arch.vocab_size,
        arch=arch_fields(arch),
        draft_vocab_size=head.draft_vocab_size,
        feature_layers=list(head.feature_layers),
    )
    save_heads(head, cfg, out)


def _random_head(arch: ModelArchConfig, draft_ids: list[int], layers=(0, 1, 2), seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(arch, len(draft_ids), layers)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    head.set_vocab(draft_ids)
    return head


@pytest.fixture(scope="module")
def random_setup(tmp_path_factory):
    from tests.conftest import make_tiny_hf_model

    root = tmp_path_factory.mktemp("eagle3_random")
    make_tiny_hf_model("llama", 4, 2, False, vocab_size=VOCAB, seed=5).save_pretrained(root / "target")
    arch = ModelArchConfig.from_pretrained(root / "target")
    draft_ids = sorted(set(range(0, VOCAB, 2)) | {3, 9, 21})  # 35 of 64 tokens
    _save_head(_random_head(arch, draft_ids), root / "target", root / "head")
    return root, draft_ids


@pytest.fixture(scope="module")
def perm_setup(tmp_path_factory):
    """A one-layer target whose greedy next token is ``(x + SHIFT) % V`` (attention and MLP zeroed, so
    the stream entering layer 0 is ``sqrt(V) onehot(x)``), and an EAGLE-3 head that reads that stream of
    the root t and drafts ``x_t + 2 SHIFT`` = ``x_{t+2}``: every first draft is right, later ones not."""
    from tests.conftest import save_permutation_target

    root = tmp_path_factory.mktemp("eagle3_perm")
    h = PERM_VOCAB
    perm = save_permutation_target(root / "target", h, SHIFT)  # perm @ onehot(x) = onehot(x + SHIFT)
    arch = ModelArchConfig.from_pretrained(root / "target")
    head = Eagle3Head(arch, h, (0, 1, 1))
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        head.fc.weight[:, :h].copy_(torch.eye(h))  # the stream entering layer 0 of the root
        head.layer.hidden_norm.weight.fill_(1.0)
        head.layer.input_layernorm.weight.fill_(1.0)
        head.layer.post_attention_layernorm.weight.fill_(1.0)
        head.norm.weight.fill_(1.0)
        head.lm_head.weight.copy_(3.0 * perm @ perm)  # x -> x + 2 SHIFT
    head.set_vocab(list(range(h)))
    _save_head(head, root / "target", root / "head")
    return root


CHAIN = {"method": "eagle3", "num_speculative_tokens": 3}
TREE = {
    "method": "eagle3",
    "num_speculative_tokens": 3,
    "tree": "dynamic",
    "tree_topk": 3,
    "max_tree_nodes": 8,
}


# ------------------------------------------------------------------------------------- features
def test_feature_layers_are_transformers_hidden_states():
    from specdec.attention.dense import DenseAttention, dense_metadata
    from specdec.models.decoder import DecoderLM
    from tests.conftest import make_tiny_hf_model

    hf = make_tiny_hf_model("llama", 4, 2, False, vocab_size=VOCAB, seed=7)
    hf.config.num_hidden_layers = 2
    ours = DecoderLM(ModelArchConfig.from_hf_config(hf.config)).eval()
    ours.load_state_dict(_our_state(hf), strict=False)
    ids = torch.tensor([5, 9, 11, 3, 7, 7, 30])
    with torch.no_grad():
        want = hf(ids[None], output_hidden_states=True).hidden_states
        ours.set_feature_layers((0, 1, 2))
        logits, feats = ours(
            ids, torch.arange(7), [(None, None)] * 2, dense_metadata([7]), DenseAttention(), all_hidden=True
        )
    h = hf.config.hidden_size
    assert feats.shape == (7, 3 * h)
    torch.testing.assert_close(feats[:, :h], want[0][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(feats[:, h : 2 * h], want[1][0], rtol=0, atol=1e-5)
    # index num_layers: the last layer's output before the final norm (HF's last entry is after it)
    torch.testing.assert_close(ours.norm(feats[:, 2 * h :]), want[2][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits, hf(ids[None]).logits[0], rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="outside"):
        ours.set_feature_layers((0, 3))


def _our_state(hf) -> dict[str, torch.Tensor]:
    """transformers' Llama weights under our fused names."""
    sd = hf.state_dict()
    out = {"embed_tokens.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(hf.config.num_hidden_layers):
        p = f"model.layers.{i}."
        out[f"layers.{i}.qkv_proj.weight"] = torch.cat(
            [sd[p + f"self_attn.{n}_proj.weight"] for n in ("q", "k", "v")]
        )
        out[f"layers.{i}.o_proj.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[f"layers.{i}.gate_up_proj.weight"] = torch.cat(
            [sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]
        )
        out[f"layers.{i}.down_proj.weight"] = sd[p + "mlp.down_proj.weight"]
        out[f"layers.{i}.input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        out[f"layers.{i}.post_attention_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
    return out


# -------------------------------------------------------------------------- training-time test
def test_training_time_test_computes_what_chain_drafting_computes(random_setup):
    """Every step j of every root t of the TTT equals a dense causal run of the head over the true
    context 0..t followed by the chain's own steps 2..j (what the drafter's paged cache holds)."""
    from experiments.train.objectives.eagle3 import Eagle3Batch, ttt_unroll
    from experiments.train.target import FrozenTarget
    from specdec.attention.dense import DenseAttention, dense_metadata

    root, draft_ids = random_setup
    target = FrozenTarget.load(root / "target")
    arch = target.arch
    head = _random_head(arch, draft_ids, seed=3).double()
    target = FrozenTarget(arch, target.embed.double(), target.lm_head)
    g = torch.Generator().manual_seed(0)
    lens, starts = [9, 7], [3, 2]
    h = arch.hidden_size
    batch = Eagle3Batch(
        lens,
        starts,
        torch.randint(0, VOCAB, (sum(lens),), generator=g),
        torch.randn(sum(lens), 3 * h, generator=g, dtype=torch.float64),
        torch.randn(sum(lens), h, generator=g).bfloat16(),
        torch.zeros(sum(lens), dtype=torch.int64),
    )
    steps = 3
    with torch.no_grad():
        got = ttt_unroll(head, target, batch, steps)
    checked = 0
    for n, offset in zip(lens, (0, lens[0])):
        x = batch.tokens[offset : offset + n]
        aux = batch.aux[offset : offset + n]
        for t in range(n - 1):
            embeds, feats, positions = [], [], []
            for p in range(t + 1):  # the true context: (x_{p+1}, aux_p) at position p
                embeds.append(target.embed[x[p + 1]])
                feats.append(head.fc(aux[p]))
                positions.append(p)
            hidden_prev = None
            for j in range(1, steps + 1):
                if t + j > n - 1:
                    break
                if j > 1:
                    embeds.append(target.embed[x[t + j]])
                    feats.append(hidden_prev)
                    positions.append(t + j - 1)
                m = len(embeds)
                with torch.no_grad():
                    out = head(
                        torch.stack(embeds),
                        torch.stack(feats),
                        torch.tensor(positions),
                        (None, None),
                        dense_metadata([m]),
                        DenseAttention(),
                    )
                hidden_prev = out[-1]
                step = got[j - 1]
                where = (step.rows == offset + t).nonzero()
                if j > 1 and len(where) == 0:
                    continue  # a root whose chain cannot reach the response: not computed
                torch.testing.assert_close(
                    step.hidden[int(where)], hidden_prev, rtol=0, atol=1e-5
                )  # norms run in float32
                checked += 1
    assert checked > 25


def test_draft_vocabulary_selection():
    from experiments.train.data import DistilData
    from experiments.train.objectives.eagle3 import select_draft_vocab, vocab_coverage

    toks = [torch.tensor([1, 1, 5, 5, 5, 6]), torch.tensor([1, 7, 7, 6])]
    tops = [
        torch.tensor([-1, 5, 5, 5, 6, 0], dtype=torch.int32),
        torch.tensor([7, 7, 6, 0], dtype=torch.int32),
    ]
    data = DistilData(
        toks, [2, 1], [torch.zeros(6, 4), torch.zeros(4, 4)], ["a", "b"], ["c", "c"], top_tokens=tops
    )
    # EOS first, then top tokens by count (5: 3, 7: 2, 6: 2 -> ties by id), then response tokens, then ids
    assert select_draft_vocab(data, 4, [2], 10) == [2, 5, 6, 7]
    assert select_draft_vocab(data, 6, [2], 10) == [2, 5, 6, 7, 0, 1]
    assert vocab_coverage(data, [5, 6]) == pytest.approx(5 / 7)
    with pytest.raises(ValueError, match="draft vocabulary size"):
        select_draft_vocab(data, 11, [2], 10)


# ------------------------------------------------------------------------------------ drafting
@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("batch", [1, 4])
def test_copying_head_first_drafts_always_accepted(perm_setup, spec, batch):
    prompts = _prompts(batch, PERM_VOCAB)
    max_tokens = [21 + 4 * i for i in range(batch)]
    base, _ = _run(perm_setup / "target", prompts, max_tokens)
    for p, out in zip(prompts, base):  # the target really is the permutation
        assert out[0] == (p[-1] + SHIFT) % PERM_VOCAB
    got, llm = _run(perm_setup / "target", prompts, max_tokens, dict(spec, model=str(perm_setup / "head")))
    assert got == base
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0
    assert stats.accepted_per_position[0] == stats.drafted_per_position[0]  # every first draft right
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("batch", [1, 4])
def test_reduced_vocabulary_greedy_equality(random_setup, spec, batch, monkeypatch):
    from specdec.drafters.eagle3 import Eagle3Drafter

    root, draft_ids = random_setup
    drafted: list[int] = []
    propose = Eagle3Drafter.propose

    def recording(self, inputs):
        out = propose(self, inputs)
        drafted.extend(t for p in out for t in p.token_ids)
        return out

    monkeypatch.setattr(Eagle3Drafter, "propose", recording)
    prompts = _prompts(batch, VOCAB)
    max_tokens = [19 + 4 * i for i in range(batch)]
    base, _ = _run(root / "target", prompts, max_tokens)
    got, llm = _run(root / "target", prompts, max_tokens, dict(spec, model=str(root / "head")))
    assert got == base
    assert drafted and set(drafted) <= set(draft_ids)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


# ---------------------------------------------------------------------------------------- errors
def test_errors(random_setup, tmp_path):
    root, draft_ids = random_setup
    target = root / "target"
    arch = ModelArchConfig.from_pretrained(target)
    with pytest.raises(ConfigError, match="exceeds the draft vocabulary"):
        LLM(
            target,
            skip_tokenizer_init=True,
            speculative_config=dict(TREE, model=str(root / "head"), tree_topk=36),
        )
    with pytest.raises(ConfigError, match="at least 7 layers"):
        default_feature_layers(6)
    assert default_feature_layers(30) == (2, 15, 27)
    with pytest.raises(ConfigError, match="two draft tokens"):
        check_vocab_maps(torch.tensor([0, -1]), torch.zeros(VOCAB, dtype=torch.bool), VOCAB)
    with pytest.raises(ConfigError, match="outside the target"):
        vocab_maps([VOCAB], VOCAB)
    with pytest.raises(ConfigError, match="three target layers"):
        Eagle3Head(arch, 8, (0, 1))
    with pytest.raises(ConfigError, match="draft_vocab_size must be"):
        Eagle3Head(arch, VOCAB + 1, (0, 1, 2))
    # a head for a deeper target: its layers do not fit this one
    import dataclasses

    deep = _random_head(dataclasses.replace(arch, num_layers=6), draft_ids, layers=(0, 1, 5))
    _save_head(deep, target, tmp_path / "deep")
    with pytest.raises(InvalidRequestError, match="feature layers"):
        LLM(target, skip_tokenizer_init=True, speculative_config=dict(CHAIN, model=str(tmp_path / "deep")))
    # a corrupt vocabulary map
    _save_head(_random_head(arch, draft_ids), target, tmp_path / "corrupt")
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / "corrupt" / "model.safetensors"))
    weights["d2t"][1] = -1  # draft tokens 0 and 1 -> the same target token
    save_file(weights, str(tmp_path / "corrupt" / "model.safetensors"))
    with pytest.raises(CorruptModelError, match="two draft tokens"):
        LLM(target, skip_tokenizer_init=True, speculative_config=dict(CHAIN, model=str(tmp_path / "corrupt")))
    raw = json.loads((root / "head" / "config.json").read_text())
    raw.pop("draft_vocab_size")
    (tmp_path / "noconf").mkdir()
    (tmp_path / "noconf" / "config.json").write_text(json.dumps(raw))
    (tmp_path / "noconf" / "model.safetensors").write_bytes(
        (root / "head" / "model.safetensors").read_bytes()
    )
    with pytest.raises(CorruptModelError, match="draft_vocab_size"):
        LLM(target, skip_tokenizer_init=True, speculative_config=dict(CHAIN, model=str(tmp_path / "noconf")))


# -------------------------------------------------------------------------------------- training
def test_eagle3_trains_saves_reloads_and_drafts(tmp_path):
    """``python -m experiments.train drafter=eagle3`` on a tiny target: data with the fused layers and
    the target's top tokens, a draft vocabulary from the training split, the training-time test; the
    checkpoint reloads (our layout) to the trained weights and drafts greedy-exactly; an EAGLE-1 run on
    the same prompts reuses the generated responses, a Medusa run the EAGLE-3 data itself."""
    from hydra import compose, initialize_config_module

    from experiments.config import register_configs, to_train_config
    from experiments.train import FrozenTarget, run_training
    from experiments.train.data import load_data
    from specdec.drafters.eagle3_layouts import load_eagle3_head
    from tests.conftest import make_tiny_hf_model

    target_dir = tmp_path / "tiny"
    make_tiny_hf_model("llama", 4, 2, False, vocab_size=96, seed=3).save_pretrained(
        target_dir, safe_serialization=True
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (12,), generator=g).tolist() for _ in range(10)]

    def cfg(drafter: str, *extra: str):
        overrides = [
            f"drafter={drafter}",
            f"model.name={target_dir}",
            "model.dtype=float32",
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.max_new_tokens=24",
            "data.heldout_fraction=0.2",
            "train.time_budget_s=null",
            "train.eval=false",
            "train.torch_threads=1",
            "train.warmup_steps=5",
            "train.log_every=5",
            "train.lr=0.01",
            "train.batch_tokens=72",
            f"train.out_dir={tmp_path / drafter}",
            *extra,
        ]
        return to_train_config(compose(config_name="train", overrides=overrides))

    register_configs()
    with initialize_config_module(config_module="experiments.conf", version_base=None):
        e3 = cfg(
            "eagle3",
            "train.epochs=40",
            "data.feature_layers=[0,1,2]",
            "train.eagle3_draft_vocab_size=48",
            "train.eagle3_ttt_steps=3",
        )
        summary = run_training(e3, tmp_path / "run", prompt_ids=prompts)
        eagle = run_training(cfg("eagle", "train.epochs=1"), None, prompt_ids=prompts)
        # Medusa on the EAGLE-3 data itself (its final-norm part): the cached data, not featurised again
        medusa = run_training(
            cfg("medusa", "train.epochs=1", "data.feature_layers=[0,1,2]"), None, prompt_ids=prompts
        )
    assert summary["final_train_loss"] < 0.8 * summary["initial_train_loss"]
    m = summary["final_metrics"]
    assert len(m["top1_per_step"]) == 3 and 0.5 < m["draft_vocab_coverage"] <= 1.0
    data = load_data(__import__("pathlib").Path(summary["data_dir"]))
    h = 64
    assert data.top_tokens is not None and all(f.shape[1] == 4 * h for f in data.features)
    assert eagle["responses_cached"] and not eagle["data_cached"]  # same responses, other features
    assert medusa["data_cached"] and medusa["data_fingerprint"] == summary["data_fingerprint"]
    target = FrozenTarget.load(target_dir)
    head, config = load_eagle3_head(tmp_path / "eagle3", target.arch, torch.float32)
    assert (config.draft_vocab_size, config.feature_layers) == (48, [0, 1, 2])
    assert head.target_ids().tolist() == sorted(head.target_ids().tolist()) and head.t2d.sum() == 48
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "eagle3" / "model.safetensors"))
    for name, value in head.state_dict().items():
        torch.testing.assert_close(value, saved[name].to(value.dtype), rtol=0, atol=0)
    prompts4 = _prompts(3, 96)
    base, _ = _run(target_dir, prompts4, [20, 24, 28])
    got, llm = _run(target_dir, prompts4, [20, 24, 28], dict(CHAIN, model=str(tmp_path / "eagle3")))
    assert got == base and llm.engine.spec_stats.num_drafts > 0


def test_compiled_target_hands_over_the_fused_layers(perm_setup):
    """On a compiled target (piecewise torch.compile) the feature streams come out of the compiled graph:
    the copying head's first drafts are still all accepted, and outputs equal eager plain decoding."""
    prompts = _prompts(3, PERM_VOCAB)
    max_tokens = [17, 21, 25]
    base, _ = _run(perm_setup / "target", prompts, max_tokens)
    llm = LLM(
        perm_setup / "target",
        skip_tokenizer_init=True,
        block_size=4,
        compile={"buckets": [8, 64]},
        speculative_config=dict(CHAIN, model=str(perm_setup / "head")),
    )
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == base
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.accepted_per_position[0] == stats.drafted_per_position[0]
    assert llm.engine.runner.compile_stats.compiled_calls > 0
