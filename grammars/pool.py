"""What every grammar backend shares: compilation off the engine thread, cached
(:class:`PooledBackend`), and the fields of a compiled grammar (:class:`CompiledBase`).

A backend subclasses :class:`PooledBackend` and implements ``_compile(spec)`` (blocking, run in the
pool) and ``fingerprint`` (its tokenizer's, :class:`~grammars.vocabulary.TokenVocabulary`); it then
has :meth:`~PooledBackend.compile_async`, :meth:`~PooledBackend.compile`, :meth:`~PooledBackend.close`
and context-manager use, with compilations cached by ``(spec, fingerprint)`` (:mod:`grammars.cache`).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from grammars.base import GrammarSpec
from grammars.cache import CompileCache
from grammars.vocabulary import TokenVocabulary

CompiledT = TypeVar("CompiledT")


class PooledBackend(Generic[CompiledT]):
    """Compiles in ``max_workers`` threads; keeps ``cache_size`` compilations (LRU).

    Raises:
        ValueError: ``max_workers`` or ``cache_size`` < 1.
    """

    #: the backend's name in :data:`grammars.registry.GRAMMAR_BACKENDS`
    name = ""

    def __init__(self, max_workers: int = 2, cache_size: int = 256) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be > 0, got {max_workers}")
        self.cache: CompileCache[CompiledT] = CompileCache(cache_size)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")

    @property
    def fingerprint(self) -> str:
        raise NotImplementedError

    def _compile(self, spec: GrammarSpec) -> CompiledT:
        raise NotImplementedError

    def compile_async(self, spec: GrammarSpec) -> Future[CompiledT]:
        """Start compiling ``spec`` (or return the cached or pending future); never blocks on the compile.

        The future's ``result()`` is the compiled grammar, or raises
        :class:`~grammars.errors.GrammarCompileError` (or a subclass). The engine polls ``future.done()``.

        Raises:
            TypeError: ``spec`` is not a :class:`GrammarSpec`.
        """
        if not isinstance(spec, GrammarSpec):
            raise TypeError(f"expected a GrammarSpec, got {type(spec).__name__}")
        key = (spec, self.fingerprint)
        return self.cache.get_or_submit(key, lambda: self._pool.submit(self._compile, spec))

    def compile(self, spec: GrammarSpec) -> CompiledT:
        """Compile ``spec`` (cached), blocking until done.

        Raises:
            GrammarCompileError: and its subclasses, see :meth:`compile_async`.
        """
        return self.compile_async(spec).result()

    def close(self) -> None:
        """Stop the compile threads: queued compilations are cancelled, running ones finish first."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CompiledBase:
    """The fields every compiled grammar has (the :class:`~grammars.base.CompiledGrammar` Protocol's
    ``spec`` and ``vocab_size``, and what reports read).

    Attributes:
        compile_time_s: wall time of the compilation.
        ignored_keywords: what the backend does not enforce of the spec (JSON schemas).
        eos_token_ids: the vocabulary's EOS ids inside the model vocabulary.
    """

    def __init__(
        self,
        spec: GrammarSpec,
        vocabulary: TokenVocabulary,
        vocab_size: int,
        compile_time_s: float,
        ignored_keywords: Sequence[str] = (),
    ) -> None:
        self._spec = spec
        self._vocab_size = vocab_size
        self.compile_time_s = compile_time_s
        self.ignored_keywords = tuple(ignored_keywords)
        self.eos_token_ids = tuple(e for e in vocabulary.eos_token_ids if 0 <= e < vocab_size)
        self.vocabulary = vocabulary

    @property
    def spec(self) -> GrammarSpec:
        return self._spec

    @property
    def vocab_size(self) -> int:
        return self._vocab_size
