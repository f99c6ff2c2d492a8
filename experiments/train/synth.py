"""Self-synthesised chat prompts: user requests written by the target itself (Magpie).

Magpie (Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with
Nothing") feeds an instruction-tuned model its chat template only up to where a user's message begins
(the *pre-query template*, here the default system turn and ``<|im_start|>user\\n`` for SmolLM2) and
samples: the model writes a user request, ended by its end-of-turn token. The requests follow the kinds of
things the model was aligned on, everyday chat first, so they add the variety of wording that built-in
templates lack (a draft head trained on 677 templates generalises poorly to chat it never saw).

:func:`synthesize_prompts` samples such requests (temperature and top-p of :class:`SynthSettings`, each
request with its own seed), keeps those the model ended itself (:func:`keep_request`: not cut at the
token limit, mostly printable text, a length within bounds), drops repeats (case and spacing folded) and
any request sharing a six-word sequence with the evaluation-only fresh chat requests
(:data:`experiments.instruct.FRESH_CHAT`), and caches the list as JSON under the training cache, keyed
by the model's identity and the settings: the same model and settings give the same prompts. Prompts
get ids ``synth/<index>`` and category ``synth``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from experiments.datasets import Prompt, _user

logger = logging.getLogger("experiments.train")

#: Bump when the selection of requests changes (part of the cache key).
SYNTH_FORMAT_VERSION = 1

_SENTINEL = "\x00SPECDEC_QUERY\x00"
_WORD = re.compile(r"[a-z0-9']+")


@dataclass(frozen=True)
class SynthSettings:
    """How requests are sampled and kept.

    Attributes:
        temperature, top_p: the sampling of a request (Magpie samples at temperature 1, top-p 1; a
            top-p below 1 trims the garbled tail a 135M model produces).
        max_tokens: most tokens of a request; requests cut at this limit are dropped.
        samples_per_request: requests sampled per engine request (``n``; they share the prefix).
        min_chars, max_chars: bounds on a kept request's length in characters.
        seed: request ``i`` of the engine samples with seed ``seed + i``.
    """

    temperature: float = 1.0
    top_p: float = 0.95
    max_tokens: int = 96
    samples_per_request: int = 32
    min_chars: int = 16
    max_chars: int = 600
    seed: int = 0


def pre_query_ids(tokenizer) -> list[int]:
    """The chat template's token ids up to where a user's message begins (the default system turn
    included, as the model saw it in alignment): the template applied to one user message, cut before
    its content. Raises ``ValueError`` when the template does not place the content verbatim."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=False
    )
    cut = text.find(_SENTINEL)
    if cut < 0:
        raise ValueError("the chat template does not place a user message's content verbatim")
    return list(tokenizer(text[:cut], add_special_tokens=False)["input_ids"])


def normalise(text: str) -> str:
    """Lower case, runs of whitespace folded to one space, stripped: the key of a repeat."""
    return " ".join(text.lower().split())


def six_word_sequences(text: str) -> set[tuple[str, ...]]:
    """Every run of six consecutive words of ``text`` (lower case, letters, digits and apostrophes)."""
    words = _WORD.findall(text.lower())
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
    ``synth``), sampled through ``specdec.LLM`` in rounds until ``count`` are kept, and cached.

    Raises:
        ValueError: ``count`` < 0, a chat template without a verbatim user slot, or fewer than ``count``
            requests kept after 8 rounds (the model does not end its requests).
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if count == 0:
        return []
    settings = settings or SynthSettings()
    from experiments.train.data import default_cache_dir, model_identity
    from specdec.zoo import resolve_model

    key = hashlib.sha256(
        json.dumps(
            {
                "version": SYNTH_FORMAT_VERSION,
                "model": model,
                "identity": model_identity(resolve_model(model)),
                "dtype": dtype,
                "settings": asdict(settings),
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()[:16]
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = path / f"synth-{key}.json"
    cached: list[str] = json.loads(path.read_text())["requests"] if path.is_file() else []
    if len(cached) < count:  # every kept request is cached: a later, larger count may need no sampling
        cached = _sample(model, count, settings, dtype, device)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps({"model": model, "settings": asdict(settings), "requests": cached}))
        tmp.replace(path)
    return [Prompt(f"synth/{i}", "synth", _user(text)) for i, text in enumerate(cached[:count])]


def _sample(model: str, count: int, settings: SynthSettings, dtype: str, device: str) -> list[str]:
    """Every request kept from rounds of sampling that stop once ``count`` are kept (each round sized
    from the previous round's yield); every engine request has its own seed, so the list depends on the
    settings only, and a longer list starts with a shorter one."""
    from experiments.instruct import FRESH_CHAT
    from specdec import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, device=device, seed=settings.seed, max_num_seqs=64)
    prefix = pre_query_ids(llm.tokenizer)
    samples: list[tuple[str, bool]] = []
    kept: list[str] = []
    next_seed, rate, t0 = settings.seed, 0.5, time.perf_counter()
    for _ in range(8):
        want = max(1, -(-int((count - len(kept)) / max(rate, 0.05) * 1.1) // settings.samples_per_request))
        params = [
            SamplingParams(
                temperature=settings.temperature,
                top_p=settings.top_p,
                max_tokens=settings.max_tokens,
                n=settings.samples_per_request,
                seed=next_seed + i,
            )
            for i in range(want)
        ]
        next_seed += want
        outs = llm.generate([{"prompt_token_ids": prefix}] * want, params)
        before = len(samples)
        samples += [(c.text, c.finish_reason == "stop") for o in outs for c in o.outputs]
        kept = select_requests(samples, settings, FRESH_CHAT)
        rate = max(len(kept), 1) / len(samples)
        logger.info(
            "synthesised %d requests, %d kept (%.0f %%) in %.0f s",
            len(samples) - before,
            len(kept),
            100 * rate,
            time.perf_counter() - t0,
        )
        if len(kept) >= count:
            return kept
    raise ValueError(f"only {len(kept)} of {count} requests kept after 8 rounds of sampling")
