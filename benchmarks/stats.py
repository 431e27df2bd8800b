"""The statistics every benchmark reports, in one place: percentiles (linear interpolation, as
numpy computes them), medians, spreads over repeats, ratios and geometric means. Empty inputs give
None rather than raising, so a run that measured nothing shows an empty cell."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

__all__ = ["geomean", "median", "percentile", "ratio", "spread", "summary"]


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values``, or None when there are none."""
    values = list(values)
    return float(np.percentile(values, q)) if values else None


def median(values: Iterable[float]) -> float | None:
    return percentile(values, 50)


def spread(values: Iterable[float]) -> dict | None:
    """Median, min and max of repeated measurements of one quantity (None when there are none)."""
    values = list(values)
    if not values:
        return None
    return {"median": median(values), "min": min(values), "max": max(values), "n": len(values)}


def summary(values: Iterable[float], scale: float = 1.0, digits: int | None = None) -> dict | None:
    """p50, p90, p99, mean and max of ``values`` times ``scale`` (e.g. 1e6: seconds to µs),
    rounded to ``digits`` where given; None when there are none."""
    values = [v * scale for v in values]
    if not values:
        return None
    out = {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
           "mean": sum(values) / len(values), "max": max(values)}
    if digits is not None:
        out = {key: round(value, digits) for key, value in out.items()}
    return out | {"n": len(values)}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None when either is missing or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def geomean(values: Iterable[float]) -> float | None:
    """The geometric mean of positive ``values`` (the mean of speedups), or None when there are none."""
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None
