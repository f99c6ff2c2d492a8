"""``grammar_backend="auto"``: per spec, the backend that enforces the most of it.

For a JSON schema each member backend says what it would not enforce (llguidance: its lenient-mode
warnings; xgrammar: :func:`grammars.xgrammar_schema.xgrammar_schema_findings`; outlines-core:
:func:`grammars.schema.schema_findings`); the members are tried in order of fewest such findings, ties
broken by the order of ``members`` (llguidance first: it compiles in milliseconds, enforces recursive
``$ref`` s and refuses rather than ignores; then xgrammar, which also keeps recursion a grammar rule;
outlines-core last). A member that cannot take the schema at all (a schema outlines-core would compile
wrongly, one llguidance or xgrammar cannot parse) is not a candidate. Regexes and choices go to the
members in order. A compilation that fails moves on to the next candidate; when none compiles,
:class:`GrammarCompileError` gives each member's reason.

With ``strict_schema=True`` only members that enforce the whole schema are candidates. The compiled
grammar is the chosen member's, with its ``backend`` name and ``ignored_keywords``.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from grammars.base import CompiledGrammar, GrammarBackend, GrammarSpec
from grammars.errors import GrammarCompileError, UnsupportedSchemaError
from grammars.pool import PooledBackend
from grammars.schema import schema_findings, warn_ignored_keywords

#: the members "auto" chooses among, in order of preference
AUTO_MEMBERS: tuple[str, ...] = ("llguidance", "xgrammar", "outlines")


class AutoBackend(PooledBackend[CompiledGrammar]):
    """Chooses a member backend per spec (implements :class:`grammars.base.GrammarBackend`).

    Args:
        make_member: builds the member backend of a name (``strict_schema`` is passed through); called
            once per member, on first use.
        members: member names in order of preference.
        strict_schema: only members that enforce the whole schema are candidates.

    Raises:
        ValueError: ``members`` is empty.
    """

    name = "auto"

    def __init__(
        self,
        make_member: Callable[[str], GrammarBackend],
        members: Sequence[str] = AUTO_MEMBERS,
        *,
        strict_schema: bool = False,
        max_workers: int = 2,
        cache_size: int = 256,
    ):
        if not members:
            raise ValueError("members must not be empty")
        super().__init__(max_workers, cache_size)
        self.members = tuple(members)
        self.strict_schema = strict_schema
        self._make_member = make_member
        self._built: dict[str, GrammarBackend] = {}
        #: (spec, complete) -> ranked candidates; complete: every member was asked (LRU-bounded)
        self._choices: OrderedDict[tuple[GrammarSpec, bool], list[tuple[str, list[str]]]] = OrderedDict()
        self._refusals: OrderedDict[GrammarSpec, dict[str, str]] = OrderedDict()
        self._max_choices = 4 * cache_size
        self._lock = threading.Lock()

    def member(self, name: str) -> GrammarBackend:
        """The member backend ``name``, built on first use."""
        with self._lock:
            backend = self._built.get(name)
            if backend is None:
                backend = self._built[name] = self._make_member(name)
            return backend

    @property
    def fingerprint(self) -> str:
        return str(self.member(self.members[0]).fingerprint)

    def _findings(self, name: str, spec: GrammarSpec) -> list[str]:
        if name == "outlines":
            return schema_findings(json.loads(spec.value), False)
        backend = self.member(name)
        return list(backend.schema_findings(spec))

    def candidates(self, spec: GrammarSpec, complete: bool = False) -> list[tuple[str, list[str]]]:
        """The members to try for ``spec``, best first, each with what it would not enforce (cached).

        Members are asked in order of preference and, unless ``complete``, the asking stops at the first
        one that enforces everything (no later member can rank above it): the list is then that member
        and the ones before it that took the spec.

        Raises:
            GrammarCompileError: no member takes the spec (each member's reason given).
        """
        with self._lock:
            cached = self._choices.get((spec, True))
            if cached is None and not complete:
                cached = self._choices.get((spec, False))
        if cached is not None:
            return cached
        ranked: list[tuple[int, int, str, list[str]]] = []
        refusals: dict[str, str] = {}
        stopped = False
        for order, name in enumerate(self.members):
            if spec.kind != "json_schema":
                ranked.append((0, order, name, []))
                continue
            try:
                found = self._findings(name, spec)
            except GrammarCompileError as e:
                refusals[name] = str(e)
                continue
            if self.strict_schema and found:
                refusals[name] = f"does not enforce {'; '.join(found)}"
                continue
            ranked.append((len(found), order, name, found))
            if not found and not complete and order < len(self.members) - 1:
                stopped = True
                break
        if not ranked:
            raise _none_compiles(refusals, strict=self.strict_schema)
        chosen = [(name, found) for _, _, name, found in sorted(ranked)]
        with self._lock:
            self._choices[(spec, not stopped)] = chosen
            self._refusals[spec] = refusals
            for table in (self._choices, self._refusals):
                while len(table) > self._max_choices:
                    table.popitem(last=False)
        return chosen

    def check_schema(self, schema: dict[str, Any] | bool, strict: bool) -> list[str]:
        """What the chosen member would not enforce of ``schema``: warned about, raised when ``strict``.

        Raises:
            GrammarCompileError: no member takes the schema.
            UnsupportedSchemaError: ``strict`` and the best member does not enforce all of it.
        """
        spec = GrammarSpec.json_schema(schema if isinstance(schema, dict) else json.dumps(schema))
        name, found = self.candidates(spec)[0]
        return warn_ignored_keywords(found, f"{name} (the best grammar backend for this schema)", strict)

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        tried: dict[str, str] = {}
        for complete in (False, True):
            candidates = self.candidates(spec, complete)  # records the members that refused the spec
            for name, _ in candidates:
                if name in tried:
                    continue
                try:
                    return self.member(name).compile(spec)
                except GrammarCompileError as e:
                    tried[name] = f"{type(e).__name__}: {e}"
        reasons = dict(self._refusals.get(spec, {}))
        reasons.update(tried)
        raise _none_compiles(reasons, strict=self.strict_schema)

    def close(self) -> None:
        super().close()
        with self._lock:
            built = list(self._built.values())
        for backend in built:
            close = getattr(backend, "close", None)
            if close is not None:
                close()


def _none_compiles(reasons: dict[str, str], strict: bool) -> GrammarCompileError:
    detail = "; ".join(f"{name}: {why}" for name, why in reasons.items())
    message = f"no grammar backend compiles this spec ({detail})"
    if strict:
        return UnsupportedSchemaError(message, list(reasons.values()))
    return GrammarCompileError(message)
