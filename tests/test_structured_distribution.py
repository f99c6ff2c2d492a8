"""Constrained decoding samples exactly the masked-and-renormalised target distribution, with and
without speculation.

A tiny random Llama with a vocabulary of 8 gets a word-level tokenizer of its own: ``a b </s> c d ab ba
cd`` (id 2 = EOS). The grammar is the regex ``a[ab]*c[abd]*dd``: the first token must start with ``a``,
``c`` appears once, and the shortest match (``a`` ``cd`` ``d``) takes three tokens, so EOS cannot occur
among the first three. The allowed tokens after every prefix are computed independently of the grammar
backends (each of llguidance, outlines-core and xgrammar is tested): by brute force over every string of
up to 9 characters that fully matches the regex (Python ``re``). The exact joint of the first three
tokens is ``prod_i softmax(masked logits_i / T)`` in float64 from transformers' logits.

Per decoding mode and grammar backend (llguidance, outlines-core, xgrammar), 50,000 samples under
llguidance and 25,000 under the others (half of that for trees; calls of 2,500 requests mixing
temperatures 0.8 and 1.3 and seeded with unseeded requests, plus greedy requests that must give the
exact masked argmax chain and unconstrained requests in the same batch) pass the chi-square test of
:mod:`tests.stats` at ``alpha = 1e-3`` per temperature: 24 tests. Modes: plain, n-gram drafter (k = 2;
drafts the grammar forbids are cut before verification), draft model (k = 2; the draft distribution is
masked too) and token trees (issue 20): an oracle drafter that knows the target proposes, at the first
output position, a depth-3 tree mixing the likeliest allowed tokens with forbidden ones
(:func:`oracle_tree`; the forbidden nodes are pruned with their subtrees, every other node's row is
masked by the grammar after its own path).
Negative controls: a draft model that draws from its masked distribution but reports the unmasked one
as ``draft_probs``, and trees whose rows are all masked by the root's grammar state (not their path's),
must fail.
"""

from __future__ import annotations

import itertools
import os
import re

import pytest
import torch

from sampling.params import SamplingParams
from specdec import LLM
from specdec.drafters.base import DrafterBase, DraftInput, DraftProposal
from tests.conftest import first_three_logits, save_target_and_draft
from tests.stats import ALPHA, assert_differs, counts_of, goodness_of_fit

VOCAB = ["a", "b", "</s>", "c", "d", "ab", "ba", "cd"]
V = len(VOCAB)
EOS = 2
REGEX = "a[ab]*c[abd]*dd"
#: after the first token the grammar forces the bytes "cd": "c" then "d", or the token "cd"
FORCED_REGEX = "[ab]cd[ab]d"
PROMPT = [0, 5, 3, 4, 1, 6, 7, 0]
TEMPERATURES = (0.8, 1.3)
K = 2
BATCH = 2500
NUM_CALLS = 20 // int(os.environ.get("SPECDEC_TEST_SCALE_DOWN", "1"))  # > 1 only to try the file quickly
TARGET_SEED, DRAFT_SEED = 3, 4

pytestmark = pytest.mark.usefixtures("fast_cpu_settings")


def save_tokenizer(path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(VOCAB)}, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # a byte-level decoder (the tokens are printable ASCII, their own bytes): llguidance then reads the
    # tokenizer in Rust instead of calling back into Python for every mask
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(path)


def match_prefixes(regex: str = REGEX, max_len: int = 9) -> set[str]:
    """Every prefix of every string over a-d of length <= max_len that fully matches ``regex``."""
    pattern = re.compile(regex)
    prefixes: set[str] = set()
    for n in range(1, max_len + 1):
        for chars in itertools.product("abcd", repeat=n):
            s = "".join(chars)
            if pattern.fullmatch(s):
                prefixes.update(s[:i] for i in range(1, n + 1))
    return prefixes


def allowed_mask(text: str, prefixes: set[str], regex: str = REGEX) -> torch.Tensor:
    """``[V]`` bool: tokens that keep ``text`` a prefix of a match (EOS: ``text`` is a full match)."""
    mask = torch.zeros(V, dtype=torch.bool)
    for i, t in enumerate(VOCAB):
        if i == EOS:
            mask[i] = re.fullmatch(regex, text) is not None
        else:
            mask[i] = (text + t) in prefixes
    return mask


def exact_joints(logits, regex: str) -> tuple[dict[float, object], list[int]]:
    """Per temperature the exact masked joint ``[V, V, V]`` of the first three tokens under ``regex``,
    and the masked greedy chain."""
    l1, l2, l3 = logits
    prefixes = match_prefixes(regex)
    masks1 = allowed_mask("", prefixes, regex)
    exact = {}
    for t in TEMPERATURES:

        def dist(x: torch.Tensor, mask: torch.Tensor, t=t) -> torch.Tensor:
            return torch.softmax((x / t).masked_fill(~mask, -torch.inf), dim=-1)

        joint = torch.zeros(V, V, V, dtype=torch.float64)
        p1 = dist(l1, masks1)
        for a in range(V):
            if p1[a] == 0:
                continue
            ta = VOCAB[a]
            p2 = dist(l2[a], allowed_mask(ta, prefixes, regex))
            for b in range(V):
                if p2[b] == 0:
                    continue
                p3 = dist(l3[a, b], allowed_mask(ta + VOCAB[b], prefixes, regex))
                joint[a, b] = p1[a] * p2[b] * p3
        exact[t] = joint.numpy()
    a = int(l1.masked_fill(~masks1, -torch.inf).argmax())
    b = int(l2[a].masked_fill(~allowed_mask(VOCAB[a], prefixes, regex), -torch.inf).argmax())
    c = int(l3[a, b].masked_fill(~allowed_mask(VOCAB[a] + VOCAB[b], prefixes, regex), -torch.inf).argmax())
    return exact, [a, b, c]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured_dist")
    target = save_target_and_draft(root, V, TARGET_SEED, DRAFT_SEED)
    save_tokenizer(root / "target")
    logits = first_three_logits(target, PROMPT, V)
    exact, greedy = exact_joints(logits, REGEX)
    forced_exact, forced_greedy = exact_joints(logits, FORCED_REGEX)
    return {
        "target": root / "target",
        "draft": root / "draft",
        "exact": exact,
        "greedy": greedy,
        "tree": oracle_tree(*logits, match_prefixes()),
        "forced": {"exact": forced_exact, "greedy": forced_greedy},
    }


def test_the_grammar_really_constrains_the_first_three_tokens(setup):
    for joint in setup["exact"].values():
        assert abs(joint.sum() - 1) < 1e-9
        assert joint[:, :, EOS].sum() == 0 and joint[EOS].sum() == 0
        support = joint > 0
        assert support.sum() < V**3 // 4  # most sequences are forbidden
        assert not support[1].any()  # "b" cannot start a match
        assert support[0].any() and support[5].any()  # "a" and "ab" can


def oracle_tree(l1, l2, l3, prefixes) -> tuple[list[int], list[int]]:
    """The oracle's tree (tokens, parents) after PROMPT: under the root and each kept first token, the
    two most likely tokens the grammar allows (by the target's masked logits) and the most likely one it
    forbids, which gets a child of its own; under each allowed second token, the most likely allowed
    third token. 16 nodes, depth 3; 6 of them (3 forbidden tokens and their children) must be pruned."""
    tokens: list[int] = []
    parents: list[int] = []

    def children(logits: torch.Tensor, text: str, parent: int, width: int) -> list[int]:
        mask = allowed_mask(text, prefixes)
        kept = []
        for t in logits.masked_fill(~mask, -torch.inf).topk(width).indices.tolist():
            tokens.append(t)
            parents.append(parent)
            kept.append(t)
        if width > 1:
            bad = int(logits.masked_fill(mask, -torch.inf).argmax())
            tokens.append(bad)
            parents.append(parent)
            tokens.append(bad)  # below a forbidden node: pruned with it
            parents.append(len(tokens) - 2)
        return kept

    for a in children(l1, "", -1, 2):
        na = tokens.index(a)
        for b in children(l2[a], VOCAB[a], na, 2):
            nb = max(i for i, (t, q) in enumerate(zip(tokens, parents)) if t == b and q == na)
            children(l3[a, b], VOCAB[a] + VOCAB[b], nb, 1)
    return tokens, parents


class OracleTreeDrafter(DrafterBase):
    """Proposes :func:`oracle_tree` at the first output position, nothing later."""

    TREE_NODES = 16

    def __init__(self, tokens: list[int], parents: list[int]) -> None:
        self.tree = DraftProposal(tokens, parents=parents)

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        return [
            self.tree if x.max_drafts and x.request.num_output_tokens == 0 else DraftProposal([])
            for x in batch
        ]

    def on_verified(self, request, num_drafts: int, num_accepted: int) -> None:
        pass


def make_llm(setup, mode: str, grammar_backend: str = "auto") -> LLM:
    if mode == "tree":
        n = BATCH + 20
        llm = LLM(
            setup["target"],
            speculative_config={"method": "ngram", "num_speculative_tokens": 3},
            seed=99,
            block_size=4,
            num_kv_blocks=7 * n + 16,
            max_model_len=32,
            max_num_seqs=n,
            max_num_batched_tokens=n * (len(PROMPT) + OracleTreeDrafter.TREE_NODES + 1),
            grammar_backend=grammar_backend,
        )
        engine = llm.engine
        engine.drafter = OracleTreeDrafter(*setup["tree"])
        engine.num_draft_slots = engine.scheduler.num_draft_slots = OracleTreeDrafter.TREE_NODES
        return llm
    spec = None
    if mode == "grammar":  # the grammar's forced tokens alone (the longest of c / cd: cd)
        spec = {"method": "grammar", "num_speculative_tokens": 3}
    if mode == "forced":  # the grammar's forced tokens drafted after a draft model's sampled token, in
        # the positions beyond k reserved for them (max_forced_drafts)
        spec = {
            "method": "draft_model",
            "model": str(setup["draft"]),
            "num_speculative_tokens": 1,
            "grammar_forced_drafts": True,
            "max_forced_drafts": 2,
        }
    if mode == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 2}
    elif mode == "draft_model":
        spec = {"method": "draft_model", "model": str(setup["draft"]), "num_speculative_tokens": K}
    n = BATCH + 20
    llm = LLM(
        setup["target"],
        speculative_config=spec,
        seed=99,
        block_size=4,
        num_kv_blocks=4 * n + 16,
        max_model_len=32,
        max_num_seqs=n,
        max_num_batched_tokens=n * (len(PROMPT) + K + 1),
        grammar_backend=grammar_backend,
    )
    return llm


def sample_counts(
    llm: LLM, num_calls: int, seed_base: int, greedy_chain=None, temperatures=TEMPERATURES, regex=REGEX
):
    samples: dict[float, list[list[int]]] = {t: [] for t in temperatures}
    for call in range(num_calls):
        params, kinds = [], []
        for i in range(BATCH):
            t = temperatures[i % len(temperatures)]
            seed = seed_base + call * BATCH + i if (i // len(temperatures)) % 2 else None
            mt = 3 + (i // (2 * len(temperatures))) % 2
            params.append(SamplingParams(temperature=t, seed=seed, max_tokens=mt, regex=regex))
            kinds.append(t)
            if greedy_chain is not None and i % 250 == 0:
                params.append(SamplingParams(temperature=0, max_tokens=3, regex=regex))
                kinds.append("greedy")
                params.append(SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))  # a free row
                kinds.append("free")
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(params), params)
        for out, kind in zip(outs, kinds):
            toks = out.outputs[0].token_ids
            if kind == "greedy":
                assert toks == greedy_chain
            elif kind != "free":
                assert len(toks) >= 3, toks
                samples[kind].append(toks[:3])
    return {t: counts_of(s, (V, V, V)) for t, s in samples.items()}


@pytest.mark.parametrize("backend", ["llguidance", "outlines", "xgrammar"])
@pytest.mark.parametrize("mode", ["plain", "ngram", "draft_model", "tree"])
def test_constrained_sampling_is_the_masked_target_distribution(setup, mode, backend):
    llm = make_llm(setup, mode, backend)
    assert llm._grammar_backend().name == backend
    # suite time: 50,000 samples under llguidance ("auto"'s first choice), 25,000 under the others; trees
    # half of that
    num_calls = NUM_CALLS // (1 if backend == "llguidance" else 2) // (2 if mode == "tree" else 1)
    counts = sample_counts(llm, num_calls, seed_base=10**6, greedy_chain=setup["greedy"])
    failed = {}
    for t, c in counts.items():
        res = goodness_of_fit(setup["exact"][t], c)
        print(f"[gof] structured {mode} {backend} T={t}: {res.describe()}")
        if res.pvalue < ALPHA:
            failed[t] = res.describe()
    assert not failed, failed
    if mode != "plain":
        stats = llm.engine.spec_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if mode == "tree":  # trees were verified, not cut to a chain: some steps accepted 3 drafts
        assert stats.accepted_per_position[2] > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_negative_control_unmasked_draft_probs_fails(setup):
    """A drafter that draws from the masked draft distribution but reports the unmasked one to the
    verifier (a real bug class: every token stays grammar-valid, but acceptance is too generous)."""
    llm = make_llm(setup, "draft_model")
    drafter = llm.engine.drafter
    original = drafter._draw

    def draw(logits, reqs, drafts, bitmasks):
        tokens, probs = original(logits, reqs, drafts, bitmasks)
        _, unmasked = original(logits, reqs, drafts, [None] * len(reqs))
        return tokens, [None if p is None else u for p, u in zip(probs, unmasked)]

    drafter._draw = draw
    counts = sample_counts(llm, 2, seed_base=7 * 10**6, temperatures=(1.3,))
    res = assert_differs(setup["exact"][1.3], counts[1.3], label="unmasked draft_probs")
    assert res.pvalue < ALPHA * 1e-3


def test_negative_control_tree_rows_masked_at_the_root_fails(setup, monkeypatch):
    """Tree rows all masked by the grammar state before the tree (the bug of masking a tree like a
    chain of one row, ignoring each node's path): the second and third tokens follow the wrong masks."""
    import specdec.engine.grammar_masks as grammar_masks
    from grammars.bitmask import allocate_token_bitmask

    def root_only(grammar, tree, vocab_size):
        bitmask = allocate_token_bitmask(1 + tree.num_nodes, vocab_size)
        for r in range(1 + tree.num_nodes):
            grammar.fill_bitmask(bitmask, r)
        return bitmask

    monkeypatch.setattr(grammar_masks, "tree_bitmask", root_only)  # inline, and beside the forward
    llm = make_llm(setup, "tree")
    counts = sample_counts(llm, 2, seed_base=8 * 10**6, temperatures=(1.3,))
    res = assert_differs(setup["exact"][1.3], counts[1.3], label="tree rows masked at the root")
    assert res.pvalue < ALPHA * 1e-3


@pytest.mark.parametrize(
    ("mode", "backend"),
    [("forced", "outlines"), ("forced", "llguidance"), ("forced", "xgrammar"), ("grammar", "auto")],
)
def test_forced_drafts_keep_the_masked_target_distribution(setup, mode, backend):
    """Grammar-aware drafting (issue 20) under FORCED_REGEX ``[ab]cd[ab]d``. ``forced``: a draft model
    samples one token (its ``draft_probs`` row: ``c`` or ``cd`` after ``a``/``b``) and the wrapper
    appends what the grammar forces after it (``d`` after ``c``) with one-hot rows, beyond k = 1 (in the
    ``max_forced_drafts`` = 2 positions reserved for them). ``grammar``:
    the forced tokens alone, deterministic; after ``a``/``b`` the allowed ``c`` and ``cd`` are a prefix
    chain, so ``cd`` is drafted and the target rejects it whenever it samples ``c``. 25,000 samples
    against the exact masked joint, per temperature."""
    llm = make_llm(setup, mode, backend)
    forced = setup["forced"]
    counts = sample_counts(llm, NUM_CALLS // 2, 2 * 10**6, forced["greedy"], regex=FORCED_REGEX)
    failed = {}
    for t, c in counts.items():
        res = goodness_of_fit(forced["exact"][t], c)
        print(f"[gof] forced drafts {backend} T={t}: {res.describe()}")
        if res.pvalue < ALPHA:
            failed[t] = res.describe()
    assert not failed, failed
    stats = llm.engine.spec_stats
    assert llm.engine.drafter.num_forced_drafts > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert len(llm.engine.mask_prefetch.wait_s) > 0  # masks computed beside the forward
    if mode == "forced":  # drafts verified and accepted beyond k = 1
        assert len(stats.accepted_per_position) == 2 and stats.accepted_per_position[1] > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


@pytest.mark.parametrize("mode", ["tree", "forced"])
def test_masks_computed_beside_the_forward_are_the_inline_ones(setup, mode):
    """The engine computes the step's bitmasks on a worker thread during the forward
    (:mod:`specdec.engine.grammar_masks`): seeded and greedy outputs are token for token those of the
    same engine computing them inline, after the forward, and the worker really ran."""
    params = [
        SamplingParams(
            temperature=t, seed=1000 + i, max_tokens=5, regex=FORCED_REGEX if mode == "forced" else REGEX
        )
        for i, t in enumerate([0.0, 0.8, 1.3] * 40)
    ]
    prompts = [{"prompt_token_ids": PROMPT}] * len(params)
    llm = make_llm(setup, mode, "llguidance")
    beside = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    prefetch = llm.engine.mask_prefetch
    assert len(prefetch.compute_s) > 0 and len(prefetch.wait_s) == len(prefetch.compute_s)
    llm.engine.mask_prefetch = None
    inline = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert beside == inline
    assert len({tuple(x) for x in beside}) >= 6  # the seeds drew different outputs (8 match FORCED_REGEX)


def test_negative_control_forced_drafts_with_uniform_rows_fail(setup, monkeypatch):
    """Forced drafts reported as drawn uniformly over the vocabulary (q = 1/V instead of 1): acceptance
    ``min(1, p / q)`` becomes far too generous for ``cd``, and the joint must move."""
    import specdec.drafters.grammar_forced as grammar_forced

    real = grammar_forced.GrammarForcedDrafter._extend

    def uniform_rows(self, x, proposal):
        out = real(self, x, proposal)
        if out.draft_probs is not None and len(out.token_ids) > len(proposal.token_ids[:1]):
            probs = out.draft_probs.clone()
            probs[1:] = 1.0 / probs.shape[-1]
            out = grammar_forced.DraftProposal(out.token_ids, probs)
        return out

    monkeypatch.setattr(grammar_forced.GrammarForcedDrafter, "_extend", uniform_rows)
    llm = make_llm(setup, "forced", "llguidance")
    counts = sample_counts(llm, 2, seed_base=9 * 10**6, temperatures=(1.3,), regex=FORCED_REGEX)
    res = assert_differs(setup["forced"]["exact"][1.3], counts[1.3], label="forced drafts, uniform rows")
    assert res.pvalue < ALPHA * 1e-3
