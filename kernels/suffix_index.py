"""The C++ index of a request's own text for suffix decoding (``csrc/suffix_index.cpp``).

:func:`request_index` gives a ``RequestSuffixIndex`` of the CPU kernels' module: the trie, drafts and
ties of its reference, :class:`specdec.drafters.suffix_tree.RequestIndex` (``extend(tokens, start)``,
``best_draft(max_match, max_drafts, cap, spec_factor, min_prob, tree)``, ``num_nodes``,
``num_indexed``; token ids in ``[0, 2**32)``, checked before anything is indexed), ~0.8-1.2 µs a token
to grow a 200-token prompt instead of ~4.5 µs (depth 24, 2-core Xeon; ~2.8 against ~7 µs at 32k
tokens), drafts in ~0.4 µs instead of ~3.5 µs on text with repeats, and ~125 bytes a node instead of
~270. None
where the module is not built, or with ``SPECDEC_SUFFIX_INDEX=0`` (A/B measurements) or
``SPECDEC_FORCE_REFERENCE=1``: the reference serves.
"""

from __future__ import annotations

from typing import Any

from kernels import cpu_ext

#: ``SPECDEC_SUFFIX_INDEX=0``: suffix decoding indexes requests with the Python reference.
DISABLE_ENV = "SPECDEC_SUFFIX_INDEX"


def available() -> bool:
    """Whether :func:`request_index` gives the C++ index here."""
    return cpu_ext.enabled(DISABLE_ENV)


def request_index(max_depth: int) -> Any | None:
    """A new, empty C++ index of depth ``max_depth`` (>= 1), or None where it is not available."""
    if not available():
        return None
    return cpu_ext.require_extension().RequestSuffixIndex(max_depth)
