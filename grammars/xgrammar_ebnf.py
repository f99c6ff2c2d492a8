"""xgrammar's regexes and EBNF, as the xgrammar backend uses them: patterns translated (or refused where
xgrammar would read them differently), string literals, and JSON whitespace restricted to a spec's
``whitespace_pattern``. See :mod:`grammars.xgrammar_backend` for why.
"""

from __future__ import annotations

import re

import xgrammar as xgr

from grammars.errors import GrammarCompileError
from grammars.outlines_backend import DEFAULT_WHITESPACE_PATTERN

#: the start of every compile error of the xgrammar backend
_NOT_COMPILED = "xgrammar cannot compile this grammar: "

# --------------------------------------------------------------------------------------------- regexes
# escapes xgrammar's regex converters read as the literal character (or, for \0, as nothing)
_LITERAL_ESCAPES = frozenset("ghijlmoqyzACEFGHIJKLMNOQRTUVXYZ0")
# escapes it rejects or ignores: word boundaries, \p{..}, backreferences, \k<name>
_UNSUPPORTED_ESCAPES = frozenset("bBpPk123456789")


def xgrammar_regex(pattern: str, full_match_spec: bool) -> str:
    """``pattern`` as xgrammar's regex converter reads it with the meaning it has for us, or an error.

    Args:
        pattern: a regex (anchors already stripped for ``regex`` specs).
        full_match_spec: a ``regex`` spec (Rust syntax, matched in full): ``.`` becomes ``[^\\n]`` and
            ``^``/``$`` are refused anywhere but at the ends. False for a JSON-schema ``pattern`` (left
            as it is: xgrammar ignores inner anchors there, which only narrows it).

    Raises:
        GrammarCompileError: a construct xgrammar cannot compile or would compile into another
            language (module docstring).
    """

    def refuse(why: str, pos: int) -> GrammarCompileError:
        return GrammarCompileError(
            f"{_NOT_COMPILED}the regex {pattern!r} uses {why} at position {pos}, which xgrammar "
            "does not support (look-around, backreferences, word boundaries, \\p{..}, inline flags, "
            "POSIX classes and escapes such as \\z, \\A or \\Q are not available)"
        )

    out: list[str] = []
    i, n = 0, len(pattern)
    in_class = False
    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 >= n:
                raise refuse("a trailing backslash", i)
            e = pattern[i + 1]
            if e in _LITERAL_ESCAPES or e in _UNSUPPORTED_ESCAPES:
                raise refuse(f"the escape \\{e}", i)
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if in_class:
            if c == "[" and pattern.startswith("[:", i) and ":]" in pattern[i + 2 :]:
                raise refuse("a POSIX character class", i)
            if c == "]":
                in_class = False
            out.append(c)
            i += 1
            continue
        if c == "[":
            in_class = True
            j = i + 1
            if pattern.startswith("^", j):
                j += 1
            if pattern.startswith("]", j):  # a leading ] is a literal
                j += 1
            out.append(pattern[i:j])
            i = j
            continue
        if c == "(" and pattern.startswith("(?", i):
            rest = pattern[i + 2 :]
            if rest.startswith(("=", "!", "<=", "<!")):
                raise refuse("look-around", i)
            if not (rest.startswith(":") or re.match(r"<[A-Za-z_][A-Za-z0-9_]*>", rest)):
                raise refuse("a group flag", i)
        if full_match_spec:
            if c == ".":
                out.append("[^\\n]")
                i += 1
                continue
            if (c == "^" and i > 0) or (c == "$" and i < n - 1):
                raise refuse(f"the anchor {c} inside the pattern", i)
        out.append(c)
        i += 1
    return "".join(out)


def ebnf_literal(text: str) -> str:
    """``text`` as an xgrammar EBNF string literal."""
    out = []
    for ch in text:
        o = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif o < 0x20 or o == 0x7F:
            out.append(f"\\x{o:02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


_WHITESPACE_SLOT = '("" | ([ \\n\\r\\t]))'
_WS_PREFIX = "specdec_ws"
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _rename_rules(ebnf: str, prefix: str) -> tuple[str, str]:
    """Every rule of ``ebnf`` renamed ``prefix`` + ``_`` + name (string literals and character classes
    untouched); returns (text, the root rule's new name)."""
    names = {line.partition(" ::= ")[0] for line in ebnf.splitlines() if " ::= " in line}
    out = []
    i, n = 0, len(ebnf)
    while i < n:
        c = ebnf[i]
        if c in '"[':
            close = '"' if c == '"' else "]"
            j = i + 1
            while j < n and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i : j + 1])
            i = j + 1
            continue
        m = _IDENTIFIER.match(ebnf, i)
        if m and (i == 0 or not (ebnf[i - 1].isalnum() or ebnf[i - 1] == "_")):
            word = m.group()
            out.append(f"{prefix}_{word}" if word in names else word)
            i = m.end()
            continue
        out.append(c)
        i += 1
    return "".join(out), f"{prefix}_root"


def restrict_whitespace(ebnf: str, whitespace_pattern: str | None) -> str:
    """xgrammar's JSON EBNF (converted with ``any_whitespace=True, max_whitespace_cnt=1``) with every
    whitespace slot matching ``whitespace_pattern`` instead (None: the default ``[ ]?``).

    Raises:
        GrammarCompileError: the pattern cannot be converted, or the EBNF has whitespace that is not in
            a slot rule (never seen; refused rather than left wider).
    """
    extra = ""
    if whitespace_pattern is None or whitespace_pattern == DEFAULT_WHITESPACE_PATTERN:
        body = '("" | (" "))'
    else:
        try:
            ws = str(xgr.Grammar.from_regex(xgrammar_regex(whitespace_pattern, full_match_spec=True)))
        except RuntimeError as e:
            raise GrammarCompileError(
                f"{_NOT_COMPILED}whitespace_pattern {whitespace_pattern!r}: {xgrammar_message(e)}"
            ) from None
        extra, root = _rename_rules(ws.strip(), _WS_PREFIX)
        body = f"(({root}))"
    lines = []
    for line in ebnf.splitlines():
        name, sep, rule = line.partition(" ::= ")
        if name.startswith(_WS_PREFIX):
            raise GrammarCompileError(f"{_NOT_COMPILED}a rule named {name!r} collides with ours")
        lines.append(name + sep + body if rule == _WHITESPACE_SLOT else line)
    text = "\n".join(lines)
    if "[ \\n\\r\\t]" in text:
        raise GrammarCompileError(
            f"{_NOT_COMPILED}its JSON grammar has whitespace outside the rules that whitespace_pattern "
            "replaces"
        )
    return text + ("\n" + extra if extra else "") + "\n"


def xgrammar_message(e: BaseException) -> str:
    """xgrammar's error without its C++ log prefix (``[time] /path/file.cc:line: ``)."""
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else type(e).__name__
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", last)
