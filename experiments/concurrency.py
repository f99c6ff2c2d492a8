"""Speculation policies under load: throughput, latency and τ against concurrency, per drafter, beside
plain decoding and every static k (issue 19), in one process.

    python -m experiments.concurrency                                   # SmolLM2 bf16, ngram, builtin
    python -m experiments.concurrency 'drafters=[ngram,quantized_self,medusa,eagle]' \\
        'policies=[goodput,batch_size,ucb]'                             # every drafter SmolLM2 has
    python -m experiments.concurrency -m dataset=builtin,humaneval,jsonl   # built-in, HumanEval, Spec-Bench
    python -m experiments.concurrency model=qwen2.5-coder-1.5b-instruct 'drafters=[draft_model]'
    python -m experiments.concurrency 'concurrency=[1,2]' 'drafters=[ngram]' \\
        'policies=[goodput,batch_size]' 'static_k=[1,4]' max_tokens=16 min_requests=2 dataset.limit=4
    python experiments/concurrency.py ...                               # the same, as a script

Cells: for every concurrency c, plain decoding (one ``LLM`` without speculation, built once), and per
drafter (one ``LLM`` each, with k = the largest of ``num_speculative_tokens`` and ``static_k``, over the
plain engine's target weights with ``share_target``: ``LLM.with_speculation``) every
policy of ``policies`` (built with k = ``num_speculative_tokens``, its answers capped there) and every
static depth j of ``static_k`` (the ``static`` policy with ``depth=j``). A drafter's engine is reused for
all of its cells by assigning a fresh policy to ``llm.engine.policy``; its counters are reset per cell.
A cell runs ``ceil(min_requests / c)`` rounds; a round submits ``c`` requests together (one ``generate``
call, continuous batching; prompts taken in order, cycling through the dataset; the prefix cache emptied
first), greedy, ``ignore_eos`` so that every request writes ``max_tokens`` and the batch stays at c.
With ``arrivals=closed_loop`` a cell is instead ``c`` clients, each submitting its next request when
its last one finishes (one ``generate`` call of the cell's requests, at least ``min_rounds * c``, with the
engine's ``max_num_seqs`` lowered to c: vLLM's ``--max-concurrency``): the batch stays at c until the
last requests, so a request that speculation finishes early makes room for the next one, where in a
round submitted together the batch drains and the round lasts as long as its slowest request.
Every model is warmed up once before its first cell. Plain decoding is measured beside each drafter's
rows: per drafter and concurrency, ``repeats`` passes run plain and every row of the drafter in turn,
the order rotated by one each pass, so that a change in the machine's load reaches them alike; a row's
speedup is over plain decoding in its own block (``plain_tokens_per_s``), and the plain row pools every
block.

Columns (``summary.json`` rows; ``concurrency.md``):

- ``tokens_per_s``: generated tokens of the cell ÷ the summed wall time of its rounds and passes;
  ``tokens_per_s_passes``: each pass's figure (their spread is the noise of the cell).
- ``speedup``: ``tokens_per_s`` ÷ plain decoding's at the same concurrency, measured in the same block
  (``plain_tokens_per_s``; the plain row: 1.0).
- ``steady_tokens_per_s``, ``steady_speedup``, ``steady_steps`` (``arrivals=closed_loop``): the same over
  the cell's full-batch steps, those that ran with c requests in flight (:class:`SteadyWindow`; passes
  summed), against plain decoding's (all of whose steps are full: its requests run in lockstep). Once
  the last request is admitted, speculation's batch drains: its requests finish one by one and its last
  steps run a shrinking batch (at 32 clients on SmolLM2, static k = 1 spent 19 % of its time there at
  0.7× its full-batch rate). A server whose clients keep coming has no drain; a benchmark's last
  requests do.
- ``tpot_p50_ms`` / ``tpot_p99_ms``: time per output token, per request (latency − time to first token)
  ÷ (generated tokens − 1), its median and 99th percentile over the cell's requests (linear
  interpolation; with few requests p99 is near the slowest). ``ttft_p50_ms``: the median time to first
  token (queueing and prefill included: a round's requests all arrive at once).
- ``tau``: τ = 1 + accepted ÷ draft steps, over the steps that drafted (``engine.spec_stats``; – when
  none did, e.g. static k = 0); ``acceptance_rate`` = accepted ÷ drafted.
- ``draft_share`` / ``verify_share``: the engine's drafting time (the policy's decisions included) and
  its target-forward, verification and commit time, each ÷ the cell's wall time; the rest is
  scheduling, output building and Python.
- ``mean_depth``: the mean draft depth the policy granted per request and step (capped by the
  scheduler near ``max_tokens``); ``draft_tokens_per_step``: tokens the drafter actually proposed per
  draft step (n-gram lookup may find fewer).
- ``calibration`` / ``cost_calibration`` (goodput rows): the policy's acceptance and cost calibrations
  at the end of the cell's median pass (``calibrations``: the acceptance factor per draft position);
  ``check_suspended`` / ``check_rechecks`` / ``check_plain_probes``: its realised-speedup check's
  decisions in the cell, every pass's (steps it suspended, let through as rechecks, made plain probes;
  absent where the policy has no check).
- ``oracle_k``, ``vs_oracle``: per drafter and concurrency, the **oracle** is the best static k in
  hindsight: the highest ``tokens_per_s`` among plain decoding (k = 0) and the drafter's static rows;
  ``vs_oracle`` = a row's ``tokens_per_s`` ÷ the oracle's (the oracle's own row: 1.0). The oracle knows
  the measured outcome of every k, but it is one k for every request and step: a policy that varies the
  depth per request and step can beat it (goodput with int8 self-drafting at c = 2: 1.14 of it).
- ``meets_targets`` (policy rows): ``speedup`` >= 1.0 and ``vs_oracle`` >= 0.95, the targets of
  issue 19 for the goodput policy (``targets`` in the summary counts the cells per policy).
- ``greedy_equal``: the cell's outputs equal plain decoding's at the same concurrency, token for token.
  Exact in float32 (speculation is exact); in bfloat16 (this benchmark's default dtype) a verification
  forward rounds differently from a decode step, so near-ties can flip.

Outputs in the Hydra run directory (``outputs/concurrency/<date>/<time>``): ``summary.json`` (rows,
oracle, targets, config, git, versions, seeds), ``concurrency.md``, ``config.yaml``, ``run_info.json`` and
``plots/speedup_vs_concurrency.{png,svg}`` (speedup over plain against concurrency, log2 axis, one panel
per drafter, one line per policy, the oracle dashed, 1.0 dotted).

Caveats: run it on an otherwise idle machine, never beside another heavy job (tests, a training run,
another benchmark): a neighbour's load shifts cells unequally. On a shared VM one pass of a cell varies by
about ±5 %, the size of the 0.95 margin of the targets: use ``repeats`` >= 2 for figures. A drafter's
engine reserves KV slots and batch budget for its largest k (``max(num_speculative_tokens, static_k)``)
whatever depth a policy chooses, as one serving engine would; a static k = j row is therefore not an
engine built with k = j. Policies that learn (goodput) start afresh in every cell unless
``keep_policies=true`` (one policy per drafter, policy and concurrency across the passes); a policy's one-time
start-up work (the engine's step-cost profile for goodput and ucb, once per engine or loaded from
the step-cost cache, :mod:`specdec.engine.cost_profile`) runs untimed, before the cells
(``engine.prepare_policy``). On a 2-core CPU the defaults (6 concurrencies, 32 requests × 128 tokens per
cell, 8 rows per concurrency with plain) take about an hour per drafter and pass;
``concurrency=[1,4,16] min_requests=16 max_tokens=64`` about a tenth of that.
"""

from __future__ import annotations

import json
import logging
import operator
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from omegaconf import DictConfig

from experiments.config import (
    TARGET_SPEEDUP,
    TARGET_VS_ORACLE,
    ConcurrencyConfig,
    config_to_dict,
    register_configs,
    to_concurrency_config,
)
from experiments.harness import (
    free_memory,
    huge_page_fields,
    shared_or_own,
    spec_stats_fields,
    time_together,
    unequal_huge_pages,
    warm_up,
)
from experiments.tables import format_cell
from experiments.tracking import NullTracker, Tracker, pick_device, run_info, run_tracked, write_run_files

logger = logging.getLogger("experiments.concurrency")

#: Row keys logged to the tracker's summary, per cell.
_SUMMARY_KEYS = ("tokens_per_s", "speedup", "tpot_p50_ms", "tpot_p99_ms", "tau", "vs_oracle")


# ------------------------------------------------------------------------------------------ policy
class DepthRecorder:
    """A policy as the engine sees it during one cell: the wrapped policy's answers, capped at ``k``
    (the policy's own k, below the engine's when ``static_k`` goes deeper), and the depth each request
    was granted per step, for ``mean_depth``. Anything else (``observe_step``...) is the policy's.

    ``kept``: the recorder (and its policy) is re-assigned to the engine in later passes
    (``keep_policies``). The engine hands a newly assigned policy its step-cost profile again, and the
    goodput policy's ``set_step_costs`` replaces its cost curve and forgets the corrections learned on
    it; a kept recorder passes the profile on the first time only (the engine's profile does not
    change). :meth:`new_cell` restarts ``mean_depth``'s counts."""

    def __init__(self, policy: Any, k: int, kept: bool = False) -> None:
        self.policy = policy
        self.k = k
        self.kept = kept
        self._costs_given: set[str] = set()
        self.total = 0
        self.count = 0
        self._check_start: dict[str, int] | None = None  # the check's counters when the cell began

    def new_cell(self) -> None:
        """Restart the granted-depth counts (a kept policy's next cell) and note the policy's check
        counters, so that :meth:`policy_fields` gives the cell's own."""
        self.total = self.count = 0
        self._check_start = _check_counters(self.policy)

    def policy_fields(self) -> dict[str, Any]:
        """What the policy's self-corrections did in the cell, where it has them (goodput): its
        acceptance and cost calibrations at the cell's end, and its realised-speedup check's decisions in
        the cell (suspended, let through as rechecks, made plain probes). Empty for a policy without
        them."""
        out: dict[str, Any] = {}
        for key in ("calibration", "cost_calibration"):
            value = getattr(self.policy, key, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = float(value)
        factors = getattr(self.policy, "calibrations", None)
        if isinstance(factors, list) and factors:
            out["calibrations"] = [float(f) for f in factors]
        now = _check_counters(self.policy)
        if now is not None:
            start = self._check_start or dict.fromkeys(now, 0)
            out.update({key: now[key] - start[key] for key in now})
        return out

    def _once(self, name: str, fn: Any) -> Any:
        """``fn`` (the policy's ``set_step_costs`` or ``set_draft_costs``), a no-op after its first
        successful call when the recorder is kept."""

        def give(*args: Any, **kwargs: Any) -> Any:
            if self.kept and name in self._costs_given:
                return None
            out = fn(*args, **kwargs)
            self._costs_given.add(name)  # after the call: a call that raised is tried again next time
            return out

        return give

    def decide(self, batch: list[Any]) -> list[Any]:
        answers = list(self.policy.decide(batch))
        if len(answers) != len(batch):
            return answers  # the engine reports it and asks request by request
        out: list[Any] = []
        for x, answer in zip(batch, answers):
            try:
                depth = operator.index(answer)
            except TypeError:
                out.append(answer)  # not an integer: the engine switches the request's drafts off
                continue
            if isinstance(answer, bool) or depth < 0:
                out.append(answer)
                continue
            depth = min(depth, self.k)
            self.total += min(depth, x.max_drafts)
            self.count += 1
            out.append(depth)
        return out

    @property
    def mean_depth(self) -> float | None:
        return self.total / self.count if self.count else None

    def __getattr__(self, name: str) -> Any:
        if name in ("policy", "kept", "_costs_given", "_check_start"):  # not set yet (copying): no recursion
            raise AttributeError(name)
        attr = getattr(self.policy, name)  # AttributeError where the policy has none, as the engine expects
        if name in ("set_step_costs", "set_draft_costs"):
            return self._once(name, attr)
        return attr


#: Row keys of the realised-speedup check's decisions in a cell (:meth:`DepthRecorder.policy_fields`),
#: and the check's counters they come from.
CHECK_FIELDS = {
    "check_suspended": "num_suspended",
    "check_rechecks": "num_rechecks",
    "check_plain_probes": "num_plain_probes",
}


def _check_counters(policy: Any) -> dict[str, int] | None:
    """The policy's realised-speedup check's counters (row keys of :data:`CHECK_FIELDS`), or None where
    it has no check (another policy, or goodput with the check off or frozen costs)."""
    check = getattr(policy, "speedup_check", None)
    if check is None:
        return None
    return {key: int(getattr(check, attr, 0)) for key, attr in CHECK_FIELDS.items()}


def _policy(name: str, k: int, tree: bool, kwargs: dict[str, Any] | None) -> Any:
    from specdec.policies import PolicyContext, build_policy

    return build_policy(name, PolicyContext(num_speculative_tokens=k, tree=tree), dict(kwargs or {}))


# -------------------------------------------------------------------------------------------- cells
def _percentiles(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    p50, p99 = np.percentile(np.asarray(values, dtype=float), [50, 99])
    return float(p50), float(p99)


def tpot_s(metrics: dict[str, Any]) -> float | None:
    """A request's time per output token after the first: (latency − TTFT) ÷ (generated − 1); None
    with fewer than two tokens or without the times."""
    n = metrics.get("num_generated_tokens") or 0
    latency, ttft = metrics.get("latency_s"), metrics.get("time_to_first_token_s")
    if n < 2 or latency is None or ttft is None:
        return None
    return (float(latency) - float(ttft)) / (n - 1)


class SteadyWindow:
    """The full-batch steps of a closed-loop cell: the steps that ran with ``max_num_seqs`` (= c)
    requests in flight (running, or queued behind the step's token budget), and the tokens they
    committed. Plain decoding's requests, started together and
    writing ``max_tokens`` each, run in lockstep, so every one of its steps is full; speculation's finish
    one by one, and once the cell's last request is admitted its batch drains through steps of fewer
    requests, which no server whose clients keep coming runs. Prompt chunks and decode steps count alike
    while the batch is full. Wraps ``engine.step`` and ``engine.scheduler.schedule`` for one
    ``generate`` call.

    Attributes:
        tokens: output tokens committed in the full-batch steps.
        time_s: their wall time.
        steps: their number.
    """

    def __init__(self, engine: Any) -> None:
        self.engine, self.tokens, self.time_s, self.steps = engine, 0, 0.0, 0
        self._seen: dict[str, int] = {}
        self._running = 0

    def __enter__(self) -> SteadyWindow:
        engine, scheduler = self.engine, self.engine.scheduler
        step, schedule = engine.step, scheduler.schedule

        def scheduled() -> Any:
            out = schedule()
            # Requests in flight: running, or queued behind the step's token budget (a prompt waits
            # its turn while the batch is full). Fewer than c: the cell's last requests drain.
            self._running = len(scheduler.running) + len(scheduler.waiting)
            return out

        def counted() -> Any:
            self._running = 0
            t0 = time.perf_counter()
            out = step()
            seconds = time.perf_counter() - t0
            tokens = 0
            for req in out:
                n = req.num_output_tokens
                tokens += n - self._seen.get(req.request_id, 0)
                self._seen[req.request_id] = n
            if self._running >= scheduler.config.max_num_seqs:
                self.tokens += tokens
                self.time_s += seconds
                self.steps += 1
            return out

        self._wrapped = (counted, scheduled)
        engine.step, scheduler.schedule = counted, scheduled
        return self

    def __exit__(self, *exc: Any) -> None:
        counted, scheduled = self._wrapped
        for obj, name, wrapper in (
            (self.engine, "step", counted),
            (self.engine.scheduler, "schedule", scheduled),
        ):
            if vars(obj).get(name) is wrapper:  # ours still: the class's method again (else left alone)
                delattr(obj, name)


def run_cell(
    llm: Any,
    prompts: Sequence[Sequence[int]],
    concurrency: int,
    rounds: int,
    params: Any,
    arrivals: str = "together",
) -> tuple[dict[str, Any], list[list[int]]]:
    """``rounds`` rounds of ``concurrency`` requests submitted together (prompts in order, cycling),
    the engine's counters summed over the rounds; ``arrivals="closed_loop"``: the same requests in one
    call with at most ``concurrency`` running (the engine's ``max_num_seqs`` lowered for the call), a
    waiting one admitted as one finishes. Returns (the cell's measurements, every output)."""
    llm.engine.reset_spec_stats()
    outputs: list[list[int]] = []
    metrics: list[dict[str, Any]] = []
    elapsed = 0.0
    sched = llm.engine.scheduler.config
    max_num_seqs = sched.max_num_seqs
    if arrivals == "closed_loop":
        batches = [[prompts[i % len(prompts)] for i in range(rounds * concurrency)]]
        sched.max_num_seqs = min(max_num_seqs, concurrency)
    else:
        batches = [
            [prompts[(r * concurrency + i) % len(prompts)] for i in range(concurrency)] for r in range(rounds)
        ]
    steady: SteadyWindow | None = None
    try:
        for batch in batches:
            if arrivals == "closed_loop":
                with SteadyWindow(llm.engine) as steady:
                    timed = time_together(llm, batch, params, reset_spec_stats=False)
            else:
                timed = time_together(llm, batch, params, reset_spec_stats=False)
            outputs += timed.outputs
            metrics += timed.metrics
            elapsed += timed.time_s
    finally:
        sched.max_num_seqs = max_num_seqs
    tokens = sum(len(o) for o in outputs)
    tpots = [t for t in (tpot_s(m) for m in metrics) if t is not None]
    ttfts = [float(m["time_to_first_token_s"]) for m in metrics if m.get("time_to_first_token_s") is not None]
    tpot50, tpot99 = _percentiles(tpots)
    ttft50, _ = _percentiles(ttfts)
    fields = spec_stats_fields(llm)
    stats = llm.engine.spec_stats
    draft_s = stats.draft_time_s if stats is not None else None
    verify_s = stats.verify_time_s if stats is not None else None
    row = {
        "concurrency": concurrency,
        "rounds": rounds,
        "num_requests": len(outputs),
        "tokens": tokens,
        "time_s": elapsed,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else None,
        "steady_tokens": steady.tokens if steady is not None else None,
        "steady_time_s": steady.time_s if steady is not None else None,
        "steady_steps": steady.steps if steady is not None else None,
        "steady_tokens_per_s": steady.tokens / steady.time_s
        if steady is not None and steady.time_s
        else None,
        "tpot_p50_ms": None if tpot50 is None else 1e3 * tpot50,
        "tpot_p99_ms": None if tpot99 is None else 1e3 * tpot99,
        "ttft_p50_ms": None if ttft50 is None else 1e3 * ttft50,
        "tau": fields.get("tau"),
        "acceptance_rate": fields.get("acceptance_rate"),
        "draft_tokens_per_step": fields.get("draft_tokens_per_step"),
        "draft_time_s": draft_s,
        "verify_time_s": verify_s,
        "draft_share": draft_s / elapsed if draft_s is not None and elapsed > 0 else None,
        "verify_share": verify_s / elapsed if verify_s is not None and elapsed > 0 else None,
    }
    return row, outputs


def _make_llm(cfg: ConcurrencyConfig, spec: dict[str, Any] | None, device: str) -> Any:
    from experiments.run import default_llm_factory

    return default_llm_factory(cfg, device)(spec)


def _log_cell(row: dict[str, Any]) -> None:
    logger.info(
        "%s c=%d: %d tokens in %.2f s (%.1f tok/s)%s",
        row["label"] if row["drafter"] is None else f"{row['drafter']} {row['label']}",
        row["concurrency"],
        row["tokens"],
        row["time_s"],
        row["tokens_per_s"] or 0.0,
        "" if row["tau"] is None else f", tau {row['tau']:.2f}",
    )
    if "check_suspended" in row:
        logger.info(
            "  check: %d suspended, %d rechecks, %d plain probes; calibration %.2f, cost calibration %.2f",
            *(row[key] for key in CHECK_FIELDS),
            row.get("calibration", float("nan")),
            row.get("cost_calibration", float("nan")),
        )
        if "calibrations" in row:
            logger.info("  calibration per position: %s", " ".join(f"{f:.2f}" for f in row["calibrations"]))


def merge_passes(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from a cell's timed passes: tokens, time and requests summed (``tokens_per_s`` over the
    sums), the other measurements from the pass with the median throughput, and the passes' throughputs
    in ``tokens_per_s_passes``."""
    if len(passes) == 1:
        return {**passes[0], "tokens_per_s_passes": [passes[0]["tokens_per_s"]]}
    rates = [p["tokens_per_s"] or 0.0 for p in passes]
    median = sorted(range(len(passes)), key=lambda i: rates[i])[len(passes) // 2]
    row = dict(passes[median])
    for key in ("tokens", "time_s", "num_requests", "rounds"):
        row[key] = sum(p[key] for p in passes)
    row["tokens_per_s"] = row["tokens"] / row["time_s"] if row["time_s"] > 0 else None
    row["tokens_per_s_passes"] = rates
    for key in CHECK_FIELDS:  # the check's decisions: every pass's (or none, where a pass lacks them)
        if all(key in p for p in passes):
            row[key] = sum(p[key] for p in passes)
        else:
            row.pop(key, None)
    if all(p.get("steady_time_s") for p in passes):
        row["steady_tokens"] = sum(p["steady_tokens"] for p in passes)
        row["steady_time_s"] = sum(p["steady_time_s"] for p in passes)
        row["steady_steps"] = sum(p.get("steady_steps") or 0 for p in passes)
        row["steady_tokens_per_s"] = row["steady_tokens"] / row["steady_time_s"]
    return row


def _cells(cfg: ConcurrencyConfig) -> list[tuple[str, str, int, dict[str, Any] | None]]:
    """(system, policy name, k, policy kwargs) of plain decoding and of the drafter's rows, in order."""
    cells: list[tuple[str, str, int, dict[str, Any] | None]] = [("plain", "plain", 0, None)]
    cells += [("policy", p, cfg.num_speculative_tokens, cfg.policy_kwargs.get(p)) for p in cfg.policies]
    cells += [("static", "static", j, {"depth": j}) for j in cfg.static_k]
    return cells


def run_drafter(
    cfg: ConcurrencyConfig,
    drafter: str,
    plain_llm: Any,
    prompts: list[list[int]],
    device: str,
    warmup: list[int],
    params: Any,
    plain_outputs: dict[int, list[list[int]]],
    huge_pages: dict[str, dict[str, Any] | None] | None = None,
) -> tuple[list[dict[str, Any]], dict[int, list[dict[str, Any]]]]:
    """Every policy and static k of one drafter at every concurrency, on one engine, interleaved with
    plain decoding on ``plain_llm``: per concurrency, ``cfg.repeats`` passes over plain and the drafter's
    rows, the order rotated by one each pass. Returns (the drafter's rows, plain's passes per
    concurrency); each drafter row carries ``plain_tokens_per_s``, plain decoding over the same block.
    ``huge_pages``: per engine name, its huge-page collapse (:func:`huge_page_fields`); the drafter's
    engine is added, and a warning logged when it and plain's are not alike (:func:`unequal_huge_pages`)."""
    spec = cfg.speculative_config(drafter)
    tree = spec.get("tree") is not None
    llm = shared_or_own(plain_llm, spec, lambda s: _make_llm(cfg, s, device), cfg.share_target)
    if huge_pages is not None:
        huge_pages[drafter] = huge_page_fields(llm)
        warning = unequal_huge_pages({"plain": huge_pages.get("plain"), drafter: huge_pages[drafter]})
        if warning:
            logger.warning("%s", warning)
    warm_up(llm, warmup)
    for name in cfg.policies:  # a policy's one-time work (the engine's step-cost profile) is not timed
        llm.engine.policy = _policy(name, cfg.num_speculative_tokens, tree, cfg.policy_kwargs.get(name))
        llm.engine.prepare_policy()
    cells = _cells(cfg)
    rows, plain_passes = [], {}
    kept: dict[tuple[str, int], DepthRecorder] = {}  # keep_policies: (policy, concurrency) -> its recorder
    for c in cfg.concurrency:
        passes: list[list[dict[str, Any]]] = [[] for _ in cells]
        for rep in range(cfg.repeats):
            for i in [(rep + j) % len(cells) for j in range(len(cells))]:
                system, name, k, kwargs = cells[i]
                if system == "plain":
                    cell, outputs = run_cell(plain_llm, prompts, c, cfg.rounds(c), params, cfg.arrivals)
                    plain_outputs.setdefault(c, outputs)
                    passes[i].append(cell)
                    continue
                # a policy with its own k; a fixed depth j <= the engine's k through the static policy
                kk = k if system == "policy" else cfg.engine_k
                keep = cfg.keep_policies and system == "policy"
                policy = kept.get((name, c)) if keep else None
                if policy is None:
                    policy = DepthRecorder(_policy(name, kk, tree, kwargs), kk, kept=keep)
                    if keep:
                        kept[(name, c)] = policy
                policy.new_cell()
                llm.engine.policy = policy
                cell, outputs = run_cell(llm, prompts, c, cfg.rounds(c), params, cfg.arrivals)
                cell["mean_depth"] = policy.mean_depth
                cell.update(policy.policy_fields())
                cell["greedy_equal"] = outputs == plain_outputs.get(c, outputs)
                passes[i].append(cell)
        plain_passes[c] = passes[0]
        plain_merged = merge_passes(passes[0])
        plain_rate = plain_merged["tokens_per_s"]
        for (system, name, k, _), cell_passes in zip(cells[1:], passes[1:]):
            label = name if system == "policy" else f"static k={k}"
            row = {"drafter": drafter, "system": system, "policy": name, "k": k, "label": label}
            row.update(merge_passes(cell_passes))
            row["greedy_equal"] = all(p["greedy_equal"] for p in cell_passes)
            row["plain_tokens_per_s"] = plain_rate
            row["plain_steady_tokens_per_s"] = plain_merged.get("steady_tokens_per_s")
            _log_cell(row)
            rows.append(row)
    del llm
    free_memory()
    return rows, plain_passes


def plain_rows(plain_passes: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One plain row per concurrency, over all its passes (every drafter's blocks)."""
    rows = []
    for passes in plain_passes.values():
        row = {"drafter": None, "system": "plain", "policy": None, "k": None, "label": "plain"}
        row.update(merge_passes(passes), mean_depth=None, greedy_equal=True)
        _log_cell(row)
        rows.append(row)
    return rows


def derive(rows: list[dict[str, Any]], drafters: Sequence[str]) -> list[dict[str, Any]]:
    """Fill ``speedup`` (over plain at the same concurrency), the oracle columns and ``meets_targets``
    into the rows; return the oracle per (drafter, concurrency)."""
    plain = {r["concurrency"]: r for r in rows if r["system"] == "plain"}

    def plain_rate(r: dict[str, Any]) -> float | None:  # plain decoding over the row's own block
        base = plain.get(r["concurrency"])
        return r.get("plain_tokens_per_s") or (base["tokens_per_s"] if base is not None else None)

    for r in rows:
        rate = plain_rate(r)
        if r["system"] == "plain":
            r["speedup"] = 1.0
        elif rate and r["tokens_per_s"]:
            r["speedup"] = r["tokens_per_s"] / rate
        else:
            r["speedup"] = None
        base = plain.get(r["concurrency"])
        steady_plain = r.get("plain_steady_tokens_per_s") or (base or {}).get("steady_tokens_per_s")
        steady = r.get("steady_tokens_per_s")
        r["steady_speedup"] = steady / steady_plain if steady and steady_plain else None
        r.update(oracle_k=None, oracle_tokens_per_s=None, vs_oracle=None, meets_targets=None)
    oracle: list[dict[str, Any]] = []
    for d in drafters:
        for c, pooled in plain.items():
            mine = [r for r in rows if r["drafter"] == d and r["concurrency"] == c]
            block = next((r.get("plain_tokens_per_s") for r in mine if r.get("plain_tokens_per_s")), None)
            base = {**pooled, "tokens_per_s": block or pooled["tokens_per_s"], "speedup": 1.0}
            candidates = [base] + [
                r for r in rows if r["drafter"] == d and r["system"] == "static" and r["concurrency"] == c
            ]
            candidates = [r for r in candidates if r["tokens_per_s"]]
            if not candidates:
                continue
            best = max(candidates, key=lambda r: r["tokens_per_s"])
            k = 0 if best is base else best["k"]
            oracle.append(
                {
                    "drafter": d,
                    "concurrency": c,
                    "k": k,
                    "system": best["system"],
                    "tokens_per_s": best["tokens_per_s"],
                    "speedup": best["speedup"],
                }
            )
            for r in rows:
                if r["drafter"] != d or r["concurrency"] != c:
                    continue
                r["oracle_k"] = k
                r["oracle_tokens_per_s"] = best["tokens_per_s"]
                r["vs_oracle"] = r["tokens_per_s"] / best["tokens_per_s"] if r["tokens_per_s"] else None
                if r["system"] == "policy" and r["speedup"] is not None and r["vs_oracle"] is not None:
                    r["meets_targets"] = r["speedup"] >= TARGET_SPEEDUP and r["vs_oracle"] >= TARGET_VS_ORACLE
    return oracle


def targets(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per policy: the cells that meet the targets (speedup >= 1.0, vs_oracle >= 0.95), of how many,
    and the worst speedup and ratio to the oracle."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["system"] != "policy":
            continue
        t = out.setdefault(
            r["policy"], {"cells": 0, "met": 0, "min_speedup": None, "min_vs_oracle": None, "failing": []}
        )
        t["cells"] += 1
        t["met"] += bool(r["meets_targets"])
        if not r["meets_targets"]:
            t["failing"].append(f"{r['drafter']} c={r['concurrency']}")
        for key, col in (("min_speedup", "speedup"), ("min_vs_oracle", "vs_oracle")):
            if r[col] is not None:
                t[key] = r[col] if t[key] is None else min(t[key], r[col])
    return out


# ---------------------------------------------------------------------------------------- tables
def _miss(value: float | None, target: float) -> str:
    """`` ✗`` after a figure below its target."""
    return " ✗" if value is not None and value < target else ""


def format_table(result: dict[str, Any]) -> str:
    """The oracle summary (per drafter and concurrency: the oracle and each policy's speedup and ratio to
    it), then every cell, then the targets and the setting."""
    cfg = result["config"]
    rows = result["rows"]
    policies = list(cfg["policies"])
    by_cell = {(r["drafter"], r["label"], r["concurrency"]): r for r in rows}
    steady = any(r.get("steady_speedup") is not None for r in rows)  # closed loop
    head = ["drafter", "c", "plain tok/s", "oracle", "oracle speedup"]
    for p in policies:
        head += [f"{p} speedup", f"{p} ÷ oracle"] + ([f"{p} steady"] if steady else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for o in result["oracle"]:
        d, c = o["drafter"], o["concurrency"]
        plain = by_cell[(None, "plain", c)]
        cells = [
            d,
            str(c),
            format_cell(plain["tokens_per_s"], ".1f"),
            "plain" if o["system"] == "plain" else f"k={o['k']}",
            format_cell(o["speedup"], ".2f", "×"),
        ]
        for p in policies:
            r = by_cell.get((d, p, c)) or {}
            speedup, vs_oracle = r.get("speedup"), r.get("vs_oracle")
            cells += [
                format_cell(speedup, ".2f", "×") + _miss(speedup, TARGET_SPEEDUP),
                format_cell(vs_oracle, ".2f") + _miss(vs_oracle, TARGET_VS_ORACLE),
            ] + ([format_cell(r.get("steady_speedup"), ".2f", "×")] if steady else [])
        lines.append("| " + " | ".join(cells) + " |")
    cols = (
        "| drafter | system | c | requests | tok/s | speedup | steady speedup | TPOT p50 / p99 (ms) | τ | "
        "acceptance | draft % | verify % | depth | ÷ oracle | greedy equal |"
    )
    lines += ["", cols, "|" + "---|" * 15]
    for r in rows:
        pct = [None if r[k] is None else 100 * r[k] for k in ("draft_share", "verify_share")]
        tpot = f"{format_cell(r['tpot_p50_ms'], '.1f')} / {format_cell(r['tpot_p99_ms'], '.1f')}"
        cells = [
            r["drafter"] or "–",
            r["label"],
            str(r["concurrency"]),
            str(r["num_requests"]),
            format_cell(r["tokens_per_s"], ".1f"),
            format_cell(r["speedup"], ".2f", "×"),
            format_cell(r.get("steady_speedup"), ".2f", "×"),
            tpot,
            format_cell(r["tau"]),
            format_cell(r["acceptance_rate"], ".3f"),
            format_cell(pct[0], ".0f"),
            format_cell(pct[1], ".0f"),
            format_cell(r["mean_depth"]),
            format_cell(r["vs_oracle"], ".2f"),
            format_cell(r.get("greedy_equal")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for p, t in result["targets"].items():
        lines.append(
            f"- {p}: {t['met']}/{t['cells']} cells meet speedup >= {TARGET_SPEEDUP:.2f} and ÷ oracle >= "
            f"{TARGET_VS_ORACLE:.2f} (worst speedup {format_cell(t['min_speedup'], '.2f', '×')}, worst ÷ "
            f"oracle {format_cell(t['min_vs_oracle'], '.2f')})"
            + (f"; short: {', '.join(t['failing'])}" if t["failing"] else "")
        )
    lines.append("")
    lines.append(
        f"Target {cfg['model']['name']} in {result['dtype']} on {result['device']}, dataset "
        f"{cfg['dataset']['name']} ({result['num_prompts']} prompts), {cfg['max_tokens']} tokens per request"
        f"{' (ignore_eos)' if cfg['ignore_eos'] else ''}, at least {cfg['min_requests']} requests per cell, "
        f"policies at k={cfg['num_speculative_tokens']}, engines at k={result['engine_k']}, "
        f"{result['torch_threads']} torch threads, greedy. Oracle: the best of plain decoding and the static "
        "k rows in hindsight (✗: a policy's figure below its target). steady speedup (closed loop): over "
        "the steps that ran with c requests in flight, against plain decoding's (the drain after the last "
        "request is admitted is left out). greedy equal: the outputs equal plain "
        "decoding's at the same concurrency token for token (exact in float32 only)."
    )
    if result.get("huge_pages_warning"):
        lines += ["", f"**Warning:** {result['huge_pages_warning']}."]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- run
def run_concurrency(
    cfg: ConcurrencyConfig,
    out_dir: str | Path | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    tracker: Tracker | None = None,
) -> dict[str, Any]:
    """Run the evaluation ``cfg`` (validated: :func:`experiments.config.to_concurrency_config`); return
    (and write to ``out_dir``) its rows, oracle, targets and table.

    Args:
        prompt_ids: token ids to run instead of the configured dataset.
        tracker: logs the rows as a table, the summary and the figure (the caller finishes it).
    """
    from experiments.run import load_token_ids
    from sampling.params import SamplingParams

    tracker = tracker or NullTracker()
    t_start = time.perf_counter()
    threads_before = torch.get_num_threads()
    if cfg.engine.torch_threads is not None:
        torch.set_num_threads(cfg.engine.torch_threads)
    try:
        torch.manual_seed(cfg.seed)
        device = pick_device(cfg.engine.device)
        seeds = {"engine": cfg.seed, "torch": cfg.seed, "dataset": getattr(cfg.dataset, "seed", None)}
        config = config_to_dict(cfg)
        info = run_info(seeds, device)
        if out_dir is not None:
            write_run_files(out_dir, config, info)
        prompts, _ids, _cats, warmup = load_token_ids(cfg.model.name, cfg.dataset, prompt_ids)
        warmup = warmup or prompts[0][:8]
        params = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, ignore_eos=cfg.ignore_eos)
        plain_llm = _make_llm(cfg, None, device)
        huge_pages: dict[str, dict[str, Any] | None] = {"plain": huge_page_fields(plain_llm)}
        warm_up(plain_llm, warmup)
        rows, plain_outputs, plain_passes = [], {}, {}
        for drafter in cfg.drafters:
            drafter_rows, passes = run_drafter(
                cfg, drafter, plain_llm, prompts, device, warmup, params, plain_outputs, huge_pages
            )
            rows += drafter_rows
            for c, p in passes.items():
                plain_passes.setdefault(c, []).extend(p)
        del plain_llm
        free_memory()
        rows = plain_rows(plain_passes) + rows
        order: dict[str | None, int] = {None: -1, **{d: i for i, d in enumerate(cfg.drafters)}}
        rows.sort(key=lambda r: (r["concurrency"], order[r["drafter"]]))  # stable: policies, then static k
        oracle = derive(rows, cfg.drafters)
        result: dict[str, Any] = {
            "kind": "concurrency",
            "rows": rows,
            "oracle": oracle,
            "targets": targets(rows),
            "engine_k": cfg.engine_k,
            "device": device,
            "dtype": (cfg.engine.dtype or cfg.model.dtype).value,
            "torch_threads": torch.get_num_threads(),
            "num_prompts": len(prompts),
            "huge_pages": huge_pages,
            "huge_pages_warning": unequal_huge_pages(huge_pages),
            "config": config,
            "seeds": seeds,
            "git": info["git"],
            "versions": info["versions"],
            "wall_time_s": time.perf_counter() - t_start,
        }
    finally:
        torch.set_num_threads(threads_before)
    result["table"] = format_table(result)
    columns = [
        "drafter",
        "label",
        "concurrency",
        "tokens_per_s",
        "speedup",
        "tpot_p50_ms",
        "tpot_p99_ms",
        "tau",
        "acceptance_rate",
        "draft_share",
        "verify_share",
        "mean_depth",
        "vs_oracle",
    ]
    tracker.log_table("concurrency", columns, [[r.get(c) for c in columns] for r in rows])
    tracker.log_summary(
        {
            f"{r['drafter'] or 'plain'}/{r['label']}/c{r['concurrency']}/{key}": r[key]
            for r in rows
            for key in _SUMMARY_KEYS
            if r[key] is not None
        }
    )
    if out_dir is not None:
        out = Path(out_dir)
        (out / "summary.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        (out / "concurrency.md").write_text(result["table"])
        if cfg.plots:
            from experiments.plot import plot_speedup_vs_concurrency

            figure = plot_speedup_vs_concurrency(result, out / "plots")
            if figure["files"] and getattr(cfg.logger, "log_plots", True):
                tracker.log_images({"plots/speedup_vs_concurrency": figure["files"][0]})
    return result


register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="concurrency")
def main(dcfg: DictConfig) -> dict[str, Any]:
    """Hydra entry point: compose ``conf/concurrency.yaml``, validate (before any model loads), run,
    print and save the tables and the figure."""
    from hydra.core.hydra_config import HydraConfig

    cfg = to_concurrency_config(dcfg)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    result = run_tracked(
        cfg, out_dir, lambda tracker: run_concurrency(cfg, out_dir=out_dir, tracker=tracker), "concurrency"
    )
    print(result["table"])
    print(f"wall time {result['wall_time_s']:.1f} s; results in {out_dir}")
    return {"rows": result["rows"], "oracle": result["oracle"], "targets": result["targets"]}


if __name__ == "__main__":
    main()
