"""Exceptions raised by specdec.

Every error a user can cause is a subclass of :class:`SpecdecError`; errors about bad arguments also
subclass :class:`ValueError` so that ``except ValueError`` keeps working for callers who expect it.

Bad input raises before any work starts. A fault that appears while a request runs and concerns that
request alone (its grammar fails to compile, its logits rows turn NaN or infinite, its drafter or its
grammar raises) does not raise: the request ends with ``finish_reason == "error"`` and a message in
``CompletionOutput.error``, its KV blocks are freed, and the other requests go on unchanged (see
:meth:`specdec.engine.LLMEngine.step`).
"""

from __future__ import annotations


class SpecdecError(Exception):
    """Base class of every exception specdec raises on purpose."""


class InvalidRequestError(SpecdecError, ValueError):
    """A prompt or its parameters are invalid (empty prompt, too long, token id out of vocabulary...).

    Raised before any work starts; requests already in the engine are not affected.
    """


class UnknownModelError(SpecdecError, ValueError):
    """A model name is neither a zoo name nor a directory holding an HF-format model."""


class ModelFetchError(SpecdecError):
    """A zoo model's package could not be downloaded (no network, package missing, pip failed)."""


class ChecksumError(SpecdecError):
    """A downloaded weight file does not have the expected sha256; nothing was written to the cache."""


class CorruptModelError(SpecdecError):
    """A model directory's weight or config files are missing, truncated or unreadable."""


class KVCacheExhaustedError(SpecdecError):
    """A single request needs more KV blocks than the whole pool holds, so preemption cannot help."""


class ConfigError(SpecdecError, ValueError):
    """An engine, cache, scheduler or speculative configuration value is invalid (raised before loading)."""


class CacheDirectoryError(SpecdecError):
    """The cache folder (``$SPECDEC_CACHE_DIR``, default ``~/.cache/specdec``) cannot be created or written,
    so a zoo model cannot be converted into it. Raised before anything is downloaded; models already
    converted there are still served from a read-only cache."""
