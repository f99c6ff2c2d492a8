"""A Hugging Face tokenizer's vocabulary as the bytes each token stands for.

Grammars match *text* (bytes) while models emit token ids, so every token id needs the exact bytes it
adds to the output (Willard & Louf 2023, "Efficient Guided Generation for Large Language Models",
build the token-level index from exactly this map). Token strings in a tokenizer's vocabulary are an
encoding of those bytes, not the bytes themselves:

- **byte-level BPE** (GPT-2, Llama 3, Qwen2, SmolLM2; the tokenizer's decoder or pre-tokenizer is
  ``ByteLevel``): each byte is written as one printable character through GPT-2's ``bytes_to_unicode``
  map (``'Ġ'`` = space 0x20, ``'Ċ'`` = newline 0x0A, ``'Ã'`` = 0xC3, ...). We invert the map. A token
  holding part of a multi-byte UTF-8 character (``'ä¸'`` is 0xE4 0xB8 of 中) becomes those raw bytes,
  which are not valid UTF-8 on their own: the grammar's byte-level automaton completes them with the
  next token;
- **SentencePiece-style** (Llama 2, Mistral: a ``Metaspace``/``▁`` decoder, ``ByteFallback``): ``'▁'``
  stands for a space and ``<0xNN>`` tokens for the raw byte 0xNN;
- anything else: ``tokenizer.convert_tokens_to_string([token])`` encoded as UTF-8 (what outlines'
  Python tokenizer adapter did), a best effort.

Added tokens that are not special are matched literally by the tokenizer, so their bytes are their
content's UTF-8. Special tokens (``tokenizer.all_special_ids`` and every added token flagged
``special``) have no bytes: a grammar never allows them, except the EOS ids, which the grammar backend
allows in final states itself.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import numpy as np
import outlines_core

Decoding = Literal["byte_level", "sentencepiece", "plain"]
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character map (``openai/gpt-2`` ``encoder.py``; also in transformers and tokenizers).

    Printable Latin-1 bytes map to themselves; the other 68 bytes (controls, space, 0x7F-0xA0, 0xAD)
    map to ``chr(256 + i)`` in byte order, so 0x20 (space) is ``'Ġ'`` (U+0120) and 0x0A is ``'Ċ'``.

    Returns:
        {byte value 0..255: one-character string}.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


_UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in bytes_to_unicode().items()}


@dataclass(frozen=True)
class TokenVocabulary:
    """A tokenizer's tokens as bytes, the input of a grammar backend.

    Attributes:
        token_bytes: index = token id, ``0 <= id < size``; the bytes the token adds to the text, or None
            for a token a grammar must never allow on its own account (special tokens, EOS included;
            ids the tokenizer does not define; tokens decoding to no bytes).
        special_ids: every special token id (EOS included).
        eos_token_ids: the ids that end generation; allowed by grammars exactly in final states.
        decoding: how token strings were turned into bytes (module docstring).
        fingerprint: sha256 hex of the decoding, every (id, bytes), the special and EOS ids; equal
            fingerprints compile to equal grammars, so it keys compile caches.
    """

    token_bytes: tuple[bytes | None, ...]
    special_ids: frozenset[int]
    eos_token_ids: tuple[int, ...]
    decoding: Decoding
    fingerprint: str

    @cached_property
    def ordinary_mask(self) -> np.ndarray:
        """bool ``[size]``: True where ``token_bytes`` is not None (computed once)."""
        return np.array([b is not None for b in self.token_bytes], dtype=np.bool_)

    @property
    def size(self) -> int:
        """Number of token ids the tokenizer defines (highest id + 1); ids from here up are padding."""
        return len(self.token_bytes)

    def outlines_token_map(self) -> dict[bytes, list[int]]:
        """``{bytes: [token ids]}`` of every ordinary token (several ids may share bytes), the map
        ``outlines_core.Vocabulary`` takes."""
        out: dict[bytes, list[int]] = {}
        for i, b in enumerate(self.token_bytes):
            if b is not None:
                out.setdefault(b, []).append(i)
        return out


def _json_state(component: Any) -> Any:
    if component is None:
        return None
    try:
        return json.loads(component.__getstate__())
    except Exception:
        return None


def detect_decoding(tokenizer: Any) -> Decoding:
    """How ``tokenizer``'s token strings encode bytes: ``ByteLevel`` in the fast tokenizer's decoder or
    pre-tokenizer means byte-level; ``Metaspace``/``ByteFallback``/``▁`` tokens mean SentencePiece."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = json.dumps([_json_state(backend.decoder), _json_state(backend.pre_tokenizer)])
        if '"ByteLevel"' in text:
            return "byte_level"
        if '"Metaspace"' in text or '"ByteFallback"' in text or "\u2581" in text:
            return "sentencepiece"
    vocab = tokenizer.get_vocab()
    if "<0x00>" in vocab or any(t.startswith("\u2581") for t in vocab):
        return "sentencepiece"
    return "plain"


def _special_ids(tokenizer: Any) -> set[int]:
    special = {int(i) for i in getattr(tokenizer, "all_special_ids", [])}
    for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            special.add(int(i))
    return special


def _token_to_bytes(token: str, decoding: Decoding, tokenizer: Any) -> bytes:
    if decoding == "byte_level":
        try:
            return bytes(_UNICODE_TO_BYTE[c] for c in token)
        except KeyError:  # not in the byte alphabet: a literal (added) token
            return token.encode("utf-8")
    if decoding == "sentencepiece":
        m = _BYTE_TOKEN.match(token)
        if m:
            return bytes([int(m.group(1), 16)])
        return token.replace("\u2581", " ").encode("utf-8")
    return str(tokenizer.convert_tokens_to_string([token])).encode("utf-8")


def tokenizer_vocabulary(tokenizer: Any, eos_token_ids: Iterable[int] | None = None) -> TokenVocabulary:
    """Every token id of a Hugging Face tokenizer as the bytes it stands for (module docstring).

    Args:
        tokenizer: a transformers tokenizer (``get_vocab``, ``added_tokens_decoder``, ``all_special_ids``).
        eos_token_ids: the ids that end generation; default ``[tokenizer.eos_token_id]``.

    Returns:
        the :class:`TokenVocabulary`, ``size`` = highest token id + 1 (``len(tokenizer)``).

    Raises:
        ValueError: no EOS id given and the tokenizer has none.
    """
    if eos_token_ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        eos_ids: tuple[int, ...] = () if eos is None else (int(eos),)
    else:
        eos_ids = tuple(dict.fromkeys(int(e) for e in eos_token_ids))
    if not eos_ids:
        raise ValueError("the tokenizer has no eos_token_id; pass eos_token_ids")
    vocab: dict[str, int] = tokenizer.get_vocab()
    special = _special_ids(tokenizer) | set(eos_ids)
    added = {int(i): a for i, a in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    decoding = detect_decoding(tokenizer)
    size = max(max(vocab.values()) + 1, max(eos_ids) + 1)
    token_bytes: list[bytes | None] = [None] * size
    for token, i in vocab.items():
        if i in special:
            continue
        if i in added:  # non-special added token: matched literally
            b = str(added[i].content).encode("utf-8")
        else:
            b = _token_to_bytes(token, decoding, tokenizer)
        token_bytes[i] = b or None  # a token that adds no bytes would loop forever in any state
    h = hashlib.sha256()
    h.update(decoding.encode())
    h.update(json.dumps([sorted(special), list(eos_ids), size]).encode())
    for i, tb in enumerate(token_bytes):
        if tb is not None:
            h.update(i.to_bytes(4, "little") + len(tb).to_bytes(2, "little") + tb)
    return TokenVocabulary(tuple(token_bytes), frozenset(special), eos_ids, decoding, h.hexdigest())


def tokenizer_fingerprint(tokenizer: Any, eos_token_ids: Sequence[int] | None = None) -> str:
    """sha256 hex of the tokenizer's byte vocabulary, special ids and EOS ids (a compile-cache key)."""
    return tokenizer_vocabulary(tokenizer, eos_token_ids).fingerprint


def build_outlines_vocabulary(
    vocabulary: TokenVocabulary, extra_tokens: dict[bytes, int] | None = None
) -> outlines_core.Vocabulary:
    """The ``outlines_core.Vocabulary`` of the ordinary tokens (special tokens, EOS included, left out).

    outlines-core gets ``eos_token_ids[0]`` as its EOS; our matchers handle every EOS id themselves.

    Args:
        vocabulary: from :func:`tokenizer_vocabulary`.
        extra_tokens: extra ``{bytes: id}`` entries (the backend's start sentinel).
    """
    token_map = vocabulary.outlines_token_map()
    for b, i in (extra_tokens or {}).items():
        token_map.setdefault(b, []).append(i)
    return outlines_core.Vocabulary(vocabulary.eos_token_ids[0], token_map)
