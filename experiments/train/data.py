"""The self-distillation data: sequences of prompt + the target's response with the target's features,
cached under ``<specdec cache>/train/<fingerprint[:16]>/`` and split by prompt.

The cache key (:func:`data_fingerprint`) covers the model, the dtype, the prompts' token ids, the
generation settings and the seed, so a second run (the other method, another budget) skips generation.
The responses (:mod:`experiments.train.generation`) are cached first, then the features
(:mod:`experiments.train.features`) with them as ``data.safetensors`` and ``meta.json``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from experiments.config import TrainConfig, TrainDataConfig
from experiments.datasets import Prompt
from experiments.train.features import featurise
from experiments.train.generation import generate_responses, read_responses, write_responses
from experiments.train.prompts import prompt_id_of, split_heldout

logger = logging.getLogger("experiments.train")

#: Bump when the cached data's layout or meaning changes (it is part of the fingerprint).
DATA_FORMAT_VERSION = 1


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
        top_tokens: with ``data.feature_layers`` (EAGLE-3), per sequence ``[L]`` int32 the target's top
            token after each position; the features are then ``[L, (n + 1) H]`` (the ``n`` layers'
            streams, then ``f_t``). None otherwise.
    """

    tokens: list[torch.Tensor]
    starts: list[int]
    features: list[torch.Tensor]
    ids: list[str]
    categories: list[str]
    heldout: list[bool] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    top_tokens: list[torch.Tensor] | None = None

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
            None if self.top_tokens is None else [self.top_tokens[i] for i in keep],
        )

    def final_features(self, hidden_size: int) -> DistilData:
        """The same sequences with only the final-norm features ``[L, H]`` (the last ``hidden_size``
        columns of EAGLE-3 data; data without fused layers is returned as it is)."""
        if self.top_tokens is None:
            return self
        return replace(self, features=[f[:, -hidden_size:] for f in self.features], top_tokens=None)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def num_response_tokens(self) -> int:
        return sum(len(t) - s for t, s in zip(self.tokens, self.starts))


# ------------------------------------------------------------------------------------ fingerprint
def model_identity(model_dir: Path) -> dict[str, Any]:
    """What identifies a model directory's weights cheaply: its config and its weight files' sizes."""
    config = model_dir / "config.json"
    return {
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
        "weights": sorted((p.name, p.stat().st_size) for p in model_dir.glob("*.safetensors")),
    }


def data_fingerprint(
    model: str,
    model_dir: Path,
    dtype: str,
    prompt_ids: Sequence[Sequence[int]],
    data: TrainDataConfig,
    feature_layers: Sequence[int] | None = None,
) -> str:
    """sha256 of everything the cached data depends on: the model, the dtype, every prompt's token ids
    and the generation settings and seed (not the split, computed when the data is loaded), and the
    feature layers when set (the responses are keyed without them, so every kind of features reuses
    one generation)."""
    prompts = hashlib.sha256(json.dumps([list(map(int, p)) for p in prompt_ids]).encode()).hexdigest()
    key: dict[str, Any] = {
        "version": DATA_FORMAT_VERSION,
        "model": model,
        "model_identity": model_identity(model_dir),
        "dtype": dtype,
        "prompts": prompts,
        "generation": _generation_settings(data),
    }
    if feature_layers:
        key["feature_layers"] = [int(i) for i in feature_layers]
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def resolve_feature_layers(data: TrainDataConfig, model_dir: Path) -> list[int] | None:
    """``data.feature_layers`` with ``[]`` replaced by EAGLE-3's default layers of the target.

    Raises:
        ValueError: a layer index above the target's number of layers.
    """
    if data.feature_layers is None:
        return None
    from specdec.drafters.eagle3_head import default_feature_layers
    from specdec.models.config import ModelArchConfig

    num_layers = ModelArchConfig.from_pretrained(model_dir).num_layers
    layers = list(data.feature_layers) or list(default_feature_layers(num_layers))
    bad = [i for i in layers if i > num_layers]
    if bad:
        raise ValueError(f"data.feature_layers {bad} exceed the target's {num_layers} layers")
    return layers


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


# -------------------------------------------------------------------------------------- on disk
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
    if data.top_tokens is not None:
        tensors["top_tokens"] = torch.cat(data.top_tokens).to(torch.int32)
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
    top = tensors.get("top_tokens")
    return DistilData(
        [tokens[a:b] for a, b in spans],
        [int(s) for s in tensors["starts"].tolist()],
        [features[a:b] for a, b in spans],
        list(meta.pop("ids")),
        list(meta.pop("categories")),
        [],
        meta,
        None if top is None else [top[a:b] for a, b in spans],
    )


# ---------------------------------------------------------------------------------------- making
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
    layers = resolve_feature_layers(data, model_dir)
    fingerprint = data_fingerprint(cfg.model.name, model_dir, cfg.model.dtype.value, prompt_ids, data, layers)
    root = Path(data.cache_dir).expanduser() if data.cache_dir else default_cache_dir()
    directory = root / fingerprint[:16]
    meta_file = directory / "meta.json"
    if meta_file.is_file() and json.loads(meta_file.read_text()).get("fingerprint") == fingerprint:
        logger.info("distillation data from the cache: %s", directory)
        dd = load_data(directory)
        dd.meta["cached"] = True
    else:
        dd = _make_data(
            cfg, prompts, prompt_ids, model_dir, fingerprint, directory, skip_tokenizer_init, layers
        )
    dd.meta["directory"] = str(directory)
    by_id = {p.id: h for p, h in zip(prompts, split_heldout(prompts, data.heldout_fraction))}
    dd.heldout = [by_id[prompt_id_of(i)] for i in dd.ids]
    return dd


def _make_data(
    cfg: TrainConfig,
    prompts: Sequence[Prompt],
    prompt_ids: Sequence[Sequence[int]],
    model_dir: Path,
    fingerprint: str,
    directory: Path,
    skip_tokenizer_init: bool,
    feature_layers: list[int] | None = None,
) -> DistilData:
    """Generate the responses (or read them from their cache file), featurise and save the data."""
    data, dtype = cfg.data, cfg.model.dtype.value
    # The responses do not depend on the features: keyed by the fingerprint without feature layers.
    responses_key = data_fingerprint(cfg.model.name, model_dir, dtype, prompt_ids, data)
    responses_file = directory.parent / f"{responses_key[:16]}.responses.json"
    cached = read_responses(responses_file, responses_key)
    if cached is not None:
        logger.info("responses from the cache: %s", responses_file)
        responses, gen_s = cached
    else:
        logger.info("generating distillation data for %d prompts into %s", len(prompt_ids), directory)
        t0 = time.perf_counter()
        responses = generate_responses(
            cfg.model.name, prompt_ids, data, dtype, cfg.train.device, skip_tokenizer_init
        )
        gen_s = time.perf_counter() - t0
        write_responses(responses_file, responses_key, gen_s, responses)
    sequences, starts, ids, categories = _sequences(prompts, prompt_ids, responses)
    t1 = time.perf_counter()
    features, top_tokens = featurise(
        model_dir, dtype, cfg.train.device, sequences, data.feature_batch_tokens, feature_layers, starts
    )
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
        "feature_layers": feature_layers,
    }
    dd = DistilData(sequences, starts, features, ids, categories, [], meta, top_tokens)
    save_data(directory, dd)
    dd.meta["cached"] = False
    dd.meta["responses_cached"] = cached is not None
    logger.info(
        "data: %d sequences, %d tokens (%d response); generation %.0f s, features %.0f s",
        len(sequences),
        meta["num_tokens"],
        meta["num_response_tokens"],
        gen_s,
        feat_s,
    )
    return dd


def _sequences(
    prompts: Sequence[Prompt],
    prompt_ids: Sequence[Sequence[int]],
    responses: Sequence[Sequence[Sequence[int]]],
) -> tuple[list[torch.Tensor], list[int], list[str], list[str]]:
    """Prompt + response token ids of every response, its response start, sequence id and category."""
    sequences, starts, ids, categories = [], [], [], []
    for p, pids, resp in zip(prompts, prompt_ids, responses):
        for j, r in enumerate(resp):
            sequences.append(torch.tensor(list(pids) + list(r), dtype=torch.int64))
            starts.append(len(pids))
            ids.append(p.id if len(resp) == 1 else f"{p.id}#{j}")
            categories.append(p.category)
    return sequences, starts, ids, categories


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
        None if any(p.top_tokens is None for p in parts) else [t for p in parts for t in p.top_tokens or []],
    )
