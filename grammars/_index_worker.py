"""Build one outlines-core ``Index`` in a child process (run as a script; imports outlines-core only).

:class:`grammars.outlines_backend.OutlinesBackend` runs this file with ``sys.executable`` so that a
compile that runs past its time limit can be killed: the Rust index construction cannot be interrupted
inside a process. Protocol: stdin holds one pickle ``{"regex", "eos_token_id", "token_map" (pickled
``{bytes: [ids]}``), "max_states", "memory_limit_bytes"}``; stdout receives one pickle, either
``("ok", index_binary, num_states, build_seconds)`` or ``("error", kind, message)`` with kind
``"compile"`` (outlines-core refused the regex or vocabulary) or ``"too_large"``.
"""

from __future__ import annotations

import os
import sys

# Run as a script, Python puts this file's directory (grammars/) first on sys.path, where base.py,
# cache.py, schema.py... would shadow top-level modules of the same names; take it out first.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import pickle  # noqa: E402
import time  # noqa: E402


def build(job: dict) -> tuple:
    if job.get("memory_limit_bytes"):
        import resource

        limit = int(job["memory_limit_bytes"])
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import outlines_core

    token_map = pickle.loads(job["token_map"])
    vocabulary = outlines_core.Vocabulary(job["eos_token_id"], token_map)
    t0 = time.perf_counter()
    try:
        index = outlines_core.Index(job["regex"], vocabulary)
    except (ValueError, RuntimeError) as e:
        return ("error", "compile", str(e))
    build_s = time.perf_counter() - t0
    num_states = len(index.get_transitions())
    if num_states > job["max_states"]:
        return ("error", "too_large", f"{num_states} states")
    _, (binary,) = index.__reduce__()
    return ("ok", binary, num_states, build_s)


def main() -> None:
    job = pickle.loads(sys.stdin.buffer.read())
    try:
        result = build(job)
    except MemoryError:
        result = ("error", "memory", "out of memory")
    sys.stdout.buffer.write(pickle.dumps(result))
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    main()
