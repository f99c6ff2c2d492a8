"""Formatting of table cells shared by the run summary, the benchmark table and the plot tables."""

from __future__ import annotations

from typing import Any


def format_cell(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    """One table cell: "–" for None, ``true``/``false`` for bools, floats with ``spec``, then ``suffix``."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:{spec}}{suffix}"
    return f"{value}{suffix}"
