"""What xgrammar (0.2.x) does not enforce of a JSON schema: a walker mirroring its converter's dispatch
(:func:`xgrammar_schema_findings`), each claim verified in ``tests/test_grammar_xgrammar.py`` by
compiling a schema with the keyword and walking an instance that violates it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from grammars.schema import (
    CONSTRAINT_KEYWORDS,
    SchemaFinding,
    _escape_pointer,
    _pairwise_disjoint,
    _resolve_local,
    _type_set,
    _types_cover,
    require_valid_object_schema,
)
from grammars.xgrammar_ebnf import xgrammar_regex

#: keyword -> what xgrammar (0.2.x) fails to enforce (reason text of the findings)
XGRAMMAR_IGNORED: dict[str, str] = {
    "multipleOf": "multipleOf is not enforced here (xgrammar enforces it for integers only: an integer "
    "divisor <= 1024, unbounded or with both bounds at most 10000 apart)",
    "minLength": "minLength/maxLength are not enforced next to pattern or a known format",
    "maxLength": "minLength/maxLength are not enforced next to pattern or a known format",
    "pattern": "pattern is not enforced next to a known format",
    "uniqueItems": "array items may repeat",
    "contains": "contains is not enforced",
    "minContains": "contains is not enforced",
    "maxContains": "contains is not enforced",
    "patternProperties": "a property matching a pattern is checked against its own schema only",
    "dependentRequired": "dependent requirements are not enforced",
    "dependentSchemas": "dependent schemas are not enforced",
    "dependencies": "dependencies are not enforced",
    "unevaluatedProperties": "unevaluatedProperties is not enforced",
    "not": "not is not enforced",
    "if": "conditional subschemas are not enforced",
    "then": "conditional subschemas are not enforced",
    "else": "conditional subschemas are not enforced",
    "$dynamicRef": "dynamic references are not followed",
    "$recursiveRef": "recursive references are not followed",
    "$ref": "only '#' and '#/...' references are followed; this one is compiled as any value",
    "required": "a required property missing from properties is not required",
    "oneOf": "oneOf is compiled as anyOf: a value matching several branches is accepted",
    "allOf": "allOf with several subschemas is compiled as any value",
}

# xgrammar's dispatch: the first of these present decides how a schema object is compiled
_DISPATCH_ORDER = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
_NEVER_ENFORCED = ("not", "if", "then", "else", "$dynamicRef", "$recursiveRef")
_OBJECT_KEYS = ("properties", "additionalProperties", "unevaluatedProperties")
_ARRAY_KEYS = ("items", "prefixItems", "unevaluatedItems")
_KNOWN_FORMATS = frozenset(
    {
        "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
        "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip
_MODERN_DRAFT_PREFIXES = ("https://json-schema.org/draft/2019-09", "https://json-schema.org/draft/2020-12")
_SUBSCHEMA_VALUES = (
    "items", "additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if", "then",
    "else", "unevaluatedProperties", "unevaluatedItems",
)  # fmt: skip
_INT_MULTIPLE_MAX = 1024
_INT_MULTIPLE_RANGE_MAX = 10_000
# the keywords each JSON type uses (a schema object without "type" that xgrammar compiles as any value
# enforces none of them)
_TYPE_KEYWORDS = frozenset(
    {
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
        "maxLength", "pattern", "minItems", "maxItems", "uniqueItems", "contains",
        "minContains", "maxContains", "required", "minProperties", "maxProperties", "patternProperties",
        "propertyNames", "dependentRequired", "dependentSchemas", "dependencies", "additionalItems",
    }
)  # fmt: skip


# ------------------------------------------------------------------------------------------ schemas
class _XGrammarSchemaWalker:
    """Walks a schema the way xgrammar's converter dispatches it (one keyword per schema object, in the
    order ``$ref``, ``const``, ``enum``, ``anyOf``, ``oneOf``, ``allOf``, ``type``, then the object
    keywords, then the array keywords, else any value) and flags what it does not enforce."""

    def __init__(self, root: dict[str, Any]):
        self.root = root
        self.ignored: list[SchemaFinding] = []
        self.visited_refs: set[str] = set()
        schema_uri = str(root.get("$schema", ""))
        self.siblings_of_ref_apply = not schema_uri or schema_uri.startswith(_MODERN_DRAFT_PREFIXES)

    def flag(self, keyword: str, pointer: str, reason: str | None = None) -> None:
        self.ignored.append(SchemaFinding(keyword, pointer, reason or XGRAMMAR_IGNORED[keyword]))

    def flag_siblings(self, node: dict[str, Any], pointer: str, dispatched: str, keep: set[str]) -> None:
        for k in node:
            if k in CONSTRAINT_KEYWORDS and k != dispatched and k not in keep and k not in _NEVER_ENFORCED:
                self.flag(k, pointer, f"dropped: xgrammar compiles only {dispatched!r} in this object")

    def flag_dropped(self, node: Any, pointer: str) -> None:
        """Flag every constraint keyword of ``node`` and its subschemas (``$ref`` s not followed):
        the part of a schema xgrammar compiles as any value."""
        if not isinstance(node, dict):
            return
        reason = "dropped: inside an allOf of several subschemas, which xgrammar compiles as any value"
        for k, value in node.items():
            if k in CONSTRAINT_KEYWORDS:
                self.flag(k, pointer, reason)
            if k in ("properties", "patternProperties", "dependentSchemas") and isinstance(value, dict):
                for name, sub in value.items():
                    self.flag_dropped(sub, f"{pointer}/{k}/{_escape_pointer(name)}")
            elif k in ("allOf", "anyOf", "oneOf", "prefixItems", "items") and isinstance(value, list):
                for i, sub in enumerate(value):
                    self.flag_dropped(sub, f"{pointer}/{k}/{i}")
            elif k in _SUBSCHEMA_VALUES and isinstance(value, dict):
                self.flag_dropped(value, f"{pointer}/{k}")

    def value_valid(self, value: Any, node: dict[str, Any]) -> bool:
        from jsonschema import validators

        validator = validators.validator_for(self.root)(self.root)
        return bool(validator.evolve(schema=node).is_valid(value))

    def walk(self, node: Any, pointer: str) -> None:
        if not isinstance(node, dict) or not node:
            return  # true/{} is any value; false is refused by xgrammar itself
        for k in _NEVER_ENFORCED:
            if k in node:
                self.flag(k, pointer)
        dispatched = next((k for k in _DISPATCH_ORDER if k in node), None)
        if dispatched == "$ref":
            if self.siblings_of_ref_apply:
                self.flag_siblings(node, pointer, "$ref", set())
            self.walk_ref(node["$ref"], pointer)
        elif dispatched in ("const", "enum"):
            values = node["enum"] if dispatched == "enum" else [node["const"]]
            if isinstance(values, list) and not all(self.value_valid(v, node) for v in values):
                self.flag_siblings(node, pointer, dispatched, set())
        elif dispatched in ("anyOf", "oneOf", "allOf"):
            subs = node[dispatched] if isinstance(node[dispatched], list) else []
            if dispatched == "allOf" and len(subs) >= 2:
                # any value: the siblings and every constraint of the subschemas are dropped (one finding
                # each, so that a backend comparison by findings sees how much is lost)
                self.flag("allOf", pointer)
                self.flag_siblings(node, pointer, "allOf", set())
                for i, sub in enumerate(subs):
                    self.flag_dropped(sub, f"{pointer}/allOf/{i}")
                return
            if dispatched == "oneOf" and len(subs) >= 2 and not _one_of_disjoint(subs):
                self.flag("oneOf", pointer)
            self.flag_siblings(node, pointer, dispatched, {"type"} if _types_cover(node, subs) else set())
            for i, sub in enumerate(subs):
                self.walk(sub, f"{pointer}/{dispatched}/{i}")
        elif "type" in node:
            types = _type_set(node) or set()
            self.walk_typed(node, pointer, types)
        elif any(k in node for k in _OBJECT_KEYS):
            self.walk_typed(node, pointer, {"object"})
        elif any(k in node for k in _ARRAY_KEYS):
            self.walk_typed(node, pointer, {"array"})
        else:  # any value: a constraint without a type is not enforced
            for k in node:
                if k in _TYPE_KEYWORDS:
                    self.flag(k, pointer, "dropped: xgrammar compiles a schema without type as any value")

    def walk_ref(self, ref: Any, pointer: str) -> None:
        if not isinstance(ref, str):
            return
        if ref != "#" and not ref.startswith("#/"):
            self.flag("$ref", pointer)
            return
        resolved = _resolve_local(self.root, ref)
        if resolved is None:
            return  # xgrammar refuses a reference it cannot find
        target_pointer, target = resolved
        if target_pointer in self.visited_refs:
            return  # recursion is a grammar rule: enforced at any depth
        self.visited_refs.add(target_pointer)
        self.walk(target, target_pointer)

    def walk_typed(self, node: dict[str, Any], pointer: str, types: set[str]) -> None:
        if types & {"integer", "number"}:
            self.walk_numeric(node, pointer, types)
        if "string" in types:
            known_format = node.get("format") in _KNOWN_FORMATS
            if known_format or "pattern" in node:
                for k in ("minLength", "maxLength"):
                    if k in node:
                        self.flag(k, pointer)
            if known_format and "pattern" in node:
                self.flag("pattern", pointer)
            if not known_format and isinstance(node.get("pattern"), str):
                xgrammar_regex(node["pattern"], full_match_spec=False)
        if "array" in types:
            if node.get("uniqueItems") is True:
                self.flag("uniqueItems", pointer)
            if "contains" in node:
                self.flag("contains", pointer)
            for k in ("minContains", "maxContains"):
                if k in node and "contains" in node:
                    self.flag(k, pointer)
            for i, sub in enumerate(node.get("prefixItems") or []):
                self.walk(sub, f"{pointer}/prefixItems/{i}")
            if isinstance(node.get("items"), dict):
                self.walk(node["items"], f"{pointer}/items")
            elif "items" not in node and isinstance(node.get("unevaluatedItems"), dict):
                self.walk(node["unevaluatedItems"], f"{pointer}/unevaluatedItems")
        if "object" in types:
            self.walk_object(node, pointer)

    def walk_numeric(self, node: dict[str, Any], pointer: str, types: set[str]) -> None:
        mult = node.get("multipleOf")
        if mult is None or isinstance(mult, bool):
            return
        if "number" in types or not _integer_multiple_enforced(node):
            self.flag("multipleOf", pointer)

    def walk_object(self, node: dict[str, Any], pointer: str) -> None:
        props = node["properties"] if isinstance(node.get("properties"), dict) else {}
        for k in ("dependentRequired", "dependentSchemas", "dependencies"):
            if k in node:
                self.flag(k, pointer)
        required = node["required"] if isinstance(node.get("required"), list) else []
        missing = [r for r in required if r not in props]
        if missing:
            self.flag("required", pointer, f"required {missing} not in properties: not required")
        uneval = node.get("unevaluatedProperties")
        if uneval is not None and uneval is not True and "additionalProperties" not in node:
            self.flag("unevaluatedProperties", pointer)
        patterns = node.get("patternProperties")
        if isinstance(patterns, dict):
            for pat, sub in patterns.items():
                xgrammar_regex(pat, full_match_spec=False)
                overlapping = [p for p in props if _search(pat, p)]
                if overlapping:
                    self.flag(
                        "patternProperties",
                        pointer,
                        f"properties {overlapping} also match {pat!r}: only their own schema is checked",
                    )
                self.walk(sub, f"{pointer}/patternProperties/{_escape_pointer(pat)}")
        names = node.get("propertyNames")
        if isinstance(names, dict):
            if isinstance(names.get("pattern"), str):
                xgrammar_regex(names["pattern"], full_match_spec=False)
            self.walk({"type": "string", **names}, f"{pointer}/propertyNames")
        for name, sub in props.items():
            self.walk(sub, f"{pointer}/properties/{_escape_pointer(name)}")
        if isinstance(node.get("additionalProperties"), dict):
            self.walk(node["additionalProperties"], f"{pointer}/additionalProperties")


def _search(pattern: str, text: str) -> bool:
    try:
        return re.search(pattern, text) is not None
    except re.error:
        return False


def _integer_multiple_enforced(node: dict[str, Any]) -> bool:
    """Whether xgrammar enforces ``multipleOf`` of an integer schema (its limits, module docstring)."""
    mult = node["multipleOf"]
    if not isinstance(mult, (int, float)) or mult != int(mult) or not 0 < mult <= _INT_MULTIPLE_MAX:
        return False
    lows = [node[k] for k in ("minimum", "exclusiveMinimum") if _is_number(node.get(k))]
    highs = [node[k] for k in ("maximum", "exclusiveMaximum") if _is_number(node.get(k))]
    if not lows and not highs:
        return True
    return bool(lows and highs) and min(highs) - max(lows) <= _INT_MULTIPLE_RANGE_MAX


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _one_of_disjoint(subs: list[Any]) -> bool:
    """Whether oneOf branches cannot overlap (so xgrammar's choice is exact): disjoint types or consts,
    or objects told apart by a required property with disjoint ``const``/``enum`` values."""
    if _pairwise_disjoint(subs):
        return True
    keys: set[str] | None = None
    for sub in subs:
        if not isinstance(sub, dict) or sub.get("type") != "object":
            return False
        props: dict[str, Any] = sub["properties"] if isinstance(sub.get("properties"), dict) else {}
        required: list[Any] = sub["required"] if isinstance(sub.get("required"), list) else []
        finite = {r for r in required if isinstance(props.get(r), dict) and _finite(props[r]) is not None}
        keys = finite if keys is None else keys & finite
    for key in sorted(keys or ()):
        seen: set[str] = set()
        disjoint = True
        for sub in subs:
            values = {json.dumps(v, sort_keys=True) for v in _finite(sub["properties"][key]) or []}
            if values & seen:
                disjoint = False
                break
            seen |= values
        if disjoint:
            return True
    return False


def _finite(node: dict[str, Any]) -> list[Any] | None:
    if "const" in node:
        return [node["const"]]
    if isinstance(node.get("enum"), list):
        return list(node["enum"])
    return None


def xgrammar_schema_findings(schema: Any) -> list[str]:
    """What xgrammar would not enforce of ``schema``, one string per finding (no warning issued).

    Raises:
        GrammarCompileError: not a JSON-object schema, not a valid JSON schema for its draft, or a
            ``pattern`` xgrammar cannot compile faithfully.
    """
    require_valid_object_schema(schema, "xgrammar")
    walker = _XGrammarSchemaWalker(schema)
    walker.walk(schema, "#")
    return [str(f) for f in walker.ignored]
