"""Self-synthesised chat prompts: user requests written by the target itself (after Magpie).

Magpie (Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with
Nothing") feeds an instruction-tuned model its chat template only up to where a user's message begins
(the *pre-query template*) and samples: the model writes a user request, ended by its end-of-turn token.
The requests follow what the model was aligned on, so they add the variety of wording that built-in
templates lack (a draft head trained on a few hundred templates generalises poorly to chat it never saw).

Where this differs from Magpie's scripts: the pre-query template here is the chat template as the model
renders a conversation without a system message, so for SmolLM2 it includes the default system turn
(Magpie leaves system turns out by default; SmolLM2 always saw one); requests may span several lines
(Magpie stops at the first newline by default); the sampling is :class:`SynthSettings`' (Magpie's
default script samples at temperature 1, top-p 1; its scripts for some models at 0.7).

:func:`synthesize_prompts` samples requests in rounds of engine requests with seeds ``seed``, ``seed +
1``, ... (every engine request ``samples_per_request`` samples), keeps those the model ended itself with
its end-of-turn token (:func:`keep_request` for the text: a length within bounds, mostly printable ASCII,
three words or more), drops repeats (case and spacing folded) and any request sharing a six-word sequence
with the evaluation-only fresh chat requests (:data:`experiments.instruct.FRESH_CHAT`). The samples are
cached as JSON under the training cache with the next seed, keyed by the model's identity, its pre-query
tokens, the fresh requests and the settings; a larger count continues from the cache, so a longer list
starts with a shorter one (as far as the engine's sampled text does not depend on the batch around a
request: bit for bit on the CPUs whose bfloat16 kernels are batch-invariant, see the README). Prompts get
ids ``synth/<index>`` and category ``synth``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from experiments.datasets import Prompt, _user

logger = logging.getLogger("experiments.train")

#: A round's samples: per engine request seed, its samples as (text, ended by the end-of-turn token).
Generate = Callable[[Sequence[int]], list[tuple[str, bool]]]

#: Bump when the selection of requests changes (part of the cache key).
SYNTH_FORMAT_VERSION = 2

_SENTINEL = "\x00SPECDEC_QUERY\x00"
_WORD = re.compile(r"[a-z0-9']+")


@dataclass(frozen=True)
class SynthSettings:
    """How requests are sampled and kept.

    Attributes:
        temperature, top_p: the sampling of a request (a top-p below 1 trims the garbled tail a 135M
            model produces).
        max_tokens: most tokens of a request; requests cut at this limit are dropped.
        samples_per_request: requests sampled per engine request (``n``; they share the prefix).
        round_requests: engine requests per round of sampling (a round: ``round_requests ×
            samples_per_request`` samples).
        min_chars, max_chars: bounds on a kept request's length, in characters.
        seed: the ``i``-th engine request samples with seed ``seed + i``.
    """

    temperature: float = 1.0
    top_p: float = 0.95
    max_tokens: int = 96
    samples_per_request: int = 32
    round_requests: int = 16
    min_chars: int = 16
    max_chars: int = 600
    seed: int = 0


def template_parts(tokenizer: Any) -> tuple[list[int], int]:
    """The chat template's token ids up to where a user's message begins, and the token that ends the
    message: the template applied (tokenised) to one user message, cut before its content.

    Raises:
        ValueError: the template does not place a message's content verbatim, its prefix tokens differ
            once a message follows (tokens merging across the cut), or no special token ends the message.
    """
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=False
    )
    cut = rendered.find(_SENTINEL)
    if cut < 0:
        raise ValueError("the chat template does not place a user message's content verbatim")
    prefix = list(tokenizer(rendered[:cut], add_special_tokens=False)["input_ids"])
    whole = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=True)
    whole = list(whole["input_ids"] if hasattr(whole, "keys") else whole)  # a BatchEncoding in transformers 5
    if whole[: len(prefix)] != prefix:
        raise ValueError("the chat template's tokens before a user message depend on the message")
    special = set(tokenizer.all_special_ids)
    end = next((t for t in whole[len(prefix) :] if t in special), None)
    if end is None:
        raise ValueError("no special token ends a user message in the chat template")
    return prefix, end


def normalise(text: str) -> str:
    """Lower case, runs of whitespace folded to one space, stripped: the key of a repeat."""
    return " ".join(text.lower().split())


def six_word_sequences(text: str) -> set[tuple[str, ...]]:
    """Every run of six consecutive words of ``text`` (lower case, letters, digits and apostrophes)."""
    words = _WORD.findall(text.lower().replace("\u2019", "'"))
    return {tuple(words[i : i + 6]) for i in range(len(words) - 5)}


def keep_request(text: str, finished: bool, settings: SynthSettings) -> bool:
    """Whether a sampled request is kept: the model ended it itself (``finished``), its stripped length
    lies in ``[min_chars, max_chars]``, at least 95 % of its characters are printable ASCII (a 135M model
    drifts into other scripts and symbol soup), and it has at least three words."""
    text = text.strip()
    if not finished or not settings.min_chars <= len(text) <= settings.max_chars:
        return False
    printable = sum(1 for c in text if c.isascii() and (c.isprintable() or c in "\n\t"))
    return printable >= 0.95 * len(text) and len(_WORD.findall(text.lower())) >= 3


def select_requests(
    samples: Iterable[tuple[str, bool]], settings: SynthSettings, exclude: Sequence[str] = ()
) -> list[str]:
    """The kept requests of ``samples`` (text, ended by the model) in order: :func:`keep_request`, the
    first of each repeat (:func:`normalise`), none sharing a six-word sequence with ``exclude``."""
    banned: set[tuple[str, ...]] = set()
    for text in exclude:
        banned |= six_word_sequences(text)
    seen: set[str] = set()
    kept = []
    for text, finished in samples:
        text = text.strip()
        key = normalise(text)
        if key in seen or not keep_request(text, finished, settings) or six_word_sequences(text) & banned:
            continue
        seen.add(key)
        kept.append(text)
    return kept


def synthesize_prompts(
    model: str,
    count: int,
    settings: SynthSettings | None = None,
    dtype: str = "bfloat16",
    device: str = "cpu",
    cache_dir: str | Path | None = None,
) -> list[Prompt]:
    """``count`` self-synthesised user requests of ``model`` as prompts (ids ``synth/<i>``, category
    ``synth``), from the cache or sampled through ``specdec.LLM`` (continuing the cached samples).

    Args:
        model: a zoo name or a local model directory with a chat template.
        count: requests wanted.
        settings: the sampling and selection (default :class:`SynthSettings`).
        dtype, device: of the engine that samples.
        cache_dir: the cache's directory (None: ``<specdec cache>/train``).

    Raises:
        TypeError: ``count`` not an int.
        ValueError: ``count`` < 0, a chat template without a clean user-message slot
            (:func:`template_parts`), or fewer than one request kept in 20 samples (the model does not
            end its requests).
    """
    if not isinstance(count, int) or isinstance(count, bool):
        raise TypeError(f"count must be an int, got {count!r}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if count == 0:
        return []
    settings = settings or SynthSettings()
    path = _cache_file(model, settings, dtype, cache_dir)
    cached = json.loads(path.read_text()) if path.is_file() else {"samples": [], "next_seed": settings.seed}
    samples = [(text, bool(ended)) for text, ended in cached["samples"]]
    kept = _select(samples, settings)
    if len(kept) < count:
        t0, before = time.perf_counter(), len(samples)
        next_seed = sample_rounds(
            _generator(model, settings, dtype, device), count, settings, samples, cached["next_seed"]
        )
        kept = _select(samples, settings)
        logger.info(
            "synthesised %d requests (%d kept in all) in %.0f s",
            len(samples) - before,
            len(kept),
            time.perf_counter() - t0,
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps({"model": model, "next_seed": next_seed, "samples": samples}))
        tmp.replace(path)
    return [Prompt(f"synth/{i}", "synth", _user(text)) for i, text in enumerate(kept[:count])]


def sample_rounds(
    generate: Generate, count: int, settings: SynthSettings, samples: list[tuple[str, bool]], next_seed: int
) -> int:
    """Rounds of ``settings.round_requests`` engine requests (seeds from ``next_seed`` on), their samples
    appended to ``samples``, until ``count`` requests are kept; returns the next seed.

    Raises:
        ValueError: the samples reach 20 × ``count`` (and a round) with fewer than ``count`` kept.
    """
    limit = 20 * count + settings.round_requests * settings.samples_per_request
    while (kept := len(_select(samples, settings))) < count:
        if len(samples) >= limit:
            raise ValueError(f"only {kept} of {count} requests kept from {len(samples)} samples")
        samples += generate(range(next_seed, next_seed + settings.round_requests))
        next_seed += settings.round_requests
    return next_seed


def _select(samples: Iterable[tuple[str, bool]], settings: SynthSettings) -> list[str]:
    from experiments.instruct import FRESH_CHAT

    return select_requests(samples, settings, FRESH_CHAT)


def _cache_file(model: str, settings: SynthSettings, dtype: str, cache_dir: str | Path | None) -> Path:
    """``<cache_dir>/synth-<key>.json``, the key a hash of everything the samples and their selection
    depend on: the model's identity (config and weight files), its pre-query tokens (the tokenizer and
    chat template), the fresh chat requests excluded, the dtype and the settings."""
    from experiments.instruct import FRESH_CHAT
    from experiments.run import load_tokenizer
    from experiments.train.data import default_cache_dir, model_identity
    from specdec.zoo import resolve_model

    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise ValueError(f"model {model} has no tokenizer: it cannot write requests")
    key = {
        "version": SYNTH_FORMAT_VERSION,
        "model": model,
        "identity": model_identity(resolve_model(model)),
        "template": template_parts(tokenizer),
        "fresh": hashlib.sha256("\n".join(FRESH_CHAT).encode()).hexdigest(),
        "dtype": dtype,
        "settings": asdict(settings),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / f"synth-{digest}.json"


def _generator(model: str, settings: SynthSettings, dtype: str, device: str) -> Generate:
    """Sampling through ``specdec.LLM``: each engine request is the pre-query template, stopped by any
    special token; a sample counts as ended when the template's end-of-turn token stopped it."""
    from specdec import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, device=device, seed=settings.seed, max_num_seqs=64)
    prefix, end_of_turn = template_parts(llm.tokenizer)
    stops = sorted(set(llm.tokenizer.all_special_ids))

    def generate(seeds: Sequence[int]) -> list[tuple[str, bool]]:
        params = [
            SamplingParams(
                temperature=settings.temperature,
                top_p=settings.top_p,
                max_tokens=settings.max_tokens,
                n=settings.samples_per_request,
                seed=seed,
                stop_token_ids=stops,
            )
            for seed in seeds
        ]
        outs = llm.generate([{"prompt_token_ids": prefix}] * len(params), params)
        return [
            (c.text, c.finish_reason == "stop" and bool(c.token_ids) and c.token_ids[-1] == end_of_turn)
            for o in outs
            for c in o.outputs
        ]

    return generate
