"""The drafter plug-in point: the :class:`Drafter` Protocol, what it sees and what it returns.

A drafter is registered by name (:func:`specdec.drafters.registry.register_drafter`) and built once per
engine from a :class:`DrafterContext`. Each step the engine calls :meth:`Drafter.propose` with one
:class:`DraftInput` per scheduled request and verifies the returned :class:`DraftProposal` exactly
(Leviathan et al. 2023; Chen et al. 2023; SpecInfer for trees), so a drafter can only change speed,
never the output distribution. Proposals are untrusted input: the engine checks them
(:func:`specdec.engine.proposals.check_proposal`) and drops, for that request and step, any that cannot
be verified.

Per-request state (an n-gram index, a draft model's KV progress, features not yet consumed) lives with
the drafter, typed, keyed by request id (:class:`RequestStates`); the engine calls :meth:`Drafter.reset`
when a request is preempted (its KV is gone: state is rebuilt from the committed tokens on re-admission)
and when it finishes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, runtime_checkable

import torch

from specdec.request import Request

if TYPE_CHECKING:
    from specdec.config import CompilationConfig, SpeculativeConfig
    from specdec.model_runner import ModelRunner
    from specdec.models.decoder import DecoderLM


@dataclass
class DraftInput:
    """What a drafter sees of one scheduled request in a step.

    Attributes:
        request: the request; ``request.token_ids`` are its committed tokens.
        num_new_tokens: committed tokens the target computes this step, from
            ``request.num_computed_tokens`` (a drafter with its own KV catches up on these).
        max_drafts: most drafts on one path: a chain's length, a tree's depth (0: propose nothing,
            e.g. a prefill chunk that is not the prompt's last; the last chunk may carry drafts).
        max_tree_nodes: most nodes of a token tree (the KV slots reserved for drafts); chain drafters
            ignore it.
        max_forced_drafts: positions a constrained request's chain may have beyond ``max_drafts``, for
            grammar-aware drafting (:mod:`specdec.drafters.grammar_forced`); other drafters ignore it.
    """

    request: Request
    num_new_tokens: int
    max_drafts: int
    max_tree_nodes: int = 0
    max_forced_drafts: int = 0


@dataclass
class DraftProposal:
    """Draft tokens for one request.

    Attributes:
        token_ids: up to ``max_drafts`` proposed tokens continuing ``request.token_ids`` (a chain), or the
            nodes of a token tree (see ``parents``); each in ``[0, vocab_size)``.
        draft_probs: ``[len(token_ids), vocab_size]`` float32, the distribution each token was drawn
            from (the verifier divides by exactly these; each row sums to 1), or None for a deterministic
            drafter. Trees are deterministic (their children are top-k candidates): None.
        parents: None for a chain; for a token tree, each node's parent (-1 = the last committed token),
            in topological order (see :class:`sampling.token_tree.TokenTree`). The engine keeps at most
            ``max_tree_nodes`` nodes of depth at most ``max_drafts``.
        match_length: a copying drafter's per-step confidence (n-gram lookup, suffix decoding): how many
            tokens of the context's suffix matched the text it copies from; None otherwise.
        first_draft_prob: a learned drafter's per-step confidence (EAGLE, EAGLE-3, Medusa): the top-1
            probability of its own distribution at the first draft position (the first draft's, unless
            it was sampled), in [0, 1]; None otherwise.

    ``match_length`` and ``first_draft_prob`` describe the proposal only (the hybrid drafter ranks its
    members' proposals by them, :mod:`specdec.drafters.hybrid`); the verifier never reads them.
    """

    token_ids: list[int]
    draft_probs: torch.Tensor | None = None
    parents: list[int] | None = None
    match_length: int | None = None
    first_draft_prob: float | None = None


@dataclass(frozen=True)
class DrafterContext:
    """What a drafter is built from (one per engine).

    Attributes:
        target: the loaded target model (dense weights: packing happens after drafters are built).
        config: the validated speculative config (``config.drafter_kwargs`` are passed separately).
        model_dir: the resolved draft model or heads directory, or None (see the registry entry's
            ``model`` kind).
        dtype: the drafter's dtype (``config.draft_dtype`` or the target's).
        device: where the target runs.
        generator: the engine's generator, for requests without a seed.
        compilation: how the engine compiles its target (None: eager); a drafter with a model of its
            own compiles it the same way (the draft model does).
    """

    target: DecoderLM
    config: SpeculativeConfig
    model_dir: Path | None
    dtype: torch.dtype
    device: torch.device
    generator: torch.Generator
    compilation: CompilationConfig | None = None

    @property
    def vocab_size(self) -> int:
        return self.target.cfg.vocab_size


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens for running requests (one class per file in ``specdec/drafters/``).

    ``uses_hidden_states``: the drafter reads the target's final-norm features (Medusa, EAGLE): every
    target forward then returns them and :meth:`observe` receives those of the committed tokens.
    Subclass :class:`DrafterBase` for no-op defaults of everything but :meth:`propose`.

    Optional, read by the engine where present (:class:`DrafterBase` has the defaults): a drafter that
    reads the committed tokens lazily (a draft model, an EAGLE head, suffix decoding's trie) tells the
    speculation policy its per-request ``draft_backlog(request, num_new_tokens) -> int`` and reports,
    after each :meth:`propose`, the seconds and tokens of its catch-up (forwards, their share of a
    forward, or indexing) in ``catch_up_s`` / ``catch_up_tokens``; a drafter that reads and writes
    the target's own KV tensors (the quantized self-drafter) takes them in ``bind_target_kv(runner)``,
    called once after :meth:`bind_kv`, when the target's runner exists. A drafter that prices its drafts
    (suffix decoding's chain cut) takes the target's profiled step costs in ``set_step_costs(step_s)``
    when its ``wants_step_costs`` is true, and each decode step of a lone request (no prefill) in
    ``observe_step_time(num_tokens, seconds)``: the step's rows and its seconds from the forward to the
    commit.
    """

    uses_hidden_states: bool

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        """One proposal per input, in order (empty where ``max_drafts`` is 0)."""
        ...

    def on_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Called after verification, before the request's next step (to roll back drafter state):
        ``num_drafts`` of its proposal were verified (0 when it proposed nothing or its proposal was not
        verified, e.g. dropped; then ``num_accepted`` is 0), ``num_accepted`` of them accepted."""
        ...

    def observe(self, request: Request, start_position: int, hidden_states: torch.Tensor) -> None:
        """``hidden_states`` ``[n, hidden_size]``: the target's features at positions ``start_position ...
        start_position + n - 1`` of the request (committed tokens computed this step: a prefill chunk,
        or the root and the accepted drafts of a verification), in order; often a view into the step's
        features of every row (read it or keep it, never write it). Called only when
        ``uses_hidden_states``."""
        ...

    def reset(self, request: Request) -> None:
        """Forget the request's state (it was preempted, or it finished)."""
        ...

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of the drafter's own KV per block of ``block_size`` tokens (0: none); the engine sizes
        the KV pool from the target's and this figure."""
        ...

    def bind_kv(self, num_blocks: int, block_size: int) -> None:
        """Allocate the drafter's own KV for the engine's pool geometry (called once, after sizing)."""
        ...


class DrafterBase:
    """No-op defaults of the :class:`Drafter` hooks; a subclass implements :meth:`propose`."""

    uses_hidden_states: bool = False
    #: Set by a hybrid drafter over this one: fill ``DraftProposal.first_draft_prob`` (a learned drafter
    #: pays a softmax over its draft vocabulary per step for it; copiers give ``match_length`` always).
    reports_confidence: bool = False
    #: Seconds and tokens of the latest :meth:`propose`'s catch-up forwards of their own (0: none).
    catch_up_s: float = 0.0
    catch_up_tokens: int = 0

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        raise NotImplementedError

    def draft_backlog(self, request: Request, num_new_tokens: int) -> int:
        """Tokens the drafter would read before drafting for ``request`` this step, beyond the last one
        (``num_new_tokens``: the step's new tokens of the request, a prompt chunk or 1): 0 for a drafter
        that keeps up every step (n-gram, Medusa heads)."""
        return 0

    def on_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        return None

    def observe(self, request: Request, start_position: int, hidden_states: torch.Tensor) -> None:
        return None

    def reset(self, request: Request) -> None:
        return None

    def kv_bytes_per_block(self, block_size: int) -> int:
        return 0

    def bind_kv(self, num_blocks: int, block_size: int) -> None:
        return None

    def bind_target_kv(self, runner: ModelRunner) -> None:
        return None


S = TypeVar("S")


class RequestStates(Generic[S]):
    """Typed per-request drafter state, keyed by request id; :meth:`get` creates it on first use."""

    def __init__(self, factory: Callable[[], S]) -> None:
        self._factory = factory
        self._states: dict[str, S] = {}

    def get(self, request: Request) -> S:
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = self._factory()
        return state

    def peek(self, request: Request) -> S | None:
        """The request's state, or None when it has none yet."""
        return self._states.get(request.request_id)

    def set(self, request: Request, state: S) -> None:
        self._states[request.request_id] = state

    def reset(self, request: Request) -> None:
        self._states.pop(request.request_id, None)

    def __len__(self) -> int:
        return len(self._states)
