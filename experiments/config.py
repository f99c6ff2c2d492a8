"""Typed experiment configuration: the schemas behind ``experiments/conf/``.

Every config group has one dataclass per option (``drafter/ngram.yaml`` is checked against
:class:`NgramDrafterConfig`, and so on); :func:`register_configs` stores them in Hydra's ConfigStore so
that a misspelt key or a value of the wrong type fails while Hydra composes the config, before any model
loads. :func:`to_experiment_config` turns the composed ``DictConfig`` into plain dataclasses and runs the
cross-field checks (:func:`validate_config`); library code only ever sees those dataclasses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

#: Tokenizer family of every zoo model: a draft model must share its target's vocabulary.
ZOO_FAMILIES = {
    "smollm2-135m-instruct": "smollm2",
    "qwen2.5-coder-0.5b-instruct": "qwen2.5",
    "qwen2.5-coder-1.5b-instruct": "qwen2.5",
}


class Dtype(str, Enum):
    """Weights, activations and KV-cache dtype."""

    float32 = "float32"
    bfloat16 = "bfloat16"


# ------------------------------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    """The target model.

    Attributes:
        name: a zoo name (``smollm2-135m-instruct``, ``qwen2.5-coder-0.5b-instruct``,
            ``qwen2.5-coder-1.5b-instruct``) or a local HF-format directory.
        dtype: ``float32`` or ``bfloat16``.
    """

    name: str = MISSING
    dtype: Dtype = Dtype.bfloat16


# ----------------------------------------------------------------------------------------- drafter
@dataclass
class DrafterConfig:
    """Base of the drafter options; ``method`` names the option."""

    method: str = MISSING

    def speculative_config(self) -> dict[str, Any] | None:
        """The ``speculative_config`` argument of ``specdec.LLM`` (None: no speculation)."""
        raise NotImplementedError


@dataclass
class NoDrafterConfig(DrafterConfig):
    """No speculation: only the baseline runs."""

    method: str = "none"

    def speculative_config(self) -> dict[str, Any] | None:
        """None: plain decoding."""
        return None


@dataclass
class NgramDrafterConfig(DrafterConfig):
    """Prompt-lookup (n-gram) drafting: propose the tokens that followed the latest n-gram match.

    Attributes:
        num_speculative_tokens: draft tokens per step (K).
        prompt_lookup_max: longest n-gram matched.
        prompt_lookup_min: shortest n-gram matched.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    def speculative_config(self) -> dict[str, Any] | None:
        """``{"method": "ngram", ...}`` for ``specdec.LLM``."""
        return {
            "method": "ngram",
            "num_speculative_tokens": self.num_speculative_tokens,
            "prompt_lookup_max": self.prompt_lookup_max,
            "prompt_lookup_min": self.prompt_lookup_min,
        }


@dataclass
class DraftModelDrafterConfig(DrafterConfig):
    """A small draft model proposes tokens; it must share the target's vocabulary.

    Attributes:
        model: zoo name or local directory of the draft model.
        num_speculative_tokens: draft tokens per step (K).
    """

    method: str = "draft_model"
    model: str = "qwen2.5-coder-0.5b-instruct"
    num_speculative_tokens: int = 4

    def speculative_config(self) -> dict[str, Any] | None:
        """``{"method": "draft_model", ...}`` for ``specdec.LLM``."""
        return {
            "method": "draft_model",
            "model": self.model,
            "num_speculative_tokens": self.num_speculative_tokens,
        }


# ----------------------------------------------------------------------------------------- dataset
@dataclass
class DatasetConfig:
    """Base of the dataset options; ``name`` names the option.

    Attributes:
        limit: most prompts (None: all).
    """

    name: str = MISSING
    limit: int | None = None


@dataclass
class BuiltinDatasetConfig(DatasetConfig):
    """Prompts built offline from the source and docstrings of Python standard-library modules.

    Attributes:
        seed: seeds the (deterministic) choice of functions and modules.
        max_prompt_chars: cap on a prompt's user message, in characters (about 4 per token).
    """

    name: str = "builtin"
    limit: int | None = 12
    seed: int = 0
    max_prompt_chars: int = 1200


@dataclass
class JsonlDatasetConfig(DatasetConfig):
    """Spec-Bench ``question.jsonl`` (``question_id``, ``category``, ``turns``; the first turn is used).

    Attributes:
        path: the file (relative paths are taken from the working directory).
        categories: keep only these categories (None: all).
        limit: the first ``limit`` prompts in round-robin order over categories (see
            :func:`experiments.datasets.load_jsonl`).
    """

    name: str = "jsonl"
    path: str = MISSING
    limit: int | None = 26
    categories: list[str] | None = None


@dataclass
class HumanEvalDatasetConfig(DatasetConfig):
    """HumanEval ``.jsonl.gz`` (``task_id``, ``prompt``): complete the function.

    Attributes:
        path: the ``.jsonl.gz`` file (relative paths are taken from the working directory).
    """

    name: str = "humaneval"
    path: str = MISSING
    limit: int | None = 12


# ---------------------------------------------------------------------------------------- sampling
@dataclass
class SamplingConfig:
    """How tokens are drawn.

    Attributes:
        temperature: 0 is greedy.
        seed: per-request seed; prompt ``i`` uses ``seed + i`` (None: the engine's generator).
        top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty: as in
            :class:`sampling.SamplingParams` (defaults: off).
    """

    temperature: float = 0.0
    seed: int | None = None
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


# -------------------------------------------------------------------------------------- experiment
@dataclass
class ExperimentConfig:
    """One experiment: a target model decoded without and with a drafter over a set of prompts.

    Attributes:
        max_tokens: most new tokens per prompt.
        seed: the engine seed (``specdec.LLM(seed=...)``) and ``torch.manual_seed``.
        device: None picks CUDA when available, else the CPU.
    """

    model: ModelConfig = MISSING
    drafter: DrafterConfig = MISSING
    dataset: DatasetConfig = MISSING
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_tokens: int = 128
    seed: int = 0
    device: str | None = None


SCHEMAS: dict[tuple[str | None, str], type] = {
    (None, "experiment_schema"): ExperimentConfig,
    ("model", "model_schema"): ModelConfig,
    ("drafter", "none_schema"): NoDrafterConfig,
    ("drafter", "ngram_schema"): NgramDrafterConfig,
    ("drafter", "draft_model_schema"): DraftModelDrafterConfig,
    ("dataset", "builtin_schema"): BuiltinDatasetConfig,
    ("dataset", "jsonl_schema"): JsonlDatasetConfig,
    ("dataset", "humaneval_schema"): HumanEvalDatasetConfig,
    ("sampling", "sampling_schema"): SamplingConfig,
}


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent).

    ``conf/config.yaml`` starts from ``experiment_schema``; each group option starts from its own
    ``<option>_schema`` (e.g. ``drafter/ngram.yaml`` lists ``ngram_schema`` in its defaults).
    """
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for (group, name), node in SCHEMAS.items():
        cs.store(group=group, name=name, node=node)


def _vocab_size(model: str) -> int | None:
    """``vocab_size`` from a local model directory's ``config.json`` (None when unknown)."""
    cfg_file = Path(model).expanduser() / "config.json"
    if not cfg_file.is_file():
        return None
    try:
        value = json.loads(cfg_file.read_text()).get("vocab_size")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) else None


def validate_config(cfg: ExperimentConfig) -> None:
    """Cross-field checks that a schema cannot express; cheap, and run before any model loads.

    Raises:
        ValueError: a non-positive ``max_tokens``/``limit``/``num_speculative_tokens``, an invalid
            n-gram window, a negative temperature, or a draft model whose vocabulary differs from
            the target's.
    """
    if cfg.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {cfg.max_tokens}")
    if cfg.sampling.temperature < 0:
        raise ValueError(f"sampling.temperature must be >= 0, got {cfg.sampling.temperature}")
    from sampling.params import SamplingParams

    s = cfg.sampling
    try:
        SamplingParams(
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            min_p=s.min_p,
            repetition_penalty=s.repetition_penalty,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
        )
    except ValueError as e:
        raise ValueError(f"sampling: {e}") from None
    if cfg.dataset.limit is not None and cfg.dataset.limit < 1:
        raise ValueError(f"dataset.limit must be >= 1 or null, got {cfg.dataset.limit}")
    d = cfg.drafter
    if isinstance(d, (NgramDrafterConfig, DraftModelDrafterConfig)) and d.num_speculative_tokens < 1:
        raise ValueError(f"drafter.num_speculative_tokens must be >= 1, got {d.num_speculative_tokens}")
    if isinstance(d, NgramDrafterConfig) and not 1 <= d.prompt_lookup_min <= d.prompt_lookup_max:
        raise ValueError(
            "need 1 <= drafter.prompt_lookup_min <= drafter.prompt_lookup_max, got "
            f"{d.prompt_lookup_min} and {d.prompt_lookup_max}"
        )
    if isinstance(d, DraftModelDrafterConfig):
        target_family = ZOO_FAMILIES.get(cfg.model.name)
        draft_family = ZOO_FAMILIES.get(d.model)
        mismatch = target_family is not None and draft_family is not None and target_family != draft_family
        if not mismatch:
            target_vocab, draft_vocab = _vocab_size(cfg.model.name), _vocab_size(d.model)
            mismatch = target_vocab is not None and draft_vocab is not None and target_vocab != draft_vocab
        if mismatch:
            same = sorted(n for n, f in ZOO_FAMILIES.items() if f == draft_family and n != d.model)
            hint = f" e.g. model={same[-1]}" if same else ""
            raise ValueError(
                f"drafter=draft_model: the draft model's vocabulary must match the target's, but "
                f"drafter.model={d.model} and model={cfg.model.name} use different tokenizers. "
                f"Pick a target of the draft model's family,{hint} (or set drafter.model to a "
                "model sharing the target's tokenizer)."
            )


def to_experiment_config(cfg: DictConfig) -> ExperimentConfig:
    """Convert a composed (and schema-checked) ``DictConfig`` into a validated :class:`ExperimentConfig`.

    Raises:
        omegaconf.errors.MissingMandatoryValue: a required value (e.g. ``dataset.path``) is unset.
        TypeError: the config was not composed from ``experiment_schema``.
        ValueError: see :func:`validate_config`.
    """
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, ExperimentConfig):
        raise TypeError(
            f"expected a config composed from 'experiment_schema', got {type(obj).__name__}; "
            "list 'experiment_schema' first in the defaults of config.yaml"
        )
    _reject_extra_keys(obj, "")
    validate_config(obj)
    return obj


def _reject_extra_keys(obj: Any, prefix: str) -> None:
    """Keys added with Hydra's ``+key=value`` bypass the schema; OmegaConf then sets them as stray
    attributes. Refuse them, naming the allowed keys."""
    from dataclasses import fields, is_dataclass

    if not is_dataclass(obj) or isinstance(obj, type):
        return
    names = [f.name for f in fields(obj)]
    extra = sorted(set(vars(obj)) - set(names))
    if extra:
        raise ValueError(
            f"unknown key(s) {', '.join(prefix + k for k in extra)} for {type(obj).__name__}; "
            f"allowed: {', '.join(prefix + n for n in names)}"
        )
    for name in names:
        _reject_extra_keys(getattr(obj, name), f"{prefix}{name}.")


def config_to_dict(cfg: ExperimentConfig) -> dict[str, Any]:
    """A JSON-ready dict of the resolved config (enums become their values)."""
    from dataclasses import asdict

    def plain(v: Any) -> Any:
        if isinstance(v, Enum):
            return v.value
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        return v

    out: dict[str, Any] = plain(asdict(cfg))
    return out
