"""The parts of the target the draft heads train against, frozen."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.models.decoder import softcap


@dataclass
class FrozenTarget:
    """The parts of the target the heads use, frozen: its token embedding (float32) and its LM head
    (bfloat16: its products dominate the cost of training)."""

    arch: Any
    embed: torch.Tensor  # [V, H] float32
    lm_head: torch.Tensor  # [V, H] bfloat16
    final_norm: torch.Tensor | None = None  # [H] float32: the final norm's weight (EAGLE-3's init)

    @classmethod
    def load(cls, model_dir: Path, device: str = "cpu") -> FrozenTarget:
        from specdec.models.config import ModelArchConfig
        from specdec.models.loader import read_state_dict

        arch = ModelArchConfig.from_pretrained(model_dir)
        state = read_state_dict(model_dir)
        embed = state["model.embed_tokens.weight"].float()
        head = embed if arch.tie_word_embeddings else state["lm_head.weight"].float()
        norm = state.get("model.norm.weight")
        return cls(
            arch,
            embed.to(device),
            head.to(device=device, dtype=torch.bfloat16),
            None if norm is None else norm.float().to(device),
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` -> ``[N, V]`` float32 logits (differentiable in ``hidden``), soft-capped where the
        target caps its logits (Gemma 2), like :meth:`specdec.models.decoder.DecoderLM.logits`."""
        out = (hidden.to(self.lm_head.dtype) @ self.lm_head.T).float()
        cap = self.arch.final_logit_softcapping
        return out if cap is None else softcap(out, cap)
