"""Prompt sets of the main job: built-in (offline), Spec-Bench JSONL and HumanEval.

Each loader returns :class:`Prompt` records holding chat messages; ``experiments.run`` applies the
target's chat template.

- ``builtin``: no download. Real text from this machine's Python standard library (source code and
  docstrings of :data:`BUILTIN_MODULES`, read with :mod:`inspect` and :mod:`ast`), wrapped in our own
  instructions in four categories (:data:`BUILTIN_CATEGORIES`). Most answers repeat code or text from
  the prompt, which is where n-gram (prompt-lookup) drafting pays off.
- chat (:func:`load_chat`, no download): everyday chat requests from templates (:data:`CHAT_TEMPLATES`
  over :data:`CHAT_TOPICS`): stories, poems, emails, explanations, tips, comparisons, arguments,
  role-play and word problems, whose answers do not copy the prompt (Spec-Bench's writing, roleplay and
  reasoning categories are of this kind). ``experiments.train`` distils draft heads on both sets.
- ``jsonl``: Spec-Bench's ``question.jsonl``; the first turn of each question.
- ``humaneval``: HumanEval's ``.jsonl.gz``; "Complete the following Python function".
- ``synthetic``: token-id prompts (no tokenizer, no text): a repeated random pattern or uniform noise.
"""

from __future__ import annotations

import ast
import functools
import gzip
import importlib
import inspect
import json
import random
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.config import (
    BuiltinDatasetConfig,
    DatasetConfig,
    HumanEvalDatasetConfig,
    JsonlDatasetConfig,
    SyntheticDatasetConfig,
)


@dataclass
class Prompt:
    """One prompt of a prompt set.

    Attributes:
        id: unique within its set (e.g. ``type_hints/heapq.merge``, a Spec-Bench ``question_id``).
        category: the per-category tables group by it.
        messages: chat messages (``{"role": "user", "content": ...}``).
        token_ids: the prompt as token ids, used as is (no chat template) when set.
    """

    id: str
    category: str
    messages: list[dict[str, str]] = field(default_factory=list)
    token_ids: list[int] | None = None

    @property
    def text(self) -> str:
        """The content of the last message."""
        return self.messages[-1]["content"] if self.messages else ""


def _user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def load_prompts(cfg: DatasetConfig) -> list[Prompt]:
    """The prompts of the configured dataset.

    Raises:
        FileNotFoundError: a dataset file is missing (the message names the path and how to set it).
        ValueError: a malformed file, an unknown category, or an unknown dataset config.
    """
    if isinstance(cfg, BuiltinDatasetConfig):
        return load_builtin(cfg.limit, cfg.seed, cfg.max_prompt_chars)
    if isinstance(cfg, JsonlDatasetConfig):
        return load_jsonl(cfg.path, cfg.limit, cfg.categories)
    if isinstance(cfg, HumanEvalDatasetConfig):
        return load_humaneval(cfg.path, cfg.limit)
    if isinstance(cfg, SyntheticDatasetConfig):
        return load_synthetic(cfg)
    raise ValueError(f"unknown dataset config {type(cfg).__name__} (name={cfg.name!r})")


def _resolve_path(path: str, what: str, hint: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(
            f"{what} not found at {p.absolute()} (dataset.path={path!r}, relative paths are taken from "
            f"the working directory {Path.cwd()}). {hint}"
        )
    return p


def round_robin(prompts: Iterable[Prompt]) -> list[Prompt]:
    """Interleave categories: the first prompt of every category (in order of first appearance), then
    the second of every category, and so on; within a category the input order is kept.

    Taking the first N of the result gives a stratified sample that covers min(N, #categories)
    categories and differs by at most one prompt between categories that have enough prompts.
    """
    groups: dict[str, list[Prompt]] = {}
    for p in prompts:
        groups.setdefault(p.category, []).append(p)
    out: list[Prompt] = []
    depth = max((len(g) for g in groups.values()), default=0)
    for i in range(depth):
        out.extend(g[i] for g in groups.values() if i < len(g))
    return out


# -------------------------------------------------------------------------------------- synthetic
def load_synthetic(cfg: SyntheticDatasetConfig) -> list[Prompt]:
    """``cfg.limit`` token-id prompts of ``cfg.prompt_len`` tokens, alternating between categories
    ``repeat`` (a random pattern of ``pattern_len`` tokens, tiled) and ``random`` (i.i.d. tokens), drawn
    from ``[low_token, vocab_size)`` with ``random.Random(seed)``."""
    rng = random.Random(cfg.seed)
    n = 4 if cfg.limit is None else cfg.limit
    prompts: list[Prompt] = []
    for i in range(n):
        if i % 2 == 0:
            pattern = [rng.randrange(cfg.low_token, cfg.vocab_size) for _ in range(cfg.pattern_len)]
            ids = [pattern[j % len(pattern)] for j in range(cfg.prompt_len)]
            category = "repeat"
        else:
            ids = [rng.randrange(cfg.low_token, cfg.vocab_size) for _ in range(cfg.prompt_len)]
            category = "random"
        prompts.append(Prompt(f"{category}/{i}", category, token_ids=ids))
    return prompts


# ------------------------------------------------------------------------------------------ jsonl
def load_jsonl(path: str, limit: int | None = None, categories: list[str] | None = None) -> list[Prompt]:
    """Spec-Bench questions (one JSON object a line: ``question_id``, ``category``, ``turns``).

    The first turn of each question is its prompt. Questions are optionally filtered to
    ``categories``, put in round-robin order over categories (:func:`round_robin`) and cut to the
    first ``limit``: ``limit=13`` on Spec-Bench gives one question of each of its 13 categories.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a malformed line, or a requested category absent from the file.
    """
    p = _resolve_path(
        path,
        "Spec-Bench questions",
        "Pass dataset.path=/path/to/question.jsonl or set SPECDEC_SPECBENCH.",
    )
    prompts: list[Prompt] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                qid, category, turns = row["question_id"], row["category"], row["turns"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"{p}:{lineno}: not a Spec-Bench question (need question_id, category, turns): {e}"
                ) from e
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
                raise ValueError(f"{p}:{lineno}: 'turns' must be a non-empty list of strings")
            prompts.append(Prompt(str(qid), str(category), _user(turns[0])))
    if categories is not None:
        present = {q.category for q in prompts}
        unknown = sorted(set(categories) - present)
        if unknown:
            raise ValueError(f"categories {unknown} are not in {p}; it has {sorted(present)}")
        wanted = set(categories)
        prompts = [q for q in prompts if q.category in wanted]
    prompts = round_robin(prompts)
    return prompts if limit is None else prompts[:limit]


# -------------------------------------------------------------------------------------- humaneval
def load_humaneval(path: str, limit: int | None = None) -> list[Prompt]:
    """HumanEval problems (``task_id``, ``prompt``) from a ``.jsonl.gz`` (or plain ``.jsonl``) file, in
    file order, the first ``limit``; the user message asks to complete the function.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a malformed line.
    """
    p = _resolve_path(
        path, "HumanEval problems", "Pass dataset.path=/path/to/HumanEval.jsonl.gz or set SPECDEC_HUMANEVAL."
    )
    opener: Any = gzip.open if p.suffix == ".gz" else open
    prompts: list[Prompt] = []
    with opener(p, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                task_id, code = str(row["task_id"]), row["prompt"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{p}:{lineno}: not a HumanEval problem (need task_id, prompt): {e}") from e
            content = f"Complete the following Python function:\n```python\n{code}\n```"
            prompts.append(Prompt(task_id, "humaneval", _user(content)))
            if limit is not None and len(prompts) >= limit:
                break
    return prompts


# ---------------------------------------------------------------------------------------- builtin
#: Standard-library modules whose source and docstrings feed the built-in prompts (pure Python ones).
BUILTIN_MODULES = (
    "base64",
    "bisect",
    "calendar",
    "colorsys",
    "csv",
    "difflib",
    "fnmatch",
    "fractions",
    "functools",
    "glob",
    "heapq",
    "ipaddress",
    "json",
    "pprint",
    "random",
    "shlex",
    "statistics",
    "string",
    "textwrap",
)

#: The built-in categories, in the order the round-robin visits them.
BUILTIN_CATEGORIES = ("type_hints", "summarize", "qa", "continue_code")

_QA_QUESTIONS = (
    "What does `{name}` return, and what does each of its parameters mean?",
    "When would you use `{name}`? Give a short example call and its result.",
    "Which special cases, errors or limits does this text mention for `{name}`?",
)


@dataclass
class _Item:
    module: str
    qualname: str
    kind: str  # "function" | "class" | "module"
    source: str  # dedented source ("" for modules)
    doc: str  # cleaned docstring ("" when none)
    annotated: bool = False
    signature: str = ""


def _iter_defs(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """Top-level functions and classes, and the methods of top-level classes, with qualified names."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            yield node.name, node
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{sub.name}", sub


@functools.cache
def _module_items(name: str) -> tuple[_Item, ...]:
    """Every public definition of a module, parsed once per process (the items are not mutated)."""
    module = importlib.import_module(name)
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):  # a frozen or C module: nothing to read
        return ()
    tree = ast.parse(source)
    items = [_Item(name, name, "module", "", inspect.cleandoc(ast.get_docstring(tree, clean=False) or ""))]
    for qualname, node in _iter_defs(tree):
        if any(part.startswith("_") for part in qualname.split(".")):
            continue
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        segment = ast.get_source_segment(source, node, padded=True) or ""
        doc = ast.get_docstring(node, clean=True) or ""
        if isinstance(node, ast.ClassDef):
            items.append(_Item(name, qualname, "class", "", doc))
            continue
        a = node.args
        params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, [a.vararg, a.kwarg])]
        annotated = node.returns is not None or any(p.annotation is not None for p in params)
        signature = f"({ast.unparse(node.args)})"
        items.append(_Item(name, qualname, "function", textwrap.dedent(segment), doc, annotated, signature))
    return tuple(items)


def _clip_paragraphs(text: str, budget: int) -> str:
    """The longest run of whole leading paragraphs of ``text`` within ``budget`` characters ("" if the
    first paragraph alone is too long)."""
    out = ""
    for para in text.split("\n\n"):
        candidate = f"{out}\n\n{para}" if out else para
        if len(candidate) > budget:
            break
        out = candidate
    return out


def _type_hints(it: _Item, cap: int) -> str | None:
    if it.kind != "function" or it.annotated or it.source.count("\n") < 3:
        return None
    content = (
        f"Add type hints to the parameters and the return value of this function from Python's "
        f"`{it.module}` module. Reply with the complete annotated function only.\n\n"
        f"```python\n{it.source.rstrip()}\n```"
    )
    return content if len(content) <= cap else None


def _continue_code(it: _Item, cap: int) -> str | None:
    lines = it.source.rstrip().splitlines()
    if it.kind != "function" or len(lines) < 10:
        return None
    head = "\n".join(lines[: len(lines) // 2])
    content = (
        f"Here is the beginning of `{it.module}.{it.qualname}`. Continue the code exactly where it "
        f"stops and finish the function; reply with code only.\n\n```python\n{head}\n```"
    )
    return content if len(content) <= cap else None


def _summarize(it: _Item, cap: int) -> str | None:
    if it.kind not in ("module", "class") or len(it.doc) < 300:
        return None
    what = (
        f"the Python module `{it.module}`"
        if it.kind == "module"
        else f"the class `{it.module}.{it.qualname}`"
    )
    intro = f"Summarize this documentation of {what} in three sentences.\n\n"
    doc = _clip_paragraphs(it.doc, cap - len(intro))
    return intro + doc if len(doc) >= 200 else None


def _qa(it: _Item, cap: int, rng: random.Random) -> str | None:
    if it.kind != "function" or len(it.doc) < 150:
        return None
    name = f"{it.module}.{it.qualname}"
    question = rng.choice(_QA_QUESTIONS).format(name=name)
    intro = f"Here is the documentation of `{name}{it.signature}`:\n\n"
    tail = f"\n\nAnswer from the text: {question}"
    doc = _clip_paragraphs(it.doc, cap - len(intro) - len(tail))
    return intro + doc + tail if len(doc) >= 100 else None


def load_builtin(limit: int | None = 12, seed: int = 0, max_prompt_chars: int = 1200) -> list[Prompt]:
    """Deterministic offline prompts from the standard library (see the module docstring).

    Candidates of every category are collected in sorted order, shuffled with ``random.Random(seed)``
    and taken round-robin over :data:`BUILTIN_CATEGORIES` (each function or docstring used at most
    once), so categories get equal shares up to one prompt. Every user message is at most
    ``max_prompt_chars`` characters (code is never cut; docstrings are cut at paragraph ends).

    Raises:
        ValueError: ``max_prompt_chars`` too small to build any prompt.
    """
    items = sorted(
        (it for m in BUILTIN_MODULES for it in _module_items(m)),
        key=lambda it: (it.module, it.qualname, it.kind),
    )
    rng = random.Random(seed)
    pools: dict[str, list[tuple[_Item, str]]] = {c: [] for c in BUILTIN_CATEGORIES}
    for it in items:
        for category, content in (
            ("type_hints", _type_hints(it, max_prompt_chars)),
            ("summarize", _summarize(it, max_prompt_chars)),
            ("qa", _qa(it, max_prompt_chars, rng)),
            ("continue_code", _continue_code(it, max_prompt_chars)),
        ):
            if content is not None:
                pools[category].append((it, content))
    for pool in pools.values():
        rng.shuffle(pool)
    if not any(pools.values()):
        raise ValueError(f"dataset.max_prompt_chars={max_prompt_chars} is too small for any built-in prompt")
    used: set[tuple[str, str]] = set()
    prompts: list[Prompt] = []
    cursors = dict.fromkeys(BUILTIN_CATEGORIES, 0)
    while limit is None or len(prompts) < limit:
        added = False
        for category in BUILTIN_CATEGORIES:
            if limit is not None and len(prompts) >= limit:
                break
            pool = pools[category]
            while cursors[category] < len(pool):
                it, content = pool[cursors[category]]
                cursors[category] += 1
                if (it.module, it.qualname) not in used:
                    used.add((it.module, it.qualname))
                    prompts.append(Prompt(f"{category}/{it.module}.{it.qualname}", category, _user(content)))
                    added = True
                    break
        if not added:
            break
    return prompts


# ------------------------------------------------------------------------------------------- chat
#: Everyday activities the chat templates are filled with (gerund phrases, so every template reads).
CHAT_TOPICS = (
    "growing tomatoes",
    "saving money",
    "learning a new language",
    "walking a dog",
    "planning a birthday party",
    "cooking pasta",
    "riding a bike in the city",
    "keeping houseplants alive",
    "going camping",
    "recycling at home",
    "getting better sleep",
    "baking bread",
    "starting a running routine",
    "visiting a museum",
    "packing for a trip",
    "making friends at a new school",
    "studying for exams",
    "taking care of a cat",
    "brewing coffee",
    "writing a diary",
    "playing chess",
    "learning to swim",
    "cleaning the kitchen",
    "watching the stars",
    "fixing a flat bicycle tire",
    "reading before bed",
    "drinking enough water",
    "volunteering at an animal shelter",
    "moving to a new city",
    "preparing for a job interview",
    "building a birdhouse",
    "travelling by train",
    "shopping at a farmers market",
    "painting with watercolours",
    "learning to play the guitar",
    "hiking in the mountains",
    "saving energy at home",
    "organising a bookshelf",
    "having a picnic",
    "feeding birds in winter",
)

_NAMES = ("Maya", "Tom", "Lea", "Omar", "Sofia", "Ben", "Aiko", "Lucas", "Priya", "Noah")

#: ``(category, template)``: the template's fields are ``topic``, ``other`` (another topic), ``name``,
#: ``friend`` (two first names) and the integers ``a``, ``b``, ``c``, ``m``.
CHAT_TEMPLATES = (
    ("writing", "Write a short story (about 150 words) about {name} {topic} for the first time."),
    ("writing", "Write a short poem about {topic}."),
    (
        "writing",
        "Write a friendly email to my friend {friend} inviting them to try {topic} with me this weekend.",
    ),
    ("explain", "Explain {topic} to a seven-year-old child, in simple words."),
    ("advice", "Give me five practical tips for {topic}."),
    (
        "brainstorm",
        "What are the most common mistakes beginners make when {topic}, and how can they avoid them?",
    ),
    ("compare", "Compare {topic} with {other}: what do they have in common, and how are they different?"),
    (
        "argument",
        "Some people say that {topic} is a waste of time. Summarise the strongest argument for that view "
        "and the strongest argument against it, then give your own conclusion.",
    ),
    (
        "roleplay",
        "Pretend you are a cheerful grandparent who has loved {topic} all your life. Your grandchild asks "
        "you how you got started. Answer in character.",
    ),
    (
        "reasoning",
        "{name} spends {a} minutes a day {topic} for {b} days, and {c} extra minutes on the last day. How "
        "many minutes does {name} spend {topic} in total? Explain your reasoning step by step.",
    ),
    (
        "reasoning",
        "{name} and {friend} both enjoy {topic}. Last month {name} did it on {a} days and {friend} on {b} "
        "days. If both keep the same pace, how many more days will {friend} have done it than {name} after "
        "{m} months? Show your steps.",
    ),
)

#: The chat categories, in the order the round-robin visits them.
CHAT_CATEGORIES = tuple(dict.fromkeys(c for c, _ in CHAT_TEMPLATES))


def _slug(text: str) -> str:
    return "-".join(text.lower().split())


def load_chat(limit: int | None = None, seed: int = 0) -> list[Prompt]:
    """Deterministic chat-like prompts: every :data:`CHAT_TEMPLATES` entry filled with every topic of
    :data:`CHAT_TOPICS` (440 prompts), the names and numbers drawn with ``random.Random(seed)``, in
    round-robin order over :data:`CHAT_CATEGORIES` (so the first ``limit`` are a stratified sample).

    Ids are ``chat/<category>/<template index>/<topic slug>``; they do not depend on ``seed``.
    """
    rng = random.Random(seed)
    n = len(CHAT_TOPICS)
    prompts: list[Prompt] = []
    for i, (category, template) in enumerate(CHAT_TEMPLATES):
        for j, topic in enumerate(CHAT_TOPICS):
            name, friend = rng.sample(_NAMES, 2)
            fields = {
                "topic": topic,
                "other": CHAT_TOPICS[(j + 1 + rng.randrange(n - 1)) % n],
                "name": name,
                "friend": friend,
                "a": rng.randint(5, 45),
                "b": rng.randint(3, 12),
                "c": rng.randint(5, 30),
                "m": rng.randint(2, 6),
            }
            content = template.format(**fields)
            prompts.append(Prompt(f"chat/{category}/{i}/{_slug(topic)}", category, _user(content)))
    prompts = round_robin(prompts)
    return prompts if limit is None else prompts[:limit]
