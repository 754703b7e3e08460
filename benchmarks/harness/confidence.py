"""Confidence for quality comparisons on paired pass/fail items: intervals, retention, McNemar."""

from __future__ import annotations

import math

import numpy as np

Z_95 = 1.959963984540054
"""The standard normal quantile of a two-sided 95% interval."""


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95% by default); (0, 1) for no items."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def flips(method: list[bool], reference: list[bool]) -> tuple[int, int]:
    """(pass → fail, fail → pass): items the reference passes and the method fails, and the reverse."""
    pass_to_fail = sum(r and not m for m, r in zip(method, reference, strict=True))
    fail_to_pass = sum(m and not r for m, r in zip(method, reference, strict=True))
    return pass_to_fail, fail_to_pass


def mcnemar_p(pass_to_fail: int, fail_to_pass: int) -> float:
    """Two-sided exact McNemar p-value: the discordant items as a binomial(b + c, 1/2) test."""
    n = pass_to_fail + fail_to_pass
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(pass_to_fail, fail_to_pass) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def retention_interval(method: list[bool], reference: list[bool], resamples: int = 10_000,
                       seed: int = 0, level: float = 0.95) -> tuple[float, float] | None:
    """Paired bootstrap percentile interval of retention = mean(method) / mean(reference).

    Items are resampled with replacement as pairs (the same items for both), so the interval
    reflects that both decoders ran the same problems. Resamples in which the reference passes
    nothing have no ratio and are left out; None if no resample has one.
    """
    m = np.asarray(method, dtype=np.float64)
    r = np.asarray(reference, dtype=np.float64)
    if m.shape != r.shape or m.size == 0:
        raise ValueError("retention needs the same non-empty items for method and reference")
    picks = np.random.default_rng(seed).integers(0, m.size, size=(resamples, m.size))
    ref_sums = r[picks].sum(axis=1)
    valid = ref_sums > 0
    if not valid.any():
        return None
    ratios = m[picks].sum(axis=1)[valid] / ref_sums[valid]
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return float(low), float(high)
