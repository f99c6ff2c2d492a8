"""Running a benchmark: a typed config, a Hydra entry point, the shared measurements and provenance.

Each ``experiments/bench_<name>.py`` script (engine, spec, sampler, drafters, grammar, quant) is a
docstring, a config dataclass subclassing :class:`HarnessConfig` (its options as typed fields, checked
once in ``validate()``), ``run(cfg) -> dict``, a table formatter and ``main = benchmark(...)``.
:func:`benchmark` stores the config in Hydra's ConfigStore (node ``bench_<name>``) and returns
``main``:

- ``main()`` (``python -m experiments.bench_<name> key=value ...``) is a ``@hydra.main`` entry point:
  ``--help``, ``--cfg job``, ``-m`` sweeps (``-m max_tokens=32,64``); the run directory Hydra makes is
  ``experiments/results/runs/<node>/<date>/<time>`` (sweeps: ``.../<node>/multirun/<date>/<time>/<job>``,
  git-ignored), and the job does not change directory;
- ``main(["dtype=float32", "batch_sizes=[1,4]"])`` composes the same config with Hydra's compose API
  (tests, notebooks) and returns the result.

Either way a misspelt key or a value of the wrong type fails while composing, naming the key, and
``validate()`` raises :class:`specdec.errors.ConfigError` before any model loads. Then the harness sets
``threads`` (torch intra-op threads, restored afterwards) and ``seed``, runs, prints the table (a
``key  value`` listing without a formatter), adds ``run_info`` (git commit, package versions, seeds,
device, torch threads, command line, Hydra overrides, the config: :func:`experiments.tracking.run_info`)
to the result and writes it as JSON to ``out`` when set.

Measurements, one function each, shared by the scripts and ``experiments/bench.py``:

- specdec: :func:`warm_up`, :func:`time_batch1` (each prompt alone, prefix cache reset),
  :func:`time_together` (one batch), :func:`measure_batch1` (an ``LLM`` built, warmed up and timed at
  batch 1), :func:`spec_stats_fields` (τ, acceptance, draft and verify time);
- transformers: :class:`ForwardCounter`, :func:`hf_generate` (one prompt), :func:`hf_batch1` (each
  prompt alone), :func:`hf_static_batch` / :func:`time_hf_static_batch` (a left-padded batch),
  :func:`hf_assistant` (an assistant model with a fixed k).
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import json
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from specdec.errors import ConfigError

logger = logging.getLogger(__name__)

#: Hydra's run and sweep directories (git-ignored), one folder per benchmark.
RUNS = Path(__file__).resolve().parent / "results" / "runs"
#: ``--help``: the script's docstring and its config (a benchmark has no config groups).
HELP_TEMPLATE = """${hydra.help.header}
== Config ==
Override any key (key=value, lists as 'key=[a,b]'); sweep with -m (key=a,b).

$CONFIG
${hydra.help.footer}"""


# ------------------------------------------------------------------------------------------ config
@dataclass
class HarnessConfig:
    """What every benchmark takes.

    Attributes:
        out: write the result (with ``run_info``) as JSON here.
        threads: torch intra-op threads during the run (None: torch's own setting).
        seed: ``torch.manual_seed`` and ``random.seed`` before the run.
    """

    out: str | None = None
    threads: int | None = None
    seed: int = 0

    def validate(self) -> None:
        """Check the values (subclasses extend it).

        Raises:
            ConfigError: a value out of range; the message names the key.
        """
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1 or null, got {self.threads}")


def require_positive(cfg: Any, *keys: str) -> None:
    """``ConfigError`` unless every ``cfg.<key>`` is >= 1."""
    for key in keys:
        value = getattr(cfg, key)
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")


def require_positive_list(key: str, values: Sequence[int]) -> None:
    """``ConfigError`` unless ``values`` is a non-empty list of integers >= 1."""
    if not values or any(v < 1 for v in values):
        raise ConfigError(f"{key} must list integers >= 1, got {list(values)}")


def require_choice(key: str, value: Any, choices: Iterable[Any]) -> None:
    """``ConfigError`` unless ``value`` is one of ``choices``."""
    options = list(choices)
    if value not in options:
        raise ConfigError(f"{key} must be one of {options}, got {value!r}")


def require_subset(key: str, values: Sequence[str], choices: Iterable[str]) -> None:
    """``ConfigError`` unless ``values`` is a non-empty subset of ``choices`` (the message lists them)."""
    options = list(choices)
    unknown = [v for v in values if v not in options]
    if unknown or not values:
        detail = f" (unknown: {unknown})" if unknown else ""
        raise ConfigError(f"{key} must be a non-empty subset of {options}, got {list(values)}{detail}")


def require_extra_methods(extra: dict[str, Any], names: Iterable[str]) -> None:
    """``ConfigError`` unless every row of a benchmark's ``extra_methods`` (a name -> its
    ``speculative_config``) has a name none of ``names`` (the built-in rows) has and a ``method``; the
    rows' settings are checked by :class:`~specdec.config.SpeculativeConfig` before any work."""
    taken = set(names)
    for name, row in extra.items():
        if name in taken:
            raise ConfigError(f"extra_methods: {name!r} is already a method; name your row otherwise")
        if not isinstance(row, dict) or not row.get("method"):
            raise ConfigError(
                f"extra_methods.{name} must be a speculative_config with a 'method', got {row!r}"
            )


def check_speculative_configs(specs: Iterable[dict[str, Any] | None]) -> None:
    """Every ``speculative_config`` of a benchmark's rows (None: plain decoding) checked by
    :class:`~specdec.config.SpeculativeConfig` before any work; the first bad one raises its
    ``ConfigError``."""
    from specdec.config import SpeculativeConfig

    for spec in specs:
        if spec is not None:
            SpeculativeConfig.from_any(spec)


# ----------------------------------------------------------------------------------------- harness
C = TypeVar("C", bound=HarnessConfig)


def key_values(result: dict[str, Any]) -> str:
    """``key  value`` lines, keys padded to one width, floats to 3 decimals."""
    width = max((len(k) for k in result), default=0)
    return "\n".join(
        f"{k:{width}s}  {v:.3f}" if isinstance(v, float) else f"{k:{width}s}  {v}" for k, v in result.items()
    )


class Benchmark(Generic[C]):
    """One benchmark: its Hydra node, config class, run function and table (see the module docstring).

    Call it with override strings to compose and run from Python, or without arguments to run Hydra's
    command line (``sys.argv``).
    """

    def __init__(
        self,
        name: str,
        config_cls: type[C],
        run: Callable[[C], dict[str, Any]],
        table: Callable[[dict[str, Any]], str] | None = None,
        device: str | None = None,
        doc: str | None = None,
    ) -> None:
        self.name = name
        self.config_cls = config_cls
        self.run = run
        self.table = table
        self.device = device
        module = inspect.getmodule(run)
        self.doc = doc if doc is not None else (module.__doc__ if module is not None else None) or ""
        self.register()

    # -------------------------------------------------------------------------------- Hydra node
    def hydra_settings(self) -> dict[str, Any]:
        """The ``hydra:`` section of the node: run and sweep directories under :data:`RUNS`, no chdir,
        the job named after the node, the script's docstring in ``--help``."""
        runs = RUNS / self.name
        stamp = "${now:%Y-%m-%d}/${now:%H-%M-%S}"
        header = self.doc.strip().replace("${", "\\${")
        return {
            "run": {"dir": f"{runs}/{stamp}"},
            "sweep": {"dir": f"{runs}/multirun/{stamp}", "subdir": "${hydra.job.num}"},
            "job": {"name": self.name, "chdir": False},
            "help": {"app_name": self.name, "header": f"{self.name}: {header}\n", "template": HELP_TEMPLATE},
        }

    def register(self) -> None:
        """Store ``<name>_schema`` (the dataclass) and ``<name>`` (the schema plus the ``hydra:``
        section) in the ConfigStore (idempotent)."""
        from hydra.core.config_store import ConfigStore

        cs = ConfigStore.instance()
        cs.store(name=f"{self.name}_schema", node=self.config_cls)
        cs.store(
            name=self.name,
            node={"defaults": [f"{self.name}_schema", "_self_"], "hydra": self.hydra_settings()},
        )

    # ---------------------------------------------------------------------------------- configs
    def to_config(self, dcfg: Any) -> C:
        """The composed ``DictConfig`` as the dataclass, validated."""
        from omegaconf import OmegaConf

        obj = OmegaConf.to_object(dcfg)
        if not isinstance(obj, self.config_cls):
            raise TypeError(f"expected a {self.config_cls.__name__} composed from {self.name!r}, got {obj!r}")
        obj.validate()
        return obj

    def config(self, overrides: Sequence[str] = ()) -> C:
        """Compose ``overrides`` (``["max_tokens=64", "batch_sizes=[1,4]"]``) with Hydra's compose API.

        Raises:
            ConfigError: an unknown key or a value of the wrong type (the message names the key and lists
                the keys), or a value ``validate()`` rejects.
        """
        from hydra import compose, initialize
        from hydra.core.global_hydra import GlobalHydra
        from hydra.errors import ConfigCompositionException

        self.register()
        try:
            if GlobalHydra.instance().is_initialized():
                dcfg = compose(config_name=self.name, overrides=list(overrides))
            else:
                with initialize(version_base=None, config_path=None):
                    dcfg = compose(config_name=self.name, overrides=list(overrides))
        except ConfigCompositionException as e:
            # Hydra's message, then its cause's (``Key 'max_token' not in ...``), less the hint to append
            # with ``+key=``, which a typed config refuses.
            lines = str(e).splitlines()
            if e.__cause__ is not None:
                lines += str(e.__cause__).splitlines()
            lines = [line for line in lines if not line.startswith("To append to your config")]
            keys = [f.name for f in dataclasses.fields(self.config_cls)]
            raise ConfigError("\n".join([f"{self.name}: {lines[0]}", *lines[1:], f"keys: {keys}"])) from e
        return self.to_config(dcfg)

    # -------------------------------------------------------------------------------------- run
    def execute(self, cfg: C) -> dict[str, Any]:
        """Run ``cfg`` (already validated): threads and seed, run, table, ``run_info``, JSON."""
        from experiments.tracking import pick_device, run_info

        threads_before = torch.get_num_threads()
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        try:
            random.seed(cfg.seed)
            torch.manual_seed(cfg.seed)
            info = run_info({"torch": cfg.seed, "random": cfg.seed}, self.device or pick_device(None))
            info["benchmark"] = self.name
            info["config"] = dataclasses.asdict(cfg)
            result = self.run(cfg)
        finally:
            torch.set_num_threads(threads_before)
        text = self.table(result) if self.table is not None else key_values(result)
        if text:
            print(text, flush=True)
        result["run_info"] = info
        if cfg.out:
            out = Path(cfg.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2, default=str) + "\n")
        return result

    def cli(self) -> dict[str, Any]:
        """Hydra's command line on ``sys.argv``; each job also writes its result to ``result.json`` in
        its Hydra run directory. Returns the result of a single run (of an in-process sweep:
        ``{"runs": [results]}``)."""
        import hydra
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import DictConfig

        self.register()
        results: list[dict[str, Any]] = []

        def task(dcfg: DictConfig) -> None:
            try:
                cfg = self.to_config(dcfg)
            except ConfigError as e:
                raise SystemExit(f"{self.name}: {e}") from None
            result = self.execute(cfg)
            run_dir = Path(HydraConfig.get().runtime.output_dir)
            (run_dir / "result.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
            results.append(result)

        hydra.main(version_base=None, config_path=None, config_name=self.name)(task)()
        return results[0] if len(results) == 1 else {"runs": results}

    def __call__(self, overrides: Sequence[str] | None = None) -> dict[str, Any]:
        """``overrides`` None: Hydra's command line (``sys.argv``); else compose them and run."""
        if overrides is None:
            return self.cli()
        return self.execute(self.config(overrides))


def benchmark(
    name: str,
    config_cls: type[C],
    run: Callable[[C], dict[str, Any]],
    table: Callable[[dict[str, Any]], str] | None = None,
    device: str | None = None,
) -> Benchmark[C]:
    """Register ``config_cls`` as Hydra node ``name`` and return the benchmark's ``main``.

    Args:
        run: ``run(cfg) -> result``; the harness adds ``run_info`` to the result.
        table: ``table(result) -> str``, printed after the run (None: a ``key  value`` listing).
        device: the device recorded in ``run_info`` (None: CUDA when available, else the CPU, as
            ``specdec.LLM`` picks).
    """
    return Benchmark(name, config_cls, run, table, device)


# ---------------------------------------------------------------------------------- measurements
def sync(device: torch.device | str | None = None) -> None:
    """Wait for CUDA work (of ``device``; None: whenever CUDA is in use) before reading a clock."""
    if device is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    elif torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    """Collect garbage and release CUDA's cached blocks (between models)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class Timed:
    """A timed generation: new token ids per request, wall-clock seconds, per-request metrics
    (specdec's ``RequestOutput.metrics``), target forwards after the prefills (transformers) and, timed
    one request at a time (:func:`time_batch1`, :func:`measure_batch1_interleaved`), each request's
    seconds."""

    outputs: list[list[int]]
    time_s: float
    metrics: list[dict[str, Any]] = field(default_factory=list)
    forwards: int = 0
    seconds: list[float] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s


def warm_up(llm: Any, prompt: Sequence[int]) -> None:
    """One greedy 4-token request (builds lazy state, fills allocator caches) before timing."""
    from sampling.params import SamplingParams

    llm.generate([{"prompt_token_ids": list(prompt)}], SamplingParams(temperature=0.0, max_tokens=4))


def time_batch1(
    llm: Any, prompts: Sequence[Sequence[int]], params: Any, reset_prefix_cache: bool = True
) -> Timed:
    """specdec at batch 1: each prompt alone, in order, timed one request at a time.

    Args:
        params: one ``SamplingParams`` for all, or one per prompt.
        reset_prefix_cache: empty the prefix cache before each request (no prompt reuses another's
            blocks).

    The speculative counters are reset first, so ``llm.engine.spec_stats`` then covers exactly these
    requests (see :func:`spec_stats_fields`).
    """
    per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    llm.engine.reset_spec_stats()
    outputs: list[list[int]] = []
    metrics: list[dict[str, Any]] = []
    seconds: list[float] = []
    for p, sp in zip(prompts, per_prompt, strict=True):
        out, m, secs = _time_request(llm, p, sp, reset_prefix_cache)
        outputs.append(out)
        metrics.append(m)
        seconds.append(secs)
    return Timed(outputs, sum(seconds), metrics, seconds=seconds)


def _time_request(
    llm: Any, prompt: Sequence[int], params: Any, reset_prefix_cache: bool = True
) -> tuple[list[int], dict[str, Any], float]:
    """One request alone, timed: its new token ids, its metrics and its seconds."""
    if reset_prefix_cache:
        llm.engine.kv.pool.reset_prefix_cache()
    sync()
    t = time.perf_counter()
    (o,) = llm.generate([{"prompt_token_ids": list(prompt)}], params)
    sync()
    return list(o.outputs[0].token_ids), dict(o.metrics), time.perf_counter() - t


def _oracle_start(llm: Any) -> tuple[Callable[[], dict[str, Any]], dict[str, Any]] | None:
    """A hybrid drafter's ``report`` and its report now (the oracle's baseline), None for other drafters."""
    report = getattr(llm.engine.drafter, "report", None)
    return None if report is None else (report, report())


def _batch1_row(
    llm: Any, timed: Timed, oracle: tuple[Callable[[], dict[str, Any]], dict[str, Any]] | None
) -> dict[str, Any]:
    """A row of :func:`measure_batch1`: tokens, seconds, tokens per second, the speculative counters and,
    from ``oracle`` (:func:`_oracle_start`), a hybrid's oracle since then."""
    row: dict[str, Any] = {"tokens": timed.tokens, "time_s": timed.time_s, "tokens_per_s": timed.tokens_per_s}
    row.update(spec_stats_fields(llm))
    if oracle is not None:
        report, before = oracle
        row.update(_oracle_fields(before, report()))
    return row


def time_together(
    llm: Any, prompts: Sequence[Sequence[int]], params: Any, reset_spec_stats: bool = True
) -> Timed:
    """specdec on every prompt submitted at once (one ``generate`` call, continuous batching), timed as
    one call, the prefix cache and (with ``reset_spec_stats``) the speculative counters reset first;
    ``reset_spec_stats=False`` lets ``llm.engine.spec_stats`` sum several calls."""
    if reset_spec_stats:
        llm.engine.reset_spec_stats()
    llm.engine.kv.pool.reset_prefix_cache()
    sync()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params)
    sync()
    elapsed = time.perf_counter() - t
    return Timed([list(o.outputs[0].token_ids) for o in outs], elapsed, [dict(o.metrics) for o in outs])


def spec_stats_fields(llm: Any) -> dict[str, Any]:
    """The speculative counters since the last reset: ``tau`` (tokens per draft step: 1 + accepted ÷
    draft steps), ``tokens_per_step`` (tokens per target forward over every sampling step, drafting or
    not: the figure to compare drafters that draft at different rates by),
    ``acceptance_rate``, ``acceptance_per_position`` (the fraction of draft steps whose draft at depth i
    was accepted), ``draft_tokens_per_step``, ``draft_time_s``, ``draft_ms_per_step`` (drafting time per
    draft step), ``verify_time_s``; empty without a
    draft step (plain decoding)."""
    stats = llm.engine.spec_stats
    if stats is None or not stats.num_drafts:
        return {}
    return {
        "tau": stats.mean_acceptance_length,
        "tokens_per_step": stats.tokens_per_step,
        "acceptance_rate": stats.acceptance_rate,
        "acceptance_per_position": [n / stats.num_drafts for n in stats.accepted_per_position],
        "draft_tokens_per_step": stats.num_draft_tokens / stats.num_drafts,
        "draft_time_s": stats.draft_time_s,
        "draft_ms_per_step": 1e3 * stats.draft_time_s / stats.num_drafts,
        "verify_time_s": stats.verify_time_s,
    }


def measure_batch1(
    model: str | Path,
    spec: dict[str, Any] | None,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    dtype: str,
    ignore_eos: bool = False,
    warmup: Sequence[int] | None = None,
    **llm_kwargs: Any,
) -> tuple[dict[str, Any], Timed]:
    """Greedy batch-1 generation of every prompt by a fresh ``LLM(model, dtype, speculative_config=spec,
    **llm_kwargs)``: warm-up (``warmup``, default the first prompt), then :func:`time_batch1`.

    Returns:
        ``({"tokens", "time_s", "tokens_per_s", **spec_stats_fields}, the Timed run)``; with a drafter that
        reports an oracle (the hybrid, :meth:`~specdec.drafters.hybrid.HybridDrafter.report`), also
        ``oracle_tau`` (its best member per step in hindsight) and ``members_chosen`` (steps each member
        drafted), over the timed prompts only.
    """
    from sampling.params import SamplingParams
    from specdec import LLM

    llm = LLM(str(model), dtype=dtype, speculative_config=spec, **llm_kwargs)
    warm_up(llm, prompts[0] if warmup is None else warmup)
    oracle = _oracle_start(llm)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    timed = time_batch1(llm, prompts, sp)
    row = _batch1_row(llm, timed, oracle)
    del llm, oracle
    free_memory()
    return row, timed


def measure_batch1_interleaved(
    model: str | Path,
    specs: dict[str, dict[str, Any] | None],
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    dtype: str,
    ignore_eos: bool = False,
    kv_cache_memory_bytes: int = 256 * 1024**2,
    share_target: bool = True,
    **llm_kwargs: Any,
) -> dict[str, tuple[dict[str, Any], Timed]]:
    """:func:`measure_batch1` of several rows at once, interleaved: every row's engine is built and warmed
    up first (each with a KV pool of ``kv_cache_memory_bytes``), then each prompt is generated by every row
    in turn, so a host whose speed drifts during the run (this project's 2-core hosts: by 10-30 % within
    minutes) moves every row alike and the ratios between rows hold. With ``share_target`` (and an eager
    target) every row's engine runs over the first row's target weights (``LLM.with_speculation``): the
    rows read the same bytes on the same pages, and the target is in memory once; otherwise each engine
    loads its own. Every engine is alive at once (:func:`interleaved_bytes` bounds their memory), with a
    KV pool of ``kv_cache_memory_bytes`` each rather than ``LLM``'s default (2 GiB): batch 1 needs little
    (SmolLM2: 23 KB a token, 11k tokens in 256 MiB).

    Returns:
        per name of ``specs``, what :func:`measure_batch1` returns for it.
    """
    from sampling.params import SamplingParams
    from specdec import LLM

    def build(spec: dict[str, Any] | None) -> Any:
        return LLM(
            str(model),
            dtype=dtype,
            speculative_config=spec,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            **llm_kwargs,
        )

    llms: dict[str, Any] = {}
    for name, spec in specs.items():
        first = next(iter(llms.values()), None)
        llms[name] = shared_or_own(first, spec, build, share_target)
    warning = unequal_huge_pages({name: huge_page_fields(llm) for name, llm in llms.items()})
    if warning:
        logger.warning("%s", warning)
    oracles: dict[str, Any] = {}
    for name, llm in llms.items():
        warm_up(llm, prompts[0])
        llm.engine.reset_spec_stats()
        oracles[name] = _oracle_start(llm)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    outputs: dict[str, list[list[int]]] = {name: [] for name in llms}
    metrics: dict[str, list[dict[str, Any]]] = {name: [] for name in llms}
    seconds: dict[str, list[float]] = {name: [] for name in llms}
    for p in prompts:
        for name, llm in llms.items():
            out, m, secs = _time_request(llm, p, sp)
            outputs[name].append(out)
            metrics[name].append(m)
            seconds[name].append(secs)
    results: dict[str, tuple[dict[str, Any], Timed]] = {}
    for name, llm in llms.items():
        timed = Timed(outputs[name], sum(seconds[name]), metrics[name], seconds=seconds[name])
        results[name] = (_batch1_row(llm, timed, oracles[name]), timed)
    del llms, llm, oracles
    free_memory()
    return results


#: The share of an engine's huge-page windows that may be refused before :func:`unequal_huge_pages` warns.
REFUSED_SHARE = 0.02


def huge_page_fields(llm: Any) -> dict[str, Any] | None:
    """What the engine's start-up huge-page collapse did (:mod:`specdec.engine.huge_pages`):
    ``{"collapsed_mb", "refused_mb", "reason"}``, or None where it was not asked for."""
    stats = getattr(llm, "huge_pages", None)
    if stats is None:
        return None
    return {
        "collapsed_mb": round(stats.collapsed_bytes / 1e6, 1),
        "refused_mb": round(stats.refused_bytes / 1e6, 1),
        "reason": stats.reason,
    }


def unequal_huge_pages(engines: dict[str, dict[str, Any] | None]) -> str | None:
    """A warning when engines compared in one process did not all get their weights onto huge pages:
    some windows refused (memory the kernel could not compact, with several engines' weights resident),
    or some engines collapsed and others not. Such an engine streams part of its weights through 4 KiB
    pages, and its rows are biased low against the others (the Qwen2.5-Coder 1.5B ← 0.5B pair at 16
    clients: the speculative engine, built second, had 1.9 GB refused and ran at 0.94× plain while it
    drafted nothing; 1.01× with huge pages off for both). None when they are alike: a few refused windows
    (under :data:`REFUSED_SHARE` of an engine's, e.g. a window partly unmapped) do not count. ``engines``:
    per engine name, :func:`huge_page_fields`."""
    collapsed = {name: bool(f and f["collapsed_mb"] > 0) for name, f in engines.items()}
    refused = {
        name: f["refused_mb"]
        for name, f in engines.items()
        if f and f["refused_mb"] > REFUSED_SHARE * (f["collapsed_mb"] + f["refused_mb"])
    }
    if not refused and len(set(collapsed.values())) <= 1:
        return None
    parts = [f"{name}: {mb:.0f} MB refused" for name, mb in refused.items()]
    parts += [f"{name}: none collapsed" for name, c in collapsed.items() if not c and any(collapsed.values())]
    return (
        "not every engine compared in this process has its weights on huge pages ("
        + "; ".join(parts)
        + "): weights on 4 KiB pages stream slower, so ratios between the engines may be biased; "
        "rerun with engine.huge_pages=false (or fewer engines, less memory in use)"
    )


def interleaved_bytes(
    model: str | Path, dtype: str, rows: int, kv_cache_memory_bytes: int, share_target: bool = True
) -> int:
    """A bound on what :func:`measure_batch1_interleaved` holds at once: the target's weights twice (the
    engine keeps a packed copy beside them), once for all rows with ``share_target``, else per row; and per
    row half as much again for the drafter's own copies (the quantized self-drafter's int8 model, heads)
    and the KV pool."""
    from specdec.memory import arch_config, weight_bytes

    _, held, _ = weight_bytes(arch_config(model), getattr(torch, dtype))
    target = 2 * held * (1 if share_target else rows)
    return target + rows * (int(0.5 * held) + kv_cache_memory_bytes)


def shared_or_own(
    first: Any, spec: dict[str, Any] | None, build: Callable[[dict[str, Any] | None], Any], share: bool = True
) -> Any:
    """An engine for ``spec``: over ``first``'s target (``first.with_speculation(spec)``) when ``share``,
    ``first`` is not None and its target can be shared (eager), else ``build(spec)`` with its own."""
    if share and first is not None and first.target_shareable:
        return first.with_speculation(spec)
    return build(spec)


def available_bytes() -> int | None:
    """The host's available memory (``MemAvailable`` in ``/proc/meminfo``), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _oracle_fields(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """A hybrid's ``oracle_tau`` and ``members_chosen`` between two of its reports."""
    steps = after["oracle_steps"] - before["oracle_steps"]
    accepted = after["oracle_accepted_tokens"] - before["oracle_accepted_tokens"]
    return {
        "oracle_tau": 1 + accepted / steps if steps else None,
        "members_chosen": {
            m: s["num_chosen"] - before["members"][m]["num_chosen"] for m, s in after["members"].items()
        },
    }


# --------------------------------------------------------------------------------- transformers
class ForwardCounter:
    """Counts a transformers model's forward calls (each verification or decode step is one)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        model.register_forward_hook(self._hook)

    def _hook(self, *args: Any) -> None:
        self.calls += 1


def hf_generate(
    model: Any,
    prompt: list[int],
    max_tokens: int,
    counter: ForwardCounter,
    ignore_eos: bool = False,
    **kwargs: Any,
) -> tuple[list[int], float, int]:
    """Greedy ``generate`` of one prompt; returns (new tokens, seconds, target forwards after the
    prefill)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    if ignore_eos:
        kwargs["min_new_tokens"] = max_tokens
    counter.calls = 0
    sync(device)
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False, **kwargs
        )
    sync(device)
    elapsed = time.perf_counter() - t
    return out[0, len(prompt) :].tolist(), elapsed, max(counter.calls - 1, 1)


def hf_batch1(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    counter: ForwardCounter,
    ignore_eos: bool = False,
    **kwargs: Any,
) -> Timed:
    """transformers at batch 1: :func:`hf_generate` on each prompt alone; ``forwards`` sums the target
    forwards after each prefill (τ = (tokens − prompts) ÷ forwards: the prefill emits the first token)."""
    outputs: list[list[int]] = []
    elapsed, forwards = 0.0, 0
    for p in prompts:
        new, secs, fw = hf_generate(model, list(p), max_tokens, counter, ignore_eos, **kwargs)
        outputs.append(new)
        elapsed += secs
        forwards += fw
    return Timed(outputs, elapsed, forwards=forwards)


def hf_static_batch(
    model: Any, prompts: Sequence[Sequence[int]], max_tokens: int, pad_id: int, ignore_eos: bool
) -> tuple[int, float]:
    """transformers greedy ``generate`` on one left-padded static batch; returns (tokens, seconds),
    counting each row's tokens up to its EOS (or all of them with ``ignore_eos``)."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p))
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    kwargs: dict[str, Any] = {"min_new_tokens": max_tokens} if ignore_eos else {}
    sync(device)
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            **kwargs,
        )
    sync(device)
    elapsed = time.perf_counter() - t
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None and not ignore_eos else set()
    tokens = 0
    for row in out[:, width:].tolist():
        n = len(row)
        for j, tok in enumerate(row):
            if tok in eos_ids:
                n = j + 1
                break
        tokens += n
    return tokens, elapsed


def time_hf_static_batch(
    model: Any, prompts: Sequence[Sequence[int]], max_tokens: int, pad_id: int, ignore_eos: bool
) -> tuple[int, float]:
    """:func:`hf_static_batch` after a warm-up on the prompts' first 8 tokens (4 new tokens)."""
    hf_static_batch(model, [list(p)[:8] for p in prompts], 4, pad_id, False)
    return hf_static_batch(model, prompts, max_tokens, pad_id, ignore_eos)


def hf_assistant(model_dir: str | Path, dtype: torch.dtype, k: int, device: str | None = None) -> Any:
    """A transformers assistant (draft) model proposing a fixed ``k`` tokens per step, as specdec's
    draft model does (transformers otherwise adapts the number of assistant tokens)."""
    from transformers import AutoModelForCausalLM

    assistant: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    if device is not None:
        assistant = assistant.to(torch.device(device))
    assistant = assistant.eval()
    assistant.generation_config.num_assistant_tokens = k
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    return assistant


__all__ = [
    "RUNS",
    "Benchmark",
    "ForwardCounter",
    "HarnessConfig",
    "Timed",
    "benchmark",
    "free_memory",
    "hf_assistant",
    "hf_batch1",
    "hf_generate",
    "hf_static_batch",
    "key_values",
    "measure_batch1",
    "require_choice",
    "require_positive",
    "require_positive_list",
    "require_subset",
    "spec_stats_fields",
    "sync",
    "time_batch1",
    "time_hf_static_batch",
    "time_together",
    "warm_up",
]
