"""A decoder's forward compiled piecewise with ``torch.compile``, one graph per token bucket.

The compiled graph runs the embedding, every layer's dense work and the final norm of all rows of a
padded batch; the LM head then runs eagerly on the rows whose logits are wanted only; attention runs
eagerly inside the ``specdec::paged_attention`` custom op
(:mod:`specdec.compilation.attention_op`). Inputs are padded to the smallest bucket
(:mod:`specdec.compilation.buckets`) with token 0 at position 0; padded rows write no K/V, attend to
nothing and are dropped before their logits or hidden states leave this module, so they never reach
the sampler or the cache. Forwards wider than the largest bucket run the eager model.

On the CPU inductor freezes the weights (``freezing=True``: folded as constants and pre-packed for
oneDNN), so the eager model's :class:`~specdec.models.packed_linear.PackedLinear` packing is not used
with compilation. Linears that run the CPU GEMV kernel (:class:`~specdec.models.cpu_linear.GemvLinear`)
stay opaque ``specdec_cpu::gemv`` calls in the graph: their weights are neither frozen nor copied.
Module guards are skipped (the weights are frozen constants), so a call costs the input-shape guards
only. The global-state guard is skipped too: it holds torch's intra-op thread count, and the engine's
adaptive threads (:mod:`specdec.engine.threads`) change that count under load, which would recompile
every bucket (about 20 s each) per count. So on the CPU inductor's own loops (norms, RoPE, activations:
a few microseconds per step) are generated single-threaded (``cpp.threads=1``), and the work that
matters (the GEMV kernel, oneDNN linears, attention) is opaque to the graph and reads the thread count
at run time. The other global state the guard held is grad mode: a call with grad enabled runs the eager
model. Inductor's FX graph cache (on by default,
under ``TORCHINDUCTOR_CACHE_DIR``) makes a second process's compilations faster.

Exactness: the compiled graph computes the same operations as :meth:`DecoderLM.forward` (greedy tokens
equal, float32 logits within 1e-4 in ``tests/test_compilation.py``); inductor may fuse and reorder
float arithmetic, so outputs are not bit-identical.
"""

from __future__ import annotations

import itertools
import logging
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from specdec.attention.base import AttentionBackend, AttentionMetadata
from specdec.compilation.attention_op import ForwardContext, LayerAttentionOp, forward_context
from specdec.compilation.buckets import pick_bucket
from specdec.models.decoder import DecoderLM

logger = logging.getLogger("specdec.compilation")
_instances = itertools.count()


@dataclass
class CompileStats:
    """Compilations done so far.

    Attributes:
        compiled_buckets: buckets compiled, in order of first use.
        compile_time_s: wall time of the first call of each bucket (tracing, inductor, warm-up run).
        compiled_calls, eager_calls: forwards run each way.
    """

    compiled_buckets: list[int] = field(default_factory=list)
    compile_time_s: dict[int, float] = field(default_factory=dict)
    compiled_calls: int = 0
    eager_calls: int = 0

    @property
    def num_compilations(self) -> int:
        return len(self.compiled_buckets)

    @property
    def total_compile_time_s(self) -> float:
        return sum(self.compile_time_s.values())


def _shape_guards_only(entries: Sequence[Any]) -> list[bool]:
    """``torch.compile``'s ``guard_filter_fn``: keep the guards on the inputs, drop those on the decoder's
    modules and the global-state guard (grad mode, intra-op threads)."""
    keep = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    return [k and entry.guard_type != "GLOBAL_STATE" for k, entry in zip(keep, entries, strict=True)]


class CompiledDecoder:
    """Calls like :meth:`DecoderLM.forward`; compiled for batches of at most ``max(buckets)`` tokens.

    Args:
        model: the decoder (plain ``nn.Linear`` or quantized linears; not
            :class:`~specdec.models.packed_linear.PackedLinear`, which inductor cannot trace).
        buckets: sorted token buckets (see :func:`~specdec.compilation.buckets.check_buckets`).
        backend: ``torch.compile`` backend (``"inductor"``; ``"eager"`` traces without compiling, for
            tests of the padding and the op).
        options: inductor options (default: ``{"freezing": True}`` on the CPU).
    """

    def __init__(
        self,
        model: DecoderLM,
        buckets: Sequence[int],
        backend: str = "inductor",
        options: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.buckets = tuple(buckets)
        self.stats = CompileStats()
        device = next(model.parameters()).device
        if options is None and backend == "inductor":
            options = {"freezing": True, "cpp.threads": 1} if device.type == "cpu" else {}
        ops = [LayerAttentionOp(i) for i in range(len(model.layers))]
        no_caches = cast(Sequence[tuple[torch.Tensor, torch.Tensor]], [(None, None)] * len(ops))
        no_metadata = cast(AttentionMetadata, None)

        def body(
            input_ids: torch.Tensor, positions: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            hidden, aux = model.layer_stack(input_ids, positions, no_caches, no_metadata, ops)
            return model.norm(hidden), aux

        # Dynamo caches compiled graphs on the code object: give each decoder its own (a draft model and
        # its target must not share frozen weights), and room for one graph per bucket.
        code = body.__code__.replace(co_name=f"specdec_forward_{next(_instances)}")
        body = types.FunctionType(code, body.__globals__, code.co_name, body.__defaults__, body.__closure__)
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, len(self.buckets) + 1)
        # One graph per bucket: static shapes, so dynamo specialises each bucket and never recompiles one.
        # Guards on the decoder's modules are dropped: its weights are frozen into the graphs anyway, and
        # checking ~300 module guards cost ~0.9 ms per call here; the global-state guard is dropped (see
        # the module docstring); the input-shape guards that pick a bucket's graph stay.
        options = {**(options or {}), "guard_filter_fn": _shape_guards_only}
        self._compiled: Callable[..., torch.Tensor] = torch.compile(
            body, backend=backend, options=options, dynamic=False, fullgraph=True
        )

    @staticmethod
    def _arange(n: int, device: torch.device) -> torch.Tensor:
        return torch.arange(n, device=device)

    def _run_bucket(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
        attention: AttentionBackend,
        n: int,
        bucket: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The compiled graph over the batch padded to ``bucket`` rows: final-norm hidden states
        ``[bucket, H]`` and the feature streams (None when unset), padding rows included."""
        # Fresh buffers, padded or not, so every call hands dynamo tensors of one kind (created here, in
        # the caller's inference mode); padding rows are token 0 at position 0.
        input_ids = input_ids.new_zeros(bucket).index_copy_(0, self._arange(n, input_ids.device), input_ids)
        positions = positions.new_zeros(bucket).index_copy_(0, self._arange(n, positions.device), positions)
        first = bucket not in self.stats.compile_time_s
        t0 = time.perf_counter()
        with forward_context(ForwardContext(metadata, attention, kv_caches, n)):
            hidden, aux = self._compiled(input_ids, positions)
        if first:
            self.stats.compile_time_s[bucket] = time.perf_counter() - t0
            self.stats.compiled_buckets.append(bucket)
            logger.info("compiled the %d-token bucket in %.1f s", bucket, self.stats.compile_time_s[bucket])
        self.stats.compiled_calls += 1
        return hidden, aux

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """As :meth:`DecoderLM.logits` (eager)."""
        return self.model.logits(rows)

    def normed_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
        attention: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As :meth:`DecoderLM.normed_hidden`, through the compiled graph where the batch fits a bucket."""
        n = input_ids.shape[0]
        bucket = pick_bucket(n, self.buckets)
        if bucket is None or torch.is_grad_enabled():
            self.stats.eager_calls += 1
            return self.model.normed_hidden(input_ids, positions, kv_caches, metadata, attention)
        hidden, aux = self._run_bucket(input_ids, positions, kv_caches, metadata, attention, n, bucket)
        return hidden[:n], (None if aux is None else aux[:n])

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
        attention: AttentionBackend,
        logits_indices: torch.Tensor | None = None,
        all_hidden: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`DecoderLM.forward`."""
        n = input_ids.shape[0]
        bucket = pick_bucket(n, self.buckets)
        if bucket is None or torch.is_grad_enabled():
            self.stats.eager_calls += 1
            return self.model(
                input_ids, positions, list(kv_caches), metadata, attention, logits_indices, all_hidden
            )
        hidden, aux = self._run_bucket(input_ids, positions, kv_caches, metadata, attention, n, bucket)
        # The LM head runs outside the graph, on the rows whose logits are wanted only (a padded prefill
        # bucket would otherwise multiply every padding row by the whole vocabulary).
        hidden = hidden[:n]
        rows = hidden if logits_indices is None else hidden[logits_indices]
        logits = self.model.logits(rows)
        if aux is not None:  # the feature layers' streams (EAGLE-3) instead of the final-norm features
            aux = aux[:n]
            return logits, (aux if all_hidden or logits_indices is None else aux[logits_indices])
        return logits, (hidden if all_hidden or logits_indices is None else rows)
