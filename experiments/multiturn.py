"""Multi-turn workloads: conversations whose later turns repeat and edit earlier output.

Two kinds, both deterministic given the model's answers (greedy decoding makes them reproducible):

- ``code_edit``: a HumanEval problem is solved, then edited turn after turn ("add type hints", "rename a
  variable", ...; the edits are picked by a hash of the task id), each answer asked for as the whole
  function again, so most of it repeats the previous answer;
- ``agent``: an agent-style loop: the task is solved, then a tool's output is fed back (the file as
  ``cat -n`` prints it, with the model's own code, and a failing test), and the model answers with the
  whole fixed file, as coding agents do.

A conversation is a first user message and follow-ups; a follow-up may quote the previous answer
(``{previous}``, ``{numbered}``). :func:`next_messages` builds a turn's chat from the history.
"""

from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path

#: HumanEval, where the shared data lives (``../shared`` of a worktree).
DEFAULT_HUMANEVAL = "../shared/humaneval/HumanEval.jsonl.gz"

CODE_EDITS = (
    "Add type hints to every parameter and the return value. Reply with the whole function only.",
    "Add a docstring example (a doctest) to the function. Reply with the whole function only.",
    "Rename the main loop variable to something more descriptive. Reply with the whole function only.",
    "Add a comment above each non-trivial line. Reply with the whole function only.",
    "Make the function raise ValueError for invalid input. Reply with the whole function only.",
)

AGENT_TOOL_TURN = (
    "Tool output (cat -n solution.py):\n{numbered}\n\nTool output (pytest):\n"
    "FAILED test_solution.py::test_{case} - AssertionError\n\n"
    "The test failed. Fix solution.py and reply with the whole file."
)


@dataclass
class Conversation:
    """One multi-turn conversation.

    Attributes:
        id: unique within its set (``code_edit/HumanEval/0``).
        category: ``code_edit`` or ``agent``.
        first: the first user message.
        follow_ups: later user messages; ``{previous}`` is the last answer, ``{numbered}`` it with line
            numbers (``cat -n``), ``{case}`` a test number.
    """

    id: str
    category: str
    first: str
    follow_ups: list[str] = field(default_factory=list)

    @property
    def num_turns(self) -> int:
        return 1 + len(self.follow_ups)


def _numbered(text: str) -> str:
    return "\n".join(f"{i:6d}\t{line}" for i, line in enumerate(text.splitlines(), 1))


def next_messages(conv: Conversation, answers: list[str]) -> list[dict[str, str]]:
    """The chat of turn ``len(answers)`` (0-based): every earlier user message and answer, then the next
    user message (follow-ups filled from the last answer)."""
    messages = [{"role": "user", "content": conv.first}]
    for turn, answer in enumerate(answers):
        messages.append({"role": "assistant", "content": answer})
        template = conv.follow_ups[turn]
        case = zlib.crc32(f"{conv.id}/{turn}".encode()) % 9 + 1
        content = template.format(previous=answer, numbered=_numbered(answer), case=case)
        messages.append({"role": "user", "content": content})
    return messages


def load_multiturn(
    path: str = DEFAULT_HUMANEVAL,
    limit: int = 4,
    turns: int = 3,
    kinds: tuple[str, ...] = ("code_edit", "agent"),
) -> list[Conversation]:
    """``limit`` conversations of each kind over the first HumanEval problems, ``turns`` turns each.

    Raises:
        FileNotFoundError: no HumanEval file at ``path``.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no HumanEval file at {p} (the shared data directory is missing)")
    problems = []
    with gzip.open(p, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                problems.append((str(row["task_id"]), row["prompt"]))
            if len(problems) >= limit:
                break
    out = []
    for task_id, code in problems:
        first = f"Complete the following Python function:\n```python\n{code}\n```"
        if "code_edit" in kinds:
            h = zlib.crc32(task_id.encode())
            edits = [CODE_EDITS[(h + i) % len(CODE_EDITS)] for i in range(turns - 1)]
            out.append(Conversation(f"code_edit/{task_id}", "code_edit", first, edits))
        if "agent" in kinds:
            out.append(Conversation(f"agent/{task_id}", "agent", first, [AGENT_TOOL_TURN] * (turns - 1)))
    return out
