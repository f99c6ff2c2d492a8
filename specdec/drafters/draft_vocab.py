"""A reduced draft vocabulary over the target's LM head (``speculative_config["draft_vocab"]``).

EAGLE-3 (Li et al. 2025) drafts from the most frequent target tokens only, so a draft token reads that
many rows of an LM head instead of the whole vocabulary's (SmolLM2: 8,192 of 49,152 rows, 9.4 of 56.6 MB
in bfloat16). The same idea applies to any drafter that drafts through the target's own LM head: the
EAGLE-2 head and Medusa take ``draft_vocab`` (a list of target token ids, or an EAGLE-3 head whose
``d2t`` to take). Their drafts are deterministic (top-1 chains, top-k trees) and verified as always, so
outputs stay exact; acceptance falls only where the target's token lies outside the vocabulary.
"""

from __future__ import annotations

import torch

from kernels import cpu_gemv
from kernels.cpu_gemv import gemv
from specdec.errors import ConfigError
from specdec.models.decoder import softcap
from specdec.quantization.apply import dense_weight
from specdec.quantization.config import QuantizationConfig
from specdec.quantization.linear import QuantizedLinear


def draft_vocab_ids(
    draft_vocab: list[int] | str, target: torch.nn.Module, dtype: torch.dtype
) -> torch.Tensor:
    """The sorted target ids ``[V']`` (int64) of a reduced draft vocabulary: ``draft_vocab`` a list of ids,
    or an EAGLE-3 head (name or directory) whose ``d2t`` map to take.

    Raises:
        ConfigError: ids outside ``[0, vocab_size)``, or no head of that name; CorruptModelError /
            InvalidRequestError from loading the EAGLE-3 head (another target's head among them).
    """
    vocab_size = target.cfg.vocab_size
    if isinstance(draft_vocab, str):
        from specdec.drafters.eagle3_layouts import load_eagle3_head
        from specdec.drafters.heads import resolve_heads_dir

        head, _ = load_eagle3_head(resolve_heads_dir(draft_vocab), target.cfg, dtype, "cpu")
        ids = sorted(set(head.target_ids().tolist()))
    else:
        ids = sorted(set(draft_vocab))
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise ConfigError(
                f"draft_vocab ids {bad[:5]} are outside the target's vocabulary [0, {vocab_size})"
            )
    return torch.tensor(ids, dtype=torch.long)


class DraftVocab:
    """The target's LM head restricted to a draft vocabulary.

    Args:
        draft_vocab: see :func:`draft_vocab_ids`.
        target: the target :class:`~specdec.models.decoder.DecoderLM` (its ``lm_head.weight`` ``[V, H]``).
        dtype: the drafter's dtype (for loading an EAGLE-3 head's maps).
        quantization: weight-only quantization of the rows (``speculative_config["quantization"]``: int8
            halves the bytes a draft token reads); None: the LM head's own dtype.

    Attributes:
        ids: ``[V']`` int64 target ids, ascending.
        weight: ``[V', H]`` the LM head's rows of those ids (a copy, made once); ``[0, H]`` when quantized.
        quantized: the rows as a :class:`~specdec.quantization.linear.QuantizedLinear`, or None.

    Raises:
        ConfigError: see :func:`draft_vocab_ids`.
    """

    def __init__(
        self,
        draft_vocab: list[int] | str,
        target: torch.nn.Module,
        dtype: torch.dtype,
        quantization: QuantizationConfig | None = None,
    ) -> None:
        self.ids = draft_vocab_ids(draft_vocab, target, dtype)
        weight, _ = dense_weight(target.lm_head)  # a quantized target's LM head: its dequantized rows
        weight = weight.detach().to(target.dtype)  # activations' dtype (a quantized head holds int8 codes)
        self.weight = weight[self.ids.to(weight.device)]
        self.softcap = target.cfg.final_logit_softcapping  # Gemma 2: the target's logits are capped
        # decided once: cpu_gemv.gemv would ask whether the kernel is built at every call (~30 µs)
        self.use_kernel = self.weight.device.type == "cpu" and cpu_gemv.available()
        #: The rows quantized (``quantization``), or None: full precision.
        self.quantized: QuantizedLinear | None = None
        self.dtype = self.weight.dtype
        if quantization is not None:
            self.quantized = QuantizedLinear.from_weight(
                self.weight, None, quantization.method, quantization.resolved_group_size, self.dtype,
                self.weight.device, quantization.kernel, quantization.zero_point,
            )  # fmt: skip
            # The dense copy is not kept (the whole vocabulary's: 56 MB): a fresh empty tensor, not a
            # view, which would keep it alive.
            self.weight = self.weight.new_empty((0, self.weight.shape[1]))

    def __len__(self) -> int:
        return len(self.ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., V']`` float32 of final-norm hidden states ``[..., H]``: the target's
        logits of those ids (soft-capped like the target's where it caps them)."""
        if self.quantized is not None:
            out = self.quantized(hidden.to(self.dtype)).float()
        else:
            out = gemv(hidden.to(self.weight.dtype), self.weight, use_kernel=self.use_kernel).float()
        return out if self.softcap is None else softcap(out, self.softcap)

    def to_target(self, indices: torch.Tensor) -> torch.Tensor:
        """Target ids of indices into :meth:`logits`' last dimension (any shape)."""
        return self.ids.to(indices.device)[indices]


def drafting_vocab(
    draft_vocab: list[int] | str | None,
    target: torch.nn.Module,
    dtype: torch.dtype,
    quantization: QuantizationConfig | None,
) -> DraftVocab | None:
    """The LM-head rows a head drafts through (EAGLE-2, Medusa): ``draft_vocab``'s, or, when the head is
    quantized with its LM head (``quantization.lm_head``), a quantized copy of the whole vocabulary's;
    None: the target's own LM head.

    Raises:
        ConfigError: see :func:`draft_vocab_ids`.
    """
    rows = quantization if quantization is not None and quantization.lm_head else None
    if draft_vocab is not None:
        return DraftVocab(draft_vocab, target, dtype, rows)
    if rows is not None:
        return DraftVocab(list(range(target.cfg.vocab_size)), target, dtype, rows)
    return None


class ReducedVocabHead(torch.nn.Module):
    """An LM head that computes the logits of a draft vocabulary only and reports every other token at
    ``-inf`` (probability 0): a draft model's LM head, so that its forward reads ``V'`` rows instead of
    ``V`` while its logits keep the target's shape for processing and sampling (the quantized
    self-drafter's ``draft_vocab``).

    Args:
        vocab: the rows (:class:`DraftVocab`: the target's LM-head rows of the ids, quantized or not).
        vocab_size: the target's vocabulary size ``V``.

    Input ``[T, H]`` final-norm hidden states; output ``[T, V]`` float32, ``-inf`` outside ``vocab.ids``
    (a soft-capping model caps them afterwards, to ``-cap``: a probability near 0, not 0; the drafts are
    verified exactly either way). A grammar that allows only tokens outside the vocabulary leaves a row of
    ``-inf``: a sampled request's drafts are then dropped for that step, a greedy one's rejected.
    """

    def __init__(self, vocab: DraftVocab, vocab_size: int) -> None:
        super().__init__()
        if vocab.quantized is not None:
            self.rows: torch.nn.Module = vocab.quantized
        else:
            self.rows = torch.nn.Linear(
                vocab.weight.shape[1], len(vocab), bias=False, dtype=vocab.weight.dtype
            )
            self.rows.weight = torch.nn.Parameter(vocab.weight, requires_grad=False)
        self.register_buffer("ids", vocab.ids.to(vocab.weight.device), persistent=False)
        self.vocab_size = vocab_size
        self.dtype = vocab.dtype  # the rows' (the target's) dtype: a drafter of another dtype casts to it

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = hidden.new_full((*hidden.shape[:-1], self.vocab_size), float("-inf"), dtype=torch.float32)
        out[..., self.ids] = self.rows(hidden.to(self.dtype)).float()
        return out
