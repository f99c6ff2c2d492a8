"""Our decoder for every supported family: Llama (SmolLM2, Llama 2/3.x), Qwen2/2.5, Qwen3, Mistral,
Gemma 2, Gemma 3 (text) and Phi-3 (see :mod:`specdec.models.families`).

Pre-norm transformer: RMSNorm, rotary position embeddings (RoPE, Su et al. 2021) from the config,
grouped-query attention (Ainslie et al. 2023) through a paged KV cache, gated MLP (SwiGLU or GeGLU,
Shazeer 2020), tied or untied LM head. q/k/v and gate/up are fused into one matrix each, so a layer is
four matrix products. The families differ only through :class:`ModelArchConfig` fields: biases, the
norm style ((1 + w) for Gemma), per-head q/k norms (Qwen3, Gemma 3), norms after attention and MLP
(Gemma), the embedding scale, the attention scale, soft-capping (Gemma 2), and per-layer sliding
windows and RoPE (Mistral, Gemma).

The forward takes a flattened variable-length batch (see :mod:`specdec.attention.base`) and returns
logits only at the rows asked for.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_decode_stack
from kernels.cpu_decode_stack import DecodeStack, StackLayer
from kernels.cpu_layer_ops import rms_norm_reference, rope_reference
from specdec.attention.base import AttentionBackend, AttentionMetadata
from specdec.errors import UnknownModelError
from specdec.models.config import ModelArchConfig

#: Activation dtypes the CPU layer-op kernels take (:mod:`kernels.cpu_layer_ops`).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in float32 as transformers does:
    ``w * norm(x)``, normalised in float32 and cast back before the product (Llama's order;
    :func:`kernels.cpu_layer_ops.rms_norm_reference`).

    ``use_kernel`` (set by :func:`use_cpu_layer_ops`): ``[T, H]`` inputs go to the CPU kernel, outside
    ``torch.compile`` traces."""

    gemma = False

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.use_kernel
            and x.dim() == 2
            and x.dtype == self.weight.dtype
            and x.dtype in KERNEL_DTYPES
            and x.device.type == "cpu"
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
        ):
            return torch.ops.specdec_cpu.rms_norm(x, self.weight, self.eps, self.gemma)
        return rms_norm_reference(x, self.weight, self.eps, self.gemma)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``(1 + w) * norm(x)``, all in float32, cast back at the end (the checkpoint
    stores ``w``, initialised at zero)."""

    gemma = True

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)  # (1 + 0): the identity scale, as transformers initialises it


def make_norm(cfg: ModelArchConfig, size: int) -> RMSNorm:
    """The family's RMSNorm over the last ``size`` features (``cfg.norm_style``)."""
    return (GemmaRMSNorm if cfg.norm_style == "gemma" else RMSNorm)(size, cfg.rms_norm_eps)


def _activation(name: str):
    if name == "silu":
        return F.silu
    if name == "gelu_pytorch_tanh":
        return functools.partial(F.gelu, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise UnknownModelError(f"hidden activation {name!r} is not supported")


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Tanh soft-capping ``cap * tanh(x / cap)`` (Gemma 2's attention and final logits)."""
    return torch.tanh(x / cap) * cap


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos and sin ``[T, 1, head_dim]`` for ``positions`` ``[T]``, ``inv_freq`` ``[head_dim / 2]``."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


class RopeTable:
    """:func:`rope_cos_sin` by lookup on the CPU, where computing it costs 8 small ops (30-90 us in the
    middle of a step, for the target's forward and a draft head's one-token steps alike) against two
    ``index_select``: the cos and sin of positions ``[0, n)``, computed by :func:`rope_cos_sin` itself on
    ``arange(n)`` (elementwise, so each row equals its value at that position bit for bit; tested), rebuilt
    at twice the size when a position reaches ``n`` or when ``inv_freq`` (the tensor object: a deep copy's
    table is rebuilt for the copy's own), ``scale`` or ``dtype`` change. One position, alone: 33-37 us for
    the function against 8-10 us for the lookup. Elsewhere (CUDA, where a lookup's bound check would
    synchronise; under compilation) it calls :func:`rope_cos_sin`."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._inv_freq: torch.Tensor | None = None  # the tensor the table was computed from
        self._cos = self._sin = torch.empty(0)

    def __call__(
        self, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[T, 1, head_dim]`` of ``positions`` ``[T]`` int64, as :func:`rope_cos_sin`."""
        if positions.device.type != "cpu" or positions.numel() == 0 or torch.compiler.is_compiling():
            return rope_cos_sin(positions, inv_freq, scale, dtype)
        need = int(positions.max()) + 1
        key = (scale, dtype)
        same = inv_freq is self._inv_freq and key == self._key
        if not same or need > self._cos.shape[0]:
            if not same:
                self._cos = torch.empty(0)
            size = max(need, 2 * self._cos.shape[0], 256)
            self._cos, self._sin = rope_cos_sin(torch.arange(size), inv_freq.cpu(), scale, dtype)
            self._key, self._inv_freq = key, inv_freq
        return self._cos.index_select(0, positions), self._sin.index_select(0, positions)


class DecoderLayer(nn.Module):
    """One decoder layer of any supported family.

    Norm names: ``input_layernorm`` before attention, ``post_attention_layernorm`` before the MLP
    (Llama's names; Gemma's checkpoint calls this one ``pre_feedforward_layernorm``). With
    ``cfg.post_norms`` (Gemma) ``attn_output_norm`` and ``mlp_output_norm`` normalise the attention
    and MLP outputs before their residual adds (Gemma's ``post_attention_layernorm`` and
    ``post_feedforward_layernorm``). With ``cfg.qk_norm`` ``q_norm``/``k_norm`` normalise each query
    and key head before RoPE.

    Args:
        cfg: the architecture.
        layer: the layer's index (picks its attention window, ``cfg.layer_window(layer)``).
    """

    def __init__(self, cfg: ModelArchConfig, layer: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.attention_scale
        # Window and soft-cap reach the backend as keywords only when set, so a backend without them
        # still serves the families that need neither.
        self.attention_kwargs: dict[str, float | int] = {}
        if cfg.layer_window(layer) is not None:
            self.attention_kwargs["sliding_window"] = int(cfg.layer_window(layer))  # type: ignore[arg-type]
        if cfg.attn_logit_softcapping is not None:
            self.attention_kwargs["softcap"] = float(cfg.attn_logit_softcapping)
        self.act = _activation(cfg.hidden_act)
        self.silu = cfg.hidden_act == "silu"
        self.use_kernels = False  # RoPE and SiLU * up through kernels.cpu_layer_ops (use_cpu_layer_ops)
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.q_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.attn_output_norm = make_norm(cfg, cfg.hidden_size) if cfg.post_norms else None
        self.mlp_output_norm = make_norm(cfg, cfg.hidden_size) if cfg.post_norms else None
        #: A one-layer C++ stack for this layer when it runs outside a stacked :class:`DecoderLM` (a draft
        #: head's layer; set by :func:`use_cpu_layer_ops`; None: off), and where it read its weights from.
        self.decode_stack: DecodeStack | None = None
        self._stack_refs = StackRefs([])

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        """``hidden`` ``[T, hidden_size]`` -> ``[T, hidden_size]``; ``cos``/``sin`` ``[T, 1, head_dim]``
        (this layer's RoPE); the cache and backend as :meth:`DecoderLM.forward`."""
        if self.decode_stack is not None:
            fast = run_stack(
                self.decode_stack, self._stack_refs, hidden, (cos, sin),
                [(k_cache, v_cache)], metadata, attention, (),
            )  # fmt: skip
            if fast is not None:
                return fast[0]
        return self.block(
            hidden, self.input_layernorm(hidden), cos, sin, k_cache, v_cache, metadata, attention
        )

    def block(
        self,
        hidden: torch.Tensor,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        """Attention on the normalised input ``x`` ``[T, qkv_proj.in_features]`` added to the residual
        ``hidden`` ``[T, hidden_size]``, then the MLP: the layer after its input norm (an EAGLE-3 layer
        feeds its own ``x``)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        # RoPE on the query and key heads in one go; values pass through.
        qk = qkv[:, : self.num_heads + self.num_kv_heads]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        if (
            self.use_kernels
            and qk.device.type == "cpu"
            and qk.dtype in KERNEL_DTYPES
            and cos.dtype == qk.dtype
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
        ):
            qk = torch.ops.specdec_cpu.rope(qk, cos, sin)
        else:
            qk = rope_reference(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        attn = attention.forward(q, k, v, k_cache, v_cache, metadata, self.scale, **self.attention_kwargs)
        out = self.o_proj(attn.reshape(num_tokens, self.q_size))
        if self.attn_output_norm is not None:
            out = self.attn_output_norm(out)
        hidden = hidden + out
        x = self.post_attention_layernorm(hidden)
        gate_up = self.gate_up_proj(x)
        if (
            self.silu
            and self.use_kernels
            and gate_up.device.type == "cpu"
            and gate_up.dtype in KERNEL_DTYPES
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
        ):
            out = self.down_proj(torch.ops.specdec_cpu.silu_mul(gate_up))
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            out = self.down_proj(self.act(gate) * up)
        if self.mlp_output_norm is not None:
            out = self.mlp_output_norm(out)
        return hidden + out


class DecoderLM(nn.Module):
    """A causal decoder LM over a paged KV cache.

    Args:
        cfg: the architecture (see :class:`ModelArchConfig`).
    """

    inv_freq: torch.Tensor

    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg, cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", torch.tensor(cfg.inv_freq, dtype=torch.float32), persistent=False)
        self._rope_table = RopeTable()
        # Gemma 3's local RoPE (sliding layers); None for the families with one RoPE.
        local = None if cfg.local_inv_freq is None else torch.tensor(cfg.local_inv_freq, dtype=torch.float32)
        self.register_buffer("local_inv_freq", local, persistent=False)
        self.local_rope_layers = [cfg.uses_local_rope(i) for i in range(cfg.num_layers)]
        #: Layers whose input residual stream is returned as the features instead of the final-norm
        #: hidden state (EAGLE-3's low, middle and high layers; set by the engine for its drafter).
        self.feature_layers: tuple[int, ...] = ()
        #: The C++ layer stack for short queries on the CPU (set by :func:`use_cpu_layer_ops`; None: off),
        #: with where it read its weights from (a model whose layers changed since falls back).
        self.decode_stack: DecodeStack | None = None
        self._stack_refs = StackRefs([])

    def set_feature_layers(self, layers: Sequence[int]) -> None:
        """Return as features the residual streams entering ``layers`` (concatenated in that order,
        ``[T, len(layers) * hidden_size]``; an index equal to ``num_layers`` is the last layer's output
        before the final norm) instead of the final-norm hidden state; ``()`` restores the default.

        Raises:
            ValueError: an index outside ``[0, num_layers]``.
        """
        layers = tuple(int(i) for i in layers)
        bad = [i for i in layers if not 0 <= i <= self.cfg.num_layers]
        if bad:
            raise ValueError(f"feature layers {bad} outside [0, {self.cfg.num_layers}]")
        self.feature_layers = layers

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (the embedding table's), whatever form the linear layers take."""
        return self.embed_tokens.weight.dtype

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, head_dim]`` for ``positions`` ``[T]``, as transformers computes them (on the
        CPU looked up in a :class:`RopeTable` of the same values)."""
        return self._rope_table(positions, self.inv_freq, self.cfg.rope_attention_scaling, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
        attention: AttentionBackend,
        logits_indices: torch.Tensor | None = None,
        all_hidden: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the flattened batch through the model.

        Args:
            input_ids: ``[T]`` token ids.
            positions: ``[T]`` position of each token in its sequence (explicit, so token trees work).
            kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads,
                head_dim]``; written at ``metadata.slot_mapping``.
            metadata: the flattened batch.
            attention: the attention backend.
            logits_indices: ``[R]`` rows whose logits are wanted; None for all rows.
            all_hidden: return the hidden states of every row, not only of the logits rows.

        Returns:
            ``(logits, hidden)``: ``logits`` ``[R, vocab_size]`` float32, and ``hidden`` the features
            learned drafters read: the final-norm hidden states, or with :attr:`feature_layers` the
            concatenated residual streams entering those layers (``F = len(feature_layers) *
            hidden_size`` columns instead of ``hidden_size``): ``[R, F]`` at the logits rows, or ``[T,
            F]`` at every row when ``all_hidden``.
        """
        hidden, aux = self.layer_stack(input_ids, positions, kv_caches, metadata, attention)
        return self.final(hidden, logits_indices, all_hidden, aux)

    def normed_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
        attention: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` without the LM head: the final-norm hidden states of every row ``[T,
        hidden_size]`` and the :attr:`feature_layers` streams ``[T, F]`` (None when unset). The logits of
        rows ``idx`` are then ``logits(normed[idx])`` (what the CUDA graphs of
        :mod:`specdec.compilation.cuda_graphs` capture)."""
        hidden, aux = self.layer_stack(input_ids, positions, kv_caches, metadata, attention)
        return self.norm(hidden), aux

    def layer_stack(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
        attention: AttentionBackend | Sequence[AttentionBackend],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embedding, RoPE and every decoder layer: the residual stream ``[T, hidden_size]`` before the
        final norm, and the :attr:`feature_layers` streams concatenated ``[T, F]`` (None when unset).
        ``attention`` is one backend for every layer, or one per layer (the compiled forward of
        :mod:`specdec.compilation` passes per-layer custom-op calls, with no caches or metadata)."""
        hidden = self.embed_tokens(input_ids)
        if self.cfg.embed_scale != 1.0:  # Gemma: the scale rounded to the activation dtype first
            hidden = hidden * torch.tensor(self.cfg.embed_scale, dtype=hidden.dtype)
        rope = {False: self.rope(positions, hidden.dtype)}
        if any(self.local_rope_layers):
            rope[True] = rope_cos_sin(
                positions, self.local_inv_freq, self.cfg.local_rope_attention_scaling, hidden.dtype
            )
        if self.decode_stack is not None and not isinstance(attention, Sequence):
            fast = self._stacked(hidden, rope[False], kv_caches, metadata, attention)
            if fast is not None:
                return fast
        per_layer = attention if isinstance(attention, Sequence) else [attention] * len(self.layers)
        streams: dict[int, torch.Tensor] = {}
        for i, (layer, (k_cache, v_cache), attn, local) in enumerate(
            zip(self.layers, kv_caches, per_layer, self.local_rope_layers)
        ):
            if i in self.feature_layers:
                streams[i] = hidden
            cos, sin = rope[local]
            hidden = layer(hidden, cos, sin, k_cache, v_cache, metadata, attn)
        if not self.feature_layers:
            return hidden, None
        streams[len(self.layers)] = hidden
        return hidden, torch.cat([streams[i] for i in self.feature_layers], dim=-1)

    def _stacked(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
        attention: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """:meth:`layer_stack`'s layers through :attr:`decode_stack` (see :func:`run_stack`); None where
        the per-layer path must run."""
        assert self.decode_stack is not None
        out = run_stack(
            self.decode_stack, self._stack_refs, hidden, rope, kv_caches, metadata,
            attention, self.feature_layers,
        )  # fmt: skip
        if out is None:
            return None
        hidden, streams = out
        return hidden, (torch.cat(streams, dim=-1) if streams else None)

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """LM head on final-norm hidden states ``[R, hidden_size]`` -> float32 ``[R, vocab_size]``,
        soft-capped by ``cfg.final_logit_softcapping`` when set (Gemma 2)."""
        head = self.lm_head
        # A GemvLinear head writes float32 logits itself on its packed weight (the same values).
        out = head.forward_float32(rows) if hasattr(head, "forward_float32") else head(rows).float()
        cap = self.cfg.final_logit_softcapping
        return out if cap is None else softcap(out, cap)

    def final(
        self,
        hidden: torch.Tensor,
        logits_indices: torch.Tensor | None,
        all_hidden: bool = False,
        aux: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Final norm and LM head on the residual stream ``hidden`` ``[T, hidden_size]``; see
        :meth:`forward` for ``logits_indices``, ``all_hidden`` and the returned shapes; ``aux`` ``[T,
        F]`` (the :attr:`feature_layers` streams) replaces the final-norm features when given."""
        if aux is not None:
            rows = hidden if logits_indices is None else hidden[logits_indices]
            logits = self.logits(self.norm(rows))
            return logits, (aux if all_hidden or logits_indices is None else aux[logits_indices])
        if all_hidden:
            hidden = self.norm(hidden)
            rows = hidden if logits_indices is None else hidden[logits_indices]
            return self.logits(rows), hidden
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        hidden = self.norm(hidden)
        return self.logits(hidden), hidden


def use_cpu_layer_ops(model: nn.Module) -> int:
    """Send ``model``'s RMSNorms, RoPE and SiLU products to the CPU kernels of
    :mod:`kernels.cpu_layer_ops`, in place, where the activations are float32 or bfloat16 on the CPU (a
    norm's weight tells its layer's dtype) and the kernels build here (asked only when some module
    qualifies: a CUDA model builds nothing). Each call still checks device and dtype, so a model moved
    later falls back to the references; with autograd on, and inside ``torch.compile`` traces, the
    references run. Returns the number of modules switched."""
    from kernels import cpu_layer_ops

    def fits(norm: nn.Module) -> bool:
        w = norm.weight
        return w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)

    norms = [m for m in model.modules() if isinstance(m, RMSNorm) and fits(m)]
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer) and fits(m.input_layernorm)]
    if not (norms or layers) or not cpu_layer_ops.available():
        return 0
    for norm in norms:
        norm.use_kernel = True
    for layer in layers:
        layer.use_kernels = True
    in_models = set()
    for lm in (m for m in model.modules() if isinstance(m, DecoderLM)):
        _use_decode_stack(lm)
        in_models.update(id(layer) for layer in lm.layers)
    for layer in layers:  # a draft head's layer: a stack of one
        if id(layer) not in in_models:
            _use_layer_stack(layer)
    return len(norms) + len(layers)


_STACK_MODULES = (
    "input_layernorm", "qkv_proj", "o_proj", "post_attention_layernorm", "gate_up_proj", "down_proj",
)  # fmt: skip
_STACK_TENSORS = ("weight", "qweight", "scales", "bias")


#: ``(store, key, value)``: a module's ``_modules`` / ``_parameters`` / ``_buffers`` dict, a key, and what it
#: held when a stack was built; the stack runs while every store still holds the same object.
_Ref = tuple[dict, str, object]


class StackRefs:
    """Where a stack read its weights (:data:`_Ref` triples), checked on every stacked forward by
    :meth:`hold` in C-level iteration (``map``; SmolLM2's 391 references, 511 int8, in 14 us alone against
    16 us for a generator over them: the gain is the fewer Python frames in the middle of a step)."""

    def __init__(self, refs: list[_Ref]) -> None:
        self.stores = [store for store, _, _ in refs]
        self.keys = [key for _, key, _ in refs]
        self.values = [value for _, _, value in refs]

    def __len__(self) -> int:
        return len(self.keys)

    def hold(self) -> bool:
        """Whether every store still holds the object it held when the stack was built."""
        return all(map(operator.is_, map(dict.get, self.stores, self.keys), self.values))


def _layer_refs(layer: DecoderLayer) -> list[_Ref]:
    """Where a stack read ``layer``'s weights: its six modules in ``layer._modules``, and in each module the
    tensors the stack holds (``weight`` and ``bias``; an int8 QuantizedLinear's ``qweight`` and ``scales``).
    Checked by dictionary lookups on every stacked forward (:class:`StackRefs`; the attribute lookups these
    replace cost ~1.2 ms per forward)."""
    refs: list[_Ref] = []
    for name in _STACK_MODULES:
        module = layer._modules[name]
        refs.append((layer._modules, name, module))
        for store in (module._parameters, module._buffers):  # type: ignore[union-attr]
            refs.extend((store, key, store[key]) for key in _STACK_TENSORS if key in store)
    return refs


def _model_refs(model: DecoderLM) -> list[_Ref]:
    """:func:`_layer_refs` of every layer of ``model``, and the layers themselves in ``model.layers``."""
    refs: list[_Ref] = [(model._modules, "layers", model.layers)]
    for i, layer in enumerate(model.layers):
        refs.append((model.layers._modules, str(i), layer))
        refs.extend(_layer_refs(layer))  # type: ignore[arg-type]
    return refs


def run_stack(
    stack: DecodeStack,
    refs: StackRefs,
    hidden: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    kv_caches: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]],
    metadata: AttentionMetadata,
    attention: AttentionBackend,
    feature_layers: Sequence[int],
    attention_input: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """``stack``'s layers on ``hidden`` ``[T, H]`` (the same kernels in the same order as the per-layer
    path, equal outputs) on the CPU attention backend, in the stack's dtype, outside autograd and
    compilation, where the module still holds the weights the stack was built from (every one of ``refs``,
    see :func:`_layer_refs`) and the batch is short queries, or short queries and prompt chunks where the
    stack takes those (:attr:`~kernels.cpu_decode_stack.DecodeStack.takes_prefill`); None where the
    per-layer path must run.
    ``attention_input``: the first layer's attention input in place of its input norm of ``hidden`` (see
    :meth:`kernels.cpu_decode_stack.DecodeStack.forward`)."""
    stack_queries = getattr(attention, "stack_queries", None)
    k_cache = kv_caches[0][0]
    if (
        stack_queries is None
        or k_cache is None
        or hidden.dim() != 2
        or hidden.dtype != stack.dtype
        or hidden.device.type != "cpu"
        or rope[0].dtype != hidden.dtype
        or hidden.shape[0] > stack.max_rows
        or torch.is_grad_enabled()
        or torch.compiler.is_compiling()
        or k_cache.dtype != hidden.dtype
        or not refs.hold()
        or (attention_input is not None and attention_input.dtype != hidden.dtype)
    ):
        return None
    queries = stack_queries(metadata, k_cache)
    if queries is None or (queries[1] and not stack.takes_prefill):
        return None
    short, chunks = queries
    return stack.forward(
        hidden, *rope, kv_caches, metadata.slot_mapping, short, feature_layers,  # type: ignore[arg-type]
        None if attention_input is None else attention_input.contiguous(), chunks,
    )  # fmt: skip


def _stack_linear(
    module: nn.Module, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """``(weight, packed, scales)`` of a linear the stack takes, computed there as the module computes it:
    a :class:`GemvLinear` on the kernel (its weight and packed copy), or an int8
    :class:`~specdec.quantization.linear.QuantizedLinear` on the int8 kernel (its codes, their tile-order
    copy or None, and float32 scales); None for any other."""
    from specdec.models.cpu_linear import GemvLinear
    from specdec.quantization.linear import QuantizedLinear

    if isinstance(module, GemvLinear) and module.direct and module.weight.dtype == dtype:
        return module.weight, module.packed, None
    if isinstance(module, QuantizedLinear) and module.int8_kernel and module.dtype == dtype:
        return module.qweight, module.tile_codes(), module.scales.float()
    return None


def _stack_layer(layer: DecoderLayer) -> StackLayer | None:
    """``layer`` as :class:`kernels.cpu_decode_stack.StackLayer`, or None when the stack does not take it
    (q/k norms, norms after attention or MLP, a GeLU MLP, linears on neither the GEMV nor the int8
    kernel)."""
    dtype = layer.input_layernorm.weight.dtype
    modules = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    linears = [_stack_linear(m, dtype) for m in modules]
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if (
        not (layer.silu and layer.use_kernels)
        or any(m is not None for m in (layer.q_norm, layer.k_norm, layer.attn_output_norm))
        or layer.mlp_output_norm is not None
        or any(lin is None for lin in linears)
        or not all(n.use_kernel and n.weight.is_contiguous() and n.weight.dtype == dtype for n in norms)
        or type(norms[0]) is not type(norms[1])
        or norms[0].eps != norms[1].eps
    ):
        return None
    (qkv, qkv_p, qkv_s), (o, o_p, o_s), (gu, gu_p, gu_s), (down, down_p, down_s) = linears  # type: ignore[misc]
    kw = layer.attention_kwargs
    return StackLayer(
        layer.input_layernorm.weight, qkv, layer.qkv_proj.bias, o, layer.o_proj.bias,
        layer.post_attention_layernorm.weight, gu, layer.gate_up_proj.bias, down, layer.down_proj.bias,
        layer.num_heads, layer.num_kv_heads, layer.head_dim, float(norms[0].eps), bool(norms[0].gemma),
        float(layer.scale), int(kw.get("sliding_window", 0)), float(kw.get("softcap", 0.0)),
        qkv_p, o_p, gu_p, down_p, qkv_s, o_s, gu_s, down_s,
    )  # fmt: skip


def _use_decode_stack(model: DecoderLM) -> bool:
    """Give ``model`` its :attr:`DecoderLM.decode_stack` when every layer fits and the stack builds here
    (``SPECDEC_CPU_DECODE_STACK=0`` keeps the per-layer path). Returns whether it did."""
    specs = [_stack_layer(layer) for layer in model.layers]
    fits = bool(specs) and all(specs) and not any(model.local_rope_layers)
    fits = fits and specs[0].input_norm.dtype == model.embed_tokens.weight.dtype  # type: ignore[union-attr]
    return _build_stack(model, specs if fits else None, lambda: _model_refs(model))


def _use_layer_stack(layer: DecoderLayer) -> bool:
    """Give a layer that runs on its own (an EAGLE head's) a one-layer :attr:`DecoderLayer.decode_stack`
    when it fits and the stack builds here. Returns whether it did."""
    spec = _stack_layer(layer)
    return _build_stack(layer, None if spec is None else [spec], lambda: _layer_refs(layer))


def _build_stack(
    owner: DecoderLM | DecoderLayer,
    specs: list[StackLayer | None] | None,
    refs: Callable[[], list[_Ref]],
) -> bool:
    """Set ``owner.decode_stack`` to a :class:`DecodeStack` of ``specs`` (None: the layers do not fit) and
    ``owner._stack_refs`` to ``refs()``, where it read its weights, when the stack builds here; else None."""
    owner.decode_stack, owner._stack_refs = None, StackRefs([])
    if specs is None or not cpu_decode_stack.available():
        return False
    owner.decode_stack = DecodeStack(specs)  # type: ignore[arg-type]
    owner._stack_refs = StackRefs(refs())
    return True
