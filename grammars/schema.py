"""What outlines-core does with a JSON schema, so that nobody trusts a grammar for more than it checks.

outlines-core (0.2.x, ``build_regex_from_schema``) turns a schema into one regular expression by
looking at **one** keyword per schema object, the first present in this order: ``properties``,
``allOf``, ``anyOf``, ``oneOf``, ``prefixItems``, ``enum``, ``const``, ``$ref``, ``type`` (an empty
schema means any JSON value); every other keyword of that object is dropped. Within ``type`` it honours
``minLength``/``maxLength`` (else ``pattern``, else ``format``) for strings, ``items``/``minItems``/
``maxItems`` for arrays, ``additionalProperties``/``minProperties`` for objects without ``properties``,
and nothing for numbers. A regex cannot count, compare numbers or look at two places at once, so
whatever was dropped is simply not enforced. Each claim in :data:`IGNORED_KEYWORDS` is verified by
``tests/test_grammar_schema.py``: an instance violating the keyword is accepted by the compiled grammar
token by token while ``jsonschema`` rejects it.

Three kinds of departure:

1. **Ignored** (:func:`find_ignored_keywords`; the grammar is *looser* than the schema, so constrained
   output can still be invalid): numeric bounds (``minimum``, ``maximum``, ``exclusiveMinimum``,
   ``exclusiveMaximum``, ``multipleOf``), ``maxProperties``, ``minProperties`` above 1 (enforced as
   "non-empty"), ``uniqueItems``, ``contains``/
   ``minContains``/``maxContains``, ``patternProperties``, ``propertyNames``, ``dependentRequired``/
   ``dependentSchemas``/``dependencies``, ``not``, ``if``/``then``/``else``, ``unevaluatedItems``,
   ``$dynamicRef``/``$recursiveRef``, ``required`` names absent from ``properties``, ``oneOf``
   exclusivity, any constraint beside the keyword outlines dispatched on (``type`` next to ``enum``,
   ``pattern`` next to ``maxLength``, siblings of ``$ref`` in drafts where they apply, ...).
   :func:`check_schema` raises :class:`UnsupportedSchemaError` for them in strict mode, else warns;
   the backend records them on the compiled grammar (``ignored_keywords``) without warning.
2. **Miscompiled** (always an error): ``allOf`` with two or more subschemas, which outlines-core
   compiles as the *concatenation* of the subschemas' regexes (``{"a":1}{"b":2}``), never valid JSON;
   ``properties`` beside a ``type`` that excludes objects (``{"type": "array", "items": ...,
   "properties": {}}``: outlines-core emits an object), ``prefixItems`` beside a ``type`` that
   excludes arrays, and a recursive ``$ref``, which outlines-core unrolls three levels deep and can end
   with a dangling comma (``{"v": 0, }``, issue 20): llguidance and xgrammar keep recursion a rule.
3. **Narrower** than the schema (documented, not reported; output stays valid but some valid
   documents cannot be produced): objects are closed (``additionalProperties`` next to ``properties``
   is ignored, absent means forbidden) and their properties come in schema order; ``prefixItems``
   arrays have exactly that many items; ``pattern`` must match the whole string; strings cannot use
   ``\\uXXXX`` escapes nor hold raw U+007F-U+009F; numbers need a signed exponent (``1e+5``, not
   ``1e5``); integers cannot be written ``1.0``; the ``format`` regexes (``uri``, ``email``, ...)
   cover a subset of the RFCs; whitespace follows the grammar's pattern.

Schemas outlines-core cannot compile at all (``not`` alone, unsupported ``format``, external
``$ref``, draft-4 tuple ``items``, boolean subschemas, a constraint without ``type`` such as
``{"minLength": 3}``) raise :class:`GrammarCompileError` from the backend with outlines-core's message.
The backend first rewrites "any value" subschemas (:func:`normalize_schema`), which outlines-core
compiles wrongly or not at all.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from grammars.errors import GrammarCompileError, UnsupportedSchemaError

#: keyword -> what outlines-core fails to enforce (reason text of the findings)
IGNORED_KEYWORDS: dict[str, str] = {
    "minimum": "numeric bounds are not enforced",
    "maximum": "numeric bounds are not enforced",
    "exclusiveMinimum": "numeric bounds are not enforced",
    "exclusiveMaximum": "numeric bounds are not enforced",
    "multipleOf": "multipleOf is not enforced",
    "maxProperties": "the number of properties is not bounded",
    "minProperties": "minProperties is not enforced next to properties (elsewhere only as non-empty)",
    "uniqueItems": "array items may repeat",
    "contains": "contains is not enforced",
    "minContains": "contains is not enforced",
    "maxContains": "contains is not enforced",
    "patternProperties": "property values are not checked by name pattern",
    "propertyNames": "property names are not checked",
    "dependentRequired": "dependent requirements are not enforced",
    "dependentSchemas": "dependent schemas are not enforced",
    "dependencies": "dependencies are not enforced",
    "not": "not is not enforced",
    "if": "conditional subschemas are not enforced",
    "then": "conditional subschemas are not enforced",
    "else": "conditional subschemas are not enforced",
    "unevaluatedItems": "unevaluatedItems is not enforced",
    "unevaluatedProperties": "unevaluatedProperties is not enforced",
    "$dynamicRef": "dynamic references are not followed",
    "$recursiveRef": "recursive references are not followed",
    "required": "a required property missing from properties is not required",
    "oneOf": "oneOf is compiled as anyOf: a value matching several branches is accepted",
    "minItems": "minItems is not enforced next to prefixItems",
    "maxItems": "maxItems is not enforced next to prefixItems",
}

#: keywords that constrain instances (everything else is an annotation both sides ignore)
CONSTRAINT_KEYWORDS = frozenset(
    {
        "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
        "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "maxItems", "minItems",
        "uniqueItems", "maxContains", "minContains", "contains", "maxProperties", "minProperties",
        "required", "dependentRequired", "dependencies", "properties", "patternProperties",
        "additionalProperties", "propertyNames", "items", "prefixItems", "additionalItems",
        "unevaluatedItems", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "not", "if", "then",
        "else", "dependentSchemas", "$ref", "$dynamicRef", "$recursiveRef",
    }
)  # fmt: skip

# The keyword outlines-core dispatches on, in its order of precedence (``type`` last).
_DISPATCH_ORDER = ("properties", "allOf", "anyOf", "oneOf", "prefixItems", "enum", "const", "$ref")
_NEVER_ENFORCED = ("not", "if", "then", "else", "$dynamicRef", "$recursiveRef")
_NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_OBJECT_IGNORED = (
    "patternProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
)  # fmt: skip
_MODERN_DRAFT_PREFIXES = ("https://json-schema.org/draft/2019-09", "https://json-schema.org/draft/2020-12")


@dataclass(frozen=True)
class SchemaFinding:
    """One keyword outlines-core does not enforce (or miscompiles), where, and why."""

    keyword: str
    pointer: str
    reason: str

    def __str__(self) -> str:
        return f"{self.keyword} at {self.pointer} ({self.reason})"


def _escape_pointer(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _resolve_local(root: Any, ref: str) -> tuple[str, Any] | None:
    """(pointer, subschema) of a local ``#/...`` reference (or ``<root $id>#/...``), else None."""
    base, _, fragment = ref.partition("#")
    root_id = root.get("$id") if isinstance(root, dict) else None
    if base and base != root_id:
        return None
    node = root
    for raw in (p for p in fragment.split("/") if p):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return "#" + fragment, node


class _Walker:
    """Walks the parts of a schema outlines-core compiles, mirroring its dispatch."""

    def __init__(self, root: dict[str, Any]):
        self.root = root
        self.ignored: list[SchemaFinding] = []
        self.miscompiled: list[SchemaFinding] = []
        self.visited_refs: set[str] = set()
        schema_uri = str(root.get("$schema", ""))
        self.siblings_of_ref_apply = not schema_uri or schema_uri.startswith(_MODERN_DRAFT_PREFIXES)
        self._validators: dict[int, Any] = {}

    def flag(self, keyword: str, pointer: str, reason: str | None = None) -> None:
        self.ignored.append(SchemaFinding(keyword, pointer, reason or IGNORED_KEYWORDS[keyword]))

    def miscompile(self, keyword: str, pointer: str, why: str, emits: str) -> None:
        reason = f"{why}, but outlines-core compiles {keyword!r} first and emits {emits}: never valid"
        self.miscompiled.append(SchemaFinding(keyword, pointer, reason))

    def flag_siblings(self, node: dict[str, Any], pointer: str, dispatched: str, keep: set[str]) -> None:
        for k in node:
            if k in CONSTRAINT_KEYWORDS and k != dispatched and k not in keep and k not in _NEVER_ENFORCED:
                self.flag(k, pointer, f"dropped: outlines-core compiles only {dispatched!r} in this object")

    def value_valid(self, value: Any, node: dict[str, Any]) -> bool:
        """Whether ``value`` satisfies ``node`` (refs resolved against the root)."""
        from jsonschema import validators

        validator = validators.validator_for(self.root)(self.root)
        return bool(validator.evolve(schema=node).is_valid(value))

    def walk(self, node: Any, pointer: str, ref_stack: tuple[str, ...] = ()) -> None:
        if not isinstance(node, dict) or not node:
            return  # booleans: outlines-core raises on them itself; {} is any value
        for k in _NEVER_ENFORCED:
            if k in node:
                self.flag(k, pointer)
        dispatched = next((k for k in _DISPATCH_ORDER if k in node), "type" if "type" in node else None)
        if dispatched == "properties":
            self.walk_properties(node, pointer, ref_stack)
        elif dispatched in ("allOf", "anyOf", "oneOf"):
            subs = node[dispatched] if isinstance(node[dispatched], list) else []
            if dispatched == "allOf" and len(subs) >= 2:
                self.miscompiled.append(
                    SchemaFinding(
                        "allOf",
                        pointer,
                        "outlines-core concatenates the subschemas' regexes: never valid JSON",
                    )
                )
            if dispatched == "oneOf" and len(subs) >= 2 and not _pairwise_disjoint(subs):
                self.flag("oneOf", pointer)
            self.flag_siblings(node, pointer, dispatched, {"type"} if _types_cover(node, subs) else set())
            for i, sub in enumerate(subs):
                self.walk(sub, f"{pointer}/{dispatched}/{i}", ref_stack)
        elif dispatched == "prefixItems":
            subs = node["prefixItems"] if isinstance(node["prefixItems"], list) else []
            types = _type_set(node)
            if types is not None and "array" not in types:
                self.miscompile("prefixItems", pointer, f"type {sorted(types)} excludes arrays", "an array")
                return
            keep = {"type", "items", "additionalItems", "unevaluatedItems"}
            if isinstance(node.get("minItems"), int) and node["minItems"] > len(subs):
                self.flag("minItems", pointer)
            if isinstance(node.get("maxItems"), int) and node["maxItems"] < len(subs):
                self.flag("maxItems", pointer)
            if node.get("uniqueItems") is True:
                self.flag("uniqueItems", pointer)
            self.flag_siblings(node, pointer, "prefixItems", keep | {"minItems", "maxItems", "uniqueItems"})
            for i, sub in enumerate(subs):
                self.walk(sub, f"{pointer}/prefixItems/{i}", ref_stack)
        elif dispatched in ("enum", "const"):
            values = node["enum"] if dispatched == "enum" else [node["const"]]
            if isinstance(values, list) and not all(self.value_valid(v, node) for v in values):
                self.flag_siblings(node, pointer, dispatched, set())
        elif dispatched == "$ref":
            if self.siblings_of_ref_apply:
                self.flag_siblings(node, pointer, "$ref", set())
            self.walk_ref(node["$ref"], pointer, ref_stack)
        elif dispatched == "type":
            self.walk_type(node, pointer, ref_stack)

    def walk_ref(self, ref: Any, pointer: str, ref_stack: tuple[str, ...]) -> None:
        resolved = _resolve_local(self.root, ref) if isinstance(ref, str) else None
        if resolved is None:
            return  # outlines-core raises on external or broken references itself
        target_pointer, target = resolved
        if target_pointer in ref_stack:
            # issue 20: the unrolled recursion can end in a dangling comma ({"v": 0, }): refused, not
            # truncated (llguidance and xgrammar keep recursion a grammar rule)
            self.miscompiled.append(
                SchemaFinding(
                    "$ref",
                    pointer,
                    "a recursive $ref, which outlines-core unrolls three levels deep and can end with a "
                    "dangling comma (invalid JSON)",
                )
            )
            return
        if target_pointer in self.visited_refs:
            return
        self.visited_refs.add(target_pointer)
        self.walk(target, target_pointer, (*ref_stack, target_pointer))

    def walk_properties(self, node: dict[str, Any], pointer: str, ref_stack: tuple[str, ...]) -> None:
        props = node["properties"] if isinstance(node["properties"], dict) else {}
        keep = {"required", "additionalProperties", "unevaluatedProperties", "minProperties", "maxProperties"}
        types = _type_set(node)
        if types is not None and "object" not in types:
            self.miscompile("properties", pointer, f"type {sorted(types)} excludes objects", "an object")
            return
        keep.add("type")
        self.flag_siblings(node, pointer, "properties", keep | set(_OBJECT_IGNORED))
        for k in _OBJECT_IGNORED:
            if k in node:
                self.flag(k, pointer)
        required: list[Any] = node["required"] if isinstance(node.get("required"), list) else []
        missing = [r for r in required if r not in props]
        if missing:
            self.flag("required", pointer, f"required {missing} not in properties: not required")
        present = [r for r in required if r in props]
        if isinstance(node.get("minProperties"), int) and node["minProperties"] > len(present):
            self.flag("minProperties", pointer)
        if isinstance(node.get("maxProperties"), int) and node["maxProperties"] < len(props):
            self.flag("maxProperties", pointer)
        for name, sub in props.items():
            self.walk(sub, f"{pointer}/properties/{_escape_pointer(name)}", ref_stack)

    def walk_type(self, node: dict[str, Any], pointer: str, ref_stack: tuple[str, ...]) -> None:
        types = _type_set(node) or set()
        if "string" in types:
            if "minLength" in node or "maxLength" in node:
                for k in ("pattern", "format"):
                    if k in node:
                        self.flag(
                            k, pointer, f"dropped: outlines-core honours only minLength/maxLength, not {k}"
                        )
            elif "pattern" in node and "format" in node:
                self.flag("format", pointer, "dropped: outlines-core honours pattern, not format")
        if types & {"number", "integer"}:
            for k in _NUMERIC:
                if k in node and not isinstance(node[k], bool):
                    self.flag(k, pointer)
        if "array" in types:
            if node.get("uniqueItems") is True:
                self.flag("uniqueItems", pointer)
            for k in ("contains", "minContains", "maxContains"):
                if k in node:
                    self.flag(k, pointer)
            if "unevaluatedItems" in node and node["unevaluatedItems"] is not True and "items" not in node:
                self.flag("unevaluatedItems", pointer)
            if isinstance(node.get("items"), dict):
                self.walk(node["items"], f"{pointer}/items", ref_stack)
        if "object" in types:
            for k in _OBJECT_IGNORED:
                if k in node:
                    self.flag(k, pointer)
            if isinstance(node.get("maxProperties"), int) and node["maxProperties"] > 0:
                self.flag("maxProperties", pointer)
            if isinstance(node.get("minProperties"), int) and node["minProperties"] > 1:
                self.flag("minProperties", pointer, "minProperties > 1 is enforced as 1 (non-empty)")
            required = node.get("required")
            if isinstance(required, list) and required:
                self.flag("required", pointer, f"required {required} without properties: not required")
            uneval = node.get("unevaluatedProperties")
            if uneval is not None and uneval is not True and node.get("additionalProperties") is None:
                self.flag("unevaluatedProperties", pointer)
            if isinstance(node.get("additionalProperties"), dict):
                self.walk(node["additionalProperties"], f"{pointer}/additionalProperties", ref_stack)


def _type_set(node: dict[str, Any]) -> set[str] | None:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    return None


def _types_cover(node: dict[str, Any], subs: list[Any]) -> bool:
    """Whether a ``type`` beside a combinator is implied by every branch (so dropping it loses nothing)."""
    outer = _type_set(node)
    if outer is None:
        return True
    if "number" in outer:
        outer = outer | {"integer"}
    for sub in subs:
        inner = _type_set(sub) if isinstance(sub, dict) else None
        if inner is None and isinstance(sub, dict) and "properties" in sub:
            inner = {"object"}
        if inner is None or not inner <= outer:
            return False
    return True


def _pairwise_disjoint(subs: list[Any]) -> bool:
    """Whether oneOf branches cannot overlap: explicit, pairwise disjoint ``type`` sets, or consts."""
    sets = []
    for sub in subs:
        if isinstance(sub, dict) and "const" in sub and len(sub) == 1:
            sets.append({"const:" + json.dumps(sub["const"], sort_keys=True)})
            continue
        types = _type_set(sub) if isinstance(sub, dict) else None
        if types is None:
            return False
        if "number" in types:
            types = types | {"integer"}
        sets.append(types)
    return all(not (a & b) for i, a in enumerate(sets) for b in sets[i + 1 :])


def find_ignored_keywords(schema: dict[str, Any]) -> tuple[list[SchemaFinding], list[SchemaFinding]]:
    """Walk the parts of ``schema`` outlines-core compiles (root, subschemas, local ``$ref`` targets).

    Returns:
        ``(ignored, miscompiled)`` findings (module docstring), in walk order.
    """
    walker = _Walker(schema)
    walker.walk(schema, "#")
    return walker.ignored, walker.miscompiled


#: ``{}`` spelled so that outlines-core compiles it correctly (the union of the JSON types, as its own
#: expansion of ``{}`` does, but parenthesised by ``anyOf``)
ANY_VALUE_SCHEMA: dict[str, Any] = {
    "anyOf": [{"type": t} for t in ("boolean", "null", "number", "string", "array", "object")]
}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_VALUES = (
    "items", "additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if", "then",
    "else", "unevaluatedProperties", "unevaluatedItems",
)  # fmt: skip


def normalize_schema(schema: Any) -> Any:
    r"""A copy of ``schema`` in which every schema that constrains nothing (``{}``, or annotations only,
    such as ``{"description": "..."}``) becomes :data:`ANY_VALUE_SCHEMA` (annotations kept).

    Both mean "any JSON value", but outlines-core 0.2.14 mishandles them: it expands ``{}`` into an
    alternation of the JSON types *without parentheses*, so inside an object the ``|`` splits the whole
    regex (``{"foo": {}}`` compiles to ``\{"foo":(true|false)|(null)|...``, which accepts the unclosed
    ``{"foo":true`` as complete), and it rejects annotation-only schemas as unsupported. Keyword
    positions and JSON pointers are unchanged, so ``$ref`` s still resolve.
    """
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: normalize_schema(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [normalize_schema(sub) for sub in value]
        elif key in _SCHEMA_VALUES and isinstance(value, dict):
            out[key] = normalize_schema(value)
        else:
            out[key] = value
    if not any(key in CONSTRAINT_KEYWORDS for key in out):
        out = {**ANY_VALUE_SCHEMA, **out}
    return out


_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("grammars_schema_quiet", default=False)


@contextlib.contextmanager
def quiet_schema_warnings() -> Iterator[None]:
    """Within this block (this thread or task only), :func:`check_schema` does not warn: for a caller that
    has already checked, and warned about, the same request (``LLM.generate`` validates every request
    before the engine's ``add_request`` validates it again). Errors are raised as always."""
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)


def check_schema(schema: dict[str, Any] | bool, strict: bool) -> list[str]:
    """Check ``schema`` before compiling it with outlines-core.

    Args:
        schema: a JSON schema (a dict; the boolean schemas ``true``/``false`` are valid JSON Schema but
            outlines-core does not compile them: :class:`GrammarCompileError`, use ``{}`` for any value).
        strict: raise on ignored keywords instead of warning.

    Returns:
        the ignored keywords, each as ``"<keyword> at <JSON pointer> (<what is not enforced>)"``; empty
        when outlines-core enforces the whole schema (up to the narrowings in the module docstring).

    Raises:
        GrammarCompileError: ``schema`` is not a valid JSON schema for its draft (``jsonschema``'s
            meta-schema check), or is a boolean.
        UnsupportedSchemaError: a miscompiled construct (always), or ignored keywords when ``strict``.

    Warns:
        UserWarning: ignored keywords when not ``strict`` (one warning listing them all), except inside
            :func:`quiet_schema_warnings`.
    """
    return warn_ignored_keywords(schema_findings(schema, strict), "outlines-core", strict, stacklevel=3)


def warn_ignored_keywords(found: list[str], engine: str, strict: bool, stacklevel: int = 3) -> list[str]:
    """Report what ``engine`` does not enforce of a schema: ``found`` is returned; when ``strict`` a
    non-empty ``found`` raises, else it is warned about (one warning listing them all; none inside
    :func:`quiet_schema_warnings`).

    Raises:
        UnsupportedSchemaError: ``strict`` and ``found`` is not empty.
    """
    if not found:
        return found
    if strict:
        raise UnsupportedSchemaError(
            f"{engine} does not enforce {len(found)} schema keyword(s) (strict=True): {'; '.join(found)}",
            found,
        )
    if not _QUIET.get():
        warnings.warn(
            f"{engine} does not enforce {len(found)} schema keyword(s); constrained output may violate "
            f"the schema: {'; '.join(found)}",
            UserWarning,
            stacklevel=stacklevel,
        )
    return found


def require_valid_object_schema(schema: Any, engine: str) -> None:
    """Raise unless ``schema`` is a JSON-object schema valid for its draft (``jsonschema``'s check).

    Raises:
        GrammarCompileError: a boolean or non-object schema (``engine`` named), or an invalid one.
    """
    from jsonschema import exceptions, validators

    if not isinstance(schema, dict):
        raise GrammarCompileError(
            f"{engine} compiles JSON-object schemas only, got {json.dumps(schema)[:80]} "
            "(use {} for any value)"
        )
    try:
        validators.validator_for(schema).check_schema(schema)
    except exceptions.SchemaError as e:
        raise GrammarCompileError(
            f"not a valid JSON schema: {e.message} at {list(e.absolute_path)}"
        ) from None


def schema_findings(schema: dict[str, Any] | bool, strict: bool) -> list[str]:
    """:func:`check_schema` without the warning (what the backend records on a compiled grammar)."""
    require_valid_object_schema(schema, "outlines-core")
    ignored, miscompiled = find_ignored_keywords(schema)
    if miscompiled:
        names = [str(f) for f in miscompiled]
        raise UnsupportedSchemaError(f"outlines-core compiles this schema wrongly: {'; '.join(names)}", names)
    found = [str(f) for f in ignored]
    if found and strict:
        raise UnsupportedSchemaError(
            f"outlines-core does not enforce these keywords (strict mode): {'; '.join(found)}", found
        )
    return found


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def validate_instance(text: str, schema: dict[str, Any] | bool) -> bool | None:
    """Whether ``text`` is one JSON document valid against ``schema``.

    Parsing is strict JSON (``NaN``/``Infinity`` rejected; duplicate keys keep the last, as Python's
    ``json`` does); validation uses ``jsonschema`` with the validator of the schema's ``$schema`` draft
    (2020-12 when absent) and its defaults, so ``format`` is an annotation, not checked.

    Returns:
        False when ``text`` does not parse, True/False from the validator otherwise, None when the
        schema cannot be evaluated (a reference ``jsonschema`` cannot resolve, e.g. a remote ``$ref``:
        nothing is fetched).
    """
    from jsonschema import validators
    from referencing.exceptions import Unresolvable

    try:
        instance = json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return False
    if isinstance(schema, bool):
        return schema
    validator = validators.validator_for(schema)(schema)
    try:
        return bool(validator.is_valid(instance))
    except Unresolvable:
        return None
