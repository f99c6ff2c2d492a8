"""Constrained decoding on real schemas: JSONSchemaBench (``../shared/jsonschemabench``) per grammar
backend, with SmolLM2.

For a deterministic sample of schemas (``per_subset`` smallest of each subset, or all of them with
``per_subset=null``) and each backend of ``backends`` (``auto``, ``llguidance``, ``xgrammar``, ``outlines``):

- compile success rate, failures by error class, compile time p50 / p90 (one at a time, 10 s limit);
  for ``auto`` the backend it chose per schema;
- the instance walk: every valid and invalid instance of each compiled schema, serialised compactly,
  fed token by token (SmolLM2's tokenizer) through a fresh matcher, as it is and with its object keys
  in schema order (:func:`in_schema_order`; every backend emits properties in that order, a documented
  narrowing): valid instances accepted, invalid ones rejected in either order; an invalid instance
  accepted by a grammar that reports nothing ignored is a failure of the backend
  (``invalid_accepted_unexplained``), one accepted where it reports ignored keywords cannot be judged;
- SmolLM2 generates one object per schema for ``generate_schemas`` compiled schemas evenly spread
  through them (short chat prompt asking for an example, greedy, ``max_tokens`` 256, all in one
  continuously batched ``generate``) in each of ``modes`` (plain; n-gram; n-gram with the grammar's
  forced tokens; the forced tokens alone; EAGLE chains; EAGLE-2 trees, every node masked along its own
  path): finished outputs that parse as JSON and that are schema-valid (``jsonschema``), the share
  ended by length, τ, tokens per target forward over all decode steps, the share of outputs identical
  to plain decoding, per-token mask time p50 / p99 (µs; ``Grammar.fill_bitmask`` calls timed in
  place, on the worker thread that computes them beside the forward) and per step the time the step
  waited for its masks after the forward (µs; the mask time left on the critical path, see
  :mod:`specdec.engine.grammar_masks`); ``figure`` plots the modes;
- decode speed at batch 1 on ``speed_prompts`` schemas: tokens/s with the grammar vs the same prompts
  without it, each with and without n-gram speculation (same process, same prompts; first backend).

    python -m experiments.bench_grammar per_subset=5 out=grammar_bench.json
    python -m experiments.bench_grammar per_subset=null 'backends=[auto,llguidance,outlines,xgrammar]'
    python -m experiments.bench_grammar per_subset=null generate_schemas=32 \\
        'modes=[plain,ngram,ngram_forced,grammar,eagle_chain,eagle_tree]' figure=docs/grammar_modes.png
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.harness import (
    HarnessConfig,
    benchmark,
    require_positive,
    require_subset,
    time_batch1,
    warm_up,
)
from specdec.errors import ConfigError

BENCH = Path(__file__).resolve().parents[1] / ".." / "shared" / "jsonschemabench"


@dataclass
class BenchGrammarConfig(HarnessConfig):
    """Attributes:
    per_subset: the smallest schemas of each subset (null: every schema).
    backends: grammar backends compared (``grammar_backend`` names).
    generate: also generate with SmolLM2 (false: compile and instance walks only).
    generate_schemas: schemas generated for, evenly spread through the compiled ones (null: all).
    modes: generation modes (:data:`GENERATION_MODES`: plain, ngram, ngram_forced, grammar,
        eagle_chain, eagle_tree).
    figure: write the modes' tokens-per-forward and τ bars here (a PNG path; null: none).
    max_tokens: of the batched generation.
    speed_prompts: schemas of the batch-1 speed figures.
    speed_max_tokens: new tokens per batch-1 request at most.
    mask_prefetch: compute the masks beside the forward (false: inline after it, for comparison).
    """

    per_subset: int | None = 5
    max_tokens: int = 256
    speed_prompts: int = 4
    speed_max_tokens: int = 96
    backends: list[str] = field(default_factory=lambda: ["auto"])
    generate: bool = True
    generate_schemas: int | None = 32
    modes: list[str] = field(default_factory=lambda: ["plain", "ngram"])
    figure: str | None = None
    mask_prefetch: bool = True

    def validate(self) -> None:
        super().validate()
        from grammars.registry import GRAMMAR_BACKENDS

        require_subset("backends", self.backends, GRAMMAR_BACKENDS)
        require_subset("modes", self.modes, GENERATION_MODES)
        if self.generate_schemas is not None and self.generate_schemas < 1:
            raise ConfigError(f"generate_schemas must be >= 1 or null, got {self.generate_schemas}")
        if self.per_subset is not None and self.per_subset < 1:
            raise ConfigError(f"per_subset must be >= 1 or null (every schema), got {self.per_subset}")
        require_positive(self, "max_tokens", "speed_prompts", "speed_max_tokens")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def select(per_subset: int | None) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (BENCH / "index.jsonl").read_text().splitlines() if line.strip()]
    if per_subset is None:
        return rows
    out: list[dict[str, Any]] = []
    taken: dict[str, int] = {}
    for r in sorted(rows, key=lambda r: (r["subset"], r["bytes"])):
        if taken.get(r["subset"], 0) < per_subset:
            taken[r["subset"]] = taken.get(r["subset"], 0) + 1
            out.append(r)
    return out


def prompt_for(llm: Any, schema: dict[str, Any]) -> dict[str, list[int]]:
    from specdec.llm import chat_token_ids

    title = schema.get("title") or schema.get("description") or "a record"
    msg = f"Write one example JSON object for {str(title)[:120]}. Reply with JSON only."
    return {"prompt_token_ids": chat_token_ids(llm.tokenizer, [{"role": "user", "content": msg}])}


class MaskTimer:
    """Times every ``fill_bitmask`` call of the backends' grammar classes (µs)."""

    def __init__(self) -> None:
        from grammars.llguidance_backend import LLGuidanceGrammar
        from grammars.outlines_backend import OutlinesGrammar
        from grammars.xgrammar_backend import XGrammarGrammar

        classes = (OutlinesGrammar, LLGuidanceGrammar, XGrammarGrammar)
        self.originals = {cls: cls.fill_bitmask for cls in classes}
        self.times_us: list[float] = []
        for cls, original in self.originals.items():
            cls.fill_bitmask = self._timed(original)  # type: ignore[method-assign]

    def _timed(self, original: Any) -> Any:
        times = self.times_us

        def timed(self_: Any, bitmask: Any, row: int) -> None:
            t = time.perf_counter()
            original(self_, bitmask, row)
            times.append((time.perf_counter() - t) * 1e6)

        return timed

    def close(self) -> None:
        for cls, original in self.originals.items():
            cls.fill_bitmask = original  # type: ignore[method-assign]


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def walk(compiled: Any, tokenizer: Any, value: Any) -> bool:
    """Whether a fresh matcher accepts ``value`` (compact JSON, the tokenizer's split) and ends final."""
    ids = tokenizer.encode(compact(value), add_special_tokens=False)
    g = compiled.matcher()
    if g.validate_tokens(ids) < len(ids):
        return False
    for t in ids:
        g.accept_token(t)
    return bool(g.is_final())


def in_schema_order(value: Any, node: Any, root: dict[str, Any], depth: int = 0) -> Any:
    """``value`` with every object's keys in the order of its schema's ``properties`` (the order the
    backends' grammars emit; other keys after them), following ``$ref`` s, ``items``/``prefixItems``,
    and the first ``anyOf``/``oneOf``/``allOf`` branch ``jsonschema`` finds ``value`` valid under."""
    from jsonschema import validators

    if not isinstance(node, dict) or depth > 40:
        return value
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target: Any = root
        for part in (p for p in ref[1:].split("/") if p):
            part = part.replace("~1", "/").replace("~0", "~")
            target = target[int(part)] if isinstance(target, list) else target.get(part, {})
        return in_schema_order(value, target, root, depth + 1)
    for key in ("anyOf", "oneOf", "allOf"):
        branches = node.get(key)
        if isinstance(branches, list) and not isinstance(node.get("properties"), dict):
            validator = validators.validator_for(root)(root)
            # the branch alone, with the root's definitions for its $refs (not the root's own keywords)
            context = {k: root[k] for k in ("$schema", "$id", "$defs", "definitions") if k in root}
            for sub in branches:
                if isinstance(sub, dict) and validator.evolve(schema={**context, **sub}).is_valid(value):
                    return in_schema_order(value, sub, root, depth + 1)
    if isinstance(value, dict):
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        extra = node.get("additionalProperties")
        ordered = {k: in_schema_order(value[k], props[k], root, depth + 1) for k in props if k in value}
        ordered.update(
            {k: in_schema_order(v, extra, root, depth + 1) for k, v in value.items() if k not in props}
        )
        return ordered
    if isinstance(value, list):
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        items = node.get("items")
        return [
            in_schema_order(v, prefix[i] if i < len(prefix) else items, root, depth + 1)
            for i, v in enumerate(value)
        ]
    return value


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def compile_and_walk(backend: Any, tokenizer: Any, docs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict:
    """Compile every schema of ``docs`` (index row, document) with ``backend`` and walk its instances."""
    from grammars import GrammarCompileError, GrammarSpec
    from grammars.schema import validate_instance

    compiled_docs: list[tuple[dict[str, Any], dict[str, Any], Any]] = []
    compile_s: list[float] = []
    failures: dict[str, int] = {}
    chosen: dict[str, int] = {}
    walks = dict.fromkeys(
        [
            "valid",
            "valid_accepted",
            "valid_accepted_in_schema_order",
            "invalid",
            "invalid_rejected",
            "invalid_accepted_unexplained",
            "label_disagrees_with_jsonschema",
        ],
        0,
    )
    unexplained: list[str] = []
    rejected: list[str] = []  # valid instances rejected even in schema order
    for r, doc in docs:
        t = time.perf_counter()
        try:
            compiled = backend.compile(GrammarSpec.json_schema(doc["schema"]))
        except (GrammarCompileError, ValueError) as e:
            failures[type(e).__name__] = failures.get(type(e).__name__, 0) + 1
            continue
        compile_s.append(time.perf_counter() - t)
        name = getattr(compiled, "backend", backend.name)
        chosen[name] = chosen.get(name, 0) + 1
        compiled_docs.append((r, doc, compiled))
        for test in doc["tests"]:
            data, label = test["data"], bool(test["valid"])
            if validate_instance(compact(data), doc["schema"]) != label:
                walks["label_disagrees_with_jsonschema"] += 1
                continue
            ok = walk(compiled, tokenizer, data)
            ordered = in_schema_order(data, doc["schema"], doc["schema"])
            ok_in_order = ok or (compact(ordered) != compact(data) and walk(compiled, tokenizer, ordered))
            if label:
                walks["valid"] += 1
                walks["valid_accepted"] += ok
                walks["valid_accepted_in_schema_order"] += ok_in_order
                if not ok_in_order:
                    rejected.append(f"{r['file']}: {compact(data)[:160]}")
            else:
                walks["invalid"] += 1
                walks["invalid_rejected"] += not ok_in_order
                if ok_in_order and not compiled.ignored_keywords:
                    walks["invalid_accepted_unexplained"] += 1
                    unexplained.append(r["file"])
    report = {
        "num_schemas": len(docs),
        "compiled": len(compiled_docs),
        "compile_success_rate": len(compiled_docs) / max(len(docs), 1),
        "compile_failures": failures,
        "compile_time_s_p50": percentile(compile_s, 0.5),
        "compile_time_s_p90": percentile(compile_s, 0.9),
        "chosen_backend": chosen,
        "compiled_with_ignored_keywords": sum(bool(c.ignored_keywords) for _, _, c in compiled_docs),
        **walks,
        "valid_accepted_share": walks["valid_accepted"] / max(walks["valid"], 1),
        "valid_accepted_in_schema_order_share": walks["valid_accepted_in_schema_order"]
        / max(walks["valid"], 1),
        "invalid_rejected_share": walks["invalid_rejected"] / max(walks["invalid"], 1),
        "invalid_accepted_unexplained_files": unexplained,
        "valid_rejected_files": rejected,
    }
    return {"report": report, "compiled": compiled_docs}


#: generation modes: label -> speculative_config (None: plain decoding)
GENERATION_MODES: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "ngram_forced": {"method": "ngram", "num_speculative_tokens": 4, "grammar_forced_drafts": True},
    "grammar": {"method": "grammar", "num_speculative_tokens": 4},
    "eagle_chain": {"method": "eagle", "num_speculative_tokens": 4},
    "eagle_tree": {
        "method": "eagle",
        "num_speculative_tokens": 4,
        "tree": "dynamic",
        "tree_topk": 4,
        "max_tree_nodes": 16,  # as in the documented runs (the library's default is 15 since 2026-12-06)
    },
}


def spread(items: list[Any], n: int | None) -> list[Any]:
    """``n`` items evenly spaced through ``items`` (all of them when ``n`` is None or larger)."""
    if n is None or n >= len(items):
        return items
    return [items[(i * len(items)) // n] for i in range(n)]


def generate_all(
    llm: Any, backend: Any, compiled_docs: list, max_tokens: int, modes: list[str], mask_prefetch: bool = True
) -> dict[str, Any]:
    """Greedy generation for every schema of ``compiled_docs``, per mode of ``modes``
    (:data:`GENERATION_MODES`). ``tokens_per_forward`` is generated tokens per target forward over all
    decode steps (steps that drafted nothing included): ``generated / (generated - accepted)``; τ
    (``mean_acceptance_length``) counts only the steps that drafted."""
    from sampling.params import SamplingParams

    prompts = [prompt_for(llm, doc["schema"]) for _, doc, _ in compiled_docs]
    out: dict[str, Any] = {}
    plain_tokens: list[list[int]] | None = None
    for label in modes:
        spec = GENERATION_MODES[label]
        runner = llm if spec is None else llm.with_speculation(spec)
        runner.engine.grammar_backend = backend
        if not mask_prefetch:
            runner.engine.mask_prefetch = None
        timer = MaskTimer()
        prefetch = runner.engine.mask_prefetch
        waits_before = len(prefetch.wait_s) if prefetch is not None else 0
        t = time.perf_counter()
        params = [
            SamplingParams(temperature=0, max_tokens=max_tokens, json_schema=doc["schema"])
            for _, doc, _ in compiled_docs
        ]
        outs = runner.generate(prompts, params)
        wall = time.perf_counter() - t
        timer.close()
        waits = [1e6 * w for w in list(prefetch.wait_s)[waits_before:]] if prefetch is not None else []
        finished = [
            (o.outputs[0], c)
            for o, (_, _, c) in zip(outs, compiled_docs)
            if o.outputs[0].finish_reason == "stop"
        ]
        clean = [o for o, c in finished if not c.ignored_keywords]
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        accepted = sum(o.metrics.get("num_accepted_tokens", 0) for o in outs)
        tokens = [o.outputs[0].token_ids for o in outs]
        if plain_tokens is None and spec is None:
            plain_tokens = tokens
        out[label] = {
            "wall_s": wall,
            "generated_tokens": generated,
            "tokens_per_forward": generated / max(generated - accepted, 1),
            "same_as_plain": None
            if plain_tokens is None
            else sum(a == b for a, b in zip(tokens, plain_tokens)) / len(tokens),
            "finished": len(finished),
            "finished_parse_share": sum(parses(o.text) for o, _ in finished) / max(len(finished), 1),
            "finished_not_parsing": [
                r["file"]
                for o, (r, _, _) in zip(outs, compiled_docs)
                if o.outputs[0].finish_reason == "stop" and not parses(o.outputs[0].text)
            ],
            "finished_valid_share": sum(bool(o.schema_valid) for o, _ in finished) / max(len(finished), 1),
            "finished_no_ignored_keywords": len(clean),
            "finished_no_ignored_keywords_valid_share": sum(bool(o.schema_valid) for o in clean)
            / max(len(clean), 1),
            "length_share": sum(o.outputs[0].finish_reason == "length" for o in outs) / max(len(outs), 1),
            "mask_us_p50": percentile(timer.times_us, 0.5),
            "mask_us_p99": percentile(timer.times_us, 0.99),
            "num_mask_calls": len(timer.times_us),
            # per step: what the step waited for its masks after the forward (computed beside it)
            "mask_wait_us_p50": percentile(waits, 0.5),
            "mask_wait_us_p99": percentile(waits, 0.99),
        }
        if spec is not None:
            stats = runner.engine.spec_stats
            out[label]["mean_acceptance_length"] = stats.mean_acceptance_length
            out[label]["num_draft_nodes"] = stats.num_draft_nodes
            out[label]["num_forced_drafts"] = getattr(runner.engine.drafter, "num_forced_drafts", 0)
        print(json.dumps({label: {k: v for k, v in out[label].items() if k != "finished_not_parsing"}}))
        if runner is not llm:
            del runner
    return out


def plot_modes(report: dict[str, Any], path: str) -> Path:
    """Tokens per target forward and τ per generation mode, one group of bars per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = {n: r["generation"] for n, r in report["backends"].items() if r.get("generation")}
    modes = list(next(iter(backends.values())))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(backends)
    for ax, key, title in (
        (axes[0], "tokens_per_forward", "tokens per target forward (all decode steps)"),
        (axes[1], "mean_acceptance_length", "τ (steps that drafted)"),
    ):
        for i, (name, gen) in enumerate(backends.items()):
            values = [gen[m].get(key, 1.0) for m in modes]
            bars = ax.bar([j + i * width for j in range(len(modes))], values, width, label=name)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(modes))], modes, rotation=20, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.legend(fontsize=8)
    n = report.get("num_generation_schemas", "?")
    fig.suptitle(f"SmolLM2-135M under JSON schemas (JSONSchemaBench, {n} schemas, greedy)", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run(cfg: BenchGrammarConfig) -> dict[str, Any]:
    if not (BENCH / "index.jsonl").exists():
        raise SystemExit(f"{BENCH} is absent")

    from grammars.registry import make_grammar_backend
    from sampling.params import SamplingParams
    from specdec import LLM

    warnings.simplefilter("ignore")
    rows = select(cfg.per_subset)
    docs = [(r, json.loads((BENCH / r["file"]).read_text())) for r in rows]
    llm = LLM("smollm2-135m-instruct")
    tokenizer = llm.tokenizer
    cfg_model = llm.engine.model_cfg
    report: dict[str, Any] = {"backends": {}}
    first: tuple[Any, list] | None = None
    for name in cfg.backends:
        backend = make_grammar_backend(
            name, tokenizer, cfg_model.vocab_size, cfg_model.eos_token_ids, compile_timeout_s=10.0
        )
        result = compile_and_walk(backend, tokenizer, docs)
        entry = result["report"]
        print(json.dumps({name: {k: v for k, v in entry.items() if not k.endswith("_files")}}))
        if cfg.generate:
            chosen = spread(result["compiled"], cfg.generate_schemas)
            report["num_generation_schemas"] = len(chosen)
            entry["generation"] = generate_all(
                llm, backend, chosen, cfg.max_tokens, cfg.modes, cfg.mask_prefetch
            )
        report["backends"][name] = entry
        if first is None:
            first = (backend, result["compiled"])
    if not cfg.generate or first is None:
        return report
    if cfg.figure:
        report["figure"] = str(plot_modes(report, cfg.figure))
    # Decode speed at batch 1 (the first backend): grammar vs none, plain vs ngram.
    backend, compiled_docs = first
    speed: dict[str, float] = {}
    sub = [
        (prompt_for(llm, doc["schema"]), doc["schema"]) for _, doc, _ in compiled_docs[: cfg.speed_prompts]
    ]
    for label, spec in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 4})):
        runner = llm if spec is None else llm.with_speculation(spec)
        runner.engine.grammar_backend = backend
        warm_up(runner, sub[0][0]["prompt_token_ids"])
        for constrained in (False, True):
            params = [
                SamplingParams(
                    temperature=0, max_tokens=cfg.speed_max_tokens, json_schema=s if constrained else None
                )
                for _, s in sub
            ]
            timed = time_batch1(
                runner, [p["prompt_token_ids"] for p, _ in sub], params, reset_prefix_cache=False
            )
            speed[f"{label}_{'grammar' if constrained else 'free'}_tok_s"] = timed.tokens_per_s
    speed["grammar_over_free_plain"] = speed["plain_grammar_tok_s"] / speed["plain_free_tok_s"]
    speed["grammar_over_free_ngram"] = speed["ngram_grammar_tok_s"] / speed["ngram_free_tok_s"]
    report["speed_batch1"] = speed
    return report


def format_table(report: dict[str, Any]) -> str:
    """One markdown row per backend: compile, instance walks, generation."""
    lines = [
        "| backend | compiled | valid accepted (as is / keys in schema order) | invalid rejected "
        "| invalid accepted, nothing ignored "
        "| compile p50 / p90 (ms) | finished parse (plain / ngram) | mask p50 / p99 (µs) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["backends"].items():
        gen = r.get("generation", {})
        parse = " / ".join(f"{gen[k]['finished_parse_share']:.0%}" for k in ("plain", "ngram") if k in gen)
        mask = gen.get("plain", {})
        p50, p90 = r["compile_time_s_p50"] or 0.0, r["compile_time_s_p90"] or 0.0
        lines.append(
            f"| {name} | {r['compiled']}/{r['num_schemas']} "
            f"| {r['valid_accepted']} / {r['valid_accepted_in_schema_order']} of {r['valid']} "
            f"| {r['invalid_rejected']}/{r['invalid']} | {r['invalid_accepted_unexplained']} "
            f"| {1e3 * p50:.1f} / {1e3 * p90:.1f} | {parse or '-'} "
            f"| {mask.get('mask_us_p50') or 0:.0f} / {mask.get('mask_us_p99') or 0:.0f} |"
        )
    for name, r in report["backends"].items():
        gen = r.get("generation")
        if not gen:
            continue
        lines += [
            "",
            f"{name}, {report.get('num_generation_schemas')} schemas, greedy:",
            "| mode | finished | parse | valid | length | τ | tokens / forward | = plain | forced drafts "
            "| mask p50 / p99 (µs) | mask wait per step p50 / p99 (µs) | wall (s) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for mode, g in gen.items():
            same = g.get("same_as_plain")
            lines.append(
                f"| {mode} | {g['finished']} | {g['finished_parse_share']:.0%} "
                f"| {g['finished_valid_share']:.0%} | {g['length_share']:.0%} "
                f"| {g.get('mean_acceptance_length', 1.0):.2f} | {g['tokens_per_forward']:.2f} "
                f"| {'-' if same is None else f'{same:.0%}'} | {g.get('num_forced_drafts', 0)} "
                f"| {g['mask_us_p50'] or 0:.0f} / {g['mask_us_p99'] or 0:.0f} "
                f"| {g.get('mask_wait_us_p50') or 0:.0f} / {g.get('mask_wait_us_p99') or 0:.0f} "
                f"| {g['wall_s']:.0f} |"
            )
    if "speed_batch1" in report:
        lines.append(json.dumps(report["speed_batch1"]))
    return "\n".join(lines)


#: ``main()``: Hydra's command line; ``main(["per_subset=2"])``: compose, run, return the report.
main = benchmark("bench_grammar", BenchGrammarConfig, run, format_table)

if __name__ == "__main__":
    main()
