"""The prompt sets of the training data and their held-out split.

Prompts: the built-in standard-library prompts (:func:`experiments.datasets.load_builtin`), the
built-in chat prompts (:func:`experiments.datasets.load_chat`), optionally the generated instruction
prompts (:func:`experiments.instruct.load_instruct`) and requests the target writes itself
(:func:`experiments.train.synth.synthesize_prompts`). A prompt is held out for evaluation when
a hash of its id falls below ``data.heldout_fraction`` (:func:`is_heldout`); :func:`load_heldout_prompts`
gives them back.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from experiments.config import TrainDataConfig
from experiments.datasets import Prompt, load_builtin, load_chat


def is_heldout(prompt_id: str, fraction: float) -> bool:
    """Whether ``prompt_id`` belongs to the held-out split: the first 8 bytes of its sha256, as a number
    in [0, 1), fall below ``fraction``. Depends on the id alone, so adding prompts moves no other."""
    return _id_hash(prompt_id) < fraction


def _id_hash(prompt_id: str) -> float:
    digest = hashlib.sha256(prompt_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_heldout(prompts: Sequence[Prompt], fraction: float) -> list[bool]:
    """The held-out flag of every prompt (:func:`is_heldout`). With ``fraction`` > 0 at least one prompt
    is held out and, given two or more, at least one is kept (the extreme hashes decide)."""
    flags = [is_heldout(p.id, fraction) for p in prompts]
    if fraction > 0 and prompts and not any(flags):
        flags[min(range(len(prompts)), key=lambda i: _id_hash(prompts[i].id))] = True
    if len(prompts) > 1 and all(flags):
        flags[max(range(len(prompts)), key=lambda i: _id_hash(prompts[i].id))] = False
    return flags


def training_prompts(
    data: TrainDataConfig, model: str | None = None, dtype: str = "bfloat16"
) -> list[Prompt]:
    """Every prompt of the training data (both splits): built-in, then chat, then the generated
    instruction prompts (``data.instruct_limit``, none by default), then ``data.synth_prompts`` requests
    written by ``model`` in ``dtype`` (Magpie; none by default).

    Raises:
        ValueError: ``data.synth_prompts`` > 0 without ``model``.
    """
    builtin = (
        []
        if data.builtin_limit == 0
        else load_builtin(data.builtin_limit, data.prompt_seed, data.max_prompt_chars)
    )
    chat = [] if data.chat_limit == 0 else load_chat(data.chat_limit, data.prompt_seed)
    instruct: list[Prompt] = []
    if data.instruct_limit != 0:
        from experiments.instruct import load_instruct

        instruct = load_instruct(data.instruct_limit, data.prompt_seed)
    synth: list[Prompt] = []
    if data.synth_prompts > 0:
        if model is None:
            raise ValueError("data.synth_prompts > 0 needs the model that writes them")
        from experiments.train.synth import synthesize_prompts

        synth = synthesize_prompts(model, data.synth_prompts, dtype=dtype, cache_dir=data.cache_dir)
    return builtin + chat + instruct + synth


def load_heldout_prompts(data: TrainDataConfig | None = None) -> list[Prompt]:
    """The held-out prompts of the training data (default: the settings of ``conf/train.yaml``), for
    evaluating heads on prompts they were not trained on. Raises ``ValueError`` when
    ``data.synth_prompts`` > 0 (their model is not known here: use :func:`training_prompts`)."""
    data = data or TrainDataConfig()
    prompts = training_prompts(data)
    return [p for p, h in zip(prompts, split_heldout(prompts, data.heldout_fraction)) if h]


def prompt_id_of(sequence_id: str) -> str:
    """The prompt id of a sequence id (``<prompt id>[#<sample>][@<part>]``)."""
    return sequence_id.split("@")[0].split("#")[0]
