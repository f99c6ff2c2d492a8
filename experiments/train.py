"""Train Medusa or EAGLE draft heads for a target by self-distillation, on the CPU, within a time budget.

    python -m experiments.train drafter=medusa                        # SmolLM2-135M, 300 s of training
    python -m experiments.train drafter=eagle train.time_budget_s=480 train.install=true
    python -m experiments.train drafter=medusa train.medusa_num_heads=5 drafter.num_speculative_tokens=5
    python -m experiments.train drafter=eagle logger=wandb train.eval=false

1. **Data** (offline). Prompts: the built-in standard-library prompts
   (:func:`experiments.datasets.load_builtin`) and the built-in chat prompts
   (:func:`experiments.datasets.load_chat`), under the target's chat template. A prompt is held out for
   evaluation when a hash of its id falls below ``data.heldout_fraction`` (:func:`is_heldout`;
   :func:`load_heldout_prompts` gives them back). The target answers every prompt through
   ``specdec.LLM`` (greedy by default; ``data.temperature`` > 0 with ``data.n`` samples for diversity),
   then our decoder runs over prompt + response with :class:`~specdec.attention.dense.DenseAttention`
   and ``all_hidden=True`` to get the feature ``f_t`` (final-norm hidden state) of every position. Token
   ids, response starts and bfloat16 features are cached under ``<specdec cache>/train/<fingerprint>/``,
   keyed by the model, the prompts' token ids, the generation settings and the seed, so a second run
   (the other method, another budget) skips generation.
2. **Training**: AdamW on float32 master weights, linear warm-up then cosine decay over the budget
   (``train.time_budget_s`` and/or ``train.epochs``); losses on response positions only; the target's
   embedding and LM head frozen (the LM head's products in bfloat16, its softmax in float32).

   - Medusa (Cai et al. 2024, Medusa-1): head k (1-based) on ``f_t`` predicts ``x_{t+k+1}``;
     cross-entropy through the LM head, summed over heads.
   - EAGLE (Li et al. 2024, EAGLE-1): whole sequences through :class:`~specdec.drafters.heads.EagleHead`
     with ``DenseAttention``; row t reads ``(embed(x_{t+1}), f_t)`` and predicts ``f_{t+1}``; loss
     ``SmoothL1(f̂, f) + 0.1 · CE(lm_head(f̂), softmax(lm_head(f)))``, optional uniform noise on the input
     features (EAGLE-1's augmentation), and optionally a second, unrolled step
     (``train.eagle_unroll=2``): row t + 1 then reads the head's own ``f̂_{t+1}``, as when drafting a
     chain, attending to the teacher-forced rows before it and to itself.

   Held-out metrics (every ``train.eval_interval_s`` on a subset, at the end on all of it): loss; for
   Medusa, per head, top-1/top-5 accuracy and the accuracy at each rank r < 10 (the fraction of
   positions whose true token is the head's r-th candidate: the input of a static tree); for EAGLE,
   top-1/top-5 of the first step (teacher-forced) and top-1 of the second (reading its own prediction).
   Logged to ``logger`` (wandb: one run per job, offline by default).
3. **Output**: :func:`~specdec.drafters.heads.save_heads` (``config.json`` with the provenance in
   ``training``, ``model.safetensors`` in bfloat16) and ``COMMAND.md`` (the exact command line and the
   figures) into ``train.out_dir``, or ``specdec/heads/<target>-<method>`` with ``train.install=true``
   (then loadable by name), or ``<run dir>/<target>-<method>``. The run directory gets ``config.yaml``,
   ``run_info.json`` and ``summary.json``.
4. **Evaluation** (``train.eval=true``): τ (tokens per verification step) and acceptance per position of
   ``specdec.LLM`` with the new heads on held-out prompts, greedy, batch 1.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import json
import logging
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from experiments.config import (
    EagleDrafterConfig,
    MedusaDrafterConfig,
    SamplingConfig,
    TrainConfig,
    TrainDataConfig,
    config_to_dict,
    register_configs,
    to_train_config,
)
from experiments.datasets import Prompt, load_builtin, load_chat
from experiments.tracking import (
    NullTracker,
    Tracker,
    package_versions,
    run_info,
    run_tracked,
    write_run_files,
)

logger = logging.getLogger("experiments.train")

#: Bump when the cached data's layout or meaning changes (it is part of the fingerprint).
DATA_FORMAT_VERSION = 1
#: Ranks whose accuracy is recorded per Medusa head (for building static trees).
NUM_RANKS = 10
#: Where ``train.install=true`` writes the heads (the built-in heads ``SpeculativeConfig`` loads by name).
HEADS_DIR = Path(__file__).resolve().parents[1] / "specdec" / "heads"

#: Builds an ``LLM`` for a ``speculative_config`` (None: plain), as in :mod:`experiments.run`.
LLMFactory = Callable[[dict[str, Any] | None], Any]


# ------------------------------------------------------------------------------------- prompts
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


def training_prompts(data: TrainDataConfig) -> list[Prompt]:
    """Every prompt of the training data (both splits): built-in, then chat."""
    builtin = (
        []
        if data.builtin_limit == 0
        else load_builtin(data.builtin_limit, data.prompt_seed, data.max_prompt_chars)
    )
    chat = [] if data.chat_limit == 0 else load_chat(data.chat_limit, data.prompt_seed)
    return builtin + chat


def load_heldout_prompts(data: TrainDataConfig | None = None) -> list[Prompt]:
    """The held-out prompts of the training data (default: the settings of ``conf/train.yaml``), for
    evaluating heads on prompts they were not trained on."""
    data = data or TrainDataConfig()
    prompts = training_prompts(data)
    return [p for p, h in zip(prompts, split_heldout(prompts, data.heldout_fraction)) if h]


# ---------------------------------------------------------------------------------------- data
@dataclass
class DistilData:
    """Self-distillation sequences: prompt + the target's response, and the target's features.

    Attributes:
        tokens: per sequence, ``[L]`` int64 token ids.
        starts: per sequence, the index of the first response token.
        features: per sequence, ``[L, H]`` the target's feature ``f_t`` at every position (bfloat16).
        ids, categories: the prompt of each sequence (a prompt with ``n`` samples gives ``n`` sequences).
        heldout: per sequence, whether its prompt is held out.
        meta: how the data was made (fingerprint, settings, counts, times).
    """

    tokens: list[torch.Tensor]
    starts: list[int]
    features: list[torch.Tensor]
    ids: list[str]
    categories: list[str]
    heldout: list[bool] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    def subset(self, heldout: bool) -> DistilData:
        """The sequences of one split."""
        keep = [i for i, h in enumerate(self.heldout) if h == heldout]
        return DistilData(
            [self.tokens[i] for i in keep],
            [self.starts[i] for i in keep],
            [self.features[i] for i in keep],
            [self.ids[i] for i in keep],
            [self.categories[i] for i in keep],
            [heldout] * len(keep),
            self.meta,
        )

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def num_response_tokens(self) -> int:
        return sum(len(t) - s for t, s in zip(self.tokens, self.starts))


def model_identity(model_dir: Path) -> dict[str, Any]:
    """What identifies a model directory's weights cheaply: its config and its weight files' sizes."""
    config = model_dir / "config.json"
    return {
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
        "weights": sorted((p.name, p.stat().st_size) for p in model_dir.glob("*.safetensors")),
    }


def data_fingerprint(
    model: str, model_dir: Path, dtype: str, prompt_ids: Sequence[Sequence[int]], data: TrainDataConfig
) -> str:
    """sha256 of everything the cached data depends on: the model, the dtype, every prompt's token ids
    and the generation settings and seed (not the split, computed when the data is loaded)."""
    prompts = hashlib.sha256(json.dumps([list(map(int, p)) for p in prompt_ids]).encode()).hexdigest()
    key = {
        "version": DATA_FORMAT_VERSION,
        "model": model,
        "model_identity": model_identity(model_dir),
        "dtype": dtype,
        "prompts": prompts,
        "generation": _generation_settings(data),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _generation_settings(data: TrainDataConfig) -> dict[str, Any]:
    return {
        "max_new_tokens": data.max_new_tokens,
        "temperature": data.temperature,
        "n": data.n,
        "seed": data.seed,
        "max_num_seqs": data.max_num_seqs,
        "max_num_batched_tokens": data.max_num_batched_tokens,
    }


def default_cache_dir() -> Path:
    """``<specdec cache>/train`` (``$SPECDEC_CACHE_DIR``, default ``~/.cache/specdec``)."""
    from specdec.zoo import cache_dir

    return cache_dir() / "train"


def generate_responses(
    model: str,
    prompt_ids: Sequence[Sequence[int]],
    data: TrainDataConfig,
    dtype: str,
    device: str,
    skip_tokenizer_init: bool = False,
) -> list[list[list[int]]]:
    """The target's responses through ``specdec.LLM``: per prompt, ``data.n`` token-id lists (EOS
    included when the target ended). Prompts are submitted shortest first (less padding per batch);
    sampled prompt i uses seed ``data.seed + i``."""
    from specdec import LLM, SamplingParams

    llm = LLM(
        model,
        dtype=dtype,
        device=device,
        seed=data.seed,
        max_num_seqs=data.max_num_seqs,
        max_num_batched_tokens=data.max_num_batched_tokens,
        skip_tokenizer_init=skip_tokenizer_init,
    )
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    params = [
        SamplingParams(
            temperature=data.temperature,
            max_tokens=data.max_new_tokens,
            n=data.n,
            seed=None if data.temperature == 0 else data.seed + i,
        )
        for i in order
    ]
    out: list[list[list[int]]] = [[] for _ in prompt_ids]
    t0 = last_log = time.perf_counter()
    done = generated = 0
    # The engine's request ids count prompts in submission order ("0", "1", ...).
    for chunk in llm.stream([{"prompt_token_ids": list(prompt_ids[i])} for i in order], params):
        if not chunk.finished:
            continue
        i = order[int(chunk.request_id)]
        assert list(chunk.prompt_token_ids) == list(prompt_ids[i]), "request ids out of order"
        out[i] = [list(c.token_ids) for c in chunk.outputs]
        done += 1
        generated += sum(len(c.token_ids) for c in chunk.outputs)
        now = time.perf_counter()
        if now - last_log > 30 or done == len(prompt_ids):
            last_log = now
            logger.info(
                "generated %d/%d prompts, %d tokens in %.0f s (%.1f tok/s)",
                done,
                len(prompt_ids),
                generated,
                now - t0,
                generated / max(now - t0, 1e-9),
            )
    del llm
    gc.collect()
    return out


def _dense_forward_batches(lengths: Sequence[int], batch_tokens: int) -> Iterator[list[int]]:
    """Indices of sequences, shortest first, packed into batches of at most ``batch_tokens`` tokens (a
    longer sequence alone)."""
    batch: list[int] = []
    total = 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if batch and total + lengths[i] > batch_tokens:
            yield batch
            batch, total = [], 0
        batch.append(i)
        total += lengths[i]
    if batch:
        yield batch


@torch.inference_mode()
def compute_features(
    target: nn.Module, sequences: Sequence[torch.Tensor], batch_tokens: int
) -> list[torch.Tensor]:
    """The target's feature (final-norm hidden state) at every position of every sequence, from whole-
    sequence forwards with :class:`~specdec.attention.dense.DenseAttention` (no KV cache), as bfloat16
    ``[L, H]`` tensors on the CPU."""
    from specdec.attention.dense import DenseAttention, dense_metadata

    device = next(target.parameters()).device
    attention = DenseAttention()
    num_layers = len(target.layers)  # type: ignore[arg-type]
    out: list[torch.Tensor | None] = [None] * len(sequences)
    t0 = last_log = time.perf_counter()
    done = 0
    for batch in _dense_forward_batches([len(s) for s in sequences], batch_tokens):
        lens = [len(sequences[i]) for i in batch]
        ids = torch.cat([sequences[i] for i in batch]).to(device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(device)
        _, hidden = target(
            ids,
            positions,
            [(None, None)] * num_layers,
            dense_metadata(lens, device),
            attention,
            logits_indices=torch.zeros(1, dtype=torch.int64, device=device),  # no LM head over every row
            all_hidden=True,
        )
        for i, h in zip(batch, hidden.split(lens)):
            out[i] = h.to(torch.bfloat16).cpu().clone()
        done += sum(lens)
        now = time.perf_counter()
        if now - last_log > 30:
            last_log = now
            logger.info("features: %d tokens in %.0f s", done, now - t0)
    return [h for h in out if h is not None]


def save_data(directory: Path, data: DistilData) -> None:
    """``data.safetensors`` (tokens, offsets, starts, features) and ``meta.json``, written atomically."""
    from safetensors.torch import save_file

    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f"{directory.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    lengths = torch.tensor([len(t) for t in data.tokens], dtype=torch.int64)
    tensors = {
        "tokens": torch.cat(data.tokens).to(torch.int32),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        "starts": torch.tensor(data.starts, dtype=torch.int64),
        "features": torch.cat(data.features).to(torch.bfloat16),
    }
    save_file(tensors, str(tmp / "data.safetensors"))
    meta = {**data.meta, "ids": data.ids, "categories": data.categories}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    if directory.exists():  # another process finished first: keep its copy
        import shutil

        shutil.rmtree(tmp)
        return
    tmp.rename(directory)


def load_data(directory: Path) -> DistilData:
    """Read what :func:`save_data` wrote (no split yet)."""
    from safetensors.torch import load_file

    tensors = load_file(str(directory / "data.safetensors"))
    meta = json.loads((directory / "meta.json").read_text())
    offsets = tensors["offsets"].tolist()
    tokens = tensors["tokens"].to(torch.int64)
    features = tensors["features"]
    spans = list(itertools.pairwise(offsets))
    return DistilData(
        [tokens[a:b] for a, b in spans],
        [int(s) for s in tensors["starts"].tolist()],
        [features[a:b] for a, b in spans],
        list(meta.pop("ids")),
        list(meta.pop("categories")),
        [],
        meta,
    )


def prepare_data(
    cfg: TrainConfig,
    prompts: Sequence[Prompt],
    prompt_ids: Sequence[Sequence[int]],
    model_dir: Path,
    skip_tokenizer_init: bool = False,
) -> DistilData:
    """The distillation data of ``prompts`` (token ids ``prompt_ids``), from the cache when it holds
    them, else generated, featurised and cached; the split is set from ``data.heldout_fraction``.

    With ``data.include_greedy`` (and ``data.temperature`` > 0) the data is the greedy responses (cached
    as the greedy settings' own data, so an earlier greedy run's cache is reused) followed by the
    sampled ones; its fingerprint is the sha256 of the two parts' fingerprints."""
    data = cfg.data
    if data.include_greedy and data.temperature > 0:
        greedy = replace(data, temperature=0.0, n=1, include_greedy=False)
        sampled = replace(data, include_greedy=False)
        parts = [
            prepare_data(replace(cfg, data=d), prompts, prompt_ids, model_dir, skip_tokenizer_init)
            for d in (greedy, sampled)
        ]
        return _concat_data(parts)
    dtype = cfg.model.dtype.value
    fingerprint = data_fingerprint(cfg.model.name, model_dir, dtype, prompt_ids, data)
    root = Path(data.cache_dir).expanduser() if data.cache_dir else default_cache_dir()
    directory = root / fingerprint[:16]
    meta_file = directory / "meta.json"
    if meta_file.is_file() and json.loads(meta_file.read_text()).get("fingerprint") == fingerprint:
        logger.info("distillation data from the cache: %s", directory)
        dd = load_data(directory)
        dd.meta["cached"] = True
    else:
        # The responses are kept on their own first, so that a run stopped while the features are
        # computed does not generate them again.
        responses_file = root / f"{fingerprint[:16]}.responses.json"
        cached = json.loads(responses_file.read_text()) if responses_file.is_file() else {}
        if cached.get("fingerprint") == fingerprint:
            logger.info("responses from the cache: %s", responses_file)
            responses, gen_s = cached["responses"], cached["generation_time_s"]
            responses_were_cached = True
        else:
            responses_were_cached = False
            logger.info("generating distillation data for %d prompts into %s", len(prompt_ids), directory)
            t0 = time.perf_counter()
            responses = generate_responses(
                cfg.model.name, prompt_ids, data, dtype, cfg.train.device, skip_tokenizer_init
            )
            gen_s = time.perf_counter() - t0
            root.mkdir(parents=True, exist_ok=True)
            tmp = responses_file.with_name(f"{responses_file.name}.tmp{os.getpid()}")
            tmp.write_text(
                json.dumps({"fingerprint": fingerprint, "generation_time_s": gen_s, "responses": responses})
            )
            tmp.replace(responses_file)
        sequences, starts, ids, categories = [], [], [], []
        for p, pids, resp in zip(prompts, prompt_ids, responses):
            for j, r in enumerate(resp):
                sequences.append(torch.tensor(list(pids) + list(r), dtype=torch.int64))
                starts.append(len(pids))
                ids.append(p.id if len(resp) == 1 else f"{p.id}#{j}")
                categories.append(p.category)
        from specdec.models.loader import load_model

        t1 = time.perf_counter()
        target = load_model(model_dir, _torch_dtype(dtype), cfg.train.device)
        features = compute_features(target, sequences, data.feature_batch_tokens)
        del target
        gc.collect()
        feat_s = time.perf_counter() - t1
        meta = {
            "fingerprint": fingerprint,
            "model": cfg.model.name,
            "dtype": dtype,
            "generation": _generation_settings(data),
            "num_prompts": len(prompt_ids),
            "num_sequences": len(sequences),
            "num_tokens": sum(len(s) for s in sequences),
            "num_response_tokens": sum(len(s) - st for s, st in zip(sequences, starts)),
            "generation_time_s": gen_s,
            "feature_time_s": feat_s,
        }
        dd = DistilData(sequences, starts, features, ids, categories, [], meta)
        save_data(directory, dd)
        dd.meta["cached"] = False
        dd.meta["responses_cached"] = responses_were_cached
        logger.info(
            "data: %d sequences, %d tokens (%d response); generation %.0f s, features %.0f s",
            len(sequences),
            meta["num_tokens"],
            meta["num_response_tokens"],
            gen_s,
            feat_s,
        )
    dd.meta["directory"] = str(directory)
    by_id = {p.id: h for p, h in zip(prompts, split_heldout(prompts, data.heldout_fraction))}
    dd.heldout = [by_id[prompt_id_of(i)] for i in dd.ids]
    return dd


def _torch_dtype(name: str) -> torch.dtype:
    from specdec.config import resolve_dtype

    return resolve_dtype(name)


def prompt_id_of(sequence_id: str) -> str:
    """The prompt id of a sequence id (``<prompt id>[#<sample>][@<part>]``)."""
    return sequence_id.split("@")[0].split("#")[0]


def _concat_data(parts: Sequence[DistilData]) -> DistilData:
    """Several data sets of the same prompts as one; a sequence id gets ``@<part>`` (so a prompt's
    sequences stay recognisable for the split: the prompt id is the part before ``#`` and ``@``)."""
    fingerprint = hashlib.sha256("".join(p.meta["fingerprint"] for p in parts).encode()).hexdigest()
    metas = [{k: v for k, v in p.meta.items() if k != "directory"} for p in parts]
    meta: dict[str, Any] = {
        "fingerprint": fingerprint,
        "generation": [m["generation"] for m in metas],
        "parts": metas,
        "num_sequences": sum(len(p) for p in parts),
        "num_tokens": sum(p.num_tokens for p in parts),
        "num_response_tokens": sum(p.num_response_tokens for p in parts),
        "generation_time_s": sum(m.get("generation_time_s", 0.0) for m in metas),
        "feature_time_s": sum(m.get("feature_time_s", 0.0) for m in metas),
        "cached": all(m.get("cached", False) for m in metas),
        "responses_cached": all(m.get("responses_cached", True) for m in metas),
        "directory": [p.meta["directory"] for p in parts],
    }
    return DistilData(
        [t for p in parts for t in p.tokens],
        [s for p in parts for s in p.starts],
        [f for p in parts for f in p.features],
        [f"{i}@{j}" for j, p in enumerate(parts) for i in p.ids],
        [c for p in parts for c in p.categories],
        [h for p in parts for h in p.heldout],
        meta,
    )


# ------------------------------------------------------------------------------------- frozen target
@dataclass
class FrozenTarget:
    """The parts of the target the heads use, frozen: its token embedding (float32) and its LM head
    (bfloat16: its products dominate the cost of training)."""

    arch: Any
    embed: torch.Tensor  # [V, H] float32
    lm_head: torch.Tensor  # [V, H] bfloat16

    @classmethod
    def load(cls, model_dir: Path, device: str = "cpu") -> FrozenTarget:
        from specdec.models.config import ModelArchConfig
        from specdec.models.loader import read_state_dict

        arch = ModelArchConfig.from_pretrained(model_dir)
        state = read_state_dict(model_dir)
        embed = state["model.embed_tokens.weight"].float()
        head = embed if arch.tie_word_embeddings else state["lm_head.weight"].float()
        return cls(arch, embed.to(device), head.to(device=device, dtype=torch.bfloat16))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` -> ``[N, V]`` float32 logits (differentiable in ``hidden``)."""
        return (hidden.to(self.lm_head.dtype) @ self.lm_head.T).float()


# ------------------------------------------------------------------------------------------ medusa
@dataclass
class MedusaExamples:
    """Response positions of Medusa training: ``features[i]`` is ``f_t``; ``labels[i, k - 1]`` is
    ``x_{t+k+1}`` (-100 past the end)."""

    features: torch.Tensor  # [P, H] bfloat16
    labels: torch.Tensor  # [P, K] int64

    def __len__(self) -> int:
        return len(self.labels)


def medusa_examples(data: DistilData, num_heads: int) -> MedusaExamples:
    """Every position t with ``start - 1 <= t <= L - 3`` of every sequence (the positions where the
    target has just emitted a response token and head 1 has a label)."""
    feats, labels = [], []
    for x, s, f in zip(data.tokens, data.starts, data.features):
        n = len(x)
        lo, hi = max(s - 1, 0), n - 2  # rows lo..hi-1
        if hi <= lo:
            continue
        rows = torch.arange(lo, hi)
        lab = torch.full((len(rows), num_heads), -100, dtype=torch.int64)
        for k in range(1, num_heads + 1):
            idx = rows + k + 1
            ok = idx < n
            lab[ok, k - 1] = x[idx[ok]]
        feats.append(f[lo:hi])
        labels.append(lab)
    if not feats:
        return MedusaExamples(
            torch.zeros(0, 0, dtype=torch.bfloat16), torch.zeros(0, num_heads, dtype=torch.int64)
        )
    return MedusaExamples(torch.cat(feats), torch.cat(labels))


def medusa_head_outputs(heads: nn.Module, features: torch.Tensor, k: int) -> torch.Tensor:
    """Head ``k`` (0-based) alone on ``features`` ``[N, H]`` -> ``[N, H]`` (what ``MedusaHeads.forward``
    computes for that head)."""
    block: nn.Module = heads.get_submodule(f"blocks.{k}")
    return features + F.silu(block(features))


def medusa_step(
    heads: nn.Module, target: FrozenTarget, features: torch.Tensor, labels: torch.Tensor
) -> tuple[float, list[float]]:
    """One step's gradients (accumulated into ``heads``): cross-entropy of each head, backpropagated head
    by head (one ``[N, V]`` logits tensor alive at a time). Returns the summed loss and each head's."""
    f = features.float()
    per_head = []
    for k in range(labels.shape[1]):
        lab = labels[:, k]
        if not bool((lab >= 0).any()):
            per_head.append(0.0)
            continue
        logits = target.logits(medusa_head_outputs(heads, f, k))
        loss = F.cross_entropy(logits, lab, ignore_index=-100)
        loss.backward()
        per_head.append(float(loss.detach()))
    return sum(per_head), per_head


@torch.inference_mode()
def evaluate_medusa(
    heads: nn.Module,
    target: FrozenTarget,
    examples: MedusaExamples,
    max_positions: int | None = None,
    chunk: int = 1024,
) -> dict[str, Any]:
    """Held-out loss and, per head, top-1/top-5 accuracy and the accuracy at each rank r < 10."""
    n = len(examples) if max_positions is None else min(len(examples), max_positions)
    num_heads = examples.labels.shape[1]
    ranks = torch.zeros(num_heads, NUM_RANKS, dtype=torch.float64)
    counts = torch.zeros(num_heads, dtype=torch.float64)
    loss_sum = torch.zeros(num_heads, dtype=torch.float64)
    for a in range(0, n, chunk):
        f = examples.features[a : min(a + chunk, n)].float()
        lab = examples.labels[a : min(a + chunk, n)]
        for k in range(num_heads):
            ok = lab[:, k] >= 0
            if not bool(ok.any()):
                continue
            logits = target.logits(medusa_head_outputs(heads, f[ok], k))
            y = lab[ok, k]
            loss_sum[k] += F.cross_entropy(logits, y, reduction="sum").double()
            top = logits.topk(NUM_RANKS, dim=-1).indices
            ranks[k] += (top == y[:, None]).double().sum(0)
            counts[k] += len(y)
    acc = ranks / counts.clamp(min=1)[:, None]
    return {
        "loss": float((loss_sum / counts.clamp(min=1)).sum()),
        "loss_per_head": [float(x) for x in loss_sum / counts.clamp(min=1)],
        "top1": [float(a[0]) for a in acc],
        "top5": [float(a[:5].sum()) for a in acc],
        "rank_accuracy": [[float(x) for x in a] for a in acc],
        "num_positions": int(counts[0]),
    }


# ------------------------------------------------------------------------------------------- eagle
@dataclass
class EagleBatch:
    """Packed sequences for the EAGLE head: row t of a sequence reads ``(embed(x_{t+1}), f_t)`` at
    position t and is trained to give ``f_{t+1}``; ``mask`` marks the rows in the response (t >= start -
    1); ``next_tokens`` is ``x_{t+2}`` (-1 past the end)."""

    lens: list[int]
    tokens: torch.Tensor  # [T] x_{t+1}
    features: torch.Tensor  # [T, H] f_t (bfloat16)
    targets: torch.Tensor  # [T, H] f_{t+1} (bfloat16)
    positions: torch.Tensor  # [T]
    mask: torch.Tensor  # [T] bool
    next_tokens: torch.Tensor  # [T] int64


def eagle_batches(
    data: DistilData, batch_tokens: int, order: Sequence[int] | None = None
) -> Iterator[EagleBatch]:
    """Sequences (in ``order``) packed into batches of at most ``batch_tokens`` rows (longer ones alone)."""
    order = range(len(data)) if order is None else order
    pending: list[int] = []
    total = 0
    for i in order:
        n = len(data.tokens[i]) - 1
        if n < 1:
            continue
        if pending and total + n > batch_tokens:
            yield _eagle_batch(data, pending)
            pending, total = [], 0
        pending.append(i)
        total += n
    if pending:
        yield _eagle_batch(data, pending)


def _eagle_batch(data: DistilData, seqs: Sequence[int]) -> EagleBatch:
    lens, toks, feats, tgts, pos, mask, nxt = [], [], [], [], [], [], []
    for i in seqs:
        x, f, s = data.tokens[i], data.features[i], data.starts[i]
        n = len(x) - 1
        lens.append(n)
        toks.append(x[1:])
        feats.append(f[:-1])
        tgts.append(f[1:])
        rows = torch.arange(n)
        pos.append(rows)
        mask.append(rows >= s - 1)
        nxt.append(torch.cat([x[2:], torch.full((1,), -1, dtype=torch.int64)]))
    return EagleBatch(
        lens,
        torch.cat(toks),
        torch.cat(feats),
        torch.cat(tgts),
        torch.cat(pos),
        torch.cat(mask),
        torch.cat(nxt),
    )


def _unrolled_inputs(
    batch: EagleBatch, step1: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[int], torch.Tensor]:
    """Inputs of the second (unrolled) step: per sequence of n rows, the n teacher-forced rows again
    followed by n - 1 second-step rows; second-step row u (position u) reads ``(embed(x_{u+1}),
    f̂_u)`` with ``f̂_u`` the first step's output at row u - 1, and attends to the teacher-forced rows
    0..u-1 and to itself.

    Returns (token embeds, features, positions, masks, lengths, index of every second-step row in the
    packed output).
    """
    e_parts, f_parts, p_parts, masks, lens, rows2 = [], [], [], [], [], []
    offset = start = 0
    for n in batch.lens:
        e = embeds[start : start + n]
        f = features[start : start + n]
        s1 = step1[start : start + n]
        m = n - 1
        e_parts += [e, e[1:]]
        f_parts += [f, s1[:-1]]
        p_parts += [torch.arange(n), torch.arange(1, n)]
        mask = torch.zeros(n + m, n + m, dtype=torch.bool)
        mask[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril_()
        if m:
            mask[n:, :n] = torch.ones(m, n, dtype=torch.bool).tril_()  # row u-1 of the block sees 0..u-1
            mask[n:, n:] = torch.eye(m, dtype=torch.bool)
        masks.append(mask)
        lens.append(n + m)
        rows2.append(torch.arange(offset + n, offset + n + m))
        offset += n + m
        start += n
    return (
        torch.cat(e_parts),
        torch.cat(f_parts),
        torch.cat(p_parts),
        masks,
        lens,
        torch.cat(rows2),
    )


def _second_step_rows(batch: EagleBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """For every second-step row u >= 1 of every sequence: its index into the first step's rows (u,
    whose target f_{u+1} and next token it shares) and whether it is trained (u >= start)."""
    idx, start = [], 0
    for n in batch.lens:
        idx.append(torch.arange(start + 1, start + n))
        start += n
    rows = torch.cat(idx)
    prev = rows - 1
    return rows, batch.mask[prev]  # the first-step row u - 1 is in the response


def eagle_forward(
    head: nn.Module,
    target: FrozenTarget,
    batch: EagleBatch,
    unroll: int,
    noise: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Predicted features of each step: a list of ``(predicted [N, H], target [N, H], next tokens [N],
    loss mask [N])``, one entry per step (teacher-forced first, then the unrolled second)."""
    from specdec.attention.dense import DenseAttention, dense_metadata

    device = target.embed.device
    attention = DenseAttention()
    embeds = target.embed[batch.tokens.to(device)]
    features = batch.features.to(device).float()
    if noise > 0:
        features = features + (torch.rand(features.shape, generator=generator) * 2 - 1).to(device) * noise
    positions = batch.positions.to(device)
    step1 = head(embeds, features, positions, (None, None), dense_metadata(batch.lens, device), attention)
    targets = batch.targets.to(device)
    out = [(step1, targets, batch.next_tokens.to(device), batch.mask.to(device))]
    if unroll >= 2:
        e2, f2, p2, masks, lens, rows2 = _unrolled_inputs(batch, step1, embeds, features)
        meta = dense_metadata(lens, device)
        meta.new_token_masks = [m.to(device) for m in masks]
        both = head(e2, f2, p2.to(device), (None, None), meta, attention)
        step2 = both[rows2.to(device)]
        rows, mask2 = _second_step_rows(batch)
        rows = rows.to(device)
        out.append((step2, targets[rows], batch.next_tokens.to(device)[rows], mask2.to(device)))
    return out


def eagle_losses(
    target: FrozenTarget, predicted: torch.Tensor, wanted: torch.Tensor, mask: torch.Tensor, ce_weight: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-1's loss over the masked rows: ``SmoothL1(f̂, f)`` (mean over features and rows) plus
    ``ce_weight`` times the cross-entropy of ``lm_head(f̂)`` against ``softmax(lm_head(f))``.
    Returns (total, feature loss, cross-entropy)."""
    p, w = predicted[mask], wanted[mask].float()
    if len(p) == 0:
        zero = predicted.sum() * 0.0
        return zero, zero.detach(), zero.detach()
    feat = F.smooth_l1_loss(p, w)
    with torch.no_grad():
        target_probs = torch.softmax(target.logits(w), dim=-1)
    logp = torch.log_softmax(target.logits(p), dim=-1)
    ce = -(target_probs * logp).sum(-1).mean()
    return feat + ce_weight * ce, feat.detach(), ce.detach()


@torch.inference_mode()
def evaluate_eagle(
    head: nn.Module,
    target: FrozenTarget,
    data: DistilData,
    max_tokens: int | None = None,
    batch_tokens: int = 1024,
) -> dict[str, Any]:
    """Held-out losses, top-1/top-5 accuracy of the first (teacher-forced) step and top-1 of the second
    (reading its own first prediction) on the response rows, against the target's greedy token
    (``argmax lm_head(f_{t+1})``: the token greedy verification accepts; the sequence's own next token
    with greedy data, not with sampled data)."""
    sums = {
        "feat": 0.0,
        "ce": 0.0,
        "rows": 0,
        "top1": 0.0,
        "top5": 0.0,
        "acc_rows": 0,
        "top1_step2": 0.0,
        "rows2": 0,
    }
    used = 0
    for batch in eagle_batches(data, batch_tokens):
        if max_tokens is not None and used >= max_tokens:
            break
        used += sum(batch.lens)
        steps = eagle_forward(head, target, batch, unroll=2)
        for step, (pred, wanted, nxt, mask) in enumerate(steps):
            rows = mask & (nxt >= 0)
            if not bool(rows.any()):
                continue
            logits = target.logits(pred[rows])
            y = target.logits(wanted[rows].float()).argmax(dim=-1)
            top = logits.topk(5, dim=-1).indices
            hit = top == y[:, None]
            if step == 0:
                n = int(mask.sum())
                _, feat, ce = eagle_losses(target, pred, wanted, mask, 0.0)
                sums["feat"] += float(feat) * n
                sums["ce"] += float(ce) * n
                sums["rows"] += n
                sums["top1"] += float(hit[:, 0].sum())
                sums["top5"] += float(hit.any(-1).sum())
                sums["acc_rows"] += len(y)
            else:
                sums["top1_step2"] += float(hit[:, 0].sum())
                sums["rows2"] += len(y)
    num_rows = max(sums["rows"], 1)
    return {
        "loss_feat": sums["feat"] / num_rows,
        "loss_ce": sums["ce"] / num_rows,
        "top1": sums["top1"] / max(sums["acc_rows"], 1),
        "top5": sums["top5"] / max(sums["acc_rows"], 1),
        "top1_step2": sums["top1_step2"] / max(sums["rows2"], 1),
        "num_positions": int(sums["acc_rows"]),
    }


# ---------------------------------------------------------------------------------------- training
class Schedule:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` of the peak over the
    budget's progress: the larger of elapsed / ``time_budget_s`` and step / total steps (epochs)."""

    def __init__(self, opts: Any, total_steps: int | None) -> None:
        self.opts = opts
        self.total_steps = total_steps
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def progress(self, step: int) -> float:
        p = 0.0
        if self.opts.time_budget_s is not None:
            p = max(p, self.elapsed() / self.opts.time_budget_s)
        if self.total_steps is not None:
            p = max(p, step / max(self.total_steps, 1))
        return min(p, 1.0)

    def done(self, step: int) -> bool:
        if self.total_steps is not None and step >= self.total_steps:
            return True
        return self.opts.time_budget_s is not None and self.elapsed() >= self.opts.time_budget_s

    def lr(self, step: int) -> float:
        o = self.opts
        warm = min(1.0, (step + 1) / o.warmup_steps) if o.warmup_steps > 0 else 1.0
        cos = 0.5 * (1 + math.cos(math.pi * self.progress(step)))
        return o.lr * warm * (o.min_lr_ratio + (1 - o.min_lr_ratio) * cos)


@dataclass
class TrainResult:
    """What a training run produced."""

    module: nn.Module
    metrics: dict[str, Any]  # the final held-out evaluation
    history: list[dict[str, Any]]  # logged training rows
    steps: int
    epochs: float
    train_time_s: float
    positions_seen: int
    initial_loss: float | None
    final_loss: float | None


def initialise_from(module: nn.Module, init_from: str | None, target: FrozenTarget, method: str) -> None:
    """Copy the weights of saved heads (a built-in name or a directory) into ``module`` (fine-tuning
    instead of a fresh initialisation); nothing when ``init_from`` is None.

    Raises:
        ConfigError: unknown heads, or heads of another method.
        CorruptModelError: unreadable heads, or heads of another shape (e.g. another number of heads).
        InvalidRequestError: heads of a target of another hidden or vocabulary size.
    """
    if init_from is None:
        return
    from specdec.drafters.heads import load_heads
    from specdec.errors import CorruptModelError

    saved, _ = load_heads(init_from, target.arch, method, torch.float32, "cpu")
    try:
        module.load_state_dict(saved.state_dict())
    except RuntimeError as e:
        raise CorruptModelError(f"heads {init_from!r} do not fit the heads being trained: {e}") from e
    logger.info("%s heads initialised from %s", method, init_from)


def init_provenance(init_from: str | None) -> dict[str, Any] | None:
    """What ``train.init_from`` heads were trained with (their command, data, steps and time, and their
    own starting point), for the new heads' record; None without ``init_from``."""
    if init_from is None:
        return None
    from specdec.drafters.heads import resolve_heads_dir

    directory = resolve_heads_dir(init_from)
    training = json.loads((directory / "config.json").read_text()).get("training") or {}
    keys = ("command", "data_fingerprint", "num_training_tokens", "steps", "epochs", "train_time_s")
    return {"heads": init_from, **{k: training.get(k) for k in keys}, "init_from": training.get("init_from")}


def train_medusa(
    cfg: TrainConfig,
    target: FrozenTarget,
    train: DistilData,
    heldout: DistilData,
    tracker: Tracker | None = None,
) -> TrainResult:
    """Train ``train.medusa_num_heads`` Medusa heads (see the module docstring)."""
    from specdec.drafters.heads import MedusaHeads

    t = cfg.train
    tracker = tracker or NullTracker()
    torch.manual_seed(t.seed)
    heads = MedusaHeads(target.arch.hidden_size, t.medusa_num_heads).to(t.device)
    initialise_from(heads, t.init_from, target, "medusa")
    examples = medusa_examples(train, t.medusa_num_heads)
    held = medusa_examples(heldout, t.medusa_num_heads)
    if len(examples) == 0:
        raise ValueError("no training positions: the responses are too short")
    batch = min(t.batch_tokens, len(examples))
    steps_per_epoch = math.ceil(len(examples) / batch)
    total_steps = None if t.epochs is None else max(1, round(t.epochs * steps_per_epoch))
    opt = torch.optim.AdamW(heads.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    gen = torch.Generator().manual_seed(t.seed)
    logger.info(
        "medusa: %d heads, %d training positions (batch %d, %d steps an epoch), %d held-out positions",
        t.medusa_num_heads,
        len(examples),
        batch,
        steps_per_epoch,
        len(held),
    )

    def evaluate(limit: int | None) -> dict[str, Any]:
        heads.eval()
        out = evaluate_medusa(heads, target, held, limit) if len(held) else {}
        heads.train()
        return out

    return _train_loop(
        cfg,
        heads,
        opt,
        total_steps,
        steps_per_epoch,
        lambda: _medusa_batches(len(examples), batch, gen),
        lambda idx: _medusa_train_step(heads, target, examples, idx),
        evaluate,
        tracker,
    )


def _medusa_batches(n: int, batch: int, gen: torch.Generator) -> Iterator[torch.Tensor]:
    perm = torch.randperm(n, generator=gen)
    for a in range(0, n, batch):
        yield perm[a : a + batch]


def _medusa_train_step(
    heads: nn.Module, target: FrozenTarget, examples: MedusaExamples, idx: torch.Tensor
) -> tuple[float, dict[str, Any], int]:
    loss, per_head = medusa_step(heads, target, examples.features[idx], examples.labels[idx])
    return loss, {"loss_per_head": per_head}, len(idx)


def train_eagle(
    cfg: TrainConfig,
    target: FrozenTarget,
    train: DistilData,
    heldout: DistilData,
    tracker: Tracker | None = None,
) -> TrainResult:
    """Train the EAGLE head (see the module docstring)."""
    from specdec.drafters.heads import EagleHead

    t = cfg.train
    tracker = tracker or NullTracker()
    torch.manual_seed(t.seed)
    head = EagleHead(target.arch).to(t.device).float()
    initialise_from(head, t.init_from, target, "eagle")
    gen = torch.Generator().manual_seed(t.seed)
    noise_gen = torch.Generator().manual_seed(t.seed + 1)
    steps_per_epoch = sum(1 for _ in eagle_batches(train, t.batch_tokens))
    if steps_per_epoch == 0:
        raise ValueError("no training sequences")
    total_steps = None if t.epochs is None else max(1, round(t.epochs * steps_per_epoch))
    opt = torch.optim.AdamW(head.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    logger.info(
        "eagle: %d training sequences (%d response rows, %d steps an epoch), %d held out, unroll %d",
        len(train),
        train.num_response_tokens,
        steps_per_epoch,
        len(heldout),
        t.eagle_unroll,
    )

    def batches() -> Iterator[EagleBatch]:
        return eagle_batches(train, t.batch_tokens, torch.randperm(len(train), generator=gen).tolist())

    def step(batch: EagleBatch) -> tuple[float, dict[str, Any], int]:
        steps = eagle_forward(head, target, batch, t.eagle_unroll, t.eagle_noise, noise_gen)
        total = torch.zeros(())
        parts: dict[str, Any] = {}
        for i, (pred, wanted, _, mask) in enumerate(steps):
            loss, feat, ce = eagle_losses(target, pred, wanted, mask, t.eagle_ce_weight)
            total = total + loss
            parts[f"loss_feat_step{i + 1}"] = float(feat)
            parts[f"loss_ce_step{i + 1}"] = float(ce)
        total = total / len(steps)
        total.backward()
        return float(total.detach()), parts, int(batch.mask.sum())

    def evaluate(limit: int | None) -> dict[str, Any]:
        head.eval()
        out = evaluate_eagle(head, target, heldout, limit) if len(heldout) else {}
        head.train()
        return out

    return _train_loop(cfg, head, opt, total_steps, steps_per_epoch, batches, step, evaluate, tracker)


def _train_loop(
    cfg: TrainConfig,
    module: nn.Module,
    opt: torch.optim.Optimizer,
    total_steps: int | None,
    steps_per_epoch: int,
    batches: Callable[[], Iterator[Any]],
    step_fn: Callable[[Any], tuple[float, dict[str, Any], int]],
    evaluate: Callable[[int | None], dict[str, Any]],
    tracker: Tracker,
) -> TrainResult:
    """The loop both methods share: schedule, clipping, logging, periodic and final evaluation."""
    t = cfg.train
    module.train()
    sched = Schedule(t, total_steps)
    history: list[dict[str, Any]] = []
    step = epoch = 0
    seen = 0
    recent: list[float] = []
    first_losses: list[float] = []
    last_eval = 0.0
    eval_time = 0.0
    while not sched.done(step):
        for batch in batches():
            if sched.done(step):
                break
            lr = sched.lr(step)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad(set_to_none=True)
            loss, parts, n = step_fn(batch)
            torch.nn.utils.clip_grad_norm_(module.parameters(), t.grad_clip)
            opt.step()
            step += 1
            seen += n
            recent.append(loss)
            if len(first_losses) < t.log_every:
                first_losses.append(loss)
            if step % t.log_every == 0:
                row = {
                    "train/loss": sum(recent) / len(recent),
                    "train/lr": lr,
                    "train/epoch": step / steps_per_epoch,
                    "train/positions": seen,
                    "train/elapsed_s": sched.elapsed(),
                    **{f"train/{k}": v for k, v in parts.items()},
                }
                history.append(row)
                tracker.log(row, step=step)
                logger.info(
                    "step %d (epoch %.2f, %.0f s): loss %.4f, lr %.2e",
                    step,
                    row["train/epoch"],
                    row["train/elapsed_s"],
                    row["train/loss"],
                    lr,
                )
                recent = []
            if sched.elapsed() - last_eval >= t.eval_interval_s and not sched.done(step):
                e0 = time.perf_counter()
                metrics = evaluate(t.eval_max_positions)
                eval_time += time.perf_counter() - e0
                last_eval = sched.elapsed()
                tracker.log({"eval": metrics}, step=step)
                logger.info("held-out (subset) at step %d: %s", step, _brief(metrics))
        epoch += 1
    train_time = sched.elapsed()
    if recent:
        history.append({"train/loss": sum(recent) / len(recent), "train/epoch": step / steps_per_epoch})
    module.eval()
    final = evaluate(None)
    tracker.log({"eval": final}, step=step)
    logger.info("held-out (all) after %d steps, %.0f s: %s", step, train_time, _brief(final))
    last_losses = [h["train/loss"] for h in history[-1:]]
    return TrainResult(
        module,
        final,
        history,
        step,
        step / steps_per_epoch,
        train_time,
        seen,
        sum(first_losses) / len(first_losses) if first_losses else None,
        last_losses[0] if last_losses else None,
    )


def _brief(metrics: dict[str, Any]) -> str:
    keys = ("loss", "top1", "top5", "loss_feat", "loss_ce", "top1_step2")

    def fmt(v: Any) -> str:
        if isinstance(v, list):
            return "[" + ", ".join(f"{x:.3f}" for x in v) + "]"
        return f"{v:.4f}"

    return ", ".join(f"{k} {fmt(metrics[k])}" for k in keys if k in metrics)


# ------------------------------------------------------------------------------------------ saving
def target_name(model: str) -> str:
    """A zoo name as it is; a directory by its last component."""
    p = Path(model).expanduser()
    return p.name if (os.sep in model or p.is_dir()) else model


def default_out_dir(cfg: TrainConfig, run_dir: Path | None) -> Path:
    """``train.out_dir``, else ``specdec/heads/<target>-<method>`` with ``train.install``, else
    ``<run dir>/<target>-<method>``."""
    from specdec.drafters.heads import default_heads_name

    name = default_heads_name(cfg.model.name, cfg.drafter.method)
    if cfg.train.out_dir:
        return Path(cfg.train.out_dir).expanduser()
    if cfg.train.install:
        return HEADS_DIR / name
    if run_dir is None:
        raise ValueError("no run directory: set train.out_dir or train.install=true")
    return run_dir / name


def command_line() -> str:
    """The command that started this process, as ``python -m experiments.train ...``."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name == "train.py":
        return (
            "python -m experiments.train " + shlex.join(argv[1:])
            if len(argv) > 1
            else "python -m experiments.train"
        )
    return shlex.join(argv)


def write_command_md(out_dir: Path, command: str, training: dict[str, Any]) -> None:
    """``COMMAND.md``: the exact command line that produced the heads, and its figures."""
    m = training.get("final_metrics") or {}
    d = training["data"]
    n = training["num_prompts"]
    lines = [
        f"# {out_dir.name}",
        "",
        f"{training['method']} heads for `{training['target']}`, trained by `experiments/train.py`:",
        "",
        "```bash",
        command,
        "```",
        "",
        f"- data: {n['train']} training and {n['heldout']} held-out prompts ({d['num_sequences']} sequences, "
        f"{d['num_tokens']} tokens, {d['num_response_tokens']} of them response tokens); "
        f"{training['num_training_tokens']} response tokens trained on; fingerprint "
        f"`{training['data_fingerprint'][:16]}`",
        f"- generation: `{json.dumps(d['generation'])}`; {d.get('generation_time_s', 0):.0f} s, then "
        f"{d.get('feature_time_s', 0):.0f} s for the features",
        f"- training: {training['train_time_s']:.0f} s, {training['steps']} steps, "
        f"{training['epochs']:.2f} epochs; seeds `{json.dumps(training['seeds'])}`",
    ]
    init = training.get("init_from")
    if init:
        lines.append(
            f"- started from the heads `{init['heads']}` ({init['train_time_s']:.0f} s, {init['steps']} "
            f"steps on data `{str(init['data_fingerprint'])[:16]}`, by `{init['command']}`)"
        )
    if "rank_accuracy" in m:
        for k, ranks in enumerate(m["rank_accuracy"]):
            lines.append(
                f"- head {k + 1} (token t+{k + 2}), held out: top-1 {m['top1'][k]:.3f}, top-5 "
                f"{m['top5'][k]:.3f}; accuracy at ranks 0-9: " + " ".join(f"{x:.3f}" for x in ranks)
            )
    elif "top1" in m:
        lines.append(
            f"- held out, first step (teacher-forced): top-1 {m['top1']:.3f}, top-5 {m['top5']:.3f}; "
            f"second step (reading its own prediction): top-1 {m['top1_step2']:.3f}"
        )
    tau = training.get("tau")
    if tau and tau.get("tau") is not None:
        per_pos = " ".join(f"{x:.2f}" for x in tau.get("accepted_per_position") or [])
        lines.append(
            f"- tau on {tau['num_prompts']} held-out prompts (greedy, batch 1): {tau['tau']:.2f}; "
            f"acceptance per position {per_pos}"
        )
    (out_dir / "COMMAND.md").write_text("\n".join(lines) + "\n")


# -------------------------------------------------------------------------------------- evaluation
def evaluate_tau(
    cfg: TrainConfig,
    heads_dir: Path,
    prompt_ids: Sequence[Sequence[int]],
    categories: Sequence[str],
    llm_factory: LLMFactory | None = None,
) -> dict[str, Any]:
    """τ and acceptance per position of ``specdec.LLM`` with the heads in ``heads_dir``, greedy, batch 1,
    over ``prompt_ids`` (counts summed over prompts; per category too)."""
    from experiments.run import run_pass

    spec = cfg.drafter.speculative_config()
    assert spec is not None
    spec["model"] = str(heads_dir)

    def make(speculative_config: dict[str, Any] | None) -> Any:
        from specdec import LLM

        return LLM(
            cfg.model.name,
            dtype=cfg.model.dtype.value,
            device=cfg.train.device,
            seed=cfg.train.seed,
            speculative_config=speculative_config,
        )

    llm = (llm_factory or make)(spec)
    records = run_pass(
        llm,
        prompt_ids,
        SamplingConfig(),
        cfg.train.eval_max_tokens,
        warmup_ids=prompt_ids[0][:16] if prompt_ids else None,
        pass_name="eval",
    )
    del llm
    gc.collect()

    def aggregate(recs: Sequence[dict[str, Any]]) -> dict[str, Any]:
        drafts = sum(r["spec"]["num_drafts"] for r in recs if r["spec"])
        drafted = sum(r["spec"]["num_draft_tokens"] for r in recs if r["spec"])
        accepted = sum(r["spec"]["num_accepted_tokens"] for r in recs if r["spec"])
        per_pos: list[int] = []
        for r in recs:
            for i, x in enumerate((r["spec"] or {}).get("accepted_per_position") or []):
                per_pos += [0] * (i + 1 - len(per_pos))
                per_pos[i] += x
        tokens = sum(r["num_tokens"] for r in recs)
        secs = sum(r["time_s"] for r in recs)
        return {
            "num_prompts": len(recs),
            "tau": 1 + accepted / drafts if drafts else None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "accepted_per_position": [x / drafts for x in per_pos] if drafts else None,
            "num_drafts": drafts,
            "tokens": tokens,
            "tokens_per_s": tokens / secs if secs else None,
        }

    out = aggregate(records)
    by_cat: dict[str, list[dict[str, Any]]] = {}
    for c, r in zip(categories, records):
        by_cat.setdefault(c, []).append(r)
    out["per_category"] = {c: aggregate(rs) for c, rs in by_cat.items()}
    return out


# ------------------------------------------------------------------------------------------- main
def _prompts_and_ids(
    cfg: TrainConfig, prompt_ids: Sequence[Sequence[int]] | None
) -> tuple[list[Prompt], list[list[int]]]:
    if prompt_ids is not None:
        prompts = [Prompt(f"given/{i}", "given", token_ids=list(ids)) for i, ids in enumerate(prompt_ids)]
        return prompts, [list(p) for p in prompt_ids]
    from experiments.run import load_tokenizer, prompt_token_ids

    prompts = training_prompts(cfg.data)
    if not prompts:
        raise ValueError("no prompts: data.builtin_limit and data.chat_limit are both 0")
    tokenizer = load_tokenizer(cfg.model.name)
    if tokenizer is None:
        raise ValueError(f"model {cfg.model.name} has no tokenizer: pass prompt token ids")
    return prompts, prompt_token_ids(tokenizer, prompts)


def run_training(
    cfg: TrainConfig,
    run_dir: str | Path | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    tracker: Tracker | None = None,
    llm_factory: LLMFactory | None = None,
) -> dict[str, Any]:
    """Data, training, saving and (``train.eval``) evaluation; returns the summary (also written to
    ``run_dir/summary.json`` with ``config.yaml`` and ``run_info.json``, when ``run_dir`` is given).

    Args:
        cfg: a validated config (:func:`experiments.config.to_train_config`).
        run_dir: the run directory (None: files only in the heads' directory).
        prompt_ids: token-id prompts to use instead of the built-in prompt sets (e.g. a model without a
            tokenizer); their ids are ``given/<i>``.
        tracker: where losses and accuracies are logged (default: nowhere). The caller finishes it.
        llm_factory: how the evaluation builds its ``LLM`` (default: ``specdec.LLM`` of the target).
    """
    from specdec.drafters.heads import HeadConfig, arch_fields, save_heads
    from specdec.zoo import resolve_model

    tracker = tracker or NullTracker()
    t_start = time.perf_counter()
    threads_before = torch.get_num_threads()
    if cfg.train.torch_threads is not None:
        torch.set_num_threads(cfg.train.torch_threads)
    run_dir = None if run_dir is None else Path(run_dir)
    command = command_line()
    seeds = {"data": cfg.data.seed, "prompts": cfg.data.prompt_seed, "train": cfg.train.seed}
    info = run_info(seeds, cfg.train.device)
    if run_dir is not None:
        write_run_files(run_dir, config_to_dict(cfg), info)
    try:
        model_dir = resolve_model(cfg.model.name)
        prompts, ids = _prompts_and_ids(cfg, prompt_ids)
        from experiments.run import has_tokenizer

        data = prepare_data(
            cfg, prompts, ids, model_dir, skip_tokenizer_init=not has_tokenizer(cfg.model.name)
        )
        train, heldout = data.subset(False), data.subset(True)
        logger.info(
            "%d training sequences (%d response tokens), %d held out (%d response tokens)",
            len(train),
            train.num_response_tokens,
            len(heldout),
            heldout.num_response_tokens,
        )
        target = FrozenTarget.load(model_dir, cfg.train.device)
        provenance = init_provenance(cfg.train.init_from)  # read before install may overwrite them
        if isinstance(cfg.drafter, MedusaDrafterConfig):
            result = train_medusa(cfg, target, train, heldout, tracker)
            num_heads, arch = cfg.train.medusa_num_heads, None
        elif isinstance(cfg.drafter, EagleDrafterConfig):
            result = train_eagle(cfg, target, train, heldout, tracker)
            num_heads, arch = 1, arch_fields(target.arch)
        else:  # validate_train_config refuses it
            raise ValueError(f"cannot train drafter {cfg.drafter.method}")
        out_dir = default_out_dir(cfg, run_dir)
        data_meta = {
            k: v for k, v in data.meta.items() if k not in ("directory", "cached", "responses_cached")
        }
        training: dict[str, Any] = {
            "command": command,
            "method": cfg.drafter.method,
            "target": cfg.model.name,
            "data_fingerprint": data.meta["fingerprint"],
            "data": data_meta,
            "heldout_fraction": cfg.data.heldout_fraction,
            "seeds": seeds,
            "num_prompts": {
                "train": len({prompt_id_of(i) for i in train.ids}),
                "heldout": len({prompt_id_of(i) for i in heldout.ids}),
            },
            "num_training_tokens": train.num_response_tokens,
            "positions_seen": result.positions_seen,
            "steps": result.steps,
            "epochs": result.epochs,
            "train_time_s": result.train_time_s,
            "init_from": provenance,
            "options": config_to_dict(cfg.train),
            "final_metrics": result.metrics,
            "initial_train_loss": result.initial_loss,
            "final_train_loss": result.final_loss,
            "git": info["git"],
            "versions": package_versions(),
        }
        head_cfg = HeadConfig(
            method=cfg.drafter.method,
            target=target_name(cfg.model.name),
            hidden_size=target.arch.hidden_size,
            vocab_size=target.arch.vocab_size,
            num_heads=num_heads,
            arch=arch,
            training=training,
        )
        save_heads(result.module, head_cfg, out_dir)
        write_command_md(out_dir, command, training)
        size = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
        logger.info("heads saved to %s (%.1f MB)", out_dir, size / 1e6)
        tau = None
        if cfg.train.eval:
            held_prompts = [
                p for p, h in zip(prompts, split_heldout(prompts, cfg.data.heldout_fraction)) if h
            ]
            held_ids = [i for i, h in zip(ids, split_heldout(prompts, cfg.data.heldout_fraction)) if h]
            k = cfg.train.eval_prompts
            tau = evaluate_tau(
                cfg, out_dir, held_ids[:k], [p.category for p in held_prompts[:k]], llm_factory
            )
            training["tau"] = tau
            head_cfg.training = training
            save_heads(result.module, head_cfg, out_dir)  # the evaluation joins the provenance
            write_command_md(out_dir, command, training)
            tracker.log_summary({"tau": {k: v for k, v in tau.items() if k != "per_category"}})
        summary: dict[str, Any] = {
            "out_dir": str(out_dir),
            "size_bytes": size,
            "data_dir": data.meta["directory"],
            "data_cached": data.meta["cached"],
            "responses_cached": data.meta.get("responses_cached", True),
            "history": result.history,
            **{k: v for k, v in training.items() if k not in ("versions", "git")},
            "git": info["git"],
            "versions": info["versions"],
            "wall_time_s": time.perf_counter() - t_start,
        }
    finally:
        torch.set_num_threads(threads_before)
    tracker.log_summary(
        {
            "final": result.metrics,
            "train_time_s": result.train_time_s,
            "steps": result.steps,
            "epochs": result.epochs,
            "num_training_tokens": training["num_training_tokens"],
        }
    )
    if run_dir is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    """A few lines: data, time, held-out accuracy, τ."""
    m = summary["final_metrics"]
    n = summary["num_prompts"]
    lines = [
        f"{summary['method']} heads for {summary['target']} -> {summary['out_dir']} "
        f"({summary['size_bytes'] / 1e6:.1f} MB)",
        f"data: {n['train']} + {n['heldout']} held-out prompts, {summary['num_training_tokens']} training "
        f"response tokens ({'cached' if summary['data_cached'] else 'generated'}: {summary['data_dir']})",
        f"training: {summary['train_time_s']:.0f} s, {summary['steps']} steps, "
        f"{summary['epochs']:.2f} epochs; train loss {summary['initial_train_loss']:.4f} -> "
        f"{summary['final_train_loss']:.4f}",
        f"held-out: {_brief(m)}",
    ]
    if "rank_accuracy" in m:
        for k, ranks in enumerate(m["rank_accuracy"]):
            lines.append(f"  head {k + 1} accuracy at ranks 0..9: " + " ".join(f"{x:.3f}" for x in ranks))
    tau = summary.get("tau")
    if tau and tau.get("tau") is not None:
        per_pos = tau.get("accepted_per_position") or []
        lines.append(
            f"tau {tau['tau']:.2f} on {tau['num_prompts']} held-out prompts; acceptance per position "
            + " ".join(f"{x:.2f}" for x in per_pos)
        )
    return "\n".join(lines)


register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="train")
def main(dcfg: DictConfig) -> dict[str, Any]:
    """Hydra entry point: compose and check the config (before any model loads), train, save, print."""
    from hydra.core.hydra_config import HydraConfig

    cfg = to_train_config(dcfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    summary = run_tracked(
        cfg, run_dir, lambda tracker: run_training(cfg, run_dir, tracker=tracker), job_type="train"
    )
    print(format_summary(summary))
    print(f"wall time {summary['wall_time_s']:.1f} s; run files in {run_dir}")
    return {k: v for k, v in summary.items() if k not in ("git", "versions", "history")}


if __name__ == "__main__":
    main()
