"""The compiled forward (``LLM(compile=...)``, :mod:`specdec.compilation`) equals the eager one.

- Buckets: the choice is the smallest bucket at least the batch (property-tested), configs are checked.
- Padding never leaks: over random mixed batches (prefill chunks, decode rows, trees) the padded forward
  leaves the KV cache and the logits exactly as the eager forward (``backend="eager"``: the trace and the
  padding without inductor's arithmetic, so equality is exact).
- Inductor, float32: greedy tokens equal and logprobs within 1e-4 of eager decoding, for chains (n-gram),
  token trees, a grammar, prefix caching and preemption, in one workload; the compilations stay within
  the bucket count. bfloat16 (inductor fuses and rounds differently; the tiny models' large random
  weights amplify it): logprobs within 0.1, and a greedy sequence may part from eager decoding only at
  a near tie (eager logprob gap <= 0.2).
- Exactness of sampling on the compiled path: the chi-square test of :mod:`tests.stats` on the first two
  tokens (n-gram and draft-model drafters, both models compiled), with a negative control (a verifier
  that accepts every draft) that must fail it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sampling.params import SamplingParams
from specdec import LLM
from specdec.compilation.buckets import DEFAULT_BUCKETS, check_buckets, pick_bucket
from specdec.config import CompilationConfig
from specdec.errors import ConfigError
from tests.conftest import first_three_logits, first_two_token_counts, save_target_and_draft
from tests.stats import ALPHA, assert_differs, goodness_of_fit
from tests.test_rejection_sampler import AcceptEverything
from tests.test_tree_engine import VOCAB, OracleTreeDrafter

pytestmark = pytest.mark.usefixtures("fast_cpu_settings")

#: Few buckets bound the inductor compilations of this file (about 5-10 s each for a tiny model).
BUCKETS = (8, 64)


# ------------------------------------------------------------------------------------------ buckets
@given(st.lists(st.integers(1, 300), min_size=1, max_size=8), st.integers(1, 400))
def test_pick_bucket_is_the_smallest_bucket_that_fits(buckets, n):
    b = check_buckets(buckets)
    got = pick_bucket(n, b)
    fitting = [x for x in b if x >= n]
    assert got == (min(fitting) if fitting else None)


def test_compile_config_is_checked():
    assert CompilationConfig.from_any(False) is None and CompilationConfig.from_any(None) is None
    assert CompilationConfig.from_any(True).buckets == DEFAULT_BUCKETS
    assert CompilationConfig.from_any({"buckets": [16, 4, 4]}).buckets == (4, 16)
    assert CompilationConfig.from_any({"enabled": False}) is None
    for bad, words in [
        ({"buckets": []}, "empty"),
        ({"buckets": [0]}, "positive"),
        ({"buckets": [2.5]}, "positive"),
        ({"backend": "tvm"}, "inductor"),
        ({"bucket": [1]}, "unknown compile option"),
        ("yes", "bool, a dict"),
    ]:
        with pytest.raises(ConfigError, match=words):
            CompilationConfig.from_any(bad)


def test_llm_rejects_a_bad_compile_option_before_loading(tmp_path):
    with pytest.raises(ConfigError, match="unknown compile option"):
        LLM(tmp_path / "never-read", skip_tokenizer_init=True, compile={"bucket": [1]})


# ---------------------------------------------------------------------------- padding, exactly
@pytest.fixture(scope="module")
def tree_target(tmp_path_factory):
    from tests.conftest import make_tiny_hf_model

    root = tmp_path_factory.mktemp("compile_tree")
    make_tiny_hf_model("llama", 6, 2, True, vocab_size=VOCAB, seed=3).save_pretrained(root)
    return root


def _segments(draw_prefill, draw_decode, seed):
    """A mixed batch: prefill chunks of ``draw_prefill`` tokens and decode rows with chains of drafts."""
    from specdec.model_runner import Segment

    g = torch.Generator().manual_seed(seed)
    segs, next_block = [], 0
    for n in draw_prefill:
        blocks = list(range(next_block, next_block + (n + 3) // 4))
        next_block += len(blocks)
        segs.append(Segment(blocks, 0, torch.randint(0, VOCAB, (n,), generator=g).tolist(), 1))
    for ctx, m in draw_decode:  # context already in the cache (garbage is fine: both runs read it)
        blocks = list(range(next_block, next_block + (ctx + m + 1 + 3) // 4))
        next_block += len(blocks)
        segs.append(Segment(blocks, ctx, torch.randint(0, VOCAB, (m + 1,), generator=g).tolist(), m + 1))
    return segs


@settings(max_examples=12, deadline=None)
@given(
    st.lists(st.integers(1, 20), max_size=2),
    st.lists(st.tuples(st.integers(1, 12), st.integers(0, 4)), max_size=4),
    st.integers(0, 10**6),
)
def test_padded_rows_never_reach_the_cache_or_the_logits(tree_target, prefill, decode, seed):
    if not prefill and not decode:
        return
    from specdec.model_runner import ModelRunner, build_inputs
    from specdec.models.loader import load_model

    model, compiled_forward = _models(tree_target, load_model)
    inputs = build_inputs(_segments(prefill, decode, seed), 4, torch.device("cpu"))
    runs = []
    for compiled in (False, True):
        runner = ModelRunner(model, 64, 4)
        torch.manual_seed(seed)
        for k, v in runner.kv_caches:  # the same garbage context in both runs
            k.normal_()
            v.normal_()
        before = [t.clone() for kv in runner.kv_caches for t in kv]
        if compiled:
            runner.forward = compiled_forward
        logits, hidden = runner.execute_with_hidden(inputs)
        runs.append((logits, hidden, [t.clone() for kv in runner.kv_caches for t in kv]))
    (l0, h0, c0), (l1, h1, c1) = runs
    assert l1.shape == l0.shape and h1.shape == h0.shape
    # Padding changes the matrix shapes, hence the float summation order: equal to rounding.
    torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1, h0, atol=1e-5, rtol=1e-5)
    written = torch.zeros(64 * 4, dtype=torch.bool)
    written[inputs.metadata.slot_mapping] = True
    for a, b, orig in zip(c0, c1, before):
        flat_a, flat_b, flat_o = (x.flatten(0, 1) for x in (a, b, orig))
        assert torch.equal(flat_b[~written], flat_o[~written])  # padded rows wrote no K/V anywhere
        torch.testing.assert_close(flat_b[written], flat_a[written], atol=1e-5, rtol=1e-5)


_MODELS: dict = {}


def _models(path, load_model):
    """The eager model and one padded forward (``backend="eager"``) over it, shared by the examples."""
    from specdec.compilation.compiled_model import CompiledDecoder

    if path not in _MODELS:
        model = load_model(path, dtype=torch.float32, device=torch.device("cpu"))
        _MODELS[path] = (model, CompiledDecoder(model, (5, 16, 128), backend="eager"))
    return _MODELS[path]


# --------------------------------------------------------------------------- inductor = eager
def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % (VOCAB - 3) + 3 for j in range(5 + 4 * i)] for i in range(n)]


def _run(llm: LLM, prompts, max_tokens=14):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _assert_same(got, base, tol, exact_tokens=True):
    """Greedy tokens equal and top-5 logprobs within ``tol``. Without ``exact_tokens`` (bfloat16) the
    sequences may part at a near tie: up to the first difference everything is within ``tol``, and there
    the two tokens' eager logprobs are within ``2 * tol`` of each other."""
    for g, b in zip(got, base):
        if exact_tokens:
            assert g.token_ids == b.token_ids
        for i, (lp_got, lp_base) in enumerate(zip(g.logprobs, b.logprobs)):
            if g.token_ids[i] != b.token_ids[i]:
                assert not exact_tokens
                assert g.token_ids[i] in lp_base, "parted at a token outside the eager top 5"
                gap = lp_base[b.token_ids[i]].logprob - lp_base[g.token_ids[i]].logprob
                assert gap <= 2 * tol, f"parted at position {i} with an eager logprob gap of {gap}"
                break
            for t in lp_got.keys() & lp_base.keys():
                assert lp_got[t].logprob == pytest.approx(lp_base[t].logprob, abs=tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_equals_eager_on_chains_trees_prefix_caching_and_preemption(tree_target, dtype):
    counters = torch._dynamo.utils.counters
    prompts = _prompts(4)
    common = dict(skip_tokenizer_init=True, block_size=4, dtype=dtype)
    eager = LLM(tree_target, **common)
    base = _run(eager, prompts)
    graphs_before = counters["stats"]["unique_graphs"]

    # Plain decoding, twice: the second pass hits the prefix cache.
    llm = LLM(tree_target, compile={"buckets": BUCKETS}, **common)
    tol, exact = (1e-4, True) if dtype == "float32" else (0.1, False)
    _assert_same(_run(llm, prompts), base, tol, exact)
    _assert_same(_run(llm, prompts), base, tol, exact)
    assert llm.engine.kv.num_prefix_hits > 0

    # Chains (n-gram) and trees (an oracle drafter) on a compiled target.
    spec = LLM(
        tree_target,
        compile={"buckets": BUCKETS},
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        **common,
    )
    _assert_same(_run(spec, prompts), base, tol, exact)
    spec.engine.drafter = OracleTreeDrafter({tuple(p): o.token_ids for p, o in zip(prompts, base)}, 2, 3)
    spec.engine.num_draft_slots = spec.engine.scheduler.num_draft_slots = 4 * 3
    spec.engine.reset_spec_stats()
    _assert_same(_run(spec, prompts), base, tol, exact)
    assert spec.engine.spec_stats.num_accepted_tokens > 0

    # Preemption: a pool too small for all four requests at once.
    small = LLM(tree_target, compile={"buckets": BUCKETS}, num_kv_blocks=12, **common)
    _assert_same(_run(small, prompts), base, tol, exact)
    assert small.engine.scheduler.num_preemptions > 0

    for runner_llm in (llm, spec, small):
        stats = runner_llm.engine.runner.compile_stats
        assert stats is not None and stats.compiled_calls > 0
        assert stats.num_compilations <= len(BUCKETS)
    # Dynamo compiled at most one graph per bucket and model (three LLMs of one model here).
    assert counters["stats"]["unique_graphs"] - graphs_before <= 3 * len(BUCKETS)


def test_a_thread_count_change_reuses_the_compiled_graphs(tree_target):
    """The engine's adaptive threads change torch's thread count under load: that must not recompile
    (dynamo's global-state guard holds the count; the compiled decoder drops it), and the output stays
    the same."""
    counters = torch._dynamo.utils.counters
    prompts = _prompts(3)
    before = torch.get_num_threads()
    llm = LLM(tree_target, skip_tokenizer_init=True, block_size=4, cpu_threads=None,
              compile={"buckets": BUCKETS, "backend": "eager"})  # fmt: skip
    try:
        torch.set_num_threads(1)
        first = _run(llm, prompts)
        graphs = counters["stats"]["unique_graphs"]
        compiled = llm.engine.runner.compile_stats.compiled_calls
        torch.set_num_threads(2)
        second = _run(llm, prompts)
    finally:
        torch.set_num_threads(before)
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation at the new count
    assert llm.engine.runner.compile_stats.compiled_calls > compiled  # ... and the graphs still ran
    assert [o.token_ids for o in second] == [o.token_ids for o in first]


def test_compiled_forward_keeps_a_grammar(tiny_text_model_dirs):
    path = next(iter(tiny_text_model_dirs.values()))
    sp = SamplingParams(temperature=0, max_tokens=12, regex="(ab|cd)+x")
    eager = LLM(path)
    llm = LLM(path, compile={"buckets": BUCKETS})
    prompts = ["hello", "a b c"]
    want = [o.outputs[0].text for o in eager.generate(prompts, sp)]
    got = [o.outputs[0].text for o in llm.generate(prompts, sp)]
    assert got == want


# ------------------------------------------------------------------------- distribution, compiled
V = 8
PROMPT = [3, 4, 5, 6, 7, 3, 4, 5]
BATCH = 48
CALLS = 200  # 9,600 samples of the first two tokens per drafter


@pytest.fixture(scope="module")
def dist_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile_dist")
    target = save_target_and_draft(root, V, 1, 2)
    l1, l2, _ = first_three_logits(target, PROMPT, V)
    p1 = torch.softmax(l1, -1)
    exact = (p1[:, None] * torch.softmax(l2, -1)).numpy()  # [V, V] joint of t1, t2 at T = 1
    return {"target": root / "target", "draft": root / "draft", "exact": exact}


def _dist_llm(setup, method: str) -> LLM:
    spec = {"method": method, "num_speculative_tokens": 2}
    if method == "draft_model":
        spec["model"] = str(setup["draft"])
    return LLM(
        setup["target"],
        skip_tokenizer_init=True,
        speculative_config=spec,
        seed=7,
        block_size=4,
        max_model_len=32,
        max_num_batched_tokens=512,
        compile={"buckets": (48, 160, 512)},  # every step fits the largest bucket: nothing runs eagerly
    )


def _counts(llm: LLM, calls: int) -> np.ndarray:
    return first_two_token_counts(llm, PROMPT, V, BATCH, calls)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_compiled_speculative_sampling_matches_the_target(dist_setup, method):
    llm = _dist_llm(dist_setup, method)
    counts = _counts(llm, CALLS)
    res = goodness_of_fit(dist_setup["exact"], counts)
    print(f"[gof] compiled {method}: {res.describe()}")
    assert res.pvalue >= ALPHA, res.describe()
    assert llm.engine.runner.compile_stats.eager_calls == 0
    assert 0 < llm.engine.spec_stats.num_accepted_tokens < llm.engine.spec_stats.num_draft_tokens


def test_compiled_negative_control_fails(dist_setup):
    llm = _dist_llm(dist_setup, "draft_model")
    llm.engine.verifier = AcceptEverything()
    counts = _counts(llm, 40)
    res = assert_differs(dist_setup["exact"], counts, label="compiled, accept every draft")
    assert res.pvalue < ALPHA * 1e-3


# ----------------------------------------------------------------------------- Hydra and the CLI
def test_hydra_engine_group_and_cli_take_compile():
    from hydra import compose, initialize_config_module

    from experiments.config import register_configs, to_experiment_config
    from specdec.cli import build_parser

    register_configs()
    with initialize_config_module("experiments.conf", version_base=None):
        cfg = to_experiment_config(compose(config_name="config"))
        assert cfg.engine.llm_kwargs(cfg.model)["compile"] is False  # eager, the reference, by default
        on = ["engine.compile=true", "engine.compile_buckets=[1,8]"]
        cfg = to_experiment_config(compose(config_name="config", overrides=on))
        assert cfg.engine.llm_kwargs(cfg.model)["compile"] == {"buckets": [1, 8]}
        with pytest.raises(ValueError, match=r"engine\.compile buckets"):
            to_experiment_config(
                compose(config_name="config", overrides=[*on[:1], "engine.compile_buckets=[0]"])
            )
    parser = build_parser()
    assert parser.parse_args(["generate", "--prompt", "hi", "--compile"]).compile is True
    assert parser.parse_args(["generate", "--prompt", "hi"]).compile is False
