"""The step's token bitmasks, computed on a worker thread while the target's forward runs.

A constrained request's bitmask rows depend only on its committed tokens and its drafts, both known
before the forward; the forward does not touch the grammar. So the engine submits the masks of every
constrained sampling request when the drafts are fitted and collects them when the logits are
processed: the grammar's work (tens of µs a row, a few hundred at the tail, per request and step) leaves
the step's critical path, as in xgrammar's and SGLang's overlap of mask generation with the GPU forward
(Dong et al. 2024, XGrammar, §3.4). llguidance computes masks outside the GIL (a Python loop keeps 85 %
of its speed beside a thread filling masks; 60 % beside xgrammar's), so the two run side by side.

Exactness does not depend on the thread: the masks are the same function of the same grammar state
(each matcher is touched by the worker alone between submission and collection, and left as it was).
A request whose masks the worker could not compute (its grammar raised) gets them computed again at
processing time, where a fault ends that request alone, as without the worker.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from specdec.scheduler import ScheduledRequest
from specdec.structured import draft_bitmask, tree_bitmask

#: Steps whose wait and compute times are kept (the oldest are dropped).
MAX_RECORDED_STEPS = 100_000


def request_bitmask(s: ScheduledRequest, vocab_size: int) -> torch.Tensor:
    """A constrained request's verification rows' packed bitmasks: ``[1 + m, ceil(vocab_size / 32)]``
    int32 for a chain of m drafts (:func:`~specdec.structured.draft_bitmask`) or a tree of m nodes
    (:func:`~specdec.structured.tree_bitmask`). The grammar is left as it was."""
    if s.draft_tree is None:
        return draft_bitmask(s.request.grammar, s.draft_token_ids, 1 + len(s.draft_token_ids), vocab_size)
    return tree_bitmask(s.request.grammar, s.draft_tree, vocab_size)


def step_bitmasks(scheduled: list[ScheduledRequest], vocab_size: int) -> dict[str, torch.Tensor]:
    """Per constrained sampling request id, :func:`request_bitmask`. A request whose grammar raises is
    left out (its rows are computed again, and its fault handled, at processing time)."""
    masks: dict[str, torch.Tensor] = {}
    for s in scheduled:
        if not s.sample or s.request.grammar is None:
            continue
        try:
            masks[s.request.request_id] = request_bitmask(s, vocab_size)
        except Exception:
            continue
    return masks


class MaskPrefetch:
    """One worker thread computing each step's bitmasks (:func:`step_bitmasks`) beside the forward.

    Attributes:
        wait_s: per step with constrained requests, seconds the step waited for the worker after its
            forward (the mask time left on the critical path).
        compute_s: per such step, seconds the worker spent on the masks.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.wait_s: deque[float] = deque(maxlen=MAX_RECORDED_STEPS)
        self.compute_s: deque[float] = deque(maxlen=MAX_RECORDED_STEPS)

    def submit(
        self, scheduled: list[ScheduledRequest], vocab_size: int
    ) -> Future[dict[str, torch.Tensor]] | None:
        """Start the masks of the step's constrained sampling requests; None when there are none."""
        if not any(s.sample and s.request.grammar is not None for s in scheduled):
            return None
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="specdec-masks")
                weakref.finalize(self, self._pool.shutdown, False)  # the engine's end ends the thread
            return self._pool.submit(self._timed, list(scheduled), vocab_size)

    def _timed(self, scheduled: list[ScheduledRequest], vocab_size: int) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        masks = step_bitmasks(scheduled, vocab_size)
        self.compute_s.append(time.perf_counter() - t0)
        return masks

    def collect(self, future: Future[dict[str, torch.Tensor]] | None) -> dict[str, torch.Tensor] | None:
        """The masks of a submitted step (waits for the worker; the wait is recorded)."""
        if future is None:
            return None
        t0 = time.perf_counter()
        masks = future.result()
        self.wait_s.append(time.perf_counter() - t0)
        return masks

    def close(self) -> None:
        """Stop the worker thread (a later ``submit`` starts a new one)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
