"""Typed experiment configuration: the schemas behind ``experiments/conf/``.

Config groups mirror the code: ``model/`` (:class:`ModelConfig`), ``drafter/`` (none, ngram,
suffix, hybrid, draft_model, quantized_self, medusa, eagle, and ``registered`` for any drafter registered with
``specdec.drafters.register_drafter``: ``specdec.LLM``'s ``speculative_config``), ``sampling/``
(:class:`SamplingConfig`) and ``grammar/`` (none, json_schema, regex, choice: fields of
``sampling.SamplingParams``), ``dataset/`` (builtin, jsonl, humaneval, synthetic), ``engine/`` (the
other arguments of ``specdec.LLM``: dtype, device, KV blocks, prefix caching, batch limits), ``logger/``
(none, wandb); ``experiment/`` holds named deltas and ``sweep/`` sweep presets (both
``# @package _global_``, checked against the primary schema).

Every group option has one dataclass (``drafter/ngram.yaml`` is checked against
:class:`NgramDrafterConfig`, and so on); :func:`register_configs` stores them in Hydra's ConfigStore so
that a misspelt key or a value of the wrong type fails while Hydra composes the config, naming the key,
before any model loads. :func:`to_experiment_config` (:func:`to_bench_config` for ``conf/bench.yaml``)
turns the composed ``DictConfig`` into plain dataclasses and runs the cross-field checks
(:func:`validate_config`); library code only ever sees those dataclasses. The checks of values the
library also takes are the library's own (``SpeculativeConfig``, the drafter's ``check_target``,
``SamplingParams``, ``CacheConfig``...), their messages prefixed with the config key; only the
experiment's own values (group names, datasets, logger, bench methods and systems) are checked here.
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf


class Dtype(str, Enum):
    """Weights, activations and KV-cache dtype."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


# ------------------------------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    """The target model.

    Attributes:
        name: a zoo name (``smollm2-135m-instruct``, ``qwen2.5-coder-0.5b-instruct``,
            ``qwen2.5-coder-1.5b-instruct``) or a local HF-format directory.
        dtype: ``float32``, ``bfloat16`` or ``float16``: the dtype this model runs in unless
            ``engine.dtype`` says otherwise. float32 by default, like ``LLM()`` and ``specdec generate``
            (greedy output then equals transformers'; bfloat16 is faster but rounds differently with the
            batch shape, which can flip greedy near-ties).
    """

    name: str = MISSING
    dtype: Dtype = Dtype.float32


# ----------------------------------------------------------------------------------------- drafter
@dataclass
class DrafterConfig:
    """Base of the drafter options; ``method`` names the option.

    Attributes:
        policy: the speculation policy (``drafter.policy=batch_size``; :mod:`specdec.policies`).
        policy_kwargs: its parameters (``'+drafter.policy_kwargs.schedule=[[4,4],[16,1]]'``).
        grammar_forced_drafts: constrained requests' chains are extended by the tokens their grammar
            forces (``drafter.grammar_forced_drafts=true``; :mod:`specdec.drafters.grammar_forced`).
        max_forced_drafts: their positions beyond k (``drafter.max_forced_drafts=8``; None: k).
    """

    method: str = MISSING
    policy: str = "static"
    policy_kwargs: dict[str, Any] = field(default_factory=dict)
    grammar_forced_drafts: bool = False
    max_forced_drafts: int | None = None

    def speculative_config(self) -> dict[str, Any] | None:
        """The ``speculative_config`` argument of ``specdec.LLM`` (None: no speculation): the drafter's
        fields, and the policy where it is not the default."""
        spec = self._method_config()
        if spec is not None and (self.policy != "static" or self.policy_kwargs):
            spec["policy"] = self.policy
            spec["policy_kwargs"] = dict(self.policy_kwargs) or None
        if spec is not None and self.grammar_forced_drafts:
            spec["grammar_forced_drafts"] = True
        if spec is not None and self.max_forced_drafts is not None:
            spec["max_forced_drafts"] = self.max_forced_drafts
        return spec

    def _method_config(self) -> dict[str, Any] | None:
        raise NotImplementedError

    def field_keys(self) -> dict[str, str]:
        """The ``SpeculativeConfig`` fields this option sets from keys of other names: field -> key (under
        ``drafter.``), so that an error names the key the user typed; fields not listed are keys of the
        same name."""
        return {}


@dataclass
class NoDrafterConfig(DrafterConfig):
    """No speculation: only the baseline runs."""

    method: str = "none"

    def _method_config(self) -> dict[str, Any] | None:
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

    def _method_config(self) -> dict[str, Any] | None:
        """``{"method": "ngram", ...}`` for ``specdec.LLM``."""
        return {
            "method": "ngram",
            "num_speculative_tokens": self.num_speculative_tokens,
            "prompt_lookup_max": self.prompt_lookup_max,
            "prompt_lookup_min": self.prompt_lookup_min,
        }


@dataclass
class SuffixDrafterConfig(DrafterConfig):
    """Suffix decoding (Oliaro et al. 2024): frequency-ranked continuations from suffix tries over the
    request's text and, with ``share_across_requests``, earlier requests' (:mod:`specdec.drafters.suffix`).

    Attributes:
        num_speculative_tokens: a chain's length, or a tree's greatest depth (K).
        tree: None (a chain) or ``dynamic`` (a token tree of the most frequent continuations).
        max_tree_nodes: most draft tokens in a tree.
        max_match, min_token_prob, spec_factor, accept_threshold, cache_max_nodes,
            share_across_requests: the ``suffix_*`` fields of ``SpeculativeConfig``.
    """

    method: str = "suffix"
    num_speculative_tokens: int = 4
    tree: str | None = None
    max_tree_nodes: int = 15  # specdec.config.DEFAULT_MAX_TREE_NODES: 16 rows with the root
    max_match: int = 16
    min_token_prob: float = 0.1
    spec_factor: float = 4.0
    accept_threshold: Any = "auto"  # "auto" or a number in [0, 1]
    cache_max_nodes: int = 1 << 20
    share_across_requests: bool = False

    def _suffix_fields(self) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "num_speculative_tokens": self.num_speculative_tokens,
            "suffix_max_match": self.max_match,
            "suffix_min_token_prob": self.min_token_prob,
            "suffix_spec_factor": self.spec_factor,
            "suffix_accept_threshold": self.accept_threshold,
            "suffix_cache_max_nodes": self.cache_max_nodes,
            "suffix_share_across_requests": self.share_across_requests,
        }
        if self.tree is not None:
            spec.update(tree=self.tree, max_tree_nodes=self.max_tree_nodes)
        return spec

    def _method_config(self) -> dict[str, Any] | None:
        """``{"method": "suffix", ...}`` for ``specdec.LLM``."""
        return {"method": "suffix", **self._suffix_fields()}

    def field_keys(self) -> dict[str, str]:
        """``suffix_<key>`` is set from ``drafter.<key>``."""
        keys = (
            "max_match",
            "min_token_prob",
            "spec_factor",
            "accept_threshold",
            "cache_max_nodes",
            "share_across_requests",
        )
        return {f"suffix_{k}": k for k in keys}


@dataclass
class HybridDrafterConfig(SuffixDrafterConfig):
    """Per request and step, the member proposal expected to have the most drafts accepted
    (:mod:`specdec.drafters.hybrid`); the suffix and n-gram fields configure those members.

    Attributes:
        members: the member drafters: model-free ones and at most one learned head, e.g.
            ``[suffix, ngram]`` or ``[eagle, suffix, ngram]``.
        prompt_lookup_max, prompt_lookup_min: the n-gram member's window.
        model: the learned member's heads (a built-in head name or a directory; None: the target's
            built-in head), only with a learned member.
        draft_vocab: the learned member's reduced draft vocabulary (as ``drafter=eagle``'s).
        quantization: ``int8`` or ``int4``: the learned member's head quantized (as ``drafter=eagle``'s);
            None: not.
        skip_outranked: skip the learned member's draft step where a model-free member's proposal
            outranks any it could make (``hybrid_skip_outranked``).
        union: submit the union of the members' proposals as one token tree (``hybrid_union``; a chain
            config then verifies up to ``k × len(members)`` drafts a step).
    """

    method: str = "hybrid"
    members: list[str] = field(default_factory=lambda: ["suffix", "ngram"])
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    draft_vocab: Any = None
    quantization: str | None = None
    skip_outranked: bool = True
    union: bool = False

    def _method_config(self) -> dict[str, Any] | None:
        """``{"method": "hybrid", ...}`` for ``specdec.LLM``."""
        spec = {
            "method": "hybrid",
            "hybrid_members": list(self.members),
            "hybrid_skip_outranked": self.skip_outranked,
            "hybrid_union": self.union,
            "prompt_lookup_max": self.prompt_lookup_max,
            "prompt_lookup_min": self.prompt_lookup_min,
            **self._suffix_fields(),
        }
        if self.model is not None:
            spec["model"] = self.model
        if self.draft_vocab is not None:
            spec["draft_vocab"] = draft_vocab_value(self.draft_vocab)
        if self.quantization is not None:
            spec["quantization"] = self.quantization
        return spec

    def field_keys(self) -> dict[str, str]:
        """The suffix keys', ``hybrid_members`` from ``drafter.members``, ``hybrid_skip_outranked`` from
        ``drafter.skip_outranked`` and ``hybrid_union`` from ``drafter.union``."""
        keys = {
            "hybrid_members": "members",
            "hybrid_skip_outranked": "skip_outranked",
            "hybrid_union": "union",
        }
        return {**super().field_keys(), **keys}


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

    def _method_config(self) -> dict[str, Any] | None:
        """``{"method": "draft_model", ...}`` for ``specdec.LLM``."""
        return {
            "method": "draft_model",
            "model": self.model,
            "num_speculative_tokens": self.num_speculative_tokens,
        }


@dataclass
class QuantizedSelfDrafterConfig(DrafterConfig):
    """The target's own weights, quantized, draft for it (no second checkpoint, no training).

    Attributes:
        quantization: ``int4`` or ``int8`` (see :mod:`specdec.quantization`).
        group_size: int4 columns per scale, 32/64/128 (None: 64).
        zero_point: int4 only: asymmetric groups (the zoo's GGUF-converted models' own 4-bit grid at 32).
        num_speculative_tokens: draft tokens per step (K).
        draft_vocab: None (the whole vocabulary), target token ids, or an EAGLE-3 head whose draft
            vocabulary the drafter's LM head computes (``drafter.draft_vocab=smollm2-135m-instruct-eagle3``).
    """

    method: str = "quantized_self"
    quantization: str = "int4"
    group_size: int | None = None
    zero_point: bool = False
    num_speculative_tokens: int = 4
    draft_vocab: Any = None

    def _method_config(self) -> dict[str, Any] | None:
        """``{"method": "quantized_self", ...}`` for ``specdec.LLM``."""
        scheme: dict[str, Any] = {"method": self.quantization}
        if self.group_size is not None:
            scheme["group_size"] = self.group_size
        if self.zero_point:
            scheme["zero_point"] = True
        spec: dict[str, Any] = {
            "method": "quantized_self",
            "quantization": scheme,
            "num_speculative_tokens": self.num_speculative_tokens,
        }
        if self.draft_vocab is not None:
            spec["draft_vocab"] = draft_vocab_value(self.draft_vocab)
        return spec


@dataclass
class HeadDrafterConfig(DrafterConfig):
    """Base of the learned-head drafters (Medusa, EAGLE), whose heads ``experiments.train`` trains.

    Attributes:
        num_speculative_tokens: the chain's length, or the tree's greatest depth.
        model: a head name (a folder of ``specdec/heads``) or a checkpoint directory; None: the built-in
            heads of the target, ``<target>-<method>`` (e.g. ``smollm2-135m-instruct-eagle``).
        tree: None (a chain), ``static`` (the index paths of ``tree_choices``) or ``dynamic`` (EAGLE-2:
            expand the ``tree_topk`` children of the likeliest nodes, keep ``max_tree_nodes``).
        tree_choices: a static tree as Medusa-style index paths (``[[0], [1], [0, 0], ...]``: path
            ``[i, j]`` is the j-th candidate of the second draft position under the i-th of the first);
            None: the default tree of the heads.
        tree_topk: children per expanded node of a dynamic tree.
        max_tree_nodes: most draft tokens in a tree.
        quantization: ``int8`` or ``int4``: the head's linears and the LM-head rows it drafts through,
            weight-only quantized (None: the head's dtype).
        draft_stop_probability: EAGLE and EAGLE-3 chains: stop after a draft whose top token has less than
            this probability under the head (None: always k; see ``SpeculativeConfig``).
    """

    method: str = MISSING
    num_speculative_tokens: int = 4
    model: str | None = None
    tree: str | None = None
    tree_choices: list[list[int]] | None = None
    tree_topk: int = 4
    max_tree_nodes: int = 15  # specdec.config.DEFAULT_MAX_TREE_NODES: 16 rows with the root
    quantization: str | None = None
    draft_stop_probability: float | None = None

    def _method_config(self) -> dict[str, Any] | None:
        """``{"method": "medusa" | "eagle", ...}`` for ``specdec.LLM``."""
        spec: dict[str, Any] = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "model": self.model,
            "tree": self.tree,
            "tree_choices": None if self.tree_choices is None else [list(p) for p in self.tree_choices],
            "tree_topk": self.tree_topk,
            "max_tree_nodes": self.max_tree_nodes,
        }
        if self.quantization is not None:
            spec["quantization"] = self.quantization
        if self.draft_stop_probability is not None:
            spec["draft_stop_probability"] = self.draft_stop_probability
        return spec


def draft_vocab_value(vocab: Any) -> str | list[int]:
    """``drafter.draft_vocab`` as ``SpeculativeConfig`` takes it: a head's name or directory, or token ids
    (Hydra gives a ``ListConfig``)."""
    return vocab if isinstance(vocab, str) else [int(i) for i in vocab]


@dataclass
class ReducedVocabHeadConfig(HeadDrafterConfig):
    """A head drafting through the target's LM head, optionally over a reduced vocabulary.

    Attributes:
        draft_vocab: None (the whole vocabulary), a list of target token ids, or the name or directory of
            an EAGLE-3 head whose draft vocabulary to take
            (``drafter.draft_vocab=smollm2-135m-instruct-eagle3``; :mod:`specdec.drafters.draft_vocab`).
    """

    draft_vocab: Any = None

    def _method_config(self) -> dict[str, Any] | None:
        spec = super()._method_config()
        if spec is not None and self.draft_vocab is not None:
            spec["draft_vocab"] = draft_vocab_value(self.draft_vocab)
        return spec


@dataclass
class MedusaDrafterConfig(ReducedVocabHeadConfig):
    """Medusa-1 heads (Cai et al. 2024) on the target's last hidden state: head k drafts the token k + 1
    steps ahead, a chain or a static tree of their top candidates."""

    method: str = "medusa"
    num_speculative_tokens: int = 4


@dataclass
class EagleDrafterConfig(ReducedVocabHeadConfig):
    """The EAGLE head (Li et al. 2024): one decoder layer, autoregressive in the target's feature space;
    a chain or a dynamic tree (EAGLE-2)."""

    method: str = "eagle"
    num_speculative_tokens: int = 4


@dataclass
class Eagle3DrafterConfig(HeadDrafterConfig):
    """The EAGLE-3 head (Li et al. 2025): a fusion of three target layers, one decoder layer and a
    reduced draft vocabulary; a chain or a dynamic tree (EAGLE-2's)."""

    method: str = "eagle3"
    num_speculative_tokens: int = 4


@dataclass
class RegisteredDrafterConfig(DrafterConfig):
    """Any drafter registered with :func:`specdec.drafters.register_drafter`, by name, with no library
    edit: ``drafter=registered drafter.method=repeat_last drafter.import_module=my_drafters``.

    Attributes:
        method: the registered name (the one group whose ``method`` is set on the command line).
        num_speculative_tokens: draft tokens per step (K), or the tree's depth.
        model: what the drafter's registry entry says ``model`` is (a draft model, heads, or None).
        tree: None (a chain), ``static`` or ``dynamic``, as the entry allows.
        drafter_kwargs: keyword arguments of the drafter's constructor.
        import_module: a module imported before the config is checked (e.g. ``my_drafters``), whose
            import registers the drafter; None: it is registered already (a built-in).
    """

    method: str = MISSING
    num_speculative_tokens: int = 4
    model: str | None = None
    tree: str | None = None
    drafter_kwargs: dict[str, Any] = field(default_factory=dict)
    import_module: str | None = None

    def _method_config(self) -> dict[str, Any] | None:
        """``{"method": <method>, ...}`` for ``specdec.LLM``: the fields, passed through."""
        return {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "model": self.model,
            "tree": self.tree,
            "drafter_kwargs": dict(self.drafter_kwargs),
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


# ----------------------------------------------------------------------------------------- dataset
@dataclass
class SyntheticDatasetConfig(DatasetConfig):
    """Token-id prompts drawn at random (no tokenizer needed): half of them a short random pattern
    repeated (category ``repeat``, where prompt lookup pays off), half uniform noise (``random``).

    Attributes:
        prompt_len: tokens per prompt.
        pattern_len: length of the repeated pattern of ``repeat`` prompts.
        vocab_size: token ids are drawn from ``[low_token, vocab_size)``; at most the model's vocabulary.
        low_token: smallest token id drawn (keeps BOS/EOS/PAD, usually the first ids, out of prompts).
        seed: seeds the draw.
    """

    name: str = "synthetic"
    limit: int | None = 4
    prompt_len: int = 32
    pattern_len: int = 6
    vocab_size: int = 128
    low_token: int = 3
    seed: int = 0


# ---------------------------------------------------------------------------------------- sampling
@dataclass
class SamplingConfig:
    """How tokens are drawn.

    Attributes:
        temperature: 0 is greedy.
        seed: per-request seed; prompt ``i`` uses ``seed + i`` (None: the engine's generator).
        top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty: as in
            :class:`sampling.SamplingParams` (defaults: off).
        ignore_eos: generate ``max_tokens`` tokens whatever the model says (throughput runs, random
            test models).
    """

    temperature: float = 0.0
    seed: int | None = None
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False


# ----------------------------------------------------------------------------------------- grammar
@dataclass
class GrammarConfig:
    """Base of the constrained-decoding options; ``kind`` names the option. Each maps onto the
    ``json_schema`` / ``regex`` / ``choice`` fields of :class:`sampling.SamplingParams`."""

    kind: str = MISSING

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``SamplingParams`` (empty: unconstrained)."""
        raise NotImplementedError


@dataclass
class NoGrammarConfig(GrammarConfig):
    """Unconstrained decoding."""

    kind: str = "none"

    def sampling_kwargs(self) -> dict[str, Any]:
        """Nothing: unconstrained."""
        return {}


@dataclass
class JsonSchemaGrammarConfig(GrammarConfig):
    """Output is JSON valid under ``json_schema``.

    Attributes:
        json_schema: the JSON schema (a mapping).
        strict: raise when the schema uses keywords the grammar cannot enforce (else warn).
    """

    kind: str = "json_schema"
    json_schema: dict[str, Any] = MISSING
    strict: bool = False

    def sampling_kwargs(self) -> dict[str, Any]:
        """``json_schema`` and ``strict``."""
        return {"json_schema": dict(self.json_schema), "strict": self.strict}


@dataclass
class RegexGrammarConfig(GrammarConfig):
    """Output is a full match of ``regex``."""

    kind: str = "regex"
    regex: str = MISSING

    def sampling_kwargs(self) -> dict[str, Any]:
        """``regex``."""
        return {"regex": self.regex}


@dataclass
class ChoiceGrammarConfig(GrammarConfig):
    """Output is exactly one of ``choice``."""

    kind: str = "choice"
    choice: list[str] = MISSING

    def sampling_kwargs(self) -> dict[str, Any]:
        """``choice``."""
        return {"choice": list(self.choice)}


# ------------------------------------------------------------------------------------------ engine
@dataclass
class EngineConfig:
    """Arguments of ``specdec.LLM`` besides the model and the drafter.

    Attributes:
        dtype: weights, activations and KV cache; None: ``model.dtype`` (the model's own default).
        device: ``cpu``, ``cuda``, ``cuda:1``...; None: in a Ray job, CUDA when Ray granted it GPUs
            (``hydra.launcher.ray.remote.num_gpus``) else the CPU; elsewhere CUDA when available.
        block_size: tokens per KV block.
        num_kv_blocks: blocks in the KV pool (None: sized from ``kv_cache_memory_bytes``).
        enable_prefix_caching: share the KV blocks of equal prompt prefixes.
        kv_cache_memory_bytes: KV pool budget when ``num_kv_blocks`` is None.
        max_num_batched_tokens: token budget of one forward.
        max_num_seqs: most requests running at once.
        max_model_len: longest sequence (None: the model's).
        torch_threads: ``torch.set_num_threads`` for the job (None: torch's default, which under Ray is
            the task's ``num_cpus``).
        quantization: weight-only quantization of the target, ``int8`` or ``int4`` (None: none).
        quantization_group_size: int4 columns per scale, 32/64/128 (None: 64).
        quantization_zero_point: int4 only: asymmetric groups.
        kv_cache_dtype: ``auto`` (the model's dtype) or ``int8``.
        compile: ``torch.compile`` the forward (``specdec.LLM``'s ``compile``; False: eager, the
            reference).
        compile_buckets: token buckets of the compiled forward (None: the library's default).
        cuda_graphs: on CUDA, replay decode and chain-verification steps from CUDA graphs
            (``specdec.LLM``'s ``cuda_graphs``; a CPU device then fails with a ``ConfigError``).
        adaptive_threads: on the CPU, use only the cores other processes leave free (``specdec.LLM``'s
            ``cpu_threads="auto"``, at most ``torch_threads``); False: a fixed count.
        grammar_backend: what compiles the ``grammar`` group's constraints: ``auto``, ``llguidance``,
            ``xgrammar`` or ``outlines`` (``specdec.LLM``'s ``grammar_backend``; :mod:`grammars.registry`).
        huge_pages: on the CPU, move the weights onto 2 MiB pages at start-up (``specdec.LLM``'s
            ``huge_pages="auto"``; False: leave them).
    """

    dtype: Dtype | None = None
    device: str | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int = 2 * 1024**3
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None
    torch_threads: int | None = None
    quantization: str | None = None
    quantization_group_size: int | None = None
    quantization_zero_point: bool = False
    kv_cache_dtype: str = "auto"
    compile: bool = False
    compile_buckets: list[int] | None = None
    cuda_graphs: bool = False
    adaptive_threads: bool = True
    grammar_backend: str = "auto"
    huge_pages: bool = True

    def compile_arg(self) -> dict[str, Any] | bool:
        """``specdec.LLM``'s ``compile`` argument."""
        if not self.compile:
            return False
        return {"buckets": list(self.compile_buckets)} if self.compile_buckets else True

    def quantization_arg(self) -> dict[str, Any] | None:
        """``specdec.LLM``'s ``quantization`` argument (None: full precision)."""
        if self.quantization is None:
            return None
        scheme: dict[str, Any] = {"method": self.quantization}
        if self.quantization_group_size is not None:
            scheme["group_size"] = self.quantization_group_size
        if self.quantization_zero_point:
            scheme["zero_point"] = True
        return scheme

    def llm_kwargs(self, model: ModelConfig) -> dict[str, Any]:
        """Keyword arguments of ``specdec.LLM`` (the device still unresolved: see
        :func:`experiments.tracking.pick_device`)."""
        return {
            "dtype": (self.dtype or model.dtype).value,
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
            "enable_prefix_caching": self.enable_prefix_caching,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "quantization": self.quantization_arg(),
            "kv_cache_dtype": self.kv_cache_dtype,
            "compile": self.compile_arg(),
            "cuda_graphs": self.cuda_graphs,
            "cpu_threads": "auto" if self.adaptive_threads else None,
            "grammar_backend": self.grammar_backend,
            "huge_pages": "auto" if self.huge_pages else False,
        }


# ------------------------------------------------------------------------------------------ logger
@dataclass
class LoggerConfig:
    """Base of the experiment-tracking options; ``name`` names the option."""

    name: str = MISSING


@dataclass
class NoLoggerConfig(LoggerConfig):
    """No tracking: nothing but the run directory's own files is written."""

    name: str = "none"


@dataclass
class WandbLoggerConfig(LoggerConfig):
    """Weights & Biases.

    Attributes:
        project, entity: where the run goes (entity None: the user's default).
        mode: ``offline`` (written under the run directory, ``wandb sync`` it later), ``online`` or
            ``disabled``; None: ``$WANDB_MODE`` when set, else ``offline`` (no network needed).
        group: groups runs (None: the sweep directory in a multirun, else no group).
        run_name: the run's name (None: the job's overrides in a multirun, else wandb's).
        tags: run tags.
        log_plots: log the run's figures as images.
    """

    name: str = "wandb"
    project: str = "specdec"
    entity: str | None = None
    mode: str | None = None
    group: str | None = None
    run_name: str | None = None
    tags: list[str] = field(default_factory=list)
    log_plots: bool = True

    def resolved_mode(self) -> str:
        """``mode``, else ``$WANDB_MODE``, else ``offline``."""
        return self.mode or os.environ.get("WANDB_MODE") or "offline"


# -------------------------------------------------------------------------------------- experiment
@dataclass
class ExperimentConfig:
    """One experiment: a target model decoded without and with a drafter over a set of prompts.

    Attributes:
        max_tokens: most new tokens per prompt.
        seed: the engine seed (``specdec.LLM(seed=...)``) and ``torch.manual_seed``.
        plots: write the run's figures (per-position and per-category acceptance) to ``plots/``.
    """

    model: ModelConfig = MISSING
    drafter: DrafterConfig = MISSING
    dataset: DatasetConfig = MISSING
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    grammar: GrammarConfig = MISSING
    engine: EngineConfig = field(default_factory=EngineConfig)
    logger: LoggerConfig = MISSING
    max_tokens: int = 128
    seed: int = 0
    plots: bool = True


# ------------------------------------------------------------------------------------------- bench
#: The draft model ``experiments.bench`` pairs with a target when ``draft_model`` is not given.
DEFAULT_DRAFT_MODELS = {"qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-0.5b-instruct"}
BENCH_SYSTEMS = ("specdec", "transformers")
#: The methods transformers ``generate`` has a counterpart of (``experiments.bench.HF_METHOD_NAMES``):
#: plain, prompt lookup and an assistant model.
TRANSFORMERS_METHODS = ("plain", "ngram", "draft_model")


def bench_methods() -> tuple[str, ...]:
    """The methods of ``experiments.bench``: ``plain`` and every registered drafter."""
    from specdec.drafters.registry import drafter_names

    return ("plain", *drafter_names())


@dataclass
class BenchConfig:
    """``python -m experiments.bench``: specdec against transformers ``generate``, same model, prompts,
    dtype and ``max_tokens``, one process.

    Attributes:
        methods: ``plain`` and/or registered drafters (:func:`bench_methods`); with the
            ``transformers`` system only those it has a counterpart of (:data:`TRANSFORMERS_METHODS`):
            ``ngram`` (transformers: ``prompt_lookup_num_tokens``) and ``draft_model`` (transformers:
            ``assistant_model``).
        systems: ``specdec`` and/or ``transformers``.
        num_speculative_tokens: k of both systems (transformers' assistant with a constant schedule).
        prompt_lookup_max, prompt_lookup_min: n-gram window (``prompt_lookup_max`` is transformers'
            ``max_matching_ngram_size``; transformers always goes down to 1).
        draft_model: draft model of ``draft_model`` (of any method that takes a draft model; None: the
            zoo's pair of the target).
        max_tokens: most new tokens per prompt.
        concurrency: specdec's concurrent requests (1: each prompt alone, timed one by one); prompts are
            reused round-robin to fill a batch.
        transformers_static_batch: also time transformers' plain ``generate`` on left-padded static
            batches of these sizes.
        ignore_eos: generate exactly ``max_tokens`` per prompt (transformers: ``min_new_tokens``, which
            masks EOS rather than ignoring it, so outputs may differ from specdec's after an EOS).
        bandwidth_bytes: size of the tensor the read-bandwidth probe sums (the floor's denominator).
        seed: engine seed and ``torch.manual_seed``.
    """

    model: ModelConfig = MISSING
    dataset: DatasetConfig = MISSING
    engine: EngineConfig = field(default_factory=EngineConfig)
    logger: LoggerConfig = MISSING
    methods: list[str] = field(default_factory=lambda: ["plain", "ngram"])
    systems: list[str] = field(default_factory=lambda: list(BENCH_SYSTEMS))
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    draft_model: str | None = None
    max_tokens: int = 128
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])
    transformers_static_batch: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    bandwidth_bytes: int = 1 << 30
    seed: int = 0

    def resolved_draft_model(self) -> str | None:
        """``draft_model``, else the zoo's draft model of the target (None when it has none)."""
        return self.draft_model or DEFAULT_DRAFT_MODELS.get(self.model.name)

    def speculative_config(self, method: str) -> dict[str, Any] | None:
        """``specdec.LLM``'s ``speculative_config`` of a method (None: plain): k, the n-gram window for a
        drafter that reads it, the draft model for one that takes a model (its registry entry says)."""
        if method == "plain":
            return None
        return method_speculative_config(
            method,
            self.num_speculative_tokens,
            prompt_lookup_max=self.prompt_lookup_max,
            prompt_lookup_min=self.prompt_lookup_min,
            draft_model=self.resolved_draft_model(),
        )


def method_speculative_config(
    method: str,
    num_speculative_tokens: int,
    *,
    prompt_lookup_max: int = 4,
    prompt_lookup_min: int = 1,
    draft_model: str | None = None,
    quantization: str | None = None,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``specdec.LLM``'s ``speculative_config`` of a registered drafter, from settings shared by every
    method (``experiments.bench``, ``experiments.concurrency``): k; the n-gram window, ``quantization``
    (the quantized self-drafter's scheme: not passed to learned heads, whose quantization is optional)
    and the draft model each only for a drafter that reads it (its registry entry says); then
    ``options``, any other ``SpeculativeConfig`` fields (``tree``, ``model``...), set last."""
    from specdec.drafters.registry import get_drafter

    entry = get_drafter(method)
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": num_speculative_tokens}
    if "prompt_lookup_max" in entry.fields:
        spec["prompt_lookup_max"] = prompt_lookup_max
    if "prompt_lookup_min" in entry.fields:
        spec["prompt_lookup_min"] = prompt_lookup_min
    # The shared scheme is the quantized self-drafter's; a learned head's own ``quantization`` (optional)
    # comes through ``options``.
    if "quantization" in entry.fields and quantization is not None and entry.model != "heads":
        spec["quantization"] = quantization
    if entry.model == "model":
        spec["model"] = draft_model
    spec.update(options or {})
    return spec


# ------------------------------------------------------------------------------------- concurrency
#: What ``experiments.concurrency`` holds a policy to (issue 19): at every concurrency, at least plain
#: decoding's throughput and this share of the best static k's (the oracle).
TARGET_SPEEDUP = 1.0
TARGET_VS_ORACLE = 0.95


#: How a concurrency cell submits its requests (:attr:`ConcurrencyConfig.arrivals`).
ARRIVALS = ("together", "closed_loop")


@dataclass
class ConcurrencyConfig:
    """``python -m experiments.concurrency``: speculation policies against plain decoding and every static
    k, at each concurrency, per drafter, one process (``conf/concurrency.yaml``).

    Attributes:
        drafters: registered drafters (:func:`specdec.drafters.drafter_names`), one ``LLM`` each.
        policies: registered speculation policies (:func:`specdec.policies.policy_names`) run on every
            drafter; each built with k = ``num_speculative_tokens``.
        policy_kwargs: per policy name, its keyword arguments (``'+policy_kwargs.goodput.frozen=true'``).
        num_speculative_tokens: k of the policies (the most drafts a policy may choose).
        static_k: the static depths run on every drafter (``0 .. 16``; 0 drafts nothing through the
            speculative engine); with plain decoding they make the oracle, the best static k in hindsight.
        concurrency: requests submitted together (the batch stays at this size with ``ignore_eos``).
        max_tokens: new tokens per request.
        min_requests: each cell runs ``ceil(min_requests / c)`` rounds of ``c`` requests, prompts taken in
            order, cycling through the dataset.
        min_rounds: with ``arrivals=closed_loop``, the fewest rounds a cell runs (requests per client;
            >= 1). A closed-loop cell ends in a drain, its last requests finishing one by one in a
            shrinking batch, which a server whose clients keep coming does not run; more rounds make it a
            smaller share of the cell (n-gram at 8 clients, 3 rounds: 18 % of goodput's time).
        ignore_eos: generate exactly ``max_tokens`` per request, so a round keeps ``c`` requests running.
        prompt_lookup_max, prompt_lookup_min: the n-gram window (``ngram``).
        draft_model: draft model of ``draft_model`` (None: the zoo's pair of the target).
        quantization: ``quantized_self``'s scheme, ``int4`` or ``int8``.
        drafter_options: per drafter, more ``speculative_config`` fields (``tree``, ``model``...):
            ``'+drafter_options.eagle.tree=dynamic'``.
        import_modules: modules imported before the checks, whose import registers drafters or policies
            of your own.
        plots: write ``plots/speedup_vs_concurrency.{png,svg}``.
        seed: engine seed and ``torch.manual_seed``.
        repeats: timed passes of every cell (>= 1), interleaved: per drafter and concurrency, plain
            decoding and the drafter's rows run in turn, the order rotated each pass.
        arrivals: ``together``: a cell's rounds submit ``c`` requests at once and wait for all of them
            (the batch drains as they finish); ``closed_loop``: ``c`` clients, each submitting its next
            request when its last one finishes (one ``generate`` call of every request of the cell
            with at most ``c`` running: vLLM's ``--max-concurrency``), at least ``min_rounds * c``
            requests a cell.
        share_target: every drafter's engine runs over the plain engine's target weights
            (``LLM.with_speculation``: the same bytes on the same pages, the target in memory once; an eager
            engine only, a compiled one loads its own); False: each engine loads its own.
        keep_policies: one policy object per drafter, policy and concurrency, kept across the ``repeats``
            passes, as a long-lived serving engine keeps its policy (what goodput learned, its population
            acceptance and corrected step costs, carries into the next pass); False: a fresh policy in
            every cell and pass. Static rows are unaffected.
    """

    model: ModelConfig = MISSING
    dataset: DatasetConfig = MISSING
    engine: EngineConfig = field(default_factory=EngineConfig)
    logger: LoggerConfig = MISSING
    drafters: list[str] = field(default_factory=lambda: ["ngram"])
    policies: list[str] = field(default_factory=lambda: ["goodput", "batch_size", "ucb"])
    policy_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    num_speculative_tokens: int = 4
    static_k: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    max_tokens: int = 128
    min_requests: int = 32
    min_rounds: int = 3
    ignore_eos: bool = True
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    draft_model: str | None = None
    quantization: str = "int4"
    drafter_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    import_modules: list[str] = field(default_factory=list)
    plots: bool = True
    seed: int = 0
    repeats: int = 1
    arrivals: str = "together"
    share_target: bool = True
    keep_policies: bool = False

    @property
    def engine_k(self) -> int:
        """k of each drafter's engine: the largest of ``num_speculative_tokens`` and ``static_k``."""
        return max([self.num_speculative_tokens, *self.static_k])

    def resolved_draft_model(self) -> str | None:
        """``draft_model``, else the zoo's draft model of the target (None when it has none)."""
        return self.draft_model or DEFAULT_DRAFT_MODELS.get(self.model.name)

    def speculative_config(self, drafter: str) -> dict[str, Any]:
        """``specdec.LLM``'s ``speculative_config`` of one drafter's engine (k = :attr:`engine_k`; the
        policy is assigned per cell)."""
        return method_speculative_config(
            drafter,
            self.engine_k,
            prompt_lookup_max=self.prompt_lookup_max,
            prompt_lookup_min=self.prompt_lookup_min,
            draft_model=self.resolved_draft_model(),
            quantization=self.quantization,
            options=dict(self.drafter_options.get(drafter) or {}),
        )

    def rounds(self, concurrency: int) -> int:
        """Rounds of ``concurrency`` requests a cell runs: ``ceil(min_requests / concurrency)`` (closed
        loop: at least ``min_rounds``, so that every client's slot is refilled)."""
        rounds = -(-self.min_requests // concurrency)
        return max(rounds, self.min_rounds) if self.arrivals == "closed_loop" else rounds


# ------------------------------------------------------------------------------------------- train
@dataclass
class TrainDataConfig:
    """Self-distillation data of ``experiments.train``: prompts, the target's responses and features.

    Attributes:
        builtin_limit: built-in (standard-library) prompts used (None: all of them).
        chat_limit: built-in chat prompts used (None: all; see :func:`experiments.datasets.load_chat`).
        max_prompt_chars: cap on a built-in prompt's user message, in characters.
        prompt_seed: seed of both prompt sets.
        heldout_fraction: share of prompts held out for evaluation, chosen by a hash of the prompt id
            (so a prompt's side never depends on the other prompts).
        max_new_tokens: most tokens of a response.
        temperature: 0 is greedy; above 0 samples ``n`` responses per prompt.
        n: responses per prompt (1 when greedy).
        seed: sampling seed (prompt i uses ``seed + i``).
        include_greedy: with ``temperature`` > 0, train on the greedy responses too (the greedy data
            followed by the sampled; each part cached on its own).
        max_num_seqs: requests the engine runs at once while generating.
        max_num_batched_tokens: token budget of one engine forward while generating.
        feature_batch_tokens: tokens of one target forward when the features are computed.
        cache_dir: where the data is cached (None: ``<specdec cache>/train``).
        instruct_limit: generated instruction prompts of Spec-Bench's kinds used (0: none; None: all;
            see :func:`experiments.instruct.load_instruct`).
        synth_prompts: user requests the target writes itself (Magpie), added to the prompts (0: none;
            see :func:`experiments.train.synth.synthesize_prompts`; cached apart).
        feature_layers: None stores the final-norm features ``[L, H]`` (Medusa, EAGLE); a list stores
            the residual streams entering those target layers, then the final-norm features, ``[L, (n +
            1) H]``, and the target's top token at every position (EAGLE-3; ``[]``: its default layers;
            ``drafter=eagle3`` sets ``[]`` when None). Medusa and EAGLE train on such data too (its
            final-norm part), so all three heads can share one cached data set.
    """

    builtin_limit: int | None = None
    chat_limit: int | None = None
    max_prompt_chars: int = 1200
    prompt_seed: int = 0
    heldout_fraction: float = 0.1
    max_new_tokens: int = 128
    temperature: float = 0.0
    n: int = 1
    seed: int = 0
    include_greedy: bool = False
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    feature_batch_tokens: int = 4096
    cache_dir: str | None = None
    instruct_limit: int | None = 0
    synth_prompts: int = 0
    feature_layers: list[int] | None = None


@dataclass
class TrainOptions:
    """How the heads are trained, saved and evaluated.

    Attributes:
        time_budget_s: wall-clock budget of the optimisation (None: no limit; then ``epochs`` must be set).
        epochs: most passes over the training data (None: until the time budget is spent).
        lr, weight_decay, warmup_steps, min_lr_ratio, grad_clip: AdamW, linear warm-up, then cosine
            decay to ``min_lr_ratio * lr`` over the budget (time or epochs, whichever ends first).
        batch_tokens: response positions per step (Medusa), or tokens of the packed sequences per
            step (EAGLE).
        medusa_num_heads: Medusa heads K (head k predicts the token k + 1 steps ahead).
        eagle_ce_weight: weight of the cross-entropy term of the EAGLE loss (EAGLE-1: 0.1).
        eagle_noise: half-width of the uniform noise added to the EAGLE head's input features
            (EAGLE-1's augmentation; 0: none).
        eagle_unroll: EAGLE steps trained: 1 (teacher forcing) or 2 (the second step reads the head's
            own first prediction, as when drafting a chain).
        eagle3_ttt_steps: EAGLE-3's training-time test: drafting steps unrolled on the head's own
            outputs (1: teacher forcing only).
        eagle3_step_decay: weight of step j's loss is ``decay ** (j - 1)`` (the paper's code: 0.8).
        eagle3_draft_vocab_size: the reduced draft vocabulary: the most frequent target tokens of the
            training data.
        eval_interval_s: held-out evaluation every this many seconds of training.
        eval_max_positions: positions (Medusa) or tokens (EAGLE) of the periodic held-out evaluations;
            the final one covers the whole held-out split.
        log_every: log the training loss every this many steps.
        seed: initialisation and data order.
        init_from: start from these heads (a built-in name or a directory, same method and target)
            instead of a fresh initialisation; their provenance goes into the new heads' record.
        torch_threads: ``torch.set_num_threads`` for the job (None: torch's default).
        device: where everything runs.
        install: write the heads to ``specdec/heads/<target>-<method>`` (loadable by name).
        out_dir: where the heads go (None: as ``install`` says, else ``<run dir>/<target>-<method>``).
        eval: after training, measure tau on held-out prompts with ``specdec.LLM`` and the new heads.
        eval_prompts: held-out prompts of that evaluation.
        eval_max_tokens: new tokens per prompt of that evaluation.
    """

    time_budget_s: float | None = 300.0
    epochs: float | None = None
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    batch_tokens: int = 1024
    medusa_num_heads: int = 4
    eagle_ce_weight: float = 0.1
    eagle_noise: float = 0.0
    eagle_unroll: int = 1
    eagle3_ttt_steps: int = 4
    eagle3_step_decay: float = 0.8
    eagle3_draft_vocab_size: int = 8192
    eval_interval_s: float = 120.0
    eval_max_positions: int = 2048
    log_every: int = 10
    seed: int = 0
    init_from: str | None = None
    torch_threads: int | None = 2
    device: str = "cpu"
    install: bool = False
    out_dir: str | None = None
    eval: bool = True
    eval_prompts: int = 24
    eval_max_tokens: int = 128


@dataclass
class TrainConfig:
    """``python -m experiments.train``: distil Medusa or EAGLE heads from a target (``conf/train.yaml``).

    Attributes:
        model: the target (``model.dtype``: the dtype of generation and features).
        drafter: ``medusa`` or ``eagle``; its speculative options are used by the evaluation.
        logger: where losses and accuracies are logged.
        data: the self-distillation data.
        train: optimisation, output and evaluation.
    """

    model: ModelConfig = MISSING
    drafter: DrafterConfig = MISSING
    logger: LoggerConfig = MISSING
    data: TrainDataConfig = field(default_factory=TrainDataConfig)
    train: TrainOptions = field(default_factory=TrainOptions)


SCHEMAS: dict[tuple[str | None, str], type] = {
    (None, "experiment_schema"): ExperimentConfig,
    (None, "bench_schema"): BenchConfig,
    (None, "concurrency_schema"): ConcurrencyConfig,
    (None, "train_schema"): TrainConfig,
    ("model", "model_schema"): ModelConfig,
    ("drafter", "none_schema"): NoDrafterConfig,
    ("drafter", "ngram_schema"): NgramDrafterConfig,
    ("drafter", "suffix_schema"): SuffixDrafterConfig,
    ("drafter", "hybrid_schema"): HybridDrafterConfig,
    ("drafter", "draft_model_schema"): DraftModelDrafterConfig,
    ("drafter", "medusa_schema"): MedusaDrafterConfig,
    ("drafter", "eagle_schema"): EagleDrafterConfig,
    ("drafter", "eagle3_schema"): Eagle3DrafterConfig,
    ("drafter", "quantized_self_schema"): QuantizedSelfDrafterConfig,
    ("drafter", "registered_schema"): RegisteredDrafterConfig,
    ("dataset", "builtin_schema"): BuiltinDatasetConfig,
    ("dataset", "jsonl_schema"): JsonlDatasetConfig,
    ("dataset", "humaneval_schema"): HumanEvalDatasetConfig,
    ("dataset", "synthetic_schema"): SyntheticDatasetConfig,
    ("sampling", "sampling_schema"): SamplingConfig,
    ("grammar", "none_schema"): NoGrammarConfig,
    ("grammar", "json_schema_schema"): JsonSchemaGrammarConfig,
    ("grammar", "regex_schema"): RegexGrammarConfig,
    ("grammar", "choice_schema"): ChoiceGrammarConfig,
    ("engine", "engine_schema"): EngineConfig,
    ("logger", "none_schema"): NoLoggerConfig,
    ("logger", "wandb_schema"): WandbLoggerConfig,
}


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent).

    ``conf/config.yaml`` starts from ``experiment_schema`` (``conf/bench.yaml`` from ``bench_schema``);
    each group option starts from its own schema, stored as ``schema/<group>/<option>`` (e.g.
    ``drafter/ngram.yaml`` lists ``/schema/drafter/ngram@_here_`` in its defaults), so a misspelt key or a
    value of the wrong type fails while Hydra composes the config, naming the key. The group schemas live
    outside the option groups, so Hydra neither offers them as options (``drafter=ngram_schema``) nor
    composes them as one.
    """
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for (group, name), node in SCHEMAS.items():
        if group is None:
            cs.store(name=name, node=node)
        else:
            cs.store(group=f"schema/{group}", name=name.removesuffix("_schema"), node=node)


def _keyed(prefix: str, err: Exception, keys: dict[str, str] | None = None) -> str:
    """A ``SpeculativeConfig`` error's message prefixed with the config key it is about:
    ``<prefix>.<message>`` when the message starts with the name of a field (renamed to its key by
    ``keys``, field -> key: ``suffix_spec_factor`` -> ``spec_factor``), else ``<prefix>: <message>``
    (``<prefix>.method: ...`` for an unknown method)."""
    from specdec.config import SpeculativeConfig

    message = str(err)
    head = re.split(r"[ =:]", message, maxsplit=1)[0]
    if head in SpeculativeConfig.__dataclass_fields__:
        key = (keys or {}).get(head, head)
        return f"{prefix}.{key}{message[len(head) :]}"
    if message.startswith("speculative method must be one of"):
        return f"{prefix}.method: {message}"
    return f"{prefix}: {message}"


def _speculative_config(spec: dict[str, Any], prefix: str, keys: dict[str, str] | None = None) -> Any:
    """``SpeculativeConfig.from_any(spec)``: every drafter check is the library's; a ``ValueError``
    is re-raised with the key prefixed (see :func:`_keyed`; ``keys``: fields set from keys of other
    names, field -> key)."""
    from specdec.config import SpeculativeConfig

    try:
        return SpeculativeConfig.from_any(spec)
    except ValueError as e:
        raise ValueError(_keyed(prefix, e, keys)) from None


def _local_model_dir(model: str) -> Path | None:
    """The directory of ``model``'s ``config.json`` when it is here without a download: a local
    HF-format directory, or a zoo model already converted (None otherwise)."""
    from specdec.zoo import ZOO, is_converted, model_dir

    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    if model in ZOO and is_converted(model):
        return model_dir(model)
    return None


def _check_against_target(target: str, spec: Any, what: str, target_key: str = "model") -> None:
    """Run the drafter's own ``check_target`` (the draft model's vocabulary against the target's, the
    quantized self-drafter's group size against the target's layers...) before any model loads, as
    ``specdec.LLM`` does, when the configs it reads are here without a download; otherwise ``specdec.LLM``
    runs it after fetching, still before any weights load.

    Args:
        what: the offending setting, for the message (``drafter.model=...``).

    Raises:
        ValueError: the drafter's check fails (its message, naming ``what`` and the target).
    """
    from specdec.drafters.heads import default_heads_name, resolve_heads_dir
    from specdec.drafters.registry import get_drafter, model_method
    from specdec.errors import SpecdecError
    from specdec.models.config import ModelArchConfig
    from specdec.zoo import ZOO

    entry = get_drafter(spec.method)
    kind, method = model_method(spec)
    paired = sorted(t for t, d in DEFAULT_DRAFT_MODELS.items() if d == spec.model and t != target)
    hint = f"; {spec.model} is the draft model of {target_key}={paired[0]}" if paired else ""
    if entry.model == "model" and target in ZOO and spec.model in ZOO:  # known before any fetch
        want, got = ZOO[target].vocab_size, ZOO[spec.model].vocab_size
        if want is not None and got is not None and want != got:
            raise ValueError(
                f"{what} does not fit {target_key}={target}: the draft model's vocabulary ({got} tokens) "
                f"differs from the target's ({want}); draft and target must share a tokenizer{hint}"
            )
    target_dir = _local_model_dir(target)
    if entry.check_target is None or target_dir is None:
        return
    try:
        draft_dir: Path | None = None
        if entry.model == "model":
            draft_dir = _local_model_dir(spec.model)
            if draft_dir is None:
                return
        elif kind == "heads":
            draft_dir = resolve_heads_dir(spec.model or default_heads_name(target, method))
        arch = ModelArchConfig.from_pretrained(target_dir)
    except SpecdecError:
        return  # unreadable here: specdec.LLM reports it
    try:
        entry.check_target(arch, spec, draft_dir)
    except SpecdecError as e:
        raise ValueError(f"{what} does not fit {target_key}={target}: {e}{hint}") from None


def _check_engine(e: EngineConfig) -> None:
    """The engine's values, checked by the library's own configs (``CacheConfig``, ``SchedulerConfig``,
    ``QuantizationConfig``, ``resolve_dtype``); the device is only parsed (it is picked on the machine
    that runs the job, see :func:`experiments.tracking.pick_device`)."""
    from grammars.registry import check_grammar_backend
    from specdec.config import CacheConfig, CompilationConfig, SchedulerConfig, resolve_dtype
    from specdec.quantization.config import QuantizationConfig

    try:
        CacheConfig(
            e.block_size, e.num_kv_blocks, e.enable_prefix_caching, e.kv_cache_memory_bytes, e.kv_cache_dtype
        )
        SchedulerConfig(e.max_num_batched_tokens, e.max_num_seqs, e.max_model_len)
        QuantizationConfig.from_any(e.quantization_arg())
        CompilationConfig.from_any(e.compile_arg())
        check_grammar_backend(e.grammar_backend)
        if e.dtype is not None:
            resolve_dtype(e.dtype.value)
    except ValueError as err:
        raise ValueError(f"engine.{err}") from None
    if e.torch_threads is not None and e.torch_threads < 1:
        raise ValueError(f"engine.torch_threads must be >= 1 or null, got {e.torch_threads}")
    if e.device is not None:
        import torch

        try:
            torch.device(e.device)
        except (RuntimeError, ValueError):
            raise ValueError(
                f"engine.device must be a torch device (cpu, cuda, cuda:1...), got {e.device!r}"
            ) from None


def _check_logger(lg: LoggerConfig) -> None:
    if isinstance(lg, WandbLoggerConfig) and lg.mode not in (None, "offline", "online", "disabled"):
        raise ValueError(f"logger.mode must be offline, online, disabled or null, got {lg.mode!r}")


def _check_dataset(d: DatasetConfig) -> None:
    if d.limit is not None and d.limit < 1:
        raise ValueError(f"dataset.limit must be >= 1 or null, got {d.limit}")
    if isinstance(d, SyntheticDatasetConfig):
        if d.prompt_len < 1 or d.pattern_len < 1:
            raise ValueError(
                "dataset.prompt_len and dataset.pattern_len must be >= 1, got "
                f"{d.prompt_len} and {d.pattern_len}"
            )
        if not 0 <= d.low_token < d.vocab_size:
            raise ValueError(
                f"need 0 <= dataset.low_token < dataset.vocab_size, got {d.low_token} and {d.vocab_size}"
            )


def sampling_params_kwargs(s: SamplingConfig, g: GrammarConfig) -> dict[str, Any]:
    """``SamplingParams`` keyword arguments of the sampling and grammar options (no ``max_tokens``,
    no ``seed``)."""
    return {
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "repetition_penalty": s.repetition_penalty,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "ignore_eos": s.ignore_eos,
        **g.sampling_kwargs(),
    }


def _check_group_names(cfg: ExperimentConfig) -> None:
    """``drafter.method``, ``dataset.name``, ``grammar.kind`` and ``logger.name`` name the chosen config
    group; overriding one alone would relabel the run without changing what runs. The exception is
    ``drafter=registered``, whose ``method`` is the registered drafter to run.

    Raises:
        ValueError: naming the key and the group to choose instead.
    """
    for group, attr in (("drafter", "method"), ("dataset", "name"), ("grammar", "kind"), ("logger", "name")):
        obj = getattr(cfg, group)
        fields = getattr(type(obj), "__dataclass_fields__", {})
        if attr not in fields or isinstance(obj, RegisteredDrafterConfig):
            continue
        expected, value = fields[attr].default, getattr(obj, attr)
        if isinstance(expected, str) and value != expected:
            raise ValueError(
                f"{group}.{attr}={value!r} contradicts the chosen group ({group}: {expected}); "
                f"{group}.{attr} names the group and cannot be overridden: choose the group instead "
                f"({group}={value})"
            )


def _import_drafter_module(d: DrafterConfig) -> None:
    """Import ``drafter.import_module`` (``drafter=registered``), whose import registers the drafter.

    Raises:
        ValueError: the module cannot be imported (naming ``drafter.import_module``).
    """
    module = getattr(d, "import_module", None)
    if module is None:
        return
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"drafter.import_module={module!r} cannot be imported: {e}") from e


def validate_config(cfg: ExperimentConfig) -> None:
    """Cross-field checks that a schema cannot express; cheap, and run before any model loads.

    Every value the library checks is checked by the library: the drafter by
    ``specdec.config.SpeculativeConfig`` (and its registry entry's ``check_target`` when the models'
    configs are here), sampling and grammar by ``SamplingParams``, the engine by specdec's
    ``CacheConfig``/``SchedulerConfig``/``QuantizationConfig``. Every message starts with the offending
    key (``drafter.num_speculative_tokens must be ...``, ``sampling: top_p must be ...``,
    ``engine.block_size must be ...``).

    Raises:
        ValueError: a relabelled group, a ``drafter.import_module`` that cannot be imported, a
            non-positive ``max_tokens``/``limit``, a drafter, sampling, grammar or engine value the
            library rejects, or a drafter that does not fit the target (e.g. a draft model of another
            vocabulary).
    """
    _import_drafter_module(cfg.drafter)
    _check_group_names(cfg)
    if cfg.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {cfg.max_tokens}")
    from sampling.params import SamplingParams

    try:
        SamplingParams(**sampling_params_kwargs(cfg.sampling, NoGrammarConfig()))
    except ValueError as e:
        raise ValueError(f"sampling: {e}") from None
    try:
        SamplingParams(**sampling_params_kwargs(SamplingConfig(), cfg.grammar))
    except ValueError as e:
        raise ValueError(f"grammar ({cfg.grammar.kind}): {e}") from None
    _check_dataset(cfg.dataset)
    _check_engine(cfg.engine)
    _check_logger(cfg.logger)
    d = cfg.drafter
    spec = d.speculative_config()
    if spec is not None:
        try:
            config = _speculative_config(spec, "drafter", d.field_keys())
        except ValueError as e:
            if (
                isinstance(d, RegisteredDrafterConfig)
                and d.import_module is None
                and f"{e}".startswith("drafter.method:")
            ):
                raise ValueError(
                    f"{e}; a drafter of your own: set drafter.import_module=<the module that registers it>"
                ) from None
            raise
        what = f"drafter.model={config.model}" if config.model else f"drafter={config.method}"
        _check_against_target(cfg.model.name, config, what)


def validate_bench_config(cfg: BenchConfig) -> None:
    """The checks of :func:`validate_config` for ``experiments.bench``.

    Raises:
        ValueError: an unknown method or system, a method transformers has no counterpart of, a
            non-positive count, a missing or mismatched draft model, or a drafter or engine value the
            library rejects.
    """
    methods = bench_methods()
    unknown = [m for m in cfg.methods if m not in methods]
    if unknown or not cfg.methods:
        raise ValueError(f"methods must be a non-empty subset of {list(methods)}, got {cfg.methods}")
    unknown = [s for s in cfg.systems if s not in BENCH_SYSTEMS]
    if unknown or not cfg.systems:
        raise ValueError(f"systems must be a non-empty subset of {list(BENCH_SYSTEMS)}, got {cfg.systems}")
    if "transformers" in cfg.systems and any(m not in TRANSFORMERS_METHODS for m in cfg.methods):
        raise ValueError(
            f"methods must be a non-empty subset of {list(TRANSFORMERS_METHODS)} with the transformers "
            f"system (the others have no transformers counterpart; set systems=[specdec]), got {cfg.methods}"
        )
    if cfg.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {cfg.max_tokens}")
    if not cfg.concurrency or any(c < 1 for c in cfg.concurrency):
        raise ValueError(f"concurrency must list integers >= 1, got {cfg.concurrency}")
    if any(b < 1 for b in cfg.transformers_static_batch):
        raise ValueError(
            f"transformers_static_batch must list integers >= 1, got {cfg.transformers_static_batch}"
        )
    if cfg.bandwidth_bytes < 4096:
        raise ValueError(f"bandwidth_bytes must be >= 4096, got {cfg.bandwidth_bytes}")
    _check_dataset(cfg.dataset)
    _check_engine(cfg.engine)
    _check_logger(cfg.logger)
    from specdec.config import SpeculativeConfig
    from specdec.drafters.registry import get_drafter

    keys = tuple(BenchConfig.__dataclass_fields__)
    for method in cfg.methods:
        if method == "plain":
            continue
        if get_drafter(method).model == "model" and cfg.resolved_draft_model() is None:
            raise ValueError(
                f"methods has {method} but model={cfg.model.name} has no default draft model: set "
                f"draft_model=<zoo name or directory> (zoo pairs: {DEFAULT_DRAFT_MODELS})"
            )
        try:
            config = SpeculativeConfig.from_any(cfg.speculative_config(method))
        except ValueError as e:
            # keyed by the bench key the message starts with (num_speculative_tokens...), else the method
            head = re.split(r"[ =:]", str(e), maxsplit=1)[0]
            raise ValueError(str(e) if head in keys else f"methods ({method}): {e}") from None
        assert config is not None
        what = f"draft_model={config.model}" if config.model else f"methods={method}"
        _check_against_target(cfg.model.name, config, what)


def _to_object(cfg: DictConfig, schema: type, name: str) -> Any:
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, schema):
        raise TypeError(
            f"expected a config composed from {name!r}, got {type(obj).__name__}; "
            f"list {name!r} first in the defaults of the primary config"
        )
    _reject_extra_keys(obj, "")
    return obj


def to_experiment_config(cfg: DictConfig) -> ExperimentConfig:
    """Convert a composed (and schema-checked) ``DictConfig`` into a validated :class:`ExperimentConfig`.

    Raises:
        omegaconf.errors.MissingMandatoryValue: a required value (e.g. ``dataset.path``) is unset.
        TypeError: the config was not composed from ``experiment_schema``.
        ValueError: see :func:`validate_config`.
    """
    obj: ExperimentConfig = _to_object(cfg, ExperimentConfig, "experiment_schema")
    validate_config(obj)
    return obj


def to_bench_config(cfg: DictConfig) -> BenchConfig:
    """Convert a composed ``conf/bench.yaml`` into a validated :class:`BenchConfig`.

    Raises:
        TypeError: the config was not composed from ``bench_schema``.
        ValueError: see :func:`validate_bench_config`.
    """
    obj: BenchConfig = _to_object(cfg, BenchConfig, "bench_schema")
    validate_bench_config(obj)
    return obj


def _check_unique_list(key: str, values: list[Any]) -> None:
    dupes = sorted({v for v in values if values.count(v) > 1}, key=str)
    if dupes:
        raise ValueError(f"{key} lists {dupes} more than once: {values}")


def validate_concurrency_config(cfg: ConcurrencyConfig) -> None:
    """The checks of ``experiments.concurrency``'s config that a schema cannot express; run before any
    model loads.

    Raises:
        ValueError: an unknown drafter or policy (the message names the registered ones), policy
            parameters the policy rejects, ``policy_kwargs`` or ``drafter_options`` for a name not run,
            a concurrency below 1 or above ``engine.max_num_seqs``, a static k outside ``0 .. 16``, a
            non-positive count, a module of ``import_modules`` that cannot be imported, a missing or
            mismatched draft model, or a drafter or engine value the library rejects.
    """
    for module in cfg.import_modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"import_modules: {module!r} cannot be imported: {e}") from None
    from specdec.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
    from specdec.drafters.registry import drafter_names, get_drafter
    from specdec.errors import ConfigError
    from specdec.policies import PolicyContext, build_policy, policy_names

    names = list(drafter_names())
    unknown = [d for d in cfg.drafters if d not in names]
    if unknown or not cfg.drafters:
        raise ValueError(
            f"drafters must be a non-empty list of registered drafters {names}, got {cfg.drafters}"
            + (f" (unknown: {unknown})" if unknown else "")
        )
    registered = policy_names()
    unknown = [p for p in cfg.policies if p not in registered]
    if unknown:
        raise ValueError(
            f"policies: unknown speculation polic{'ies' if len(unknown) > 1 else 'y'} {unknown}; "
            f"registered: {', '.join(registered)} (a policy of your own: import_modules=[<its module>])"
        )
    if not cfg.policies and not cfg.static_k:
        raise ValueError("policies and static_k are both empty: nothing to compare with plain decoding")
    for key, values in (
        ("drafters", cfg.drafters),
        ("policies", cfg.policies),
        ("static_k", cfg.static_k),
        ("concurrency", cfg.concurrency),
    ):
        _check_unique_list(key, list(values))
    if not cfg.concurrency or any(c < 1 for c in cfg.concurrency):
        raise ValueError(f"concurrency must list integers >= 1, got {cfg.concurrency}")
    if max(cfg.concurrency) > cfg.engine.max_num_seqs:
        raise ValueError(
            f"concurrency {max(cfg.concurrency)} exceeds engine.max_num_seqs={cfg.engine.max_num_seqs}: "
            "the batch would not hold that many requests (raise engine.max_num_seqs)"
        )
    if any(not 0 <= k <= MAX_SPECULATIVE_TOKENS for k in cfg.static_k):
        raise ValueError(f"static_k must list integers in [0, {MAX_SPECULATIVE_TOKENS}], got {cfg.static_k}")
    k = cfg.num_speculative_tokens
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k}"
        )
    for key in ("max_tokens", "min_requests", "min_rounds", "repeats"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"{key} must be >= 1, got {getattr(cfg, key)}")
    if cfg.arrivals not in ARRIVALS:
        raise ValueError(f"arrivals must be one of {list(ARRIVALS)}, got {cfg.arrivals!r}")
    for key, given, listed, allowed in (
        ("policy_kwargs", cfg.policy_kwargs, "policies", cfg.policies),
        ("drafter_options", cfg.drafter_options, "drafters", cfg.drafters),
    ):
        stray = [name for name in given if name not in allowed]
        if stray:
            raise ValueError(f"{key} has {stray}, which {listed} does not list ({allowed})")
    _check_dataset(cfg.dataset)
    _check_engine(cfg.engine)
    _check_logger(cfg.logger)
    keys = tuple(ConcurrencyConfig.__dataclass_fields__)
    for drafter in cfg.drafters:
        if get_drafter(drafter).model == "model" and cfg.resolved_draft_model() is None:
            raise ValueError(
                f"drafters has {drafter} but model={cfg.model.name} has no default draft model: set "
                f"draft_model=<zoo name or directory> (zoo pairs: {DEFAULT_DRAFT_MODELS})"
            )
        try:
            config = SpeculativeConfig.from_any(cfg.speculative_config(drafter))
        except ValueError as e:
            head = re.split(r"[ =:]", str(e), maxsplit=1)[0]
            raise ValueError(str(e) if head in keys else f"drafters ({drafter}): {e}") from None
        assert config is not None
        what = f"draft_model={config.model}" if config.model else f"drafters={drafter}"
        _check_against_target(cfg.model.name, config, what)
        for policy in cfg.policies:
            ctx = PolicyContext(cfg.num_speculative_tokens, tree=config.tree is not None)
            try:
                build_policy(policy, ctx, dict(cfg.policy_kwargs.get(policy) or {}))
            except ConfigError as e:
                raise ValueError(f"policy_kwargs.{policy}: {e}") from None


def to_concurrency_config(cfg: DictConfig) -> ConcurrencyConfig:
    """Convert a composed ``conf/concurrency.yaml`` into a validated :class:`ConcurrencyConfig`.

    Raises:
        TypeError: the config was not composed from ``concurrency_schema``.
        ValueError: see :func:`validate_concurrency_config`.
    """
    obj: ConcurrencyConfig = _to_object(cfg, ConcurrencyConfig, "concurrency_schema")
    validate_concurrency_config(obj)
    return obj


def validate_train_config(cfg: TrainConfig) -> None:
    """The checks of ``experiments.train``'s config that a schema cannot express; run before any model
    loads.

    Raises:
        ValueError: a drafter other than medusa/eagle/eagle3, a relabelled group, a drafter value the library
            rejects (``SpeculativeConfig``), a non-positive count or budget, neither a time budget nor
            epochs, greedy with ``n`` > 1, or an engine value ``specdec.LLM`` would reject.
    """
    d, data, t = cfg.drafter, cfg.data, cfg.train
    if not isinstance(d, HeadDrafterConfig):
        raise ValueError(f"drafter must be medusa, eagle or eagle3 for training, got drafter={d.method}")
    for group, attr in (("drafter", "method"), ("logger", "name")):
        obj = getattr(cfg, group)
        expected, value = type(obj).__dataclass_fields__[attr].default, getattr(obj, attr)
        if isinstance(expected, str) and value != expected:
            raise ValueError(
                f"{group}.{attr}={value!r} contradicts the chosen group ({group}: {expected}); choose the "
                f"group instead ({group}={value})"
            )
    _check_logger(cfg.logger)
    from specdec.drafters.registry import get_drafter

    # k, the tree and the dynamic tree's options are the library's to check (those the method reads);
    # tree_choices and model are left to the evaluation's specdec.LLM, as before.
    spec = d.speculative_config()
    assert spec is not None
    keys = ("method", "num_speculative_tokens", "tree", *get_drafter(d.method).fields)
    _speculative_config({k: v for k, v in spec.items() if k in keys and k != "tree_choices"}, "drafter")
    if isinstance(d, MedusaDrafterConfig) and d.num_speculative_tokens > t.medusa_num_heads:
        raise ValueError(
            f"drafter.num_speculative_tokens={d.num_speculative_tokens} needs as many Medusa heads, but "
            f"train.medusa_num_heads={t.medusa_num_heads}"
        )
    for key, value in (
        ("data.builtin_limit", data.builtin_limit),
        ("data.chat_limit", data.chat_limit),
        ("data.instruct_limit", data.instruct_limit),
    ):
        if value is not None and value < 0:
            raise ValueError(f"{key} must be >= 0 or null, got {value}")
    if data.synth_prompts < 0:
        raise ValueError(f"data.synth_prompts must be >= 0, got {data.synth_prompts}")
    for key, value in (
        ("data.max_prompt_chars", data.max_prompt_chars),
        ("data.max_new_tokens", data.max_new_tokens),
        ("data.n", data.n),
        ("data.max_num_seqs", data.max_num_seqs),
        ("data.max_num_batched_tokens", data.max_num_batched_tokens),
        ("data.feature_batch_tokens", data.feature_batch_tokens),
        ("train.batch_tokens", t.batch_tokens),
        ("train.medusa_num_heads", t.medusa_num_heads),
        ("train.log_every", t.log_every),
        ("train.eval_max_positions", t.eval_max_positions),
        ("train.eval_prompts", t.eval_prompts),
        ("train.eval_max_tokens", t.eval_max_tokens),
    ):
        if value < 1:
            raise ValueError(f"{key} must be >= 1, got {value}")
    if not 0.0 <= data.heldout_fraction < 1.0:
        raise ValueError(f"data.heldout_fraction must be in [0, 1), got {data.heldout_fraction}")
    if data.temperature < 0:
        raise ValueError(f"data.temperature must be >= 0, got {data.temperature}")
    if data.temperature == 0 and data.n != 1:
        raise ValueError(
            f"data.n={data.n} needs sampling: greedy responses are all the same (set data.temperature)"
        )
    if data.include_greedy and data.temperature == 0:
        raise ValueError(
            "data.include_greedy=true needs data.temperature > 0 (the greedy data is the default)"
        )
    if t.time_budget_s is None and t.epochs is None:
        raise ValueError("set train.time_budget_s or train.epochs (or both)")
    if t.time_budget_s is not None and t.time_budget_s <= 0:
        raise ValueError(f"train.time_budget_s must be > 0 or null, got {t.time_budget_s}")
    if t.epochs is not None and t.epochs <= 0:
        raise ValueError(f"train.epochs must be > 0 or null, got {t.epochs}")
    if t.lr <= 0 or t.weight_decay < 0 or t.grad_clip <= 0 or t.warmup_steps < 0:
        raise ValueError(
            "train.lr and train.grad_clip must be > 0, train.weight_decay and train.warmup_steps >= 0"
        )
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    if t.eagle_unroll not in (1, 2):
        raise ValueError(f"train.eagle_unroll must be 1 or 2, got {t.eagle_unroll}")
    if t.eagle_ce_weight < 0 or t.eagle_noise < 0:
        raise ValueError("train.eagle_ce_weight and train.eagle_noise must be >= 0")
    if t.eagle3_ttt_steps < 1 or t.eagle3_draft_vocab_size < 1 or not 0.0 < t.eagle3_step_decay <= 1.0:
        raise ValueError(
            "train.eagle3_ttt_steps and train.eagle3_draft_vocab_size must be >= 1, train.eagle3_step_decay "
            f"in (0, 1]; got {t.eagle3_ttt_steps}, {t.eagle3_draft_vocab_size}, {t.eagle3_step_decay}"
        )
    if data.feature_layers is not None and any(
        isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in data.feature_layers
    ):
        raise ValueError(f"data.feature_layers must be layer indices >= 0, got {data.feature_layers}")
    if t.torch_threads is not None and t.torch_threads < 1:
        raise ValueError(f"train.torch_threads must be >= 1 or null, got {t.torch_threads}")
    try:
        import torch

        torch.device(t.device)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"train.device must be a torch device (cpu, cuda, cuda:1...), got {t.device!r}"
        ) from None
    from specdec.config import SchedulerConfig

    try:
        SchedulerConfig(data.max_num_batched_tokens, data.max_num_seqs)
    except ValueError as err:
        raise ValueError(f"data.{err}") from None


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """Convert a composed ``conf/train.yaml`` into a validated :class:`TrainConfig`.

    Raises:
        TypeError: the config was not composed from ``train_schema``.
        ValueError: see :func:`validate_train_config`.
    """
    obj: TrainConfig = _to_object(cfg, TrainConfig, "train_schema")
    validate_train_config(obj)
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


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready dict of a config dataclass (enums become their values)."""
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
