"""The engine package: :class:`LLMEngine` and the stages of one step, one module each.

- ``engine``: :class:`LLMEngine`, requests in and the step on one screen (admit → schedule → propose →
  forward → verify → commit), with add/abort and the lock;
- ``build``: the target, the drafter from the registry, the KV pool's size, packing;
- ``admission``: request validation and grammar compilation;
- ``proposals``: drafting, checking and fitting proposals;
- ``verification``: processing the logits rows, sampling or verifying, logprobs;
- ``commit``: rollback, tree compaction, appending tokens under the stop rules;
- ``faults``: running a batch so that one request's fault ends that request alone.
"""

from specdec.engine.engine import FaultInjector, LLMEngine
from specdec.engine.verification import logits_rows

__all__ = ["FaultInjector", "LLMEngine", "logits_rows"]
