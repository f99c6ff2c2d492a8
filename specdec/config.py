"""Typed engine configuration, validated with ``ValueError`` at construction."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from specdec.errors import ConfigError

if TYPE_CHECKING:
    from specdec.policies.base import SpeculationPolicy
    from specdec.quantization.config import QuantizationConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_int(name: str, value: object, minimum: int, optional: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is an int >= ``minimum`` (or None when ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = f"an integer >= {minimum}" + (" or None" if optional else "")
        raise ConfigError(f"{name} must be {kind}, got {value!r}")


@dataclass
class CacheConfig:
    """Paged KV cache.

    Attributes:
        block_size: tokens per KV block.
        num_kv_blocks: blocks in the pool; None sizes the pool to hold ``max_num_seqs`` full-length
            sequences, capped at ``kv_cache_memory_bytes``.
        enable_prefix_caching: share full blocks of equal prefixes between requests.
        kv_cache_memory_bytes: memory budget for the pool when ``num_kv_blocks`` is None.
        kv_cache_dtype: ``"auto"`` (the model's dtype) or ``"int8"`` (one float32 scale per token and KV
            head; see :mod:`specdec.quantization.kv_cache`). A draft model's KV stays in its own dtype.
        kv_huge_pages: on the CPU, allocate the target's pool on transparent huge pages, faulted in at
            start-up as ``torch.zeros`` faults its memory, not by the steps that first write it
            (:func:`specdec.engine.huge_pages.zeros_on_huge_pages`; ``LLM`` sets it with its
            ``huge_pages``).
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int = 2 * 1024**3
    kv_cache_dtype: str = "auto"
    kv_huge_pages: bool = False

    def __post_init__(self) -> None:
        from specdec.quantization.kv_cache import check_kv_cache_dtype

        check_kv_cache_dtype(self.kv_cache_dtype)
        _check_int("block_size", self.block_size, 1)
        _check_int("num_kv_blocks", self.num_kv_blocks, 1, optional=True)
        _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if not isinstance(self.kv_huge_pages, bool):
            raise ConfigError(f"kv_huge_pages must be a bool, got {self.kv_huge_pages!r}")


@dataclass
class SchedulerConfig:
    """Continuous batching.

    Attributes:
        max_num_batched_tokens: token budget of one forward (prefill chunks + decode tokens + drafts).
        max_num_seqs: most requests running at once.
        max_model_len: longest sequence (prompt + output); None: the model's maximum.
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_model_len", self.max_model_len, 2, optional=True)


#: The largest capture size of CUDA graphs (requests per step).
MAX_CUDA_GRAPH_BATCH = 1024


@dataclass
class CompilationConfig:
    """``torch.compile`` of the target's (and a draft model's) forward, piecewise: everything but
    attention, one graph per token bucket (see :mod:`specdec.compilation`).

    Attributes:
        enabled: compile; False keeps the eager model (the reference).
        buckets: token counts the forward is padded to (sorted, distinct, positive); wider forwards
            (long prefill chunks) run eagerly. Default :data:`~specdec.compilation.buckets.DEFAULT_BUCKETS`.
        backend: ``"inductor"``, or ``"eager"`` (traces and pads without generating code: for tests).
        cuda_graphs: on CUDA, replay decode and chain-verification steps from captured CUDA graphs (see
            :mod:`specdec.compilation.cuda_graphs`); independent of ``enabled`` (graphs of the eager or
            of the compiled forward). Needs a CUDA device and the Triton attention backend.
        cuda_graph_batch_sizes: requests per step that graphs are captured for (a step is padded to the
            next one; more requests run eagerly). Default
            :data:`~specdec.compilation.cuda_graphs.DEFAULT_CAPTURE_SIZES`.
        cuda_graph_max_query_len: the longest query (new tokens of one request) a graph takes: a decode
            token is 1, a chain of k drafts k + 1. Default 8.
    """

    enabled: bool = True
    buckets: tuple[int, ...] | None = None
    backend: str = "inductor"
    cuda_graphs: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    cuda_graph_max_query_len: int = 8

    def __post_init__(self) -> None:
        from specdec.compilation.buckets import DEFAULT_BUCKETS, check_buckets

        if not isinstance(self.enabled, bool):
            raise ConfigError(f"compile enabled must be a bool, got {self.enabled!r}")
        try:
            self.buckets = check_buckets(DEFAULT_BUCKETS if self.buckets is None else list(self.buckets))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"compile buckets: {e}") from None
        if self.backend not in ("inductor", "eager"):
            raise ConfigError(f"compile backend must be 'inductor' or 'eager', got {self.backend!r}")
        from specdec.compilation.cuda_graphs import DEFAULT_CAPTURE_SIZES

        if not isinstance(self.cuda_graphs, bool):
            raise ConfigError(f"compile cuda_graphs must be a bool, got {self.cuda_graphs!r}")
        sizes = DEFAULT_CAPTURE_SIZES if self.cuda_graph_batch_sizes is None else self.cuda_graph_batch_sizes
        try:
            self.cuda_graph_batch_sizes = check_buckets(list(sizes))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"compile cuda_graph_batch_sizes: {e}") from None
        if self.cuda_graph_batch_sizes[-1] > MAX_CUDA_GRAPH_BATCH:
            raise ConfigError(
                f"compile cuda_graph_batch_sizes must be at most {MAX_CUDA_GRAPH_BATCH} requests, got "
                f"{self.cuda_graph_batch_sizes[-1]}"
            )
        q = self.cuda_graph_max_query_len
        if isinstance(q, bool) or not isinstance(q, int) or not 1 <= q <= 64:
            raise ConfigError(f"compile cuda_graph_max_query_len must be an int in [1, 64], got {q!r}")

    @classmethod
    def from_any(cls, value: CompilationConfig | dict | bool | None) -> CompilationConfig | None:
        """``True`` (defaults), ``False`` / None (off), a dict of fields, or a config; None when neither
        ``enabled`` nor ``cuda_graphs`` is set.

        Raises:
            ConfigError: another type, an unknown field, or an invalid value.
        """
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, dict):
            names = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - names)
            if unknown:
                raise ConfigError(f"unknown compile option(s) {unknown}; expected some of {sorted(names)}")
            value = cls(**value)
        if not isinstance(value, cls):
            raise ConfigError(f"compile must be a bool, a dict or a CompilationConfig, got {value!r}")
        return value if value.enabled or value.cuda_graphs else None


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"`` / ``"bfloat16"`` / ``"float16"`` or a torch dtype.

    Raises:
        ConfigError (a ValueError): any other dtype.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None picks CUDA when available, else the CPU.

    Raises:
        ConfigError: not a device torch knows, or CUDA asked for where it is not available.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device must be 'cpu', 'cuda', 'cuda:N' or None, got {device!r} ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but CUDA is not available here")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be a CPU or CUDA device, got {device!r}")
    return dev


#: Largest ``num_speculative_tokens`` accepted (beyond this, acceptance of the last positions is ~0).
MAX_SPECULATIVE_TOKENS = 16
TREE_KINDS = (None, "static", "dynamic")
#: Largest token tree verified per request per step.
MAX_TREE_NODES = 64
#: The hybrid drafter's members when ``hybrid_members`` is None (:mod:`specdec.drafters.hybrid`).
DEFAULT_HYBRID_MEMBERS = ("suffix", "ngram")
#: Default ``max_tree_nodes``: 15 drafts and the request's last accepted token make a verification
#: step of 16 rows, one 16-row tile of the AMX kernels (and a compiled step's bucket); a 17th row starts a
#: second tile: on a 2-core Intel Xeon with AMX a 17-row step cost 1.48x a plain step against 1.25x for
#: 16 rows (``python -m experiments.bench_step tree_nodes=17``, then the default 16), and EAGLE-3 trees
#: of 15 drafts ran 1.44x plain decoding against 1.29x for 16 at the same tau (docs/engine.md, "Trees of
#: 15 drafts").
#: A compiled step pads 17 tokens to its 32-token bucket (specdec/compilation/buckets.py).
DEFAULT_MAX_TREE_NODES = 15
#: Medusa's static tree when ``tree="static"`` and no ``tree_choices`` are given: 15 nodes over 4 heads
#: (16 rows with the root, as :data:`DEFAULT_MAX_TREE_NODES`): the 16-node tree that
#: :func:`specdec.drafters.tree.choices_from_accuracies` built from held-out per-rank accuracies of the
#: built-in SmolLM2 heads, less its least likely path ``(0, 4)``.
DEFAULT_TREE_CHOICES: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (0, 0), (2,), (3,), (0, 1), (4,), (5,),
    (1, 0), (0, 2), (6,), (7,), (0, 3), (8,), (2, 0),
)  # fmt: skip
#: Fields every drafter may set; the others belong to the drafters that declare them
#: (``register_drafter(fields=...)``) and keep their defaults elsewhere.
_COMMON_FIELDS = (
    "method", "num_speculative_tokens", "model", "draft_dtype", "tree", "drafter_kwargs",
    "policy", "policy_kwargs", "grammar_forced_drafts", "max_forced_drafts",
)  # fmt: skip


@dataclass
class SpeculativeConfig:
    """Speculative decoding: which drafter proposes tokens, how many, and in what shape.

    The built-in methods (each registered in its own file of :mod:`specdec.drafters`; a user's own
    through :func:`specdec.drafters.register_drafter`): "ngram" (prompt lookup, Saxena 2023),
    "draft_model" (a smaller model with the target's tokenizer; Leviathan et al. 2023, Chen et al. 2023),
    "quantized_self" (the target's own weights quantized, see ``quantization``: a draft model that needs
    no second checkpoint), "medusa" (Medusa-1 heads, Cai et al. 2024), "eagle" (an EAGLE head, Li et al.
    2024), "eagle3" (an EAGLE-3 head: fused target layers, a reduced draft vocabulary; Li et al. 2025),
    "grammar" (the tokens a request's grammar forces, no model: jump-forward decoding verified as
    drafts), "suffix" (suffix decoding, Oliaro et al. 2024: suffix tries over the request's text and,
    opt-in, earlier requests'), "hybrid" (per request and step, the member proposal with the most expected
    accepted drafts).

    Attributes:
        method: a registered drafter's name (:func:`specdec.drafters.drafter_names`).
        num_speculative_tokens: k, the most draft tokens per step of a chain, or the deepest level of a
            tree (1..16).
        prompt_lookup_max, prompt_lookup_min: n-gram sizes tried by "ngram", longest first.
        model: "draft_model": a zoo name or an HF-format directory; "medusa"/"eagle"/"eagle3": a built-in
            head name (a folder of ``specdec/heads``) or a head checkpoint directory, None for the target's
            built-in heads (``<target zoo name>-<method>``). What it means for a drafter is its registry
            entry's ``model`` kind.
        draft_dtype: dtype of the draft model or heads; None: the target's.
        quantization: "quantized_self": the drafter is the target's own weights quantized, ``"int4"``,
            ``"int8"`` or a dict of :class:`~specdec.quantization.config.QuantizationConfig` fields (e.g.
            ``{"method": "int4", "group_size": 32}``); it shares the target's tokenizer and embedding, has
            its own KV, and the full-precision target verifies its drafts as any draft model's.
            "eagle" / "eagle3" / "medusa": the head's linear layers and the LM-head rows it drafts through
            (the target's, or ``draft_vocab``'s; a quantized copy, the target keeps its own) are
            weight-only quantized, so a draft token reads about half the bytes (int8). Drafts are
            verified as always: outputs stay exact.
        tree: None (a chain of k drafts), "static" (a Medusa tree from ``tree_choices``; medusa only) or
            "dynamic" (EAGLE-2's tree; eagle and eagle3): the values the drafter's entry lists in ``trees``.
        tree_choices: the static tree's index paths (None: :data:`DEFAULT_TREE_CHOICES`); paths deeper than
            k are dropped.
        tree_topk: "dynamic": children drafted per expanded node, and nodes expanded per level.
        max_tree_nodes: "dynamic": draft tokens kept after reranking (the verified tree's size; default
            15, so that with the last accepted token a step verifies 16 rows: :data:`DEFAULT_MAX_TREE_NODES`).
        drafter_kwargs: keyword arguments passed to the drafter's constructor (user drafters).
        policy: the speculation policy, a registered name (:func:`specdec.policies.policy_names`):
            ``"static"`` (depth k every step, the default), ``"batch_size"`` (k from a schedule over the
            step's batch size), ``"goodput"`` (expected committed tokens per second from acceptance
            history and the step's cost) or ``"ucb"`` (a bandit over depths, BanditSpec's UCBSpec); see
            :mod:`specdec.policies`.
        policy_kwargs: keyword arguments of the policy's constructor (``"static"``: ``depth``;
            ``"batch_size"``: ``schedule``; ``"goodput"`` / ``"ucb"``: see their classes).
        grammar_forced_drafts: constrained requests' chains are cut at the first token their grammar
            forbids and extended by the tokens it forces: see :mod:`specdec.drafters.grammar_forced`.
            Exact; it only adds drafts.
        max_forced_drafts: with ``grammar_forced_drafts``, draft positions a constrained request may use
            beyond k for grammar-aware drafting (the forced tokens, and the lookups between them of a
            drafter that can continue a draft): its chain may be ``k + max_forced_drafts`` long, and that
            many more KV slots are reserved for it each step. Unconstrained requests and the speculation
            policy's depth are unaffected (the policy decides the drafter's part, up to k). None: k.
        suffix_max_match: "suffix" / "hybrid": longest suffix of the context matched (tokens, 1..64).
        suffix_min_token_prob: "suffix" / "hybrid": continuations whose path probability (frequency
            along the suffix trie) is below this are not drafted (0..1).
        suffix_spec_factor: "suffix" / "hybrid": a match of p tokens allows ``ceil(factor × p)`` drafts
            (SuffixDecoding's adaptive budget), capped by k and ``max_tree_nodes``.
        suffix_accept_threshold: "suffix" / "hybrid": a chain keeps its drafts while their estimated
            chance of acceptance (from earlier drafts after matches of the same length) is at least this
            (at least one draft); ``"auto"`` (the default): the break-even from the target's step
            costs (a verification row's cost × mean tokens per step; the row's cost profiled at
            start-up, then learned from the engine's one-request steps for requests without a seed), a
            number in [0, 1] fixes it, 0 keeps every draft. See :mod:`specdec.drafters.draft_length`.
        suffix_cache_max_nodes: "suffix" / "hybrid": node budget of the global suffix trie over earlier
            requests (least recently used requests evicted; ~270 bytes a node in CPython 3.11).
        suffix_share_across_requests: "suffix" / "hybrid": draft from earlier requests' prompts and
            outputs. Off by default: outputs stay exact either way, but a request's speed could reveal
            what another request wrote (see :mod:`specdec.drafters.suffix`).
        hybrid_members: "hybrid": the drafters it chooses among per request and step (None:
            ``["suffix", "ngram"]``); see :mod:`specdec.drafters.hybrid`.
        hybrid_skip_outranked: "hybrid" with a learned member: skip the head's draft step for a request
            when a model-free member's proposal outranks any the head could make (True, the default);
            False: the head drafts every step, so the hindsight counts and the oracle see its proposals
            every step too.
        hybrid_union: "hybrid": submit the union of the members' proposals as one token tree (their
            common prefixes shared, the best-ranked member's nodes first) instead of the best one alone,
            so that a step accepts what its best member in hindsight would have had accepted (greedy:
            exactly the oracle's τ) for the cost of verifying more rows. A chain config then reserves
            ``min(k × len(members), 64)`` draft slots, a tree keeps ``max_tree_nodes``. Deterministic
            proposals merge; a sampled chain (with ``draft_probs``) that ranks first goes alone. False
            (default): the best proposal alone.
        draft_vocab: "eagle" / "medusa" / "quantized_self": draft from a reduced vocabulary (EAGLE-3's
            idea): a list of target token ids, or the name or directory of an EAGLE-3 head for the same
            target whose draft vocabulary (its ``d2t``: the most frequent target tokens of its training
            data) to take. Each draft token then costs the target's LM-head rows of those tokens only.
            None: the whole vocabulary. Drafts are verified as always, so outputs stay exact; acceptance
            can only fall where the target's token lies outside the vocabulary.
        draft_stop_probability: "eagle" / "eagle3" chains: stop a request's chain after a draft whose
            head distribution gives its top token less than this probability (EAGLE-2's confidence, used to
            cut a chain: the next drafts would likely be rejected), so a step drafts 1..k tokens. The
            decision reads the drafter's own distribution only, so outputs stay exact. None: always k.

    Raises:
        ConfigError (a ValueError): unknown method (the message names the registered ones), k outside
            1..16, a method-specific field set for a drafter that does not read it, a missing or
            unexpected model, a tree the drafter does not draft, or the drafter's own checks.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    draft_dtype: str | None = None
    quantization: str | dict | None = None
    tree: str | None = None
    tree_choices: list[list[int]] | None = None
    tree_topk: int = 4
    max_tree_nodes: int = DEFAULT_MAX_TREE_NODES
    drafter_kwargs: dict | None = None
    policy: str = "static"
    policy_kwargs: dict | None = None
    grammar_forced_drafts: bool = False
    max_forced_drafts: int | None = None
    suffix_max_match: int = 16
    suffix_min_token_prob: float = 0.1
    suffix_spec_factor: float = 4.0
    suffix_accept_threshold: float | str = "auto"
    suffix_cache_max_nodes: int = 1 << 20
    suffix_share_across_requests: bool = False
    hybrid_members: list[str] | None = None
    hybrid_skip_outranked: bool = True
    hybrid_union: bool = False
    draft_vocab: list[int] | str | None = None
    draft_stop_probability: float | None = None

    def __post_init__(self) -> None:
        from specdec.drafters.registry import drafter_names, get_drafter, model_method

        entry = get_drafter(self.method)
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min)
        _check_int("tree_topk", self.tree_topk, 1)
        _check_int("max_tree_nodes", self.max_tree_nodes, 1)
        if self.max_tree_nodes > MAX_TREE_NODES:
            raise ConfigError(f"max_tree_nodes must be <= {MAX_TREE_NODES}, got {self.max_tree_nodes}")
        if self.model is not None and not isinstance(self.model, str):
            raise ConfigError(f"model must be a name or a directory (str), got {self.model!r}")
        if self.drafter_kwargs is not None and not isinstance(self.drafter_kwargs, dict):
            raise ConfigError(f"drafter_kwargs must be a dict, got {self.drafter_kwargs!r}")
        if not isinstance(self.grammar_forced_drafts, bool):
            raise ConfigError(f"grammar_forced_drafts must be a bool, got {self.grammar_forced_drafts!r}")
        if self.max_forced_drafts is not None:
            _check_int("max_forced_drafts", self.max_forced_drafts, 0)
            if self.max_forced_drafts > MAX_SPECULATIVE_TOKENS * 2:
                raise ConfigError(
                    f"max_forced_drafts must be <= {MAX_SPECULATIVE_TOKENS * 2}, got {self.max_forced_drafts}"
                )
            if self.max_forced_drafts and not self.grammar_forced_drafts:
                raise ConfigError("max_forced_drafts needs grammar_forced_drafts=True")
        if self.tree not in TREE_KINDS:
            raise ConfigError(f"tree must be one of {TREE_KINDS}, got {self.tree!r}")
        if self.tree not in entry.trees:
            takers = [n for n in drafter_names() if self.tree in get_drafter(n).trees]
            shapes = " and ".join("chains" if t is None else f"{t} trees" for t in entry.trees)
            raise ConfigError(
                f"tree={self.tree!r} needs method {' or '.join(map(repr, takers))} "
                f"({self.method} drafts {shapes})"
            )
        for name in fields(self):
            if name.name in _COMMON_FIELDS or name.name in entry.fields:
                continue
            value = getattr(self, name.name)
            if value != name.default or type(value) is not type(name.default):  # 1 is set, not True
                takers = [n for n in drafter_names() if name.name in get_drafter(n).fields]
                raise ConfigError(
                    f"{name.name}={value!r} applies to method {' or '.join(map(repr, takers))} only "
                    f"(method is {self.method!r})"
                )
        stop = self.draft_stop_probability
        if stop is not None:
            if isinstance(stop, bool) or not isinstance(stop, (int, float)) or not 0.0 < stop < 1.0:
                raise ConfigError(f"draft_stop_probability must be None or a number in (0, 1), got {stop!r}")
            if self.tree is not None:
                raise ConfigError(
                    "draft_stop_probability cuts chains; a tree ranks its nodes instead (tree=None)"
                )
            self.draft_stop_probability = float(stop)
        if self.quantization is not None:
            self.quantization_config()  # the scheme's own checks, before any weights load (every taker)
        if self.draft_vocab is not None and not isinstance(self.draft_vocab, str):
            ids = self.draft_vocab
            if (
                not isinstance(ids, (list, tuple))
                or not ids
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
            ):
                raise ConfigError(
                    "draft_vocab must be a non-empty list of target token ids (non-negative ints) or the "
                    f"name or directory of an EAGLE-3 head, got {ids!r}"
                )
            self.draft_vocab = list(ids)
        self.build_policy()  # unknown names and bad parameters fail here, before any weights load
        if entry.check_config is not None:
            entry.check_config(self)
        kind, _ = model_method(self)
        if kind == "model" and not self.model:
            raise ConfigError(f"speculative method {self.method!r} needs model=<zoo name or directory>")
        if kind == "none" and self.model is not None:
            raise ConfigError(f"speculative method {self.method!r} takes no model (got model={self.model!r})")

    def build_policy(self) -> SpeculationPolicy:
        """A new instance of the configured speculation policy.

        Raises:
            ConfigError: unknown policy (the message names the registered ones) or bad ``policy_kwargs``.
        """
        from specdec.policies import PolicyContext, build_policy

        if not isinstance(self.policy, str):
            raise ConfigError(f"policy must be a registered policy name (str), got {self.policy!r}")
        ctx = PolicyContext(self.num_speculative_tokens, tree=self.tree is not None)
        return build_policy(self.policy, ctx, self.policy_kwargs)

    def quantization_config(self) -> QuantizationConfig | None:
        """The :class:`~specdec.quantization.config.QuantizationConfig` of the quantized self-drafter or of
        a head's weights (None: not quantized)."""
        from specdec.quantization.config import QuantizationConfig

        return QuantizationConfig.from_any(self.quantization)

    def static_tree_choices(self) -> list[list[int]]:
        """The static tree's paths, limited to depth k (and for Medusa, to k heads)."""
        choices = self.tree_choices if self.tree_choices is not None else DEFAULT_TREE_CHOICES
        return [list(c) for c in choices if len(c) <= self.num_speculative_tokens]

    @property
    def num_forced_draft_slots(self) -> int:
        """Draft positions (and KV slots) beyond k that a constrained request may use for grammar-aware
        drafting: ``max_forced_drafts`` (None: k) with ``grammar_forced_drafts``, else 0."""
        if not self.grammar_forced_drafts:
            return 0
        return self.num_speculative_tokens if self.max_forced_drafts is None else self.max_forced_drafts

    @property
    def num_draft_slots(self) -> int:
        """KV slots a request reserves for drafts per step: k for a chain, the tree's size for a tree,
        ``min(k × members, 64)`` for a hybrid union of chains (``hybrid_union``)."""
        if self.tree == "static":
            return len(self.static_tree_choices())
        if self.tree == "dynamic":
            return self.max_tree_nodes
        if self.method == "hybrid" and self.hybrid_union is True:  # the members' chains as one tree
            members = len(self.hybrid_members or DEFAULT_HYBRID_MEMBERS)
            return min(self.num_speculative_tokens * members, MAX_TREE_NODES)
        return self.num_speculative_tokens

    @classmethod
    def from_any(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """Accept a SpeculativeConfig, a dict of its fields, or None.

        Raises:
            ValueError: unknown keys or invalid values.
        """
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a SpeculativeConfig or a dict, got {type(value)}")
        known = set(cls.__dataclass_fields__)
        unknown = set(value) - known
        if unknown:
            raise ConfigError(f"unknown speculative_config keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**value)
