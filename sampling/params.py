"""Per-request sampling parameters.

Names and meanings follow vLLM's offline API (``vllm.SamplingParams``) so researchers feel at home; each
transform's exact definition (and the order they run in) is in :mod:`sampling.processors`.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

from grammars.errors import InvalidRequestError

if TYPE_CHECKING:
    from grammars.base import GrammarSpec

#: Temperatures below this are treated as greedy decoding (argmax).
GREEDY_EPSILON = 1e-5

#: Largest ``logprobs`` (top-N alternatives per token) a request may ask for.
MAX_LOGPROBS = 20

#: Bound of the OpenAI API's presence and frequency penalties.
MAX_OPENAI_PENALTY = 2.0

#: Largest ``top_k`` accepted (any value at or above the vocabulary size keeps every token).
MAX_TOP_K = 2**31 - 1

#: Largest ``n`` (samples of one prompt, each a request of its own).
MAX_N = 4096


#: Keyword arguments people bring from transformers, vLLM's older API or habit, and what to write instead.
SAMPLING_PARAMS_ALIASES: dict[str, str] = {
    "max_new_tokens": "use max_tokens=... (new tokens, the prompt excluded, as transformers' max_new_tokens)",
    "max_length": "use max_tokens=... (it counts generated tokens only; transformers' max_length also "
    "counts the prompt)",
    "do_sample": "specdec has no do_sample: do_sample=False is temperature=0 (greedy), do_sample=True is a "
    "temperature > 0 (the default is 1.0)",
    "temp": "use temperature=...",
    "num_return_sequences": "use n=... (independent samples per prompt)",
    "num_beams": "beam search is its own call: llm.beam_search(prompts, BeamSearchParams(beam_width=..., "
    "max_tokens=...)) (sampling.beam_search.BeamSearchParams)",
    "eos_token_id": "use stop_token_ids=[...] (EOS itself always stops unless ignore_eos=True)",
    "stop_sequences": "use stop=[...]",
    "stop_strings": "use stop=[...]",
    "top_logprobs": "use logprobs=N",
    "guided_json": "use json_schema=...",
    "guided_regex": "use regex=...",
    "guided_choice": "use choice=[...]",
}

_F = TypeVar("_F", bound=Callable[..., Any])


def unknown_keyword_message(owner: str, name: str, valid: Iterable[str], aliases: Mapping[str, str]) -> str:
    """The message for ``owner(name=...)`` when ``name`` is not a parameter: what to write instead, from
    ``aliases``, else the closest valid names (``difflib``), else every valid name."""
    message = f"{owner}() got an unexpected keyword argument {name!r}"
    if name in aliases:
        return f"{message}: {aliases[name]}"
    valid = list(valid)
    close = difflib.get_close_matches(name, valid, n=2, cutoff=0.6)
    if close:
        return f"{message}; did you mean {' or '.join(repr(c) for c in close)}?"
    return f"{message}; its keyword arguments are {', '.join(valid)}"


def suggest_keywords(owner: str, aliases: Mapping[str, str]) -> Callable[[_F], _F]:
    """Decorate a function, or a class's ``__init__`` (a dataclass's too), so that an unknown keyword
    argument raises a ``TypeError`` that says what to write instead (:func:`unknown_keyword_message`)
    rather than Python's bare one. Everything else is the function's own behaviour."""

    def decorate(obj: _F) -> _F:
        func = obj.__init__ if isinstance(obj, type) else obj  # type: ignore[misc]
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        params = inspect.signature(func).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return obj  # takes any keyword
        valid = frozenset(n for n, p in params.items() if p.kind in kinds and n != "self")

        @functools.wraps(func)
        def checked(*args: Any, **kwargs: Any) -> Any:
            for name in kwargs:
                if name not in valid:
                    raise TypeError(unknown_keyword_message(owner, name, sorted(valid), aliases))
            return func(*args, **kwargs)

        if isinstance(obj, type):
            obj.__init__ = checked  # type: ignore[misc]
            return obj
        return cast(_F, checked)

    return decorate


def coerce_scalars(obj: object, float_fields: Sequence[str], int_fields: Sequence[str]) -> None:
    """Turn NumPy (or other ``numbers``) scalars in these fields into Python ``float`` / ``int``, so
    sweeps built from arrays work; anything else is left for validation to reject."""
    plain = (float, int, bool, type(None))  # the common case, tested first: the ABC checks are slow
    for name in float_fields:
        v = getattr(obj, name)
        if type(v) not in plain and isinstance(v, numbers.Real) and not isinstance(v, (bool, float, int)):
            setattr(obj, name, float(v))
    for name in int_fields:
        v = getattr(obj, name)
        if type(v) not in plain and isinstance(v, numbers.Integral) and not isinstance(v, (bool, int)):
            setattr(obj, name, int(v))


def _check_unicode(text: str, field: str) -> None:
    """Raise unless ``text`` encodes as UTF-8 (a str may hold lone surrogates, which no tokenizer or
    grammar compiler accepts)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            f"{field} is not valid Unicode text: {text[e.start]!r} at position {e.start} ({e.reason})"
        ) from None


def _is_number(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float))


def _is_int(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, int)


@suggest_keywords("SamplingParams", SAMPLING_PARAMS_ALIASES)
@dataclass
class SamplingParams:
    """How one request draws its tokens.

    Attributes:
        temperature: 0 means greedy (argmax of the processed logits); otherwise the processed logits are
            divided by it before softmax. A finite number >= 0.
        top_k: keep the ``top_k`` largest logits (and every token tied with the k-th); 0 or -1: off; at
            most ``2**31 - 1`` (:data:`MAX_TOP_K`; values at or above the vocabulary size keep every token).
        top_p: nucleus sampling, keep the smallest set of most probable tokens whose mass reaches
            ``top_p`` (at least one token); in (0, 1], 1 = off.
        min_p: drop tokens whose probability (after temperature) is below ``min_p`` times the largest
            probability; in [0, 1], 0 = off.
        repetition_penalty: transformers' (Keskar et al. 2019, CTRL): a token that occurs in the prompt or
            the output has its logit divided by it when positive, multiplied when negative; > 0, 1 = off.
        presence_penalty: OpenAI API: subtracted from the logit of every token that occurs in the output
            (prompt excluded); in [0, 2] (the OpenAI API also allows negative values, which reward
            repetition; specdec does not).
        frequency_penalty: OpenAI API: subtracted once per occurrence in the output; in [0, 2].
        seed: seed of the request's own ``torch.Generator``; a seeded request draws the same tokens alone
            or in any batch. None: draws from the engine's generator.
        max_tokens: most tokens to generate (>= 1). Generation never exceeds it.
        min_tokens: stop tokens (EOS unless ``ignore_eos``, and ``stop_token_ids``) are masked out and stop
            strings ignored until this many tokens have been generated; 0 <= min_tokens <= max_tokens.
        stop_token_ids: token ids that end generation (the stop token is part of the output, like EOS).
        stop: strings that end generation; the text is cut before the first occurrence (the stop string
            is not part of ``text``), ``token_ids`` end with the token that completed it. Needs a tokenizer.
        ignore_eos: keep generating past the tokenizer's EOS token.
        logprobs: None, or N in [0, 20]: return per generated token the log-probability of the chosen
            token and of the N most likely tokens, under the processed distribution (see
            :mod:`sampling.processors`).
        n: independent samples per prompt, 1 <= n <= 4096 (:data:`MAX_N`); sample i > 0 of a seeded request
            uses a seed derived from ``(seed, i)``.
        json_schema: constrain the output to JSON valid under this schema (a dict or a JSON string;
            outlines-core's regex for it, with bounded whitespace). See :mod:`grammars`.
        regex: constrain the output to a full match of this regular expression, in the syntax of Rust's
            regex crate (what outlines-core compiles: ``\\p{L}`` and ``(?<name>...)`` work; look-around and
            backreferences do not). A pattern that does not compile raises ``GrammarCompileError`` from
            ``LLM.generate`` (a ``ValueError``) naming the position and the cause as Python's :mod:`re`
            reports them (for a pattern only Rust's syntax rejects, the features it lacks).
        choice: constrain the output to exactly one of these strings.
        strict: with ``json_schema``, raise if the schema uses keywords the grammar cannot enforce
            (numeric bounds, ``uniqueItems``...) instead of warning; either way the final text is
            validated with ``jsonschema`` (``CompletionOutput.schema_valid``).

    Raises:
        InvalidRequestError (a ``ValueError``): at construction, naming the field and its allowed range.
        TypeError: an unknown keyword argument, with what to write instead (``max_new_tokens`` ->
            ``max_tokens``, ``do_sample=False`` -> ``temperature=0``...: :data:`SAMPLING_PARAMS_ALIASES`,
            else the closest names).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: Sequence[int] = field(default_factory=list)
    stop: str | Sequence[str] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    json_schema: dict | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    strict: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (again: the dataclass is mutable, so the engine re-checks on submission).

        Raises:
            InvalidRequestError: naming the first invalid field and its allowed range.
        """
        coerce_scalars(
            self,
            ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"),
            ("top_k", "seed", "max_tokens", "min_tokens", "logprobs", "n"),
        )
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            raise InvalidRequestError(
                f"top_k must be an integer >= -1 (0 or -1: off) and <= {MAX_TOP_K}, got {self.top_k!r}"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not math.isfinite(rp) or rp <= 0:
            raise InvalidRequestError(f"repetition_penalty must be a finite number > 0, got {rp!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not 0 <= v <= MAX_OPENAI_PENALTY:
                raise InvalidRequestError(f"{name} must be in [0, {MAX_OPENAI_PENALTY}], got {v!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequestError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not (-(2**63) <= self.seed < 2**64):
            raise InvalidRequestError(f"seed must fit in 64 bits, got {self.seed}")
        if isinstance(self.stop_token_ids, (str, bytes, dict)) or not isinstance(
            self.stop_token_ids, Iterable
        ):
            raise InvalidRequestError(
                f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}"
            )
        ids = list(self.stop_token_ids)
        for t in ids:
            if not _is_int(t) or t < 0:
                raise InvalidRequestError(f"stop_token_ids must be non-negative integers, got {t!r}")
        self.stop_token_ids = ids
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if isinstance(stops, (bytes, dict)) or not isinstance(stops, Iterable):
                raise InvalidRequestError(f"stop must be a string or a list of strings, got {self.stop!r}")
            stops = list(stops)
            if not all(isinstance(s, str) and s for s in stops):
                raise InvalidRequestError(f"stop must hold non-empty strings, got {stops!r}")
            for s in stops:
                _check_unicode(s, "a stop string")
            self.stop = stops
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
            raise InvalidRequestError(
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        self._validate_grammar()

    def _validate_grammar(self) -> None:
        given = [f for f in ("json_schema", "regex", "choice") if getattr(self, f) is not None]
        if len(given) > 1:
            raise InvalidRequestError(f"give at most one of json_schema, regex and choice, got {given}")
        if self.json_schema is not None:
            schema = self.json_schema
            if isinstance(schema, str):
                _check_unicode(schema, "json_schema")
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise InvalidRequestError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise InvalidRequestError(
                    f"json_schema must be a JSON object (dict or JSON string), got {type(schema).__name__}"
                )
            try:
                text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError) as e:  # not JSON data (sets, objects, NaN...), or circular
                raise InvalidRequestError(f"json_schema is not JSON data: {e}") from None
            _check_unicode(text, "json_schema")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise InvalidRequestError(f"regex must be a non-empty string, got {self.regex!r}")
        if self.regex is not None:
            _check_unicode(self.regex, "regex")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes, dict)) or not isinstance(self.choice, Iterable):
                raise InvalidRequestError(f"choice must be a list of strings, got {self.choice!r}")
            choices = list(self.choice)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise InvalidRequestError(
                    f"choice must be a non-empty list of non-empty strings, got {choices!r}"
                )
            for c in choices:
                _check_unicode(c, "a choice")
            self.choice = choices
        if not isinstance(self.strict, bool):
            raise InvalidRequestError(f"strict must be a bool, got {self.strict!r}")

    @property
    def schema(self) -> dict[str, Any] | None:
        """``json_schema`` parsed (None without one)."""
        if self.json_schema is None:
            return None
        return json.loads(self.json_schema) if isinstance(self.json_schema, str) else self.json_schema

    @property
    def grammar_spec(self) -> GrammarSpec | None:
        """The grammar this request is constrained by, as a hashable spec (None: unconstrained)."""
        if self.json_schema is None and self.regex is None and self.choice is None:
            return None
        from grammars.base import GrammarSpec

        if self.json_schema is not None:
            return GrammarSpec.json_schema(self.json_schema)  # key order kept: it orders the output
        if self.regex is not None:
            return GrammarSpec.regex(self.regex)
        if self.choice is not None:
            return GrammarSpec.choice(list(self.choice))
        return None

    @property
    def greedy(self) -> bool:
        """True when the request decodes greedily (temperature below ``GREEDY_EPSILON``)."""
        return self.temperature < GREEDY_EPSILON

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (empty when unset)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
