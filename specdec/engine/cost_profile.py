"""The target's step cost, profiled once and cached: seconds of one forward per batched-token count.

Policies that weigh drafts against time (``"goodput"``, ``"ucb"``) ask for it by setting
``wants_step_costs`` (:class:`~specdec.policies.base.PolicyBase`); before such a policy's first decision
the engine hands it :func:`step_costs` (``policy.set_step_costs``), measured here or loaded from the
cache. A drafter may ask the same way (suffix decoding's chain cut, :mod:`specdec.drafters.draft_length`:
``drafter.set_step_costs`` before its first draft).

Profile: for each token count ``T`` (powers of two up to the largest speculative step the scheduler can
form, ``min(max_num_seqs, 32) × (num_draft_slots + 1)`` capped by ``max_num_batched_tokens``, one past
each power of two from 8 on (the stairs of a tiled kernel), plus ``num_speculative_tokens + 1``),
``min(T, max_num_seqs)`` sequences of about ``T / b`` new tokens at positions from 0, every row's logits
wanted (verification rows), on scratch KV blocks taken from the pool and given back (they may evict
cached prefixes; done once per engine, before its first schedule). One warm-up forward (a compiled bucket
compiles here), then the fastest of ``repeats`` timed forwards (a forward's cost is its fastest run;
slower ones met the host's other work: with the median of 3, a 16-token step of Qwen2.5-Coder 1.5B read
150 ms against 125 ms in decoding, and a 5-token step cost more than an 8-token one), taken round-robin
over the counts (every count's first forward, then every count's second...), so that a slow spell of the
host meets one repeat of several counts rather than every repeat of one. The scratch blocks are one
allocation, as many as the largest count needs (the evicted cached prefixes no more).
Then no count costs more than a larger one (a forward over fewer tokens does no
more work): ``cost(n) = min(cost(m) for m >= n)``. This is
the weight-bound part of a step (contexts are short); attention over long contexts, sampling and
verification are learned from observed steps by the policies' cost model (unless frozen).

Cache: ``$SPECDEC_STEP_COSTS`` if set (a JSON file; ``off`` disables the cache), else ``step_costs.json``
in the zoo's cache folder (``$SPECDEC_CACHE_DIR``, default ``~/.cache/specdec``), one entry per key: a
SHA-256 over the model config, dtype, device (and the CPU model or GPU name), torch version, intra-op
threads, the compiled buckets and backend (or eager), KV cache dtype, attention backend, the library's
version and the CPU kernels' build key (their sources and this CPU's flags). A second
engine with the same key loads the costs instead of profiling (so a frozen policy's decisions repeat
across processes on that machine).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import specdec
from specdec.model_runner import Segment, build_inputs

if TYPE_CHECKING:
    from specdec.engine.engine import LLMEngine

logger = logging.getLogger("specdec.engine")

#: Timed forwards per token count (the fastest is kept).
REPEATS = 5
#: The profiling method, in the cache key (a cached profile taken another way is not reused).
PROFILE_METHOD = 3
#: Tokens of the catch-up forward a draft model is profiled with (:func:`draft_model_costs`).
CATCH_UP_PROFILE_TOKENS = 256


def cache_path() -> Path | None:
    """``$SPECDEC_STEP_COSTS`` (a file), else ``step_costs.json`` in the zoo's cache folder
    (:func:`specdec.zoo.cache_dir`); None when ``SPECDEC_STEP_COSTS`` is ``off``."""
    from specdec.zoo import cache_dir

    path = os.environ.get("SPECDEC_STEP_COSTS")
    if path is not None and path.lower() in ("off", "0", "none"):
        return None
    return Path(path) if path else cache_dir() / "step_costs.json"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _kernels_key() -> str | None:
    try:
        from kernels.cpu_ext import build_key

        return build_key()
    except Exception:  # an install without the kernel sources
        return None


def cost_key(engine: LLMEngine) -> tuple[str, dict[str, Any]]:
    """The cache key of ``engine``'s target step cost and the description it hashes."""
    runner = engine.runner
    cfg = engine.model_cfg
    model_cfg = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else repr(cfg)
    stats = getattr(runner, "compile_stats", None)
    forward = getattr(runner, "forward", None)
    what = {
        "model": model_cfg,
        "modules": sorted({type(m).__name__ for m in engine.model.modules()}) if engine.model else None,
        "dtype": str(getattr(runner, "dtype", None)),
        "device": str(getattr(runner, "device", None)),
        "device_name": _device_name(getattr(runner, "device", torch.device("cpu"))),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "compiled": list(getattr(forward, "buckets", ())) if stats is not None else None,
        "kv_cache_dtype": str(getattr(runner, "kv_cache_dtype", None)),
        "attention": type(getattr(runner, "attention", None)).__name__,
        # The library and its CPU kernels: a profile taken before an upgrade is not today's cost.
        "specdec": specdec.__version__,
        "cpu_kernels": _kernels_key(),
        "profile_method": PROFILE_METHOD,
    }
    blob = json.dumps(what, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20], what


def token_counts(engine: LLMEngine) -> list[int]:
    """The batched-token counts profiled (see the module docstring)."""
    sched = engine.scheduler.config
    slots = max(engine.num_draft_slots, engine.num_speculative_tokens)
    cap = min(min(sched.max_num_seqs, 32) * (slots + 1), sched.max_num_batched_tokens)
    counts = {c for c in (2**i for i in range(16)) if c <= cap} | {cap}
    # one past each power of two from 8 on: a step's cost rises in stairs (AMX tiles of 16 rows: on
    # SmolLM2 bf16 17 tokens cost 13.5 ms against 16's 11.0 and 32's 14.1), which interpolating
    # between powers of two would smooth into a ramp, making the first extra rows look cheap
    counts |= {c for c in (2**i + 1 for i in range(3, 16)) if c <= cap}
    if engine.num_speculative_tokens + 1 <= cap:
        counts.add(engine.num_speculative_tokens + 1)
    return sorted(counts)


@torch.inference_mode()
def profile_target(
    engine: LLMEngine,
    counts: list[int],
    repeats: int = REPEATS,
    runner: Any = None,
    max_seqs: int | None = None,
) -> dict[int, float]:
    """Seconds of one target forward per token count in ``counts`` (the fastest of ``repeats``, then made
    non-decreasing in the count, see the module docstring), on scratch blocks of the KV pool; counts that
    do not fit in the free blocks are skipped. ``runner``: another runner over the same block tables (a
    draft model's) instead of the target's. ``max_seqs``: at most this many sequences per forward
    (default: the scheduler's ``max_num_seqs``; fewer, longer sequences time a prompt chunk)."""
    pool = engine.kv.pool
    with_hidden = runner is None and engine.drafter is not None and engine.drafter.uses_hidden_states
    runner = runner or engine.runner
    bs = runner.block_size
    max_seqs = max_seqs or engine.scheduler.config.max_num_seqs
    shapes: dict[int, list[int]] = {}  # count -> its sequences' new tokens
    for count in counts:
        b = min(count, max_seqs)
        shapes[count] = [count // b + (i < count % b) for i in range(b)]
    # Round-robin over the counts, repeat after repeat: the host's slow spells last longer than a count's
    # back-to-back repeats (all 5 forwards of a 65-token step once ran at 50 ms against 33 ms, and the
    # goodput policy priced 65-128-token steps on it), so each count's repeats are spread over the profile.
    needs = {count: sum(-(-n // bs) for n in lens) for count, lens in shapes.items()}
    fit = {count: lens for count, lens in shapes.items() if needs[count] <= pool.num_free_blocks}
    times: dict[int, list[float]] = {count: [] for count in fit}
    if not fit:
        return {}
    # One allocation for every count (their block contents do not matter): the profile evicts no more
    # cached prefixes than its largest count needs.
    blocks = pool.allocate(max(needs[count] for count in fit))
    run = runner.execute_with_hidden if with_hidden else runner.execute
    try:
        inputs_of = {}
        for count, lens in fit.items():
            segments, at = [], 0
            for n in lens:
                nb = -(-n // bs)
                segments.append(Segment(blocks[at : at + nb], 0, [0] * n, n))
                at += nb
            inputs_of[count] = build_inputs(segments, bs, runner.device)
        for i in range(repeats + 1):
            for count, inputs in inputs_of.items():
                t0 = time.perf_counter()
                run(inputs)
                if runner.device.type == "cuda":
                    torch.cuda.synchronize(runner.device)
                if i:  # the first round warms up (and compiles a bucket)
                    times[count].append(time.perf_counter() - t0)
    finally:
        pool.free(blocks)
    out = {count: min(ts) for count, ts in times.items() if ts}
    return monotone(out)


def monotone(costs: dict[int, float]) -> dict[int, float]:
    """``{n: min(costs[m] for m >= n)}``: no token count costs more than a larger one."""
    out: dict[int, float] = {}
    low = float("inf")
    for n in sorted(costs, reverse=True):
        low = min(low, costs[n])
        out[n] = low
    return dict(sorted(out.items()))


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def draft_model_costs(engine: LLMEngine) -> tuple[dict[int, float], float]:
    """A draft model's costs, profiled now (a second or two; not cached): ``({rows: seconds}, seconds per
    token)``, one forward over ``rows`` requests' one token each (rows 1, 2, 4, ... up to
    ``min(max_num_seqs, 32)``: a draft position's cost for that many drafting requests), and a catch-up
    forward's seconds per token (:data:`CATCH_UP_PROFILE_TOKENS` tokens over 4 requests: what the draft
    model pays to read a request's backlog, a prompt for one, before its first draft). ``({}, 0.0)`` for
    drafters without a model runner of their own (n-gram, suffix: drafting costs next to nothing; EAGLE
    and Medusa heads: learned from steps)."""
    from specdec.model_runner import ModelRunner

    runner = getattr(engine.drafter, "runner", None)
    if not isinstance(runner, ModelRunner):
        return {}, 0.0
    cap = min(engine.scheduler.config.max_num_seqs, 32)
    rows = [r for r in (2**i for i in range(6)) if r <= cap]
    t0 = time.perf_counter()
    costs = profile_target(engine, rows, runner=runner)
    n = CATCH_UP_PROFILE_TOKENS
    catch_up = profile_target(engine, [n], runner=runner, max_seqs=4).get(n, 0.0) / n
    logger.info(
        "profiled the draft model at %d batch sizes in %.1f s: %s; catch-up %.3f ms per token",
        len(costs),
        time.perf_counter() - t0,
        ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in costs.items()),
        catch_up * 1e3,
    )
    return costs, catch_up


def step_costs(engine: LLMEngine) -> dict[int, float]:
    """``{num_tokens: seconds}`` of ``engine``'s target forward: from the cache when its key is there
    (and covers the counts), else profiled now and written to the cache. A cache that cannot be read or
    written is ignored (logged)."""
    key, what = cost_key(engine)
    counts = token_counts(engine)
    path = cache_path()
    if path is not None:
        entry = _read(path).get(key)
        if isinstance(entry, dict):
            try:
                costs = {int(n): float(s) for n, s in entry["step_s"].items()}
            except (KeyError, TypeError, ValueError, AttributeError):
                costs = {}
            if costs and all(c in costs for c in counts) and all(s > 0 for s in costs.values()):
                logger.info("step costs loaded from %s (key %s)", path, key)
                return costs
    t0 = time.perf_counter()
    costs = profile_target(engine, counts)
    logger.info(
        "profiled the target step at %d token counts in %.1f s: %s",
        len(costs),
        time.perf_counter() - t0,
        ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in costs.items()),
    )
    if path is not None and costs:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            data = _read(path)
            data[key] = {"step_s": {str(n): s for n, s in costs.items()}, "what": what, "time": time.time()}
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1, default=str))
            tmp.replace(path)
        except OSError as e:
            logger.warning("could not write the step-cost cache %s: %s", path, e)
    return costs
