"""Faults and aborts: one request's trouble ends that request alone, frees what it held, and never changes
another request's output.

Every test compares the other requests with a reference run in a fresh engine (greedy and seeded
requests: their tokens do not depend on what else runs), checks that every KV block is free at the end
(``check_invariants`` of the pool included), and that the faulty request ends with ``finish_reason``
"error" and a message (or "abort" for aborts), keeping the tokens it had before.

Fault injection goes through the engine's documented seam ``LLMEngine.fault_injector`` (called after
every target forward with the scheduled requests and the logits) and through monkeypatched drafters,
grammars and model runners.
"""

from __future__ import annotations

import copy
import math
import random
import threading

import pytest
import torch

from sampling.beam_search import BeamSearchParams
from sampling.params import SamplingParams
from specdec import LLM
from specdec.engine import LLMEngine, logits_rows
from specdec.request import Request

MAX_MODEL_LEN = 96
SPECS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(fast_cpu_settings):
    yield


def make_llm(dirs, spec: str = "plain", **kwargs) -> LLM:
    config = SPECS[spec]
    if config is not None and config["method"] == "draft_model":
        config = dict(config, model=str(dirs["draft"]))
    kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    kwargs.setdefault("block_size", 4)
    return LLM(dirs["target"], speculative_config=config, **kwargs)


# Prompts with repeats, so that prompt lookup finds drafts; greedy and seeded sampled requests.
PROMPTS = [
    [40, 41, 42, 43, 40, 41, 42, 43, 40, 41],
    [100, 101, 102, 100, 101, 102, 100],
    [7, 8, 9, 10, 11, 12, 7, 8, 9],
    [200, 201, 200, 201, 200, 201, 200, 201, 202, 203, 204],
]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=11, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=20, seed=5, max_tokens=11, ignore_eos=True),
]


def reference(dirs, spec: str, indices: list[int]) -> dict[int, list[int]]:
    """The outputs of ``PROMPTS[i]`` with ``PARAMS[i]``, together, in a fresh engine with an ample pool."""
    llm = make_llm(dirs, spec, num_kv_blocks=256)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in indices], [PARAMS[i] for i in indices])
    assert all(o.outputs[0].error is None for o in outs)
    return {i: o.outputs[0].token_ids for i, o in zip(indices, outs)}


def add_all(engine: LLMEngine, indices: list[int], prefix: str = "r") -> dict[int, Request]:
    """Add ``PROMPTS[i]`` with a copy of ``PARAMS[i]`` (tests may break a request's own params)."""
    return {i: engine.add_request(f"{prefix}{i}", PROMPTS[i], copy.copy(PARAMS[i])) for i in indices}


def run_to_end(engine: LLMEngine, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("requests still running after max_steps")


def assert_all_free(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.requests == {}
    assert engine.kv.num_free_blocks == engine.num_kv_blocks
    assert all(b.ref_count == 0 for b in engine.kv.pool.blocks)
    engine.kv.pool.check_invariants()


def nan_rows_of(victim: str, at_step: int, value: float = math.nan, rows: str = "all"):
    """A fault injector writing ``value`` into the logits rows of request ``victim`` at its
    ``at_step``-th sampling step (rows "all", "first" or "last")."""
    seen = {"n": 0}

    def inject(scheduled, logits: torch.Tensor) -> None:
        where = logits_rows(scheduled).get(victim)
        if where is None:
            return
        seen["n"] += 1
        if seen["n"] != at_step:
            return
        chosen = {"all": list(where), "first": [where[0]], "last": [where[-1]]}[rows]
        if value == -math.inf:
            logits[chosen] = -math.inf  # no token left: every entry -inf
        elif value == math.inf:
            logits[chosen, 3] = math.inf  # one +inf entry
        else:
            logits[chosen] = value

    return inject


# ------------------------------------------------------------------------------------- NaN logits
@pytest.mark.parametrize(
    "spec, value, rows",
    [
        ("plain", math.nan, "all"),
        ("plain", math.inf, "all"),
        ("plain", -math.inf, "all"),
        ("ngram", math.nan, "all"),
        ("ngram", math.nan, "last"),
        ("draft_model", math.nan, "first"),
    ],
    ids=["plain-nan", "plain-posinf", "plain-all-neginf", "ngram-nan", "ngram-nan-last-row", "draft-nan"],
)
def test_non_finite_logits_end_that_request_only(tiny_text_model_dirs, spec, value, rows):
    dirs = tiny_text_model_dirs
    want = reference(dirs, spec, [0, 1, 2, 3])
    llm = make_llm(dirs, spec, num_kv_blocks=64)
    engine = llm.engine
    reqs = add_all(engine, [0, 1, 2, 3])
    engine.fault_injector = nan_rows_of("r2", at_step=3, value=value, rows=rows)
    run_to_end(engine)
    bad = reqs[2]
    assert bad.finish_reason == "error" and bad.error is not None
    assert bad.error.startswith("non-finite logits"), bad.error
    assert 2 <= len(bad.output_token_ids) < len(want[2])
    assert bad.output_token_ids == want[2][: len(bad.output_token_ids)]  # what it had was right
    assert bad.block_ids == []
    for i in (0, 1, 3):
        assert reqs[i].error is None and reqs[i].finish_reason == "length"
        assert reqs[i].output_token_ids == want[i], i
    assert engine.num_failed_requests == 1
    assert_all_free(engine)
    if spec != "plain":
        assert engine.spec_stats is not None and engine.spec_stats.num_draft_tokens > 0
    # The engine goes on: the same requests again give the reference.
    engine.fault_injector = None
    again = add_all(engine, [0, 1, 2, 3], prefix="again")
    run_to_end(engine)
    assert {i: r.output_token_ids for i, r in again.items()} == want
    assert_all_free(engine)


def test_the_failed_request_is_reported_through_llm_generate(tiny_text_model_dirs):
    dirs = tiny_text_model_dirs
    want = reference(dirs, "plain", [0, 1])
    llm = make_llm(dirs, "plain", num_kv_blocks=64)
    llm.engine.fault_injector = nan_rows_of("1", at_step=2)  # LLM.generate numbers requests 0, 1, ...
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in (0, 1)], [PARAMS[0], PARAMS[1]])
    assert outs[0].outputs[0].token_ids == want[0] and outs[0].outputs[0].error is None
    bad = outs[1].outputs[0]
    assert bad.finish_reason == "error" and "non-finite logits" in (bad.error or "")
    assert bad.token_ids == want[1][:1] and outs[1].finished
    assert_all_free(llm.engine)


def test_nan_written_into_the_kv_cache_does_not_reach_later_requests(tiny_text_model_dirs, monkeypatch):
    """A forward that turns NaN writes NaN K/V too. The blocks only the failed request held are zeroed
    before they return to the pool: later requests that get them (and read their stale slots, masked,
    in the reference's batched attention path, where a 0 probability times NaN is NaN) are unchanged.
    Negative control: without the zeroing they are not. Run on the reference attention backend: the CPU
    kernel never reads a masked slot, so there the control would pass either way."""
    dirs = tiny_text_model_dirs
    later = [0, 2, 3]
    want = reference(dirs, "plain", later)

    def run(scrub: bool) -> dict[int, tuple[list[int], str | None]]:
        monkeypatch.setenv("SPECDEC_CPU_ATTENTION", "0")  # the backend is chosen when the LLM is built
        llm = make_llm(dirs, "plain", num_kv_blocks=24, enable_prefix_caching=False)
        assert type(llm.engine.runner.attention).__name__ == "ReferenceAttention"
        engine = llm.engine
        if not scrub:
            monkeypatch.setattr("specdec.engine.faults.zero_blocks", lambda *a: None)

        def poison(scheduled, logits):
            where = logits_rows(scheduled).get("victim")
            victim = engine.scheduler.requests.get("victim")
            if where is None or victim is None or victim.num_output_tokens < 3:
                return
            logits[list(where)] = math.nan
            for k_cache, v_cache in engine.runner.kv_caches:  # every slot of its blocks
                k_cache[victim.block_ids] = math.nan
                v_cache[victim.block_ids] = math.nan

        engine.fault_injector = poison
        victim_params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        victim = engine.add_request("victim", list(range(30, 62)), victim_params)
        run_to_end(engine)
        assert victim.finish_reason == "error"
        engine.fault_injector = None
        monkeypatch.undo()
        reqs = add_all(engine, later)
        run_to_end(engine)
        assert_all_free(engine)
        return {i: (r.output_token_ids, r.error) for i, r in reqs.items()}

    assert run(scrub=True) == {i: (want[i], None) for i in later}
    poisoned = run(scrub=False)
    assert any(poisoned[i] != (want[i], None) for i in later), "the negative control did not fail"


# ------------------------------------------------------------------------------- other faults
def test_grammar_that_fails_to_compile_ends_its_request_only(tiny_text_model_dirs):
    dirs = tiny_text_model_dirs
    want = reference(dirs, "ngram", [0, 1])
    llm = make_llm(dirs, "ngram", num_kv_blocks=64)
    engine = llm.engine
    llm._grammar_backend()  # LLM.generate would compile first and raise; the engine API compiles async
    reqs = add_all(engine, [0])
    bad = engine.add_request("bad", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=5, regex="(a"))
    reqs.update(add_all(engine, [1]))
    run_to_end(engine)
    assert bad.finish_reason == "error" and bad.output_token_ids == []
    assert bad.error is not None and bad.error.startswith("GrammarCompileError"), bad.error
    assert {i: r.output_token_ids for i, r in reqs.items()} == want
    assert all(r.error is None for r in reqs.values())
    assert engine.num_failed_requests == 1
    assert_all_free(engine)


def test_stop_string_that_never_matches_runs_to_max_tokens(tiny_text_model_dirs):
    dirs = tiny_text_model_dirs
    llm = make_llm(dirs, "ngram", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    (plain,) = llm.generate({"prompt_token_ids": PROMPTS[0]}, params)
    never = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=["<never appears>", "§§§"])
    (out,) = llm.generate({"prompt_token_ids": PROMPTS[0]}, never)
    c = out.outputs[0]
    assert "<never appears>" not in c.text and "§§§" not in c.text
    assert c.token_ids == plain.outputs[0].token_ids and len(c.token_ids) == 30
    assert c.finish_reason == "length" and c.stop_reason is None and c.error is None
    assert c.text == plain.outputs[0].text
    assert_all_free(llm.engine)


@pytest.mark.parametrize("spec", ["ngram", "draft_model"])
def test_drafter_raising_for_one_request_ends_that_request_only(tiny_text_model_dirs, spec):
    dirs = tiny_text_model_dirs
    want = reference(dirs, spec, [0, 1, 3])
    llm = make_llm(dirs, spec, num_kv_blocks=64)
    engine = llm.engine
    drafter = engine.drafter
    assert drafter is not None
    propose = drafter.propose
    calls = {"batched failures": 0}

    def flaky_propose(batch):
        if any(x.request.request_id == "r2" and x.request.num_output_tokens >= 3 for x in batch):
            if len(batch) > 1:
                calls["batched failures"] += 1
            raise RuntimeError("the drafter broke on this context")
        return propose(batch)

    drafter.propose = flaky_propose  # type: ignore[method-assign]
    reqs = add_all(engine, [0, 1, 2, 3])
    run_to_end(engine)
    bad = reqs[2]
    assert bad.finish_reason == "error"
    assert bad.error == "drafter failed: RuntimeError: the drafter broke on this context"
    assert len(bad.output_token_ids) >= 3 and bad.block_ids == []
    assert calls["batched failures"] >= 1  # the batch failed, then each request was asked alone
    assert {i: reqs[i].output_token_ids for i in (0, 1, 3)} == want
    assert engine.num_failed_requests == 1
    assert_all_free(engine)


def test_non_finite_draft_probabilities_drop_the_drafts_only(tiny_text_model_dirs):
    """A drafter whose distributions turn NaN for one request: that step verifies no drafts for it (still
    exact), the request goes on without an error, and the others are unchanged."""
    dirs = tiny_text_model_dirs
    want = reference(dirs, "draft_model", [0, 2, 3])
    llm = make_llm(dirs, "draft_model", num_kv_blocks=64)
    engine = llm.engine
    drafter = engine.drafter
    assert drafter is not None
    propose = drafter.propose
    broken = {"n": 0}

    def nan_probs(batch):
        proposals = propose(batch)
        for x, p in zip(batch, proposals):
            if x.request.request_id == "r1" and p.draft_probs is not None:
                p.draft_probs = torch.full_like(p.draft_probs, math.nan)
                broken["n"] += 1
        return proposals

    drafter.propose = nan_probs  # type: ignore[method-assign]
    reqs = add_all(engine, [0, 1, 2, 3])
    run_to_end(engine)
    assert broken["n"] > 0
    r1 = reqs[1]
    assert r1.error is None and r1.finish_reason == "length" and len(r1.output_token_ids) == 10
    assert r1.spec_stats is not None and r1.spec_stats.num_draft_tokens == 0  # every draft was dropped
    assert {i: reqs[i].output_token_ids for i in (0, 2, 3)} == want
    assert_all_free(engine)


def test_a_grammar_that_raises_while_committing_ends_its_request_only(tiny_text_model_dirs):
    dirs = tiny_text_model_dirs
    want = reference(dirs, "plain", [0, 1])
    llm = make_llm(dirs, "plain", num_kv_blocks=64)
    engine = llm.engine
    llm._grammar_backend()
    reqs = add_all(engine, [0, 1])
    bad = engine.add_request(
        "bad", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=20, regex="[a-z]{1,30}")
    )
    engine.admit_compiled(wait=True)
    while engine.compiling:
        engine.admit_compiled(wait=True)
    assert bad.grammar is not None
    accept = bad.grammar.accept_token

    def accept_then_break(token_id: int) -> bool:
        if bad.grammar.num_accepted_tokens >= 2:  # type: ignore[union-attr]
            raise ValueError("matcher state corrupted")
        return accept(token_id)

    bad.grammar.accept_token = accept_then_break  # type: ignore[method-assign]
    run_to_end(engine)
    assert bad.finish_reason == "error" and bad.error == "ValueError: matcher state corrupted"
    assert len(bad.output_token_ids) == 3  # the third token was appended when the matcher raised
    assert {i: r.output_token_ids for i, r in reqs.items()} == want
    assert_all_free(engine)


def test_parameters_broken_after_submission_end_that_request_only(tiny_text_model_dirs):
    """Sampling metadata is built for the whole batch; when that raises, it is built request by request
    to find the culprit, which ends; the batch goes on without it."""
    dirs = tiny_text_model_dirs
    want = reference(dirs, "ngram", [0, 1, 3])
    llm = make_llm(dirs, "ngram", num_kv_blocks=64)
    engine = llm.engine
    reqs = add_all(engine, [0, 1, 2, 3])
    for _ in range(3):
        engine.step()
    reqs[2].sampling_params.top_k = 10**30  # bypasses validation (it ran at submission)
    run_to_end(engine)
    bad = reqs[2]
    assert bad.finish_reason == "error"
    assert bad.error is not None and bad.error.startswith("cannot process its logits"), bad.error
    assert {i: reqs[i].output_token_ids for i in (0, 1, 3)} == want
    assert_all_free(engine)


# ------------------------------------------------------------------------------------------ aborts
ABORT_POINTS = ["waiting", "chunked-prefill", "mid-speculative-step", "decode", "from-another-thread"]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("point", ABORT_POINTS)
def test_abort_at_any_point_frees_everything_and_changes_no_other_output(tiny_text_model_dirs, point, seed):
    """The victim has a 40-token prompt and a budget of 16 tokens per step, so its prefill takes three
    chunks; the other requests run with prompt-lookup speculation."""
    dirs = tiny_text_model_dirs
    rng = random.Random(f"{point}-{seed}")
    others = [0, 1, 2, 3]
    want = reference(dirs, "ngram", others)
    llm = make_llm(dirs, "ngram", num_kv_blocks=48, max_num_batched_tokens=16)
    engine = llm.engine
    victim_prompt = [rng.randrange(3, 260) for _ in range(20)] * 2
    victim_params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    reqs = add_all(engine, others[:2])
    victim = engine.add_request("victim", victim_prompt, victim_params)
    reqs.update(add_all(engine, others[2:]))
    seen: dict[str, object] = {}

    if point == "waiting":
        engine.abort_request("victim")
        seen["computed"] = victim.num_computed_tokens
    elif point == "chunked-prefill":
        while not 0 < victim.num_computed_tokens < len(victim_prompt):
            engine.step()
        seen["computed"] = victim.num_computed_tokens
        engine.abort_request("victim")
    elif point in ("mid-speculative-step", "from-another-thread"):
        target_step = rng.randrange(1, 4)

        def abort_while_verifying(scheduled, logits):
            mine = [s for s in scheduled if s.request is victim and s.draft_token_ids]
            if not mine or "aborted at" in seen:
                return
            seen["drafting"] = seen.get("drafting", 0) + 1  # type: ignore[operator]
            if seen["drafting"] != target_step:
                return
            seen["aborted at"] = victim.num_output_tokens
            if point == "from-another-thread":
                t = threading.Thread(target=engine.abort_request, args=("victim",))
                t.start()
                t.join(timeout=0.2)
                assert t.is_alive(), "the abort did not wait for the step to end"
                seen["thread"] = t
            else:
                engine.abort_request("victim")
            assert not victim.status.finished  # applied when the step ends

        engine.fault_injector = abort_while_verifying
        for _ in range(200):
            if "aborted at" in seen:
                break
            engine.step()
        assert "aborted at" in seen, "the victim never verified drafts"
        engine.fault_injector = None
        if point == "from-another-thread":
            seen["thread"].join(timeout=5)  # type: ignore[attr-defined]
        assert victim.finish_reason == "abort"
    else:
        steps = rng.randrange(1, 6)
        while victim.num_output_tokens < steps:
            engine.step()
        engine.abort_request("victim")
    assert victim.finish_reason == "abort" and victim.block_ids == [] and victim.error is None
    assert "victim" not in engine.scheduler.requests
    if point == "waiting":
        assert seen["computed"] == 0 and victim.output_token_ids == []
    if point == "chunked-prefill":
        assert 0 < seen["computed"] < len(victim_prompt) and victim.output_token_ids == []  # type: ignore[operator]
    run_to_end(engine)
    assert {i: r.output_token_ids for i, r in reqs.items()} == want
    assert all(r.error is None for r in reqs.values())
    assert_all_free(engine)
    # What the victim produced before the abort was right.
    (alone,) = make_llm(dirs, "ngram", num_kv_blocks=48).generate(
        {"prompt_token_ids": victim_prompt}, victim_params
    )
    assert victim.output_token_ids == alone.outputs[0].token_ids[: len(victim.output_token_ids)]


def test_interrupted_generate_frees_its_requests(tiny_text_model_dirs):
    dirs = tiny_text_model_dirs
    want = reference(dirs, "ngram", [0, 1, 2])
    llm = make_llm(dirs, "ngram", num_kv_blocks=64)
    calls = {"n": 0}

    def interrupt(scheduled, logits):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt

    llm.engine.fault_injector = interrupt
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in (0, 1, 2)], [PARAMS[i] for i in (0, 1, 2)])
    assert_all_free(llm.engine)
    llm.engine.fault_injector = None
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in (0, 1, 2)], [PARAMS[i] for i in (0, 1, 2)])
    assert [o.outputs[0].token_ids for o in outs] == [want[i] for i in (0, 1, 2)]


@pytest.mark.parametrize("interrupt_at", [1, 2, 3, 5, 9])
def test_beam_search_interrupted_at_any_forward_frees_everything(tiny_model_dirs, interrupt_at):
    """Beam search runs in the caller's thread: an interrupt (KeyboardInterrupt, or any exception) at any
    forward (prefill chunks included: a budget of 8 tokens per forward) returns every block, and the next
    beam search and generation give what a fresh engine gives."""
    model_dir = tiny_model_dirs["llama-gqa3-tied"]
    prompts = [
        {"prompt_token_ids": [5, 17, 33, 48, 9, 70, 3, 4, 5, 6, 7, 8]},
        {"prompt_token_ids": [9, 10, 11]},
    ]
    params = BeamSearchParams(beam_width=3, max_tokens=8, num_return_sequences=2, ignore_eos=True)

    def fresh() -> LLM:
        return LLM(
            model_dir, skip_tokenizer_init=True, block_size=4, num_kv_blocks=40, max_num_batched_tokens=8
        )

    ref = fresh()
    ref_execute = ref.engine.runner.execute
    forwards = {"n": 0}

    def counting(inputs):
        forwards["n"] += 1
        return ref_execute(inputs)

    ref.engine.runner.execute = counting  # type: ignore[method-assign]
    want_beams = [[s.token_ids for s in o.sequences] for o in ref.beam_search(prompts, params)]
    # 2 prefill forwards (12 + 3 prompt tokens in chunks of 8), then one per generated token but the last.
    assert forwards["n"] == 2 + params.max_tokens - 1
    ref.engine.runner.execute = ref_execute  # type: ignore[method-assign]
    want_gen = [
        o.outputs[0].token_ids for o in ref.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    ]

    llm = fresh()
    execute = llm.engine.runner.execute
    calls = {"n": 0}

    def interrupting(inputs):
        calls["n"] += 1
        if calls["n"] == interrupt_at:
            raise KeyboardInterrupt
        return execute(inputs)

    llm.engine.runner.execute = interrupting  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        llm.beam_search(prompts, params)
    assert calls["n"] == interrupt_at
    assert_all_free(llm.engine)
    llm.engine.runner.execute = execute  # type: ignore[method-assign]
    assert [[s.token_ids for s in o.sequences] for o in llm.beam_search(prompts, params)] == want_beams
    assert_all_free(llm.engine)
    got_gen = [
        o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    ]
    assert got_gen == want_gen
    assert_all_free(llm.engine)


# ------------------------------------------------------------------- batch independence of drafts
def _alone_and_together(dirs, spec: str, budget: int) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Each of the four requests alone, then all four together, with a step budget of ``budget`` tokens."""
    alone = {}
    for i in range(4):
        (out,) = make_llm(dirs, spec, num_kv_blocks=64, max_num_batched_tokens=budget).generate(
            {"prompt_token_ids": PROMPTS[i]}, PARAMS[i]
        )
        alone[i] = out.outputs[0].token_ids
    together = make_llm(dirs, spec, num_kv_blocks=64, max_num_batched_tokens=budget).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], PARAMS
    )
    return alone, {i: o.outputs[0].token_ids for i, o in enumerate(together)}


@pytest.mark.parametrize("spec", ["ngram", "draft_model"])
def test_seeded_outputs_do_not_depend_on_the_other_requests_under_a_tight_budget(tiny_text_model_dirs, spec):
    """With a budget of 8 tokens per step, four speculating requests (k = 3) cannot all verify their drafts
    in one step. A request whose drafts do not fit waits a step instead of verifying fewer, so every
    output, the seeded ones included, equals its output alone (and aborting one request cannot change
    another's, the case a break test found)."""
    alone, together = _alone_and_together(tiny_text_model_dirs, spec, budget=8)
    assert together == alone


def test_negative_control_cutting_drafts_to_the_budget_changes_seeded_outputs(
    tiny_text_model_dirs, monkeypatch
):
    """The old rule (drafts cut to what is left of the budget) makes a seeded request's random draws depend
    on the requests scheduled before it: some seeded output changes, no greedy one does."""
    from specdec.scheduler import Scheduler

    new_rule = Scheduler._plan

    def cut_to_budget(self, req, num_computed, budget):
        plan = new_rule(self, req, num_computed, self.config.max_num_batched_tokens)
        if plan is None:
            return None
        n, slots, depth, forced = plan
        slots = max(0, min(slots, budget - n))
        return min(n, budget), slots, min(depth, slots), min(forced, slots)

    monkeypatch.setattr(Scheduler, "_plan", cut_to_budget)
    alone, together = _alone_and_together(tiny_text_model_dirs, "ngram", budget=8)
    differ = {i for i in alone if alone[i] != together[i]}
    assert differ and all(PARAMS[i].seed is not None for i in differ), differ
