"""Build one outlines-core ``Index`` in a child process (run as a script; imports outlines-core only).

:class:`grammars.outlines_backend.OutlinesBackend` runs this file with ``sys.executable`` so that a
compile that runs past its time limit can be killed: the Rust index construction cannot be interrupted
inside a process. Protocol (JSON and raw bytes, never pickle): stdin holds one JSON line ``{"regex",
"eos_token_id", "max_states", "memory_limit_bytes"}``, then the token map as JSON ``[[hex of the token's
bytes, [ids]], ...]``; stdout receives one JSON line, either ``{"status": "ok", "num_states",
"build_s", "size"}`` followed by ``size`` bytes of the index's binary form, or ``{"status": "error",
"kind", "message"}`` with kind ``"compile"`` (outlines-core refused the regex or vocabulary),
``"too_large"`` or ``"memory"``.
"""

from __future__ import annotations

import os
import sys

# Run as a script, Python puts this file's directory (grammars/) first on sys.path, where base.py,
# cache.py, schema.py... would shadow top-level modules of the same names; take it out first.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import json  # noqa: E402
import time  # noqa: E402


def build(job: dict, token_map_json: bytes) -> tuple:
    if job.get("memory_limit_bytes"):
        import resource

        limit = int(job["memory_limit_bytes"])
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import outlines_core

    token_map = {bytes.fromhex(h): ids for h, ids in json.loads(token_map_json)}
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
    header, _, token_map_json = sys.stdin.buffer.read().partition(b"\n")
    job = json.loads(header)
    try:
        result = build(job, token_map_json)
    except MemoryError:
        result = ("error", "memory", "out of memory")
    out = sys.stdout.buffer
    if result[0] == "ok":
        _, binary, num_states, build_s = result
        meta = {"status": "ok", "num_states": num_states, "build_s": build_s, "size": len(binary)}
        out.write(json.dumps(meta).encode() + b"\n" + bytes(binary))
    else:
        out.write(json.dumps({"status": "error", "kind": result[1], "message": result[2]}).encode() + b"\n")
    out.flush()


if __name__ == "__main__":
    main()
