"""Helpers shared by the grammar tests (tiny in-process tokenizers, token-by-token acceptance); the
checks of the helpers themselves are at the bottom."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from grammars import OutlinesGrammar, allocate_token_bitmask, is_token_allowed
from grammars.vocabulary import bytes_to_unicode

TINY_MERGES = [("Ġ", "w"), ("a", "b"), ("1", "2"), ("Ã", "©"), ("Ġw", "o"), ("Ġ", "a"), ("Ġa", "b")]


@lru_cache(maxsize=1)
def tiny_byte_level_tokenizer() -> Any:
    """A byte-level BPE tokenizer (GPT-2 style) built in-process: ids 0 ``<|endoftext|>`` (EOS) and 1
    ``<|pad|>`` are special, 2..257 the 256 single bytes, then the merges of :data:`TINY_MERGES`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    b2u = bytes_to_unicode()
    vocab = {"<|endoftext|>": 0, "<|pad|>": 1}
    for b in range(256):
        vocab[b2u[b]] = len(vocab)
    for a, b in TINY_MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=TINY_MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")


@lru_cache(maxsize=1)
def tiny_sentencepiece_tokenizer() -> Any:
    """A SentencePiece-style tokenizer (``▁`` for spaces, ``<0xNN>`` byte fallback) built in-process:
    0 ``<unk>``, 1 ``<s>``, 2 ``</s>`` (EOS), 3..258 the byte tokens ``<0x00>``..``<0xFF>``, then
    ``▁``, ``a``, ``b``, ``▁a``, ``é``, ``▁hello``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for t in ["▁", "a", "b", "▁a", "é", "▁hello"]:
        vocab[t] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def feed(grammar: OutlinesGrammar, token_ids: list[int], check_mask: bool = True) -> int:
    """Accept ``token_ids`` one by one, asserting before each that the mask bit agrees with acceptance.

    Returns:
        how many were accepted before the first rejection (``len(token_ids)`` if all).
    """
    bm = allocate_token_bitmask(1, grammar.compiled.vocab_size)
    for n, t in enumerate(token_ids):
        if check_mask:
            grammar.fill_bitmask(bm, 0)
            allowed = is_token_allowed(bm, 0, t)
        ok = grammar.accept_token(t)
        if check_mask:
            assert allowed == ok, (n, t)
        if not ok:
            return n
    return len(token_ids)


def allowed_ids(grammar: OutlinesGrammar) -> torch.Tensor:
    """The ids the current mask allows, ascending (int64 ``[n]``)."""
    from grammars import unpack_bitmask

    bm = allocate_token_bitmask(1, grammar.compiled.vocab_size)
    grammar.fill_bitmask(bm, 0)
    return unpack_bitmask(bm, grammar.compiled.vocab_size)[0].nonzero().flatten()


def test_tiny_tokenizers_are_what_the_tests_assume():
    bl = tiny_byte_level_tokenizer()
    assert len(bl) == 258 + len(TINY_MERGES) and bl.eos_token_id == 0 and sorted(bl.all_special_ids) == [0, 1]
    assert bl.convert_ids_to_tokens(bl.encode("ab wo", add_special_tokens=False)) == ["ab", "Ġwo"]
    sp = tiny_sentencepiece_tokenizer()
    assert sp.eos_token_id == 2 and sp.convert_ids_to_tokens([3, 258, 259]) == ["<0x00>", "<0xFF>", "▁"]
