"""The top-level packages are layered without import cycles (see ``docs/layers.md``):

    kernels < grammars < sampling < specdec < experiments

A module may import its own package and the packages below it, never one above it: not at module level,
not lazily inside a function, not under ``TYPE_CHECKING``, not through ``importlib.import_module`` with
a literal name. ``kernels`` imports torch, the standard library and third-party packages only. No
library package imports ``tests``. Every ``.py`` file is read with :mod:`ast`, so the check sees every
import statement without importing anything.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Lowest first.
LAYERS = ("kernels", "grammars", "sampling", "specdec", "experiments")
RANK = {name: i for i, name in enumerate(LAYERS)}
#: First-party packages no library module may import.
FORBIDDEN_EVERYWHERE = ("tests",)
_IMPORT_FUNCS = {"import_module", "__import__"}


def _modules(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def _imports(path: Path, package: str | None = None) -> list[tuple[int, str]]:
    """``(line, imported module)`` for every import in the file, wherever it is; ``package``: the file's
    top-level package (default: from its path)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = package or path.relative_to(ROOT).parts[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            # A relative import stays inside the file's own package.
            out.append((node.lineno, package if node.level else node.module or ""))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            arg = node.args[0]
            if name in _IMPORT_FUNCS and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                out.append((node.lineno, arg.value))
    return out


def _edges() -> list[tuple[str, str, str, int, str]]:
    """``(from package, to package, file, line, module)`` for every import of another first-party
    package (one of :data:`LAYERS` or :data:`FORBIDDEN_EVERYWHERE`)."""
    first_party = set(LAYERS) | set(FORBIDDEN_EVERYWHERE)
    out = []
    for package in LAYERS:
        for path in _modules(package):
            for line, module in _imports(path):
                target = module.split(".")[0]
                if target in first_party and target != package:
                    out.append((package, target, str(path.relative_to(ROOT)), line, module))
    return out


def test_every_package_is_scanned():
    for package in LAYERS:
        assert (ROOT / package / "__init__.py").is_file(), package
        assert len(_modules(package)) >= 2, package


def test_no_package_imports_one_above_it():
    bad = [
        f"{file}:{line}: {pkg} imports {module} ({target} is above {pkg})"
        if target in RANK
        else f"{file}:{line}: {pkg} imports {module} (library code never imports {target})"
        for pkg, target, file, line, module in _edges()
        if target not in RANK or RANK[target] > RANK[pkg]
    ]
    assert not bad, "imports against the layer order " + " < ".join(LAYERS) + ":\n" + "\n".join(bad)


def test_kernels_import_no_first_party_package():
    bad = [f"{file}:{line}: {module}" for pkg, _, file, line, module in _edges() if pkg == "kernels"]
    assert not bad, "kernels may import torch, the standard library and third-party packages only:\n" + (
        "\n".join(bad)
    )


def test_package_graph_has_no_cycle():
    graph: dict[str, set[str]] = {p: set() for p in LAYERS}
    for pkg, target, *_ in _edges():
        if target in graph:
            graph[pkg].add(target)
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                pytest.fail("import cycle between packages: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for p in LAYERS:
        if p not in state:
            visit(p, [p])


def test_checker_sees_lazy_and_type_checking_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "import importlib\n"
        "if TYPE_CHECKING:\n"
        "    from specdec.llm import LLM\n"
        "def f():\n"
        "    import sampling.params\n"
        "    return importlib.import_module('experiments.run')\n"
        "from . import sibling\n"
    )
    found = sorted(_imports(probe, "kernels"))
    assert found == [
        (1, "typing"),
        (2, "importlib"),
        (4, "specdec.llm"),
        (6, "sampling.params"),
        (7, "experiments.run"),
        (8, "kernels"),
    ]


def test_shared_error_classes_are_the_same_objects():
    import grammars.errors
    import specdec.errors

    assert set(specdec.errors.__all__) == set(grammars.errors.__all__)
    for name in specdec.errors.__all__:
        assert getattr(specdec.errors, name) is getattr(grammars.errors, name), name
        assert issubclass(getattr(specdec.errors, name), specdec.errors.SpecdecError), name


def test_shared_types_are_re_exported():
    import grammars.bitmask
    import kernels.attention_metadata
    import kernels.reshape_and_cache
    import kernels.token_bitmask
    import sampling.token_tree
    import specdec.attention.base
    import specdec.attention.reference
    import specdec.drafters.tree

    assert specdec.drafters.tree.TokenTree is sampling.token_tree.TokenTree
    assert specdec.attention.base.AttentionMetadata is kernels.attention_metadata.AttentionMetadata
    assert specdec.attention.reference.write_kv is kernels.reshape_and_cache.write_kv
    assert grammars.bitmask.apply_token_bitmask_torch is kernels.token_bitmask.apply_token_bitmask_torch


def test_errors_import_without_torch():
    """``import specdec.errors`` / ``grammars`` / ``grammars.errors`` load neither torch nor the engine."""
    code = (
        "import sys, specdec.errors, grammars, grammars.errors\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'outlines_core', 'specdec.llm', 'specdec.engine')"
        " if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
