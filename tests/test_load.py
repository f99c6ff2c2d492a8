"""Load under KV pressure: 200 requests added over time into a pool that forces many preemptions.

The workload (:func:`make_workload`, seeded): 200 requests with prompts of 1 to 40 tokens (half of them
repetitive, so that prompt lookup finds drafts), ``max_tokens`` 1 to 40, and parameters drawn among greedy,
seeded sampling (temperature, top-k, top-p, min-p, repetition penalty, logprobs mixed), unseeded sampling,
and grammar-constrained decoding (a regex, a choice and a JSON schema; greedy or seeded), some with stop
strings. The engine holds one speculative configuration at a time, so the 200 requests run twice, once
with prompt lookup (``ngram``, k = 3) and once with a draft model (k = 3).

Each run is done twice on the tiny random Llama with a byte-level tokenizer (``tiny_text_model_dirs``):

- **loaded**: a pool of 32 blocks of 4 tokens (one request can need 21), up to 16 requests at once, the
  requests added over time (a few at the start, then 0 to 3 between steps);
- **ample**: 1024 blocks, every request added at once (another batching altogether).

Checked: every request finishes ("stop" or "length", no error); every greedy and seeded request, plain or
constrained, has the same tokens in both; no block is leaked (all free, pool invariants, scheduler
empty); the resident memory stays bounded; and the scheduling bound holds (below).

Scheduling policy and its bound (:mod:`specdec.scheduler`): requests are served in the order they entered
the scheduler; when blocks run out the newest running request is preempted (recomputed later), and the
oldest request never yields. So at every step the oldest unfinished request is scheduled, computes at
least one token and is not preempted (checked at each of the ~1,000 steps). Once oldest, a request q with
prompt P, at most M generated tokens and a token budget B per step finishes within
``T(q) = ceil((P + M - 1) / B) + M`` steps (its recomputed prefill in chunks of B, then at least one token
per step). Hence a request r finishes at most ``sum of T(q)`` over the requests q that entered no later
than r and were unfinished when r entered, steps after it entered (checked for every request).

Speculation and seeds: the drafts a request verifies at a step depend on the request alone (the step
budget here is large enough never to cut them, and a preempted request drafts again on the last chunk
of its recompute), so a seeded request draws the same random numbers with or without preemption.

Figures: ``pytest -s tests/test_load.py`` prints them; ``python -m tests.test_load`` runs the same workload
outside pytest and prints them as JSON.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sampling.params import SamplingParams
from specdec import LLM
from specdec.engine import LLMEngine
from specdec.request import Request

NUM_REQUESTS = 200
MAX_MODEL_LEN = 96
BLOCK_SIZE = 4
LOADED_BLOCKS = 32
AMPLE_BLOCKS = 1024
MAX_NUM_SEQS = 16
BUDGET = 4096  # tokens per step: never cuts drafts (16 sequences x (79 + 3) tokens at most)
K = 3
#: Resident memory may grow by at most this much from the end of the first (warm-up) run to the end.
RSS_GROWTH_BOUND_MIB = 32

GRAMMARS: list[dict[str, Any]] = [
    {"regex": "[a-z]{1,12}"},
    {"choice": ["yes", "no", "maybe"]},
    {
        "json_schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
            "required": ["a", "b"],
        }
    },
]


@dataclass
class Job:
    """One request of the workload."""

    index: int
    prompt: list[int]
    params: SamplingParams
    kind: str  # greedy, seeded, sampled, grammar-greedy, grammar-seeded

    @property
    def deterministic(self) -> bool:
        return self.kind != "sampled"


def make_workload(seed: int = 0, n: int = NUM_REQUESTS, vocab: int = 265) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        length = rng.randint(1, 40)
        if rng.random() < 0.5:
            motif = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 5))]
            prompt = (motif * length)[:length]
        else:
            prompt = [rng.randrange(3, vocab) for _ in range(length)]
        max_tokens = rng.randint(1, 40)
        kind = rng.choices(
            ["greedy", "seeded", "sampled", "grammar-greedy", "grammar-seeded"], [30, 25, 15, 15, 15]
        )[0]
        kw: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": rng.random() < 0.5}
        if kind in ("seeded", "sampled", "grammar-seeded"):
            kw.update(
                temperature=rng.choice([0.6, 1.0, 1.4]),
                top_k=rng.choice([0, 5, 50]),
                top_p=rng.choice([1.0, 0.9]),
                min_p=rng.choice([0.0, 0.05]),
                repetition_penalty=rng.choice([1.0, 1.2]),
            )
            if kind != "sampled":
                kw["seed"] = rng.randrange(2**31)
        else:
            kw["temperature"] = 0.0
        if kind.startswith("grammar"):
            kw.update(rng.choice(GRAMMARS))
        elif rng.random() < 0.15:
            kw["stop"] = ["ab", "zz"]
        if rng.random() < 0.2:
            kw["logprobs"] = rng.choice([0, 3])
        jobs.append(Job(i, prompt, SamplingParams(**kw), kind))
    return jobs


def rss_bytes() -> int:
    """Resident set size now (``/proc/self/statm``, field 2, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size of the process so far (``VmHWM`` of ``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


@dataclass
class RunResult:
    outputs: dict[int, Request]
    steps: int
    preemptions: int
    max_preemptions_of_one_request: int
    wall_s: float
    entry_step: dict[int, int] = field(default_factory=dict)
    finish_step: dict[int, int] = field(default_factory=dict)
    invariant_checks: int = 0


def make_llm(dirs: dict[str, Path], method: str, num_blocks: int, backend: Any = None) -> LLM:
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": K}
    if method == "draft_model":
        spec["model"] = str(dirs["draft"])
    llm = LLM(
        dirs["target"],
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_blocks,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=BUDGET,
        speculative_config=spec,
    )
    if backend is not None:  # one grammar backend (and compile cache) for every engine: same tokenizer
        llm.engine.grammar_backend = backend
    else:
        llm._grammar_backend()
    for g in GRAMMARS:  # compile before the run, so that constrained requests enter when added
        spec_ = SamplingParams(max_tokens=1, **g).grammar_spec
        assert spec_ is not None and llm.engine.grammar_backend is not None
        llm.engine.grammar_backend.compile(spec_)
    return llm


def run(llm: LLM, jobs: list[Job], over_time: bool, seed: int = 0, check_bound: bool = False) -> RunResult:
    """Run ``jobs`` on ``llm.engine``: all at once, or ``over_time`` (8 at first, then 0-3 per step)."""
    engine = llm.engine
    rng = random.Random(seed)
    pending = list(jobs)
    reqs: dict[int, Request] = {}
    entry: dict[int, int] = {}
    finish: dict[int, int] = {}
    index_of: dict[str, int] = {}
    checks = {"n": 0}
    if check_bound:
        schedule = engine.scheduler.schedule

        def checked_schedule():
            live = list(engine.scheduler.requests.values())
            oldest = min(live, key=lambda r: r.arrival_index) if live else None
            out = schedule()
            if oldest is not None:
                mine = [s for s in out.scheduled if s.request is oldest]
                assert len(mine) == 1 and mine[0].num_new_tokens >= 1, (oldest, out)
                assert oldest not in out.preempted
                checks["n"] += 1
            return out

        engine.scheduler.schedule = checked_schedule  # type: ignore[method-assign]

    def add(count: int) -> None:
        for _ in range(min(count, len(pending))):
            job = pending.pop(0)
            rid = f"job{job.index}"
            reqs[job.index] = engine.add_request(rid, job.prompt, job.params)
            assert rid in engine.scheduler.requests  # grammars are compiled: it entered at once
            entry[job.index] = engine.num_steps
            index_of[rid] = job.index

    t0 = time.perf_counter()
    preemptions0 = engine.scheduler.num_preemptions
    add(8 if over_time else len(pending))
    while pending or engine.has_unfinished_requests():
        for req in engine.step():
            if req.status.finished and index_of[req.request_id] not in finish:
                finish[index_of[req.request_id]] = engine.num_steps
        if over_time:
            add(rng.randint(0, 3))
        assert engine.num_steps < 20_000
    wall = time.perf_counter() - t0
    if check_bound:
        engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    by_request = engine.scheduler.num_preemptions_by_request
    return RunResult(
        reqs,
        engine.num_steps,
        engine.scheduler.num_preemptions - preemptions0,
        max((by_request.get(f"job{j.index}", 0) for j in jobs), default=0),
        wall,
        entry,
        finish,
        checks["n"],
    )


def assert_nothing_leaked(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.requests == {} and not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.kv.num_free_blocks == engine.num_kv_blocks
    assert all(b.ref_count == 0 for b in engine.kv.pool.blocks)
    engine.kv.pool.check_invariants()
    assert engine.num_failed_requests == 0


def waiting_bound(jobs: list[Job], entry: dict[int, int], finish: dict[int, int], order: list[int]) -> int:
    """Check every request's steps from entry to finish against the bound; returns the largest slack."""

    def t(job: Job) -> int:
        m = min(job.params.max_tokens, MAX_MODEL_LEN - len(job.prompt))
        return math.ceil((len(job.prompt) + m - 1) / BUDGET) + m

    by_index = {j.index: j for j in jobs}
    worst = 0
    for pos, i in enumerate(order):
        older = [q for q in order[: pos + 1] if finish[q] > entry[i]]  # unfinished when i entered
        bound = sum(t(by_index[q]) for q in older)
        waited = finish[i] - entry[i]
        assert waited <= bound, (i, waited, bound)
        worst = max(worst, waited)
    return worst


def load_figures(dirs: dict[str, Path], verbose: bool = True) -> dict[str, Any]:
    """Run the whole load test; assert everything; return the figures."""
    jobs = make_workload()
    halves = {"ngram": jobs, "draft_model": jobs}
    figures: dict[str, Any] = {"requests": len(jobs), "runs": {}}
    rss_after_warmup = None
    backend = None
    t_start = time.perf_counter()
    for method, part in halves.items():
        ample = make_llm(dirs, method, AMPLE_BLOCKS, backend)
        backend = ample.engine.grammar_backend
        want = run(ample, part, over_time=False)
        assert_nothing_leaked(ample.engine)
        assert want.preemptions == 0
        if rss_after_warmup is None:
            rss_after_warmup = rss_bytes()
        loaded = make_llm(dirs, method, LOADED_BLOCKS, backend)
        got = run(loaded, part, over_time=True, seed=1, check_bound=True)
        assert_nothing_leaked(loaded.engine)
        compared = 0
        for job in part:
            g, w = got.outputs[job.index], want.outputs[job.index]
            for r in (g, w):
                assert r.status.finished and r.finish_reason in ("stop", "length"), (job, r)
                assert r.error is None and 1 <= r.num_output_tokens <= job.params.max_tokens
            if job.deterministic:
                assert g.output_token_ids == w.output_token_ids, (method, job)
                assert g.finish_reason == w.finish_reason
                compared += 1
        order = sorted(got.entry_step, key=lambda i: got.outputs[i].arrival_index)
        worst_wait = waiting_bound(part, got.entry_step, got.finish_step, order)
        spec_stats = loaded.engine.spec_stats
        assert spec_stats is not None and spec_stats.num_accepted_tokens > 0
        figures["runs"][method] = {
            "requests": len(part),
            "compared_token_for_token": compared,
            "preempted_requests": sum(1 for r in got.outputs.values() if r.stats.num_preemptions),
            "preemptions": got.preemptions,
            "max_preemptions_of_one_request": got.max_preemptions_of_one_request,
            "steps": got.steps,
            "steps_ample_pool": want.steps,
            "oldest_request_invariant_checks": got.invariant_checks,
            "longest_wait_steps": worst_wait,
            "draft_tokens": spec_stats.num_draft_tokens,
            "accepted_tokens": spec_stats.num_accepted_tokens,
            "wall_s_loaded": round(got.wall_s, 2),
            "wall_s_ample": round(want.wall_s, 2),
            "kinds": {k: sum(1 for j in part if j.kind == k) for k in sorted({j.kind for j in part})},
        }
        del ample, loaded
    assert rss_after_warmup is not None
    growth = rss_bytes() - rss_after_warmup
    figures.update(
        wall_s=round(time.perf_counter() - t_start, 2),
        preemptions=sum(r["preemptions"] for r in figures["runs"].values()),
        peak_rss_mib=round(peak_rss_bytes() / 2**20, 1),
        rss_growth_after_warmup_mib=round(growth / 2**20, 1),
    )
    if verbose:
        print("\nload test figures:", json.dumps(figures, indent=2))
    assert growth < RSS_GROWTH_BOUND_MIB * 2**20, figures
    return figures


@pytest.fixture(scope="module", autouse=True)
def _one_thread(fast_cpu_settings):
    yield


def test_load_under_preemption(tiny_text_model_dirs):
    figures = load_figures(tiny_text_model_dirs)
    for method, r in figures["runs"].items():
        assert r["preemptions"] >= 60, (method, r)  # the pool really was too small
        assert r["preempted_requests"] >= 50, (method, r)
        assert r["compared_token_for_token"] >= 150, (method, r)
        assert r["oldest_request_invariant_checks"] == r["steps"]


def test_negative_control_seeded_outputs_need_drafts_after_a_recompute(tiny_text_model_dirs, monkeypatch):
    """With the old rule (drafts only when exactly one token is left to compute, so a request's first step
    after a recompute verifies none) a preempted seeded request draws its random numbers differently and
    its output changes; greedy requests are unaffected."""
    from specdec.scheduler import Scheduler

    jobs = make_workload()[:100]
    ample = make_llm(tiny_text_model_dirs, "ngram", AMPLE_BLOCKS)
    want = run(ample, jobs, over_time=False)
    new_rule = Scheduler._plan

    def old_rule(self, req, num_computed, budget):
        plan = new_rule(self, req, num_computed, budget)
        if plan is None or req.num_tokens - num_computed == 1:
            return plan
        return plan[0], 0, 0, 0

    monkeypatch.setattr(Scheduler, "_plan", old_rule)
    loaded = make_llm(tiny_text_model_dirs, "ngram", LOADED_BLOCKS, ample.engine.grammar_backend)
    got = run(loaded, jobs, over_time=True, seed=1)
    assert got.preemptions > 0
    differ = {
        j.kind
        for j in jobs
        if j.deterministic and got.outputs[j.index].output_token_ids != want.outputs[j.index].output_token_ids
    }
    assert differ and differ <= {"seeded", "grammar-seeded"}, differ


def test_workload_mixes_every_kind():
    jobs = make_workload()
    kinds = {k: sum(1 for j in jobs if j.kind == k) for k in {j.kind for j in jobs}}
    assert len(jobs) == NUM_REQUESTS and set(kinds) == {
        "greedy",
        "seeded",
        "sampled",
        "grammar-greedy",
        "grammar-seeded",
    }
    assert min(kinds.values()) >= 15
    assert any(j.params.stop for j in jobs) and any(j.params.logprobs is not None for j in jobs)
    assert {len(j.prompt) for j in jobs} >= {1, 40} and {j.params.max_tokens for j in jobs} >= {1, 40}


if __name__ == "__main__":  # python -m tests.test_load: the same run outside pytest, figures as JSON
    import tempfile

    import torch

    from tests.conftest import save_tiny_text_models

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(load_figures(save_tiny_text_models(Path(tmp)), verbose=False), indent=2))
