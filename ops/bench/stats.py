"""Statistics of measured samples, and JSON-safe results (strict JSON has no NaN)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100), as numpy's default."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def dist(values: Iterable[float]) -> dict[str, float]:
    """mean, p50, p90, p99, max and count of a sample (NaN when empty)."""
    xs = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return {"n": 0, "mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan, "max": math.nan}
    return {
        "n": len(xs),
        "mean": statistics.fmean(xs),
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "max": max(xs),
    }


def median(values: Iterable[float]) -> float:
    xs = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(xs) if xs else math.nan


def clean(obj: Any) -> Any:
    """JSON-safe copy: NaN/inf become None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj
