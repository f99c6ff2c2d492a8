"""The README's SmolLM2 examples run and print what they say (issue 24: the Quick start promised
``3.4 [7, 7, 6, 4]`` and printed ``3.1818181818181817 [7, 7, 6, 4]``).

The blocks are taken from README.md as it stands and run in one fresh interpreter (so the README, not a
copy of it, is tested):

- the Quick start: every ``print(...)  # comment`` whose comment is an exact output (numbers and
  brackets only, e.g. ``3.18 [7, 7, 6, 4]``) must appear verbatim, in order;
- "Your own drafter": it runs, and ``print(llm.engine.spec_stats)`` shows sane derived figures;
- the fault-injection example: the chosen prompt's request ends with "error" in both calls, the others
  do not, and the request ids count up across the calls.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARK = "=== README block {} ==="
BLOCKS = {
    "quick_start": "## Quick start (Python)",
    "own_drafter": "### Your own drafter",
    "faults": "## Reliability: bad input, KV pressure, faults and aborts",
}


def python_block(heading: str) -> str:
    """The first ```python block after the line ``heading`` (and before the next heading of any level)."""
    text = README.read_text(encoding="utf-8")
    start = text.index("\n" + heading + "\n") + len(heading) + 2
    block = re.compile(r"^```python\n(.*?)^```", re.S | re.M).search(text, start)
    assert block is not None, f"no python block after {heading!r}"
    between = text[start : block.start()]
    assert not re.search(r"^#+ ", between, re.M), f"the block after {heading!r} is under another heading"
    return block.group(1)


def exact_outputs(code: str) -> list[str]:
    """The comments of ``print`` lines that state an exact output: digits, brackets and punctuation only
    (prose comments such as "the model copies the code back" are skipped)."""
    out = []
    for line in code.splitlines():
        m = re.match(r"\s*print\(.*\)\s+#\s*(.+?)\s*$", line)
        if m and re.fullmatch(r"[0-9\s.,\[\]()+-]+", m.group(1)):
            out.append(m.group(1))
    return out


def is_subsequence(wanted: list[str], lines: list[str]) -> bool:
    it = iter(lines)
    return all(any(line == w for line in it) for w in wanted)


def split_output(stdout: str) -> dict[str, list[str]]:
    parts: dict[str, list[str]] = {}
    current = None
    for line in stdout.splitlines():
        m = re.fullmatch(MARK.format(r"(\w+)"), line)
        if m:
            current = m.group(1)
            parts[current] = []
        elif current is not None:
            parts[current].append(line)
    return parts


@pytest.mark.real_model
@pytest.mark.slow
def test_readme_examples_print_what_they_say(smollm2_dir, tmp_path):
    codes = {name: python_block(heading) for name, heading in BLOCKS.items()}
    assert exact_outputs(codes["quick_start"]) == ["1.97 [9, 8, 7, 5]"]  # the Quick start's promise
    script = "\n".join(f"print({MARK.format(name)!r}, flush=True)\n{code}" for name, code in codes.items())
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,  # the blocks must not depend on the working directory
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = split_output(proc.stdout)
    assert list(out) == list(BLOCKS), proc.stdout[-2000:]

    # Quick start: the text, then exactly the numbers its comment promises.
    lines = out["quick_start"]
    assert "def area(width, height)" in "\n".join(lines)
    assert is_subsequence(exact_outputs(codes["quick_start"]), lines), lines

    # Your own drafter: the stats print their derived figures, within their ranges.
    stats = "\n".join(out["own_drafter"])
    assert "SpecStats(" in stats, stats
    rate = re.search(r"acceptance_rate=([0-9.]+|None)", stats)
    tau = re.search(r"mean_acceptance_length=([0-9.]+|None)", stats)
    assert rate is not None and tau is not None, stats
    assert 0.0 <= float(rate.group(1)) <= 1.0 and 1.0 <= float(tau.group(1)) <= 4.0, stats

    # Fault injection by prompt: both calls hit their second request, ids count up across calls.
    lines = out["faults"]
    calls = [re.fullmatch(r"(\[.*?\]) (\[.*\])", line) for line in lines[:2]]
    assert all(calls), lines
    for n, m in enumerate(calls):
        assert m is not None
        ids, reasons = ast.literal_eval(m.group(1)), ast.literal_eval(m.group(2))
        assert ids == [str(3 * n + i) for i in range(3)], lines
        assert reasons[1] == "error" and {reasons[0], reasons[2]} <= {"length", "stop"}, lines
    assert lines[2].startswith("non-finite logits"), lines
