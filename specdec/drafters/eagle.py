"""EAGLE drafter: one decoder layer, autoregressive in the target's feature space; chain or EAGLE-2 tree.

Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", ICML 2024 (the head and
chain drafting); Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees",
EMNLP 2024 (the dynamic tree).

Head position ``t`` takes ``(embed(x_{t+1}), f_t)`` and predicts ``f_{t+1}``; the target's LM head turns
that into the distribution of ``x_{t+2}``. The head's K/V lives in its own cache tensors on the target's
block tables (slot of position t), like the draft-model drafter. Per request the drafter keeps the
target's features it has not consumed yet (handed over by the engine from the verification forward,
:meth:`EagleDrafter.observe`) and how many head positions hold K/V computed from true features.

A step with ``L`` committed tokens knows the target's features up to position ``L - 2`` (the last
committed token is the root the target computes now). The drafter first catches up on head positions
up to ``L - 2``, whose last output predicts the first draft, then drafts:

- **chain** (``tree=None``): top-1 at each of k steps, all requests batched through the paged cache; the
  speculative positions' K/V is overwritten by the next catch-up.
- **dynamic tree** (``tree="dynamic"``): at depth 1 the root's top ``tree_topk`` tokens; at each further
  depth the ``tree_topk`` nodes of the previous depth with the highest cumulative draft log-probability
  are fed to the head (each sees the context, its fed ancestors and itself: every fed node re-fed as one
  tree-masked segment in the step's reserved slots, through the layer stack, where they fit; else over a
  dense copy of the request's head K/V) and each gets its top ``tree_topk`` children; finally the
  ``max_tree_nodes`` best nodes of all depths are kept (:func:`specdec.drafters.tree.select_top_nodes`).

With prefix caching, head positions inside reused blocks are not recomputed: they hold whatever head K/V
was written there, the earlier request's (equal, features being deterministic given the tokens) when it
drafted past them, zeros or stale values otherwise. Drafts are verified exactly, so this can only lower
acceptance.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sampling.sampler import argmax_rows
from sampling.token_tree import TokenTree
from specdec.attention.base import AttentionMetadata
from specdec.drafters.base import DrafterBase, DrafterContext, DraftInput, DraftProposal
from specdec.drafters.draft_vocab import DraftVocab, drafting_vocab
from specdec.drafters.heads import EagleHead, load_heads
from specdec.drafters.registry import register_drafter
from specdec.drafters.tree import select_top_nodes
from specdec.errors import ConfigError
from specdec.model_runner import Segment, build_inputs, select_attention_backend
from specdec.quantization.apply import quantize_linears
from specdec.request import Request

#: Feature chunks a request keeps before they are copied into one tensor (:meth:`_EagleState.append`).
MAX_FEATURE_CHUNKS = 32


@dataclass
class _EagleState:
    num_computed: int  # head positions < this hold K/V from true features
    features_start: int  # position of features[0]
    features: list[torch.Tensor] = field(default_factory=list)  # [n_i, H] chunks, consecutive positions
    num_features: int = 0  # rows over ``features`` (kept, not summed: a request that never drafts
    # appends a chunk per step)

    @property
    def features_end(self) -> int:
        """One past the position of the last known feature."""
        return self.features_start + self.num_features

    def append(self, rows: torch.Tensor) -> None:
        """Keep ``rows`` (often a view into a step's features of every row, which it keeps alive); every
        :data:`MAX_FEATURE_CHUNKS` chunks they are copied into one tensor of their own, so a request that
        seldom drafts holds its own rows, not the steps' whole tensors."""
        self.features.append(rows)
        self.num_features += rows.shape[0]
        if len(self.features) >= MAX_FEATURE_CHUNKS:
            self.features = [torch.cat(self.features)]

    def feature_rows(self, start: int, end: int) -> torch.Tensor:
        feats = torch.cat(self.features) if len(self.features) > 1 else self.features[0]
        self.features = [feats]
        return feats[start - self.features_start : end - self.features_start]

    def drop_before(self, position: int) -> None:
        if not self.features:
            return
        feats = torch.cat(self.features) if len(self.features) > 1 else self.features[0]
        cut = max(0, position - self.features_start)
        self.features = [feats[cut:]] if cut < feats.shape[0] else []
        self.features_start += cut
        self.num_features = feats.shape[0] - min(cut, feats.shape[0])


class _DenseTreeAttention:
    """Attention for tree drafting of one request: its head K/V so far as dense tensors plus the fed
    tree nodes, each query seeing the whole context, its fed ancestors and itself."""

    def __init__(self, k_ctx: torch.Tensor, v_ctx: torch.Tensor) -> None:
        self.k, self.v = k_ctx, v_ctx  # [C, KVH, D]
        self.num_context = k_ctx.shape[0]
        self.visible: torch.Tensor | None = None  # [q, C + fed] bool, set before each forward

    def forward(self, query, key, value, k_cache, v_cache, metadata: AttentionMetadata, scale: float):
        self.k = torch.cat([self.k, key.to(self.k.dtype)])
        self.v = torch.cat([self.v, value.to(self.v.dtype)])
        q = query.transpose(0, 1)  # [H, q, D]
        k, v = self.k.transpose(0, 1).to(q.dtype), self.v.transpose(0, 1).to(q.dtype)
        gqa = q.shape[0] != k.shape[0]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.visible, scale=scale, enable_gqa=gqa)
        return o.transpose(0, 1)


@register_drafter(
    "eagle",
    model="heads",
    trees=(None, "dynamic"),
    fields=("tree_topk", "max_tree_nodes", "draft_vocab", "quantization", "draft_stop_probability"),
)
class EagleDrafter(DrafterBase):
    """EAGLE (Li et al. 2024): one decoder layer in the target's feature space; chain or EAGLE-2 tree.

    Args:
        ctx: ``ctx.target`` (its embedding and LM head are shared with the head); ``ctx.model_dir`` the
            head's directory; ``ctx.config``: ``num_speculative_tokens`` (chain length / tree depth),
            ``tree`` None or "dynamic", ``tree_topk``, ``max_tree_nodes``, ``draft_vocab`` (a reduced
            draft vocabulary: the LM head's rows of those tokens only, ``[V', H]``, copied once).
        head: an already loaded :class:`EagleHead` (tests); None loads it from ``ctx.model_dir``.

    Its own KV (the head's K/V on the target's block tables) is allocated by :meth:`bind_kv`.

    Raises:
        ConfigError: ``tree_topk`` larger than the vocabulary; ``draft_vocab`` ids outside the target's
            vocabulary, or an EAGLE-3 head for another target.
        CorruptModelError, InvalidRequestError: see :func:`specdec.drafters.heads.load_heads`.
    """

    uses_hidden_states = True
    #: The reduced draft vocabulary (``draft_vocab``, or the whole one quantized), None for the target's.
    vocab: DraftVocab | None = None
    #: Draft logits come from the target's LM head (EAGLE-3's head has its own).
    drafts_through_target_lm_head = True
    #: Dynamic trees: each level re-feeds the fed nodes as one paged, tree-masked segment where they fit
    #: the step's reserved slots (the layer stack's path); False: always the dense reference path (the
    #: tests compare the two).
    paged_tree = True

    def __init__(self, ctx: DrafterContext, head: EagleHead | None = None) -> None:
        target, config = ctx.target, ctx.config
        if head is None:
            assert ctx.model_dir is not None, "the registry resolves the head's directory"
            head = self._load_head(ctx)
        vocab = self._draft_vocab_size(head, target.cfg.vocab_size)
        quantization = config.quantization_config()
        if quantization is not None:  # the head's linears, and below the LM-head rows it drafts through
            quantize_linears(head, quantization, next(head.parameters()).dtype)
        if self.drafts_through_target_lm_head:
            self.vocab = drafting_vocab(getattr(config, "draft_vocab", None), target, ctx.dtype, quantization)
            if self.vocab is not None:
                vocab = len(self.vocab)
        if config.tree == "dynamic" and config.tree_topk > vocab:
            raise ConfigError(f"tree_topk={config.tree_topk} exceeds the draft vocabulary ({vocab} tokens)")
        self.target = target
        self.head = head
        self.config = config
        param = next(head.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.attention = select_attention_backend(self.device)
        self.block_size = 0
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.states: dict[str, _EagleState] = {}
        self._id_map: list[int] | None = None  # target id of each draft-logits column (see _choose)

    @staticmethod
    def _load_head(ctx: DrafterContext) -> torch.nn.Module:
        loaded, _ = load_heads(str(ctx.model_dir), ctx.target.cfg, "eagle", ctx.dtype, ctx.device)
        assert isinstance(loaded, EagleHead)
        return loaded

    @staticmethod
    def _draft_vocab_size(head: torch.nn.Module, vocab_size: int) -> int:
        """Tokens the head drafts from (EAGLE: the target's whole vocabulary)."""
        return vocab_size

    def kv_bytes_per_block(self, block_size: int) -> int:
        arch = self.head.arch
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * block_size * arch.num_kv_heads * arch.head_dim * elem

    def bind_kv(self, num_blocks: int, block_size: int) -> None:
        arch = self.head.arch
        shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        self.block_size = block_size
        self.kv_cache = (
            torch.zeros(shape, dtype=self.dtype, device=self.device),
            torch.zeros(shape, dtype=self.dtype, device=self.device),
        )

    # ------------------------------------------------------------------ state
    def observe(self, request: Request, start_position: int, hidden_states: torch.Tensor) -> None:
        state = self.states.get(request.request_id)
        if state is None or start_position != state.features_end:
            # A fresh (or re-admitted) request: positions before the first feature are taken as computed
            # (prefix-cached blocks keep the head K/V written when they were filled).
            state = self.states[request.request_id] = _EagleState(start_position, start_position)
        state.append(hidden_states.detach().to(self.dtype))

    def reset(self, request: Request) -> None:
        self.states.pop(request.request_id, None)

    def _catch_up_start(self, request: Request) -> int | None:
        """The first head position the request's next draft computes (the catch-up runs from it to the
        last committed feature, ``request.num_tokens - 2``), or None when it cannot draft (no features)."""
        state = self.states.get(request.request_id)
        last = request.num_tokens - 2
        if state is None or state.features_end != last + 1:
            return None
        return min(max(state.num_computed, state.features_start), last)

    def draft_backlog(self, request: Request, num_new_tokens: int) -> int:
        """Committed tokens whose head K/V the request's next draft computes first, the last one aside (it
        rides in the drafting forward): its prompt before its first draft, and the tokens since its last
        draft where a policy held it back. The head reads them in the same forward as its first draft
        row, timed as ``catch_up_s`` in proportion (:meth:`propose`)."""
        start = self._catch_up_start(request)
        return 0 if start is None else request.num_tokens - 2 - start

    def on_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Nothing to roll back: speculative head K/V is overwritten by the next catch-up."""

    # ------------------------------------------------------------------ head
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[R, V']`` float32 of predicted hidden states ``[R, H]`` (EAGLE: the target's
        LM head over its whole vocabulary, ``V' = V``)."""
        if self.vocab is not None:  # reduced: the LM head's rows of the draft vocabulary only
            return self.vocab.logits(hidden)
        return self.target.logits(hidden.to(self.target.dtype))

    def _to_target(self, indices: torch.Tensor) -> torch.Tensor:
        """Target token ids of indices into :meth:`_logits`' columns (EAGLE: the same, or the reduced
        vocabulary's ids)."""
        return indices if self.vocab is None else self.vocab.to_target(indices)

    def _choose(
        self, logits: torch.Tensor, batch: list[DraftInput], proposals: list[DraftProposal]
    ) -> list[int]:
        """One chain draft per row of ``logits`` ``[R, V']`` (row r drafts for ``batch[r]``, whose
        ``proposals[r]`` holds its drafts so far): EAGLE drafts the top-1 token (``draft_probs`` stay
        None: deterministic drafts)."""
        if self._id_map is None:  # the index -> target id map as a list: a lookup per draft, no tensor op
            self._id_map = self._to_target(torch.arange(logits.shape[-1], device=logits.device)).tolist()
        id_map = self._id_map
        return [id_map[i] for i in argmax_rows(logits).tolist()]

    def _run(self, segments: list[Segment], features: torch.Tensor) -> torch.Tensor:
        """Head forward over paged segments whose ``token_ids`` are the ``x_{t+1}``; returns the predicted
        features at each segment's logits rows."""
        inputs = build_inputs(segments, self.block_size, self.device)
        embeds = self.target.embed_tokens(inputs.input_ids).to(self.dtype)
        assert self.kv_cache is not None, "bind_kv allocates the head's KV"
        out = self.head(embeds, features, inputs.positions, self.kv_cache, inputs.metadata, self.attention)
        if inputs.logits_indices.shape[0] == out.shape[0]:  # a row per token (chain steps): all, in order
            return out
        return out[inputs.logits_indices]

    @torch.inference_mode()
    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        proposals = [DraftProposal([]) for _ in batch]
        self.catch_up_s, self.catch_up_tokens = 0.0, 0
        # 1. Catch up on head positions [num_computed, L - 1) of drafting requests.
        drafting: list[int] = []
        segments: list[Segment] = []
        feats: list[torch.Tensor] = []
        for i, x in enumerate(batch):
            req = x.request
            start = self._catch_up_start(req) if x.max_drafts > 0 else None
            if start is None:
                continue  # not drafting, or features missing (a request in prefill): no drafts this step
            state = self.states[req.request_id]
            last = req.num_tokens - 2  # last position with a known target feature
            segments.append(Segment(req.block_ids, start, req.token_ids[start + 1 : last + 2], 1))
            feats.append(state.feature_rows(start, last + 1))
            state.num_computed = last + 1
            state.drop_before(last + 1)
            drafting.append(i)
        if not drafting:
            return proposals
        rows = sum(len(seg.token_ids) for seg in segments)
        t0 = time.perf_counter()
        root_features = self._run(segments, torch.cat(feats))  # [B, H]: predicts f_{L-1}
        if rows > len(segments):  # a catch-up rode in this forward: its share of the time (the policy's)
            self.catch_up_tokens = rows - len(segments)
            self.catch_up_s = (time.perf_counter() - t0) * self.catch_up_tokens / rows
        if self.config.tree == "dynamic":
            for row, i in enumerate(drafting):
                proposals[i] = self._tree(batch[i], root_features[row])
            return proposals
        # 2. Chain: top-1, one head position per request per step; row r of `feature` drafts for
        # batch[drafting[active[r]]].
        feature = root_features
        active = list(range(len(drafting)))
        stop = self.config.draft_stop_probability
        first = True
        while True:
            logits = self._logits(feature)
            tokens = self._choose(
                logits, [batch[drafting[r]] for r in active], [proposals[drafting[r]] for r in active]
            )
            for r, token in zip(active, tokens):
                proposals[drafting[r]].token_ids.append(token)
            report = first and self.reports_confidence
            top_prob = torch.softmax(logits, -1).amax(-1) if stop is not None or report else None
            if report:
                for r, p in zip(active, top_prob.tolist()):
                    proposals[drafting[r]].first_draft_prob = p
            first = False
            # Confident rows only go on (draft_stop_probability): the head's top-1 probability, a function
            # of the drafts so far, so the verification stays exact.
            confident = [True] * len(active) if stop is None else (top_prob >= stop).tolist()
            keep = [
                j
                for j, r in enumerate(active)
                if confident[j] and len(proposals[drafting[r]].token_ids) < batch[drafting[r]].max_drafts
            ]
            if not keep:
                break
            if len(keep) < len(active):
                feature, active = feature[keep], [active[j] for j in keep]
            segs = []
            for r in active:
                req = batch[drafting[r]].request
                drafts = proposals[drafting[r]].token_ids
                segs.append(Segment(req.block_ids, req.num_tokens - 2 + len(drafts), drafts[-1:], 1))
            feature = self._run(segs, feature)
        return proposals

    def _tree(self, x: DraftInput, root_feature: torch.Tensor) -> DraftProposal:
        """EAGLE-2's dynamic tree for one request.

        Each level's forward sees the context, the node's fed ancestors and itself. Where every node the
        tree can feed (``tree_topk × (depth - 1)``) fits in the KV slots the step reserved for the request
        (its last token's and ``max_tree_nodes`` drafts'), each level re-feeds all fed nodes as one paged
        segment at the context's end with their tree attention mask (the layer stack's path, as the
        target verifies a tree; the slots are scratch, the next catch-up overwrites them); otherwise the
        level feeds its new nodes alone over a dense copy of the request's head K/V. Both compute the same
        attention."""
        cfg = self.config
        req = x.request
        topk, depth_limit = cfg.tree_topk, x.max_drafts
        budget = max(1, min(cfg.max_tree_nodes, x.max_tree_nodes))
        context = req.num_tokens - 1  # head positions 0 .. L-2
        paged = self.paged_tree and topk * max(0, depth_limit - 1) <= x.max_tree_nodes + 1
        attn: _DenseTreeAttention | None = None
        if not paged:
            blocks = torch.tensor(req.block_ids[: -(-context // self.block_size)], device=self.device)
            assert self.kv_cache is not None, "bind_kv allocates the head's KV"
            k_cache, v_cache = self.kv_cache
            attn = _DenseTreeAttention(
                k_cache[blocks].flatten(0, 1)[:context], v_cache[blocks].flatten(0, 1)[:context]
            )
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        fed: list[int] = []  # candidate index of each fed node, in feeding order
        # Depth 1: children of the root.
        logp = torch.log_softmax(self._logits(root_feature[None]), dim=-1)[0]
        top = logp.topk(topk)
        frontier = []
        for lp, t in zip(top.values.tolist(), self._to_target(top.indices).tolist()):
            frontier.append(len(tokens))
            tokens.append(t)
            parents.append(-1)
            scores.append(lp)
        node_feature = {c: root_feature for c in frontier}  # feature each node was predicted from
        for depth in range(2, depth_limit + 1):
            expand = sorted(frontier, key=lambda c: -scores[c])[:topk]
            if attn is None:  # all fed nodes again, then the new ones: one paged segment, tree-masked
                fed.extend(expand)
                slot = {c: j for j, c in enumerate(fed)}  # a fed node's parent was fed before it
                sub = TokenTree(tuple(tokens[c] for c in fed), tuple(slot.get(parents[c], -1) for c in fed))
                seg = Segment(
                    req.block_ids,
                    context,
                    list(sub.token_ids),
                    len(expand),
                    positions=[context - 1 + d for d in sub.depths()],
                    mask=sub.attention_mask(num_prefix=0),
                )
                out = self._run([seg], torch.stack([node_feature[c] for c in fed]))
            else:
                # Each fed node sees the context, its fed ancestors and itself.
                visible = torch.zeros(len(expand), context + len(fed) + len(expand), dtype=torch.bool)
                visible[:, :context] = True
                for r, c in enumerate(expand):
                    a = parents[c]
                    while a >= 0:
                        visible[r, context + fed.index(a)] = True
                        a = parents[a]
                    visible[r, context + len(fed) + r] = True
                attn.visible = visible.to(self.device)
                embeds = self.target.embed_tokens(
                    torch.tensor([tokens[c] for c in expand], device=self.device)
                )
                feats = torch.stack([node_feature[c] for c in expand])
                positions = torch.full((len(expand),), context - 1 + depth - 1, device=self.device)
                out = self.head(embeds.to(self.dtype), feats, positions, (None, None), None, attn)
                fed.extend(expand)
            logp = torch.log_softmax(self._logits(out), dim=-1)
            top = logp.topk(topk)
            frontier = []
            top_ids = self._to_target(top.indices)
            for r, c in enumerate(expand):
                for lp, t in zip(top.values[r].tolist(), top_ids[r].tolist()):
                    node_feature[len(tokens)] = out[r]
                    frontier.append(len(tokens))
                    tokens.append(t)
                    parents.append(c)
                    scores.append(scores[c] + lp)
        keep = select_top_nodes(scores, parents, budget)
        index = {c: j for j, c in enumerate(keep)}
        proposal = DraftProposal([tokens[c] for c in keep], parents=[index.get(parents[c], -1) for c in keep])
        if self.reports_confidence:
            proposal.first_draft_prob = math.exp(scores[0])  # the root's best child (topk, best first)
        return proposal
