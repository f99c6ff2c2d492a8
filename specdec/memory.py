"""Memory and speed calculator: weight bytes, KV bytes per token and per request, how many requests a
memory budget holds, and the bandwidth floor of a decode step, from a model's ``config.json`` alone.

    python -m specdec.memory --model smollm2-135m-instruct --context 2048 --batch 8 \\
        --dtype bfloat16 --quantization int4 --kv-cache-dtype int8 --memory-gib 4 --bandwidth-gbs 30

Definitions (all in bytes; GB = 10^9, GiB = 2^30):

- **weight bytes**: what the engine holds for the model: the embedding table, norms and biases in
  ``dtype``; every linear layer dense in ``dtype``, or quantized at its packed size, codes plus scales (and
  zeros) exactly as :class:`~specdec.quantization.linear.QuantizedLinear` stores them
  (:func:`~specdec.quantization.linear.quantized_nbytes`); a tied LM head is free when dense and a
  separate matrix when quantized.
- **KV bytes per token**: ``layers × 2 × KV heads × head size × element size`` (``"auto"``: the model's
  dtype), or ``layers × 2 × KV heads × (head size + 4)`` for int8 (one float32 scale per token and head);
  per request: × ``context`` tokens, and the engine allocates whole blocks: ``ceil(context / block_size)``
  blocks. A request with a prompt of P tokens and ``max_tokens`` M holds P + M - 1 tokens of KV at its
  longest (the last token is never fed back). Speculative decoding also reserves k slots per step, and a
  draft model has a KV cache of its own (the quantized self-drafter shares the target's): not counted here.
- **requests a budget holds**: KV blocks in the budget (``memory_bytes`` minus the weights, or a KV budget
  ``kv_cache_memory_bytes`` as ``LLM`` takes) ÷ blocks per request, rounded down: the number of requests
  of ``context`` tokens that run at once without preemption.
- **sliding windows** (Mistral, Gemma 2/3, windowed Qwen/Phi-3 configs): a windowed layer's attention
  reads only the last ``sliding_window`` tokens of KV, so its share of the KV read per step is
  ``min(context, sliding_window)`` tokens (``kv_read_bytes_per_request``). The bytes held, the blocks per
  request and the requests a budget holds stay those of full attention: the peak. With some global layer
  (Gemma 2/3) the engine keeps every token's KV; when *every* layer is windowed (Mistral, windowed
  Phi-3/Qwen configs) and no drafter keeps KV of its own, it releases the blocks wholly behind a
  request's window as it decodes (``specdec.kv_cache.manager``), so a decoding request then holds
  about ``ceil(sliding_window / block_size) + 1`` blocks (plus its draft slots), but a prompt still
  holds the whole of its last prefill chunk, which this calculator does not know.
- **bandwidth floor of a decode step**: the bytes one step must read, ÷ the memory read bandwidth (given,
  or measured by :func:`measure_read_bandwidth`). A step at batch B reads every weight once (the embedding
  table only in B rows, unless it is also the dense LM head) and each request's KV inside the windows:
  ``weight_read_bytes + B × kv_read_bytes_per_request`` (``context × KV bytes per token`` without
  windows). ``floor_tokens_per_s = B / floor_step_s``
  is the fastest plain decoding can go; real steps are slower (compute, small matrix-vector products
  that do not reach streaming bandwidth, Python), see the README's figures.

Only ``config.json`` is read: no weights are loaded (a zoo model not yet converted is fetched first, as
``LLM`` would).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.config import resolve_dtype
from specdec.errors import ConfigError, SpecdecError
from specdec.models.config import ModelArchConfig
from specdec.quantization.config import QuantizationConfig
from specdec.quantization.kv_cache import check_kv_cache_dtype, kv_bytes_per_token
from specdec.quantization.linear import quantized_nbytes

GIB = 1024**3


@dataclass
class MemoryEstimate:
    """What :func:`estimate` computes (bytes unless named otherwise)."""

    model: str
    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    context: int
    batch: int
    block_size: int
    num_params: int
    weight_bytes: int
    weight_read_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    kv_bytes_per_request: int
    kv_read_bytes_per_request: int
    kv_blocks_per_request: int
    kv_budget_bytes: int | None
    num_kv_blocks: int | None
    max_requests: int | None
    step_read_bytes: int
    bandwidth_bytes_per_s: float
    bandwidth_measured: bool
    floor_step_s: float
    floor_tokens_per_s: float

    def summary(self) -> str:
        def mb(n: float) -> str:
            return f"{n / 1e6:,.1f} MB"

        lines = [
            f"model              {self.model} ({self.num_params / 1e6:,.1f} M parameters)",
            f"dtype              {self.dtype}, quantization {self.quantization or 'none'}, "
            f"KV cache {self.kv_cache_dtype}",
            f"weights            {mb(self.weight_bytes)} held, {mb(self.weight_read_bytes)} read per step",
            f"KV per token       {self.kv_bytes_per_token:,} bytes",
            f"KV per request     {mb(self.kv_bytes_per_request)} ({self.context} tokens; "
            f"{self.kv_blocks_per_request} blocks of {self.block_size})",
        ]
        if self.kv_read_bytes_per_request != self.kv_bytes_per_request:
            lines.append(
                f"KV read per step   {mb(self.kv_read_bytes_per_request)} per request (sliding windows)"
            )
        if self.max_requests is not None:
            lines.append(
                f"budget             {mb(self.kv_budget_bytes or 0)} for KV = {self.num_kv_blocks} blocks "
                f"= {self.max_requests} requests of {self.context} tokens"
            )
        how = "measured" if self.bandwidth_measured else "given"
        lines.append(
            f"decode step        {mb(self.step_read_bytes)} read at batch {self.batch} / "
            f"{self.bandwidth_bytes_per_s / 1e9:.1f} GB/s ({how}) = {self.floor_step_s * 1e3:.2f} ms "
            f"floor, at most {self.floor_tokens_per_s:,.1f} tokens/s"
        )
        return "\n".join(lines)


def measure_read_bandwidth(
    num_bytes: int = GIB, repeats: int = 5, device: str | torch.device = "cpu", huge_pages: bool = False
) -> float:
    """Best-of-``repeats`` streaming read bandwidth in bytes/s: ``torch.sum`` over ``num_bytes`` of
    float32 (the same measurement as ``experiments.bench``). ``huge_pages``: the CPU buffer on 2 MiB pages
    first, as an engine's weights are (:mod:`specdec.engine.huge_pages`; 22 → 28-32 GB/s on this
    project's host)."""
    x = torch.ones(max(num_bytes // 4, 1), dtype=torch.float32, device=device)
    if huge_pages and x.device.type == "cpu":
        from specdec.engine.huge_pages import collapse_tensors

        collapse_tensors([x])
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def arch_config(model: str | Path) -> ModelArchConfig:
    """The architecture of a zoo name or HF-format directory, from its ``config.json`` only.

    Raises:
        UnknownModelError, ModelFetchError, ChecksumError: as :func:`specdec.zoo.resolve_model`.
        CorruptModelError: unreadable config.
    """
    from specdec.zoo import resolve_model

    return ModelArchConfig.from_pretrained(resolve_model(model))


def _linears(cfg: ModelArchConfig) -> list[tuple[int, int, bool]]:
    """``(out_features, in_features, bias)`` of one decoder layer's linear layers."""
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [
        (q_size + 2 * kv_size, cfg.hidden_size, cfg.qkv_bias),
        (cfg.hidden_size, q_size, cfg.o_bias),
        (2 * cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias),
        (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias),
    ]


def _norm_params_per_layer(cfg: ModelArchConfig) -> int:
    """Norm weights of one decoder layer: before attention and MLP, after them with ``post_norms``
    (Gemma), per query and key head with ``qk_norm`` (Qwen3, Gemma 3)."""
    return (4 if cfg.post_norms else 2) * cfg.hidden_size + (2 * cfg.head_dim if cfg.qk_norm else 0)


def kv_read_tokens(cfg: ModelArchConfig, context: int) -> float:
    """Tokens of KV a decode step reads per request, averaged over layers: ``context`` for a global
    layer, ``min(context, sliding_window)`` for a windowed one (HF ``sliding_window``, ``layer_types``)."""
    per_layer = [
        context if (w := cfg.layer_window(i)) is None else min(context, w) for i in range(cfg.num_layers)
    ]
    return sum(per_layer) / cfg.num_layers


def weight_bytes(
    cfg: ModelArchConfig,
    dtype: torch.dtype,
    quantization: QuantizationConfig | None = None,
    batch: int = 1,
    device: str | torch.device = "cpu",
) -> tuple[int, int, int]:
    """``(num_params, bytes held, bytes read by one decode step at ``batch``)`` (see the module docstring).

    Raises:
        ConfigError: the quantization does not fit the architecture.
    """
    if quantization is not None:
        quantization.check_model(cfg)
    elem = torch.empty((), dtype=dtype).element_size()
    h, v = cfg.hidden_size, cfg.vocab_size

    def linear_bytes(out_f: int, in_f: int, bias: bool) -> int:
        b = out_f * elem if bias else 0
        if quantization is None:
            return out_f * in_f * elem + b
        return b + quantized_nbytes(
            quantization.method,
            out_f,
            in_f,
            quantization.resolved_group_size,
            dtype,
            device,
            quantization.kernel,
            quantization.zero_point,
        )

    norms = _norm_params_per_layer(cfg)
    per_layer = sum(linear_bytes(o, i, b) for o, i, b in _linears(cfg)) + norms * elem
    params_per_layer = sum(o * i + (o if b else 0) for o, i, b in _linears(cfg)) + norms
    layers = cfg.num_layers * per_layer
    embed = v * h * elem
    head_quantized = quantization is not None and quantization.lm_head
    if head_quantized:
        assert quantization is not None
        head = quantized_nbytes(
            quantization.method, v, h, quantization.resolved_group_size, dtype, device, quantization.kernel,
            quantization.zero_point,
        )  # fmt: skip
    else:
        head = 0 if cfg.tie_word_embeddings else v * h * elem
    num_params = v * h * (1 if cfg.tie_word_embeddings else 2) + cfg.num_layers * params_per_layer + h
    held = embed + layers + h * elem + head
    # A dense tied head reads the whole embedding table as the LM head; otherwise lookups read B rows.
    head_read = embed if (cfg.tie_word_embeddings and not head_quantized) else head
    embed_read = 0 if (cfg.tie_word_embeddings and not head_quantized) else min(batch, v) * h * elem
    read = layers + h * elem + head_read + embed_read
    return num_params, held, read


def estimate(
    model: str | Path,
    context: int,
    batch: int = 1,
    dtype: str | torch.dtype = "bfloat16",
    quantization: Any = None,
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    memory_bytes: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    bandwidth_bytes_per_s: float | None = None,
    device: str | torch.device = "cpu",
) -> MemoryEstimate:
    """Memory and bandwidth-floor figures for ``model`` (see the module docstring).

    Args:
        model: a zoo name or HF-format directory (only its ``config.json`` is read).
        context: tokens of KV per request (prompt + output - 1 at the longest).
        batch: requests decoding together (for the step floor).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        quantization: as ``LLM(quantization=...)``: None, ``"int8"``, ``"int4"``, a dict or a config.
        kv_cache_dtype: ``"auto"`` or ``"int8"``.
        block_size: KV block size.
        memory_bytes: total memory for weights and KV (the KV budget is what the weights leave).
        kv_cache_memory_bytes: a KV budget alone (as ``LLM(kv_cache_memory_bytes=...)``); ignored when
            ``memory_bytes`` is given.
        bandwidth_bytes_per_s: memory read bandwidth; None measures it here.
        device: the device whose quantized layouts to count (``"cpu"``: torch's packed int4 layout in
            bfloat16).

    Raises:
        ConfigError: a non-positive context, batch or block size, a negative budget, bad dtype,
            quantization or KV cache dtype.
    """
    for name, value in (("context", context), ("batch", batch), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    for name, given in (("memory_bytes", memory_bytes), ("kv_cache_memory_bytes", kv_cache_memory_bytes)):
        if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < 0):
            raise ConfigError(f"{name} must be a non-negative integer or None, got {given!r}")
    if bandwidth_bytes_per_s is not None and not bandwidth_bytes_per_s > 0:
        raise ConfigError(f"bandwidth must be positive, got {bandwidth_bytes_per_s!r}")
    torch_dtype = resolve_dtype(dtype)
    check_kv_cache_dtype(kv_cache_dtype)
    qconfig = QuantizationConfig.from_any(quantization)
    cfg = arch_config(model)
    num_params, held, read = weight_bytes(cfg, torch_dtype, qconfig, batch, device)
    per_token = kv_bytes_per_token(cfg, torch_dtype, kv_cache_dtype)
    per_block = per_token * block_size
    blocks_per_request = -(-context // block_size)
    budget: int | None = None
    if memory_bytes is not None:
        budget = max(0, memory_bytes - held)
    elif kv_cache_memory_bytes is not None:
        budget = kv_cache_memory_bytes
    num_blocks = None if budget is None else budget // per_block
    max_requests = None if num_blocks is None else num_blocks // blocks_per_request
    measured = bandwidth_bytes_per_s is None
    bandwidth = measure_read_bandwidth() if bandwidth_bytes_per_s is None else float(bandwidth_bytes_per_s)
    kv_read = round(kv_read_tokens(cfg, context) * per_token)
    step = read + batch * kv_read
    floor = step / bandwidth
    qname = None
    if qconfig is not None:
        qname = qconfig.method
        if qconfig.resolved_group_size is not None:
            qname += f" g{qconfig.resolved_group_size}" + (" zero point" if qconfig.zero_point else "")
        qname += "" if qconfig.lm_head else " (LM head dense)"
    return MemoryEstimate(
        model=str(model),
        dtype=str(torch_dtype).removeprefix("torch."),
        quantization=qname,
        kv_cache_dtype=kv_cache_dtype,
        context=context,
        batch=batch,
        block_size=block_size,
        num_params=num_params,
        weight_bytes=held,
        weight_read_bytes=read,
        kv_bytes_per_token=per_token,
        kv_bytes_per_block=per_block,
        kv_bytes_per_request=per_token * context,
        kv_read_bytes_per_request=kv_read,
        kv_blocks_per_request=blocks_per_request,
        kv_budget_bytes=budget,
        num_kv_blocks=num_blocks,
        max_requests=max_requests,
        step_read_bytes=step,
        bandwidth_bytes_per_s=bandwidth,
        bandwidth_measured=measured,
        floor_step_s=floor,
        floor_tokens_per_s=batch / floor,
    )


def main(argv: list[str] | None = None) -> MemoryEstimate:
    parser = argparse.ArgumentParser(
        prog="python -m specdec.memory", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--model", required=True, help="zoo name or HF-format directory")
    parser.add_argument("--context", type=int, required=True, help="tokens of KV per request")
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--quantization", default="none", choices=["none", "int8", "int4"])
    parser.add_argument("--group-size", type=int, default=None, help="int4 group size (32, 64, 128)")
    parser.add_argument("--zero-point", action="store_true", help="int4 with a zero point per group")
    parser.add_argument("--dense-lm-head", action="store_true", help="keep the LM head unquantized")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--bandwidth-gbs", type=float, default=None, help="read bandwidth, GB/s (else measured)"
    )
    parser.add_argument("--memory-gib", type=float, default=None, help="memory for weights + KV, GiB")
    parser.add_argument(
        "--kv-memory-gib", type=float, default=None, help="memory for the KV cache alone, GiB"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    quantization = None
    for flag, gib in (("--memory-gib", args.memory_gib), ("--kv-memory-gib", args.kv_memory_gib)):
        if gib is not None and not (math.isfinite(gib) and gib >= 0):
            parser.error(f"{flag} must be a finite number of GiB >= 0, got {gib}")
    try:
        if args.quantization != "none":
            quantization = QuantizationConfig(
                args.quantization, args.group_size, lm_head=not args.dense_lm_head, zero_point=args.zero_point
            )
        elif args.group_size is not None or args.zero_point or args.dense_lm_head:
            parser.error("--group-size, --zero-point and --dense-lm-head need --quantization")
        est = estimate(
            args.model,
            args.context,
            args.batch,
            args.dtype,
            quantization,
            args.kv_cache_dtype,
            args.block_size,
            memory_bytes=None if args.memory_gib is None else int(args.memory_gib * GIB),
            kv_cache_memory_bytes=None if args.kv_memory_gib is None else int(args.kv_memory_gib * GIB),
            bandwidth_bytes_per_s=None if args.bandwidth_gbs is None else args.bandwidth_gbs * 1e9,
        )
    except SpecdecError as e:  # a bad value, an unknown model, a model that cannot be fetched
        parser.error(f"{type(e).__name__}: {e}")
    print(json.dumps(asdict(est), indent=2) if args.json else est.summary())
    return est


if __name__ == "__main__":
    main()
