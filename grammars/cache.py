"""A thread-safe LRU cache of compile results (futures), keyed by (spec, tokenizer fingerprint).

Futures rather than grammars are cached so that concurrent requests for the same spec share one
compilation: the second caller gets the first caller's pending future. Failed compilations stay cached
too (a schema that timed out once would time out again and cost another ``compile_timeout_s``);
:meth:`CompileCache.clear` forgets everything.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class CompileCache(Generic[T]):
    """At most ``max_entries`` futures, least recently used evicted first (a pending future that is
    evicted still completes for the callers holding it).

    Raises:
        ValueError: ``max_entries`` < 1.
    """

    def __init__(self, max_entries: int = 256):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, Future[T]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get_or_submit(self, key: Hashable, submit: Callable[[], Future[T]]) -> Future[T]:
        """The cached future for ``key``, or the one ``submit()`` starts (called under the lock, so it must
        only schedule work, not do it)."""
        with self._lock:
            fut = self._entries.get(key)
            if fut is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return fut
            self.misses += 1
            fut = submit()
            self._entries[key] = fut
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
            return fut

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def clear(self) -> None:
        """Forget every entry (pending compilations still finish for their current holders)."""
        with self._lock:
            self._entries.clear()
