"""Building an engine's parts: the target, the drafter (from the registry), the KV pool's size, packing.

Order matters and is fixed here: checks that need only configs run before any weights load (the
drafter's ``check_target``), the drafter is built from the target's dense weights (the quantized
self-drafter copies them), the pool is sized from the target's and the drafter's own KV bytes per
block, and only then are the bfloat16 linears packed for oneDNN.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.config import CacheConfig, CompilationConfig, SchedulerConfig, SpeculativeConfig, resolve_dtype
from specdec.drafters.base import Drafter, DrafterContext
from specdec.drafters.registry import build_drafter, get_drafter
from specdec.engine.huge_pages import zeros_on_huge_pages
from specdec.kv_cache.manager import KVCacheManager, cdiv
from specdec.model_runner import ModelRunner
from specdec.models.config import ModelArchConfig
from specdec.models.cpu_linear import use_gemv_linears, use_packed_weights
from specdec.models.decoder import DecoderLM, use_cpu_layer_ops
from specdec.models.loader import load_model
from specdec.models.packed_linear import pack_linears
from specdec.quantization.config import QuantizationConfig
from specdec.scheduler import Scheduler


@dataclass
class EngineParts:
    """What :func:`build_engine_parts` returns.

    Attributes:
        model: the target (linears packed where that pays); None for an engine on a fake runner.
        model_cfg: the target's architecture (vocabulary, EOS ids, maximum positions).
        drafter: the drafter with its KV bound, or None without speculation.
        max_model_len: longest sequence, capped at the model's maximum.
        num_kv_blocks: blocks in the pool (the target's and the drafter's KV share its geometry).
        runner: the target's model runner over the pool (anything with ``prepare``, ``execute``,
            ``execute_with_hidden``, ``copy_slots``, ``kv_caches``: see ``tests/engine/fake_runner.py``).
        generator: the engine's generator (requests without a seed).
    """

    model: DecoderLM | None
    model_cfg: ModelArchConfig
    drafter: Drafter | None
    max_model_len: int
    num_kv_blocks: int
    runner: ModelRunner
    generator: torch.Generator


def build_engine_parts(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    seed: int,
    model: DecoderLM | None,
    speculative_config: SpeculativeConfig | None,
    draft_model_dir: str | Path | None,
    quantization: QuantizationConfig | None,
    compilation: CompilationConfig | None = None,
) -> EngineParts:
    """Load (or take) the target, build the drafter, size the KV pool and pack the linears.

    Raises:
        Whatever the drafter's ``check_target`` raises, before any weights load (e.g.
        ``InvalidRequestError`` for a draft model of another vocabulary); the loader's errors
        (``CorruptModelError``, ...); the drafter's construction errors; ``ConfigError`` for a drafter
        that breaks the Protocol.
    """
    spec = speculative_config
    model_dir_of_drafter = Path(draft_model_dir) if draft_model_dir is not None else None
    if spec is not None:
        check_target = get_drafter(spec.method).check_target
        if check_target is not None:
            arch = model.cfg if model is not None else ModelArchConfig.from_pretrained(model_dir)
            check_target(arch, spec, model_dir_of_drafter)
    if model is None:
        model = load_model(model_dir, dtype=dtype, device=device, quantization=quantization)
    cfg = model.cfg
    max_model_len = min(
        scheduler_config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
    )
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    drafter = None
    if spec is not None:
        draft_dtype = resolve_dtype(spec.draft_dtype or dtype)
        ctx = DrafterContext(model, spec, model_dir_of_drafter, draft_dtype, device, generator, compilation)
        drafter = build_drafter(ctx)
    # EAGLE-3 reads the target's residual streams at chosen layers instead of its final features (reset
    # otherwise: a model object may be reused by another engine).
    layers = getattr(drafter, "feature_layers", None) or ()
    if layers or getattr(model, "feature_layers", ()):
        model.set_feature_layers(layers)
    bs = cache_config.block_size
    num_blocks = cache_config.num_kv_blocks
    if num_blocks is None:
        per_block = ModelRunner.kv_bytes_per_block(model, bs, dtype, cache_config.kv_cache_dtype)
        if drafter is not None:
            per_block += drafter.kv_bytes_per_block(bs)
        wanted = scheduler_config.max_num_seqs * cdiv(max_model_len, bs)
        num_blocks = max(1, min(wanted, cache_config.kv_cache_memory_bytes // per_block))
    if drafter is not None:
        drafter.bind_kv(num_blocks, bs)
    # Last, so that drafters built from the target's weights (quantized_self) read them in their dense
    # form: few-row products through the CPU GEMV kernel where it builds, else bfloat16 linears
    # pre-packed for oneDNN (eager only: inductor cannot trace packed weights, and freezes its own).
    memo: dict[int, Any] = {}  # modules a draft model shares with the target are swapped once
    compiled = compilation is not None and compilation.enabled
    for m in (model, *drafter_modules(drafter)):
        if use_gemv_linears(m, memo) == 0 and not compiled:
            pack_linears(m, memo)
        if not compiled:  # verification / batched rows, prefill chunks: packed (tiles or oneDNN); int8 tiles
            use_packed_weights(m)
        use_cpu_layer_ops(m)  # norms, RoPE and SiLU products through the CPU kernels where they build
    runner = ModelRunner(
        model,
        num_blocks,
        bs,
        kv_cache_dtype=cache_config.kv_cache_dtype,
        compilation=compilation,
        kv_zeros=zeros_on_huge_pages if cache_config.kv_huge_pages else None,
    )
    bind_target_kv = getattr(drafter, "bind_target_kv", None)
    if bind_target_kv is not None:
        bind_target_kv(runner)
    return EngineParts(model, cfg, drafter, max_model_len, num_blocks, runner, generator)


def drafter_modules(drafter: Drafter | None) -> list[torch.nn.Module]:
    """The drafter's own networks whose linears take the target's CPU path (:func:`use_gemv_linears`):
    a draft model (``drafter.model``, a :class:`DecoderLM`), an EAGLE / EAGLE-3 head (``drafter.head``),
    Medusa's heads (``drafter.heads``). A draft step runs them on one or a few rows, where ``F.linear``
    streams bfloat16 weights at half the kernel's speed (an EAGLE-3 draft step spent 6.4 of its 10.9 ms
    there)."""
    found = []
    for name in ("model", "head", "heads"):
        module = getattr(drafter, name, None)
        if isinstance(module, torch.nn.Module) and (name != "model" or isinstance(module, DecoderLM)):
            found.append(module)
    for member in getattr(drafter, "members", None) or ():  # the hybrid's learned member
        found += drafter_modules(member)
    return found


def release_window(cfg: ModelArchConfig, drafter: Drafter | None, block_size: int) -> int | None:
    """The sliding window behind which the block manager releases a request's KV blocks
    (``KVCacheManager(sliding_window=...)``), or None to keep every block.

    Only when every layer of the target is windowed (:attr:`ModelArchConfig.uniform_sliding_window`):
    with one global layer (Gemma 2/3 as released) every key stays readable, and the attention merely
    skips the blocks outside the windowed layers' windows. And only when the drafter keeps no KV of its
    own on the target's block tables (``kv_bytes_per_block`` 0: n-gram, suffix, Medusa, none): a draft
    model catches up lazily from the last position it saw, which may lie before the target's window, and
    its own layers need not be windowed (EAGLE heads attend globally: ``heads.head_arch``). An engine whose
    ``drafter`` is replaced after building keeps the window chosen here.
    """
    window = cfg.uniform_sliding_window
    if window is None or (drafter is not None and drafter.kv_bytes_per_block(block_size) > 0):
        return None
    return window


def build_scheduler(
    parts: EngineParts,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    spec: SpeculativeConfig | None,
) -> tuple[KVCacheManager, Scheduler]:
    """The block manager over ``parts.num_kv_blocks`` blocks and the scheduler that reserves, per
    drafting request and step, ``spec.num_draft_slots`` KV slots (k for chains, the tree size for trees,
    k per member for a hybrid union), and ``spec.num_forced_draft_slots`` more for a constrained request
    under grammar-aware drafting.
    Under a sliding window on every layer the manager releases blocks behind it (:func:`release_window`)."""
    window = release_window(parts.model_cfg, parts.drafter, cache_config.block_size)
    kv = KVCacheManager(
        parts.num_kv_blocks, cache_config.block_size, cache_config.enable_prefix_caching, window
    )
    k, slots = (spec.num_speculative_tokens, spec.num_draft_slots) if spec else (0, 0)
    forced = spec.num_forced_draft_slots if spec else 0
    return kv, Scheduler(scheduler_config, kv, parts.max_model_len, k, slots, forced)
