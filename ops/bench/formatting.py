"""Numbers as the summary, the goals table and the plots show them ("n/a" for a missing value)."""

from __future__ import annotations

import math
from typing import Any


def num(x: Any) -> float:
    """A finite number, else NaN (results JSON stores NaN as null)."""
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else math.nan


def fmt(x: Any, digits: int = 2, unit: str = "") -> str:
    v = num(x)
    return "n/a" if math.isnan(v) else f"{v:,.{digits}f}{unit}"


def pct(x: Any, digits: int = 1) -> str:
    v = num(x)
    return "n/a" if math.isnan(v) else f"{100 * v:.{digits}f}%"


def ms(x: Any) -> str:
    v = num(x)
    return "n/a" if math.isnan(v) else f"{1000 * v:,.0f}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table, one line per row."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]
