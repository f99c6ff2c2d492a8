"""CUDA graphs of the decode and chain-verification forward: one graph per padded batch shape.

An eager SmolLM2 step launches about 15 kernels per layer from Python, so on a GPU it is bound by launch
overhead, not by the bytes of the weights. A captured graph replays all of them in one launch. This is
vLLM's and nano-vllm's decode graphs, extended to verification: a step qualifies when every request
brings between 1 and ``max_query_len`` new tokens (a decode token, or a chain of k drafts after its last
committed token, or a prefill chunk that short) and no tree attention mask. Longer prefill chunks, token
trees and wider batches run the eager forward.

Padding. A qualifying batch of B requests with query lengths ``q_b`` is laid out on a fixed grid of
``Bp × Qp`` rows, request-major: ``Bp`` is the smallest capture size ``>= B`` (``batch_sizes``), ``Qp``
the longest query of the batch. Request ``b`` owns rows ``b·Qp ... b·Qp + Qp - 1``; its real tokens
come first, then ``Qp - q_b`` padding rows; requests ``B ... Bp - 1`` are padding requests of ``Qp``
rows each. Every padding row has token 0, position 0 and slot -1 (no K/V is written), and its outputs
are dropped. A real request's ``seq_len`` grows by its padding rows, so its context length (``seq_len -
Qp``) and every real row's causal limit stay what they were: padding rows come after the real ones and
no real row sees them. Padding requests attend to ``Qp`` slots of block 0 (read, never written).

Static buffers (allocated once, outside the graphs' memory pool) hold the inputs and attention metadata
of the largest grid; each graph reads views of them. A graph holds the layers and the final norm
(:meth:`DecoderLM.normed_hidden`); the LM head runs after the replay, eagerly, on the rows whose logits
are wanted only (as in :mod:`specdec.compilation.compiled_model`), so no graph keeps a ``[rows,
vocab]`` output and padding rows cost no vocabulary product. A replay first copies the step's inputs into
the buffers (a handful of small kernels), then replays, then gathers the wanted rows of the graph's
outputs (a copy: the next replay overwrites them). Graphs are captured on first use of a shape, lazily,
and share one memory pool (their outputs are copied out before the next replay, so no two are live at
once).

The attention backend must declare ``cuda_graph_key(metadata, num_heads, num_kv_heads)``: the launch
choices it derives from host values (the Triton backend: its KV split count), which become part of the
graph's key; a backend without it (the reference, which reads lengths on the host) never runs in a
graph.

Exactness: a graph runs the same kernels as the eager forward of the padded batch. Its real rows equal
the eager forward of the unpadded batch up to the matrix products' choice of algorithm for a different
row count (bits may differ, as between any two batch sizes); the engine verifies drafts with the
graph's ``target_probs`` like any other, so the output distribution is the target's. Tested on the CPU
with ``capture=False`` (the padded layout without graphs) against the unpadded forward, and on CUDA
against the eager forward.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.attention.base import AttentionBackend, AttentionMetadata
from specdec.errors import ConfigError

logger = logging.getLogger("specdec.compilation")

#: Default capture sizes (requests per step), after vLLM's: small batches exactly, then steps of 8 and 16.
DEFAULT_CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64)
#: Default longest query a graph takes: a chain of 7 drafts after the last committed token.
DEFAULT_MAX_QUERY_LEN = 8


@dataclass
class CudaGraphStats:
    """Graphs captured and forwards run each way.

    Attributes:
        captured: the key of each graph, in order of capture (``(Bp, Qp, backend key)``).
        capture_time_s: total wall time of the captures (warm-up forwards included).
        graph_calls, eager_calls: forwards replayed from a graph, and forwards that did not qualify.
    """

    captured: list[tuple[Any, ...]] = field(default_factory=list)
    capture_time_s: float = 0.0
    graph_calls: int = 0
    eager_calls: int = 0


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: capture=False
    hidden: torch.Tensor | None = None  # [Bp * Qp, H] final-norm hidden states, the graph's output
    aux: torch.Tensor | None = None  # [Bp * Qp, F] feature-layer streams (EAGLE-3), or None


class CudaGraphRunner:
    """Replays captured graphs of ``forward`` for the steps that qualify (see the module docstring).

    Args:
        forward: the forward (:class:`~specdec.models.decoder.DecoderLM` or
            :class:`~specdec.compilation.compiled_model.CompiledDecoder`): its ``normed_hidden`` is
            captured, its ``logits`` runs after each replay.
        kv_caches: the runner's per-layer ``(k_cache, v_cache)``.
        attention: the attention backend (must define ``cuda_graph_key``).
        num_heads, num_kv_heads: the model's attention heads (for the backend's key).
        num_blocks: blocks in the KV pool (the static block table's width: any request fits).
        batch_sizes: capture sizes, sorted; batches of more requests run eagerly.
        max_query_len: longest query a graph takes.
        capture: capture CUDA graphs (True on CUDA); False runs the eager forward on the padded static
            buffers, which tests the padding on any device.

    Raises:
        ConfigError: capture asked for on a device that is not CUDA, or a backend without
            ``cuda_graph_key``.
    """

    def __init__(
        self,
        forward: Any,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        attention: AttentionBackend,
        num_heads: int,
        num_kv_heads: int,
        num_blocks: int,
        batch_sizes: Sequence[int] = DEFAULT_CAPTURE_SIZES,
        max_query_len: int = DEFAULT_MAX_QUERY_LEN,
        capture: bool = True,
    ) -> None:
        device = kv_caches[0][0].device
        if capture and device.type != "cuda":
            raise ConfigError(f"cuda_graphs needs a CUDA device; the KV cache is on {device}")
        if capture and not supports_cuda_graphs(attention):
            raise ConfigError(
                f"cuda_graphs needs the Triton attention backend, not {type(attention).__name__} "
                "(an int8 KV cache or SPECDEC_FORCE_REFERENCE=1 selects the reference)"
            )
        self.forward = forward
        self.kv_caches = list(kv_caches)
        self.attention = attention
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.max_query_len = max_query_len
        self.capture = capture
        self.device = device
        self.stats = CudaGraphStats()
        self._graphs: dict[tuple[Any, ...], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        max_b, max_t = self.batch_sizes[-1], self.batch_sizes[-1] * max_query_len

        def buffer(*shape: int, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.int64, device=device)

        # The static inputs (shapes are of the largest grid; a graph reads leading views).
        self.input_ids = buffer(max_t)  # [Tp]
        self.positions = buffer(max_t)  # [Tp]
        self.slot_mapping = buffer(max_t, fill=-1)  # [Tp]
        self.query_start_loc = buffer(max_b + 1)  # [Bp + 1]
        self.seq_lens = buffer(max_b)  # [Bp]
        self.block_table = buffer(max_b, max(1, num_blocks))  # [Bp, num_blocks]

    # ------------------------------------------------------------------------------------------ public
    def qualifies(self, metadata: AttentionMetadata, num_tokens: int) -> tuple[int, int] | None:
        """``(Bp, Qp)`` of the grid the step fits, or None when it runs eagerly."""
        if metadata.new_token_masks is not None and any(m is not None for m in metadata.new_token_masks):
            return None
        lens = metadata.query_lens
        if not lens or num_tokens != sum(lens):
            return None
        q_max = max(lens)
        if min(lens) < 1 or q_max > self.max_query_len or len(lens) > self.batch_sizes[-1]:
            return None
        if metadata.block_table.shape[1] > self.block_table.shape[1]:
            return None
        bp = next(b for b in self.batch_sizes if b >= len(lens))
        return bp, q_max

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
        all_hidden: bool,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """As :meth:`DecoderLM.forward` with this runner's caches and backend: ``(logits [R, V],
        hidden)`` (``hidden`` ``[T, F]`` when ``all_hidden``, else ``[R, F]``); None when the step does
        not qualify (the caller runs the eager forward)."""
        grid = self.qualifies(metadata, input_ids.shape[0])
        if grid is None:
            self.stats.eager_calls += 1
            return None
        bp, qp = grid
        with torch.cuda.device(self.device) if self.capture else contextlib.nullcontext():
            real_rows, seq_lens_host = self._fill(input_ids, positions, metadata, bp, qp)
            meta = self._metadata(bp, qp, seq_lens_host)
            key = (bp, qp, self._backend_key(meta))
            entry = self._graphs.get(key)
            if entry is None:
                entry = self._graphs[key] = self._capture(bp, qp, meta)
                self.stats.captured.append(key)
            if entry.graph is not None:
                entry.graph.replay()
                hidden_all, aux_all = entry.hidden, entry.aux
            else:  # capture=False: the padded forward, eagerly
                hidden_all, aux_all = self._forward(bp, qp, meta)
            assert hidden_all is not None
            self.stats.graph_calls += 1
            rows = real_rows[logits_indices]  # [R] rows of the grid
            logits = self.forward.logits(hidden_all.index_select(0, rows))
            features = hidden_all if aux_all is None else aux_all
            return logits, features.index_select(0, real_rows if all_hidden else rows)

    # ----------------------------------------------------------------------------------------- helpers
    def _backend_key(self, metadata: AttentionMetadata) -> Hashable:
        key_of = getattr(self.attention, "cuda_graph_key", None)
        return None if key_of is None else key_of(metadata, self.num_heads, self.num_kv_heads)

    def _fill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        bp: int,
        qp: int,
    ) -> tuple[torch.Tensor, list[int]]:
        """Copy the step into the static buffers laid out on the ``bp × qp`` grid; returns the grid row of
        each real token ``[T]`` and the padded ``seq_lens`` on the host ``[bp]``."""
        lens = metadata.query_lens
        b = len(lens)
        grid_rows = [i * qp + j for i, q in enumerate(lens) for j in range(q)]
        real_rows = torch.tensor(grid_rows, dtype=torch.int64).to(self.device, non_blocking=True)
        tp = bp * qp
        self.input_ids[:tp].zero_()
        self.positions[:tp].zero_()
        self.slot_mapping[:tp].fill_(-1)
        self.input_ids.index_copy_(0, real_rows, input_ids)
        self.positions.index_copy_(0, real_rows, positions)
        self.slot_mapping.index_copy_(0, real_rows, metadata.slot_mapping)
        torch.arange(0, (bp + 1) * qp, qp, out=self.query_start_loc[: bp + 1])
        pad = torch.tensor([qp - q for q in lens], dtype=torch.int64).to(self.device, non_blocking=True)
        self.seq_lens[:b].copy_(metadata.seq_lens + pad)
        self.seq_lens[b:bp].fill_(qp)
        width = metadata.block_table.shape[1]
        self.block_table[:bp].zero_()
        self.block_table[:b, :width].copy_(metadata.block_table)
        seq_lens_host = [s + qp - q for s, q in zip(metadata.seq_lens_host, lens)] + [qp] * (bp - b)
        return real_rows, seq_lens_host

    def _metadata(self, bp: int, qp: int, seq_lens_host: list[int]) -> AttentionMetadata:
        """Metadata over views of the static buffers (host lists: the padded grid)."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bp + 1],
            seq_lens=self.seq_lens[:bp],
            slot_mapping=self.slot_mapping[: bp * qp],
            block_table=self.block_table[:bp],
            query_lens=[qp] * bp,
            seq_lens_host=seq_lens_host,
        )

    def _forward(
        self, bp: int, qp: int, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tp = bp * qp
        return self.forward.normed_hidden(
            self.input_ids[:tp], self.positions[:tp], self.kv_caches, metadata, self.attention
        )

    def _capture(self, bp: int, qp: int, metadata: AttentionMetadata) -> _Graph:
        """Warm up (Triton's compilations, the allocator) on a side stream, then capture one forward. The
        warm-up forwards write the step's own K/V at its own slots, as the replay will again."""
        if not self.capture:
            return _Graph(None)
        t0 = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(bp, qp, self._fresh(metadata))
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden, aux = self._forward(bp, qp, metadata)
        torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        self.stats.capture_time_s += dt
        logger.info("captured a CUDA graph of %d requests × %d tokens in %.2f s", bp, qp, dt)
        return _Graph(graph, hidden, aux)

    @staticmethod
    def _fresh(metadata: AttentionMetadata) -> AttentionMetadata:
        """The same views with an empty backend cache (the capture computes its own launch plan)."""
        return AttentionMetadata(
            metadata.query_start_loc, metadata.seq_lens, metadata.slot_mapping, metadata.block_table,
            metadata.query_lens, metadata.seq_lens_host,
        )  # fmt: skip


def supports_cuda_graphs(attention: AttentionBackend) -> bool:
    """Whether ``attention`` can run in CUDA graphs (it defines ``cuda_graph_key``)."""
    return hasattr(attention, "cuda_graph_key")


def check_cuda_graphs(device: torch.device, kv_cache_dtype: str = "auto") -> None:
    """Fail before any loading where CUDA graphs cannot run.

    Raises:
        ConfigError: ``device`` is not CUDA, or the attention backend there would not be Triton (an int8
            KV cache, ``SPECDEC_FORCE_REFERENCE=1``, Triton missing).
    """
    from kernels._triton import force_reference, triton_available

    if device.type != "cuda":
        raise ConfigError(f"cuda_graphs needs a CUDA device, got {device}")
    if kv_cache_dtype == "int8" or force_reference() or not triton_available():
        why = (
            "kv_cache_dtype='int8'"
            if kv_cache_dtype == "int8"
            else ("SPECDEC_FORCE_REFERENCE=1" if force_reference() else "Triton is not installed")
        )
        raise ConfigError(f"cuda_graphs needs the Triton attention backend, which {why} rules out")
