"""Admission: validating a request before any work, and compiling its grammar off the engine thread.

A constrained request waits in :class:`GrammarAdmission` until its grammar is compiled, then joins the
scheduler (its priority is the moment it joins; see :mod:`specdec.scheduler`). A grammar that fails to
compile ends its request alone.
"""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from typing import TYPE_CHECKING

from sampling.params import SamplingParams
from specdec.errors import InvalidRequestError, KVCacheExhaustedError
from specdec.kv_cache.manager import cdiv
from specdec.request import Request, RequestStatus

if TYPE_CHECKING:
    from grammars.base import GrammarBackend

logger = logging.getLogger("specdec.engine")


def is_index(x: object) -> bool:
    """An integer that is not a bool (Python ints first: the ABC check is slow), e.g. a token id."""
    return type(x) is int or (not isinstance(x, bool) and isinstance(x, numbers.Integral))


def validate_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    block_size: int,
    num_kv_blocks: int,
    num_draft_slots: int,
    has_tokenizer: bool,
    grammar_backend: GrammarBackend | None,
) -> None:
    """Check one request before any work.

    Raises:
        InvalidRequestError: empty prompt, prompt of ``max_model_len`` tokens or more, token ids
            outside ``[0, vocab_size)``, params that are not a ``SamplingParams``, stop token ids
            outside the vocabulary, stop strings or a grammar without a tokenizer.
        UnsupportedSchemaError: a JSON schema with keywords ``grammar_backend`` cannot enforce, under
            ``strict=True``.
        GrammarCompileError: a JSON schema no backend takes (``grammar_backend="auto"``).
        KVCacheExhaustedError: the request alone needs more KV blocks than the pool has.
    """
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    params.validate()  # fields may have been changed since construction
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty")
    if n >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {n} tokens but max_model_len is {max_model_len}: "
            "it must leave room for at least one generated token"
        )
    bad = [t for t in prompt_token_ids if not is_index(t) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}")
    bad_stops = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad_stops:
        raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab_size}); got {bad_stops[:5]}")
    if params.stop_strings and not has_tokenizer:
        raise InvalidRequestError("stop strings need a tokenizer (skip_tokenizer_init=True was given)")
    if params.grammar_spec is not None:
        if grammar_backend is None:
            raise InvalidRequestError(
                "json_schema / regex / choice need a tokenizer (skip_tokenizer_init=True was given)"
            )
        schema = params.schema
        if schema is not None:
            # what this backend ignores: warned about, or UnsupportedSchemaError when strict
            check = getattr(grammar_backend, "check_schema", None)
            if check is None:  # a backend of the first round's Protocol: outlines-core's findings
                from grammars.schema import check_schema

                check = check_schema
            check(schema, params.strict)
    total = min(n + params.max_tokens, max_model_len)
    # The last generated token ends the request before its KV is ever written; a verification step may
    # also reserve slots for its drafts past the committed tokens.
    need = cdiv(total - 1 + num_draft_slots, block_size)
    if need > num_kv_blocks:
        raise KVCacheExhaustedError(
            f"this request can need {need} KV blocks ({total - 1} tokens"
            + (f" and {num_draft_slots} draft slots" if num_draft_slots else "")
            + f") but the pool has only {num_kv_blocks}; raise num_kv_blocks or lower max_tokens"
        )


class GrammarAdmission:
    """Constrained requests whose grammar is still compiling.

    Attributes:
        compiling: request id -> (request, the compilation's future).
        num_failed: requests ended because their grammar failed to compile.
    """

    def __init__(self) -> None:
        self.compiling: dict[str, tuple[Request, Future]] = {}
        self.num_failed = 0

    def submit(self, request: Request, backend: GrammarBackend) -> None:
        """Start compiling the request's grammar (``request.sampling_params.grammar_spec``)."""
        spec = request.sampling_params.grammar_spec
        assert spec is not None
        self.compiling[request.request_id] = (request, backend.compile_async(spec))

    def admit_ready(self, admit: Callable[[Request], None], wait: bool = False) -> None:
        """Hand requests whose grammar finished compiling to ``admit`` (``wait``: block for one first).

        A grammar that fails to compile ends its request only (``finish_reason`` "error",
        ``request.error`` set)."""
        if not self.compiling:
            return
        if wait:
            futures.wait([f for _, f in self.compiling.values()], return_when=futures.FIRST_COMPLETED)
        for rid, (req, fut) in list(self.compiling.items()):
            if not fut.done():
                continue
            del self.compiling[rid]
            try:
                req.grammar = fut.result().matcher()
            except Exception as e:  # a compile error or limit: this request ends, the others go on
                logger.warning("request %s: grammar compilation failed: %s", rid, e)
                req.error = f"{type(e).__name__}: {e}"
                req.status = RequestStatus.FINISHED_ERROR
                req.stats.finished_time = time.perf_counter()
                self.num_failed += 1
                continue
            admit(req)

    def abort(self, request_id: str) -> bool:
        """Abort a request still compiling; returns whether it was one."""
        entry = self.compiling.pop(request_id, None)
        if entry is None:
            return False
        pending, fut = entry
        fut.cancel()
        pending.status = RequestStatus.FINISHED_ABORTED
        pending.stats.finished_time = time.perf_counter()
        return True
