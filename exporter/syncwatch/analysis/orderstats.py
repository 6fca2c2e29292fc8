"""Order statistics of the slowest rank.

A synchronous step ends when the slowest of ``R`` ranks arrives. With independent per-rank times
of CDF ``F``, the step's CDF is ``F(t) ** R``; for Gaussian jitter the expected excess of the slowest
rank over the mean is ``sigma * E[max of R standard normals]`` (1.42 at R = 8, 3.97 at 16,384).
"""

from __future__ import annotations

import math
from functools import lru_cache


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _Phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


@lru_cache(maxsize=4096)
def normal_max_moments(n: int) -> tuple[float, float]:
    """(mean, standard deviation) of the maximum of ``n`` independent standard normals.

    Numerical integration of the density ``n phi(x) Phi(x)^(n-1)`` on a fine grid (trapezoid,
    step 0.002 over [-9, 9]): accurate to ~1e-6, a few milliseconds per ``n``, cached.
    """
    if n < 1:
        raise ValueError("n must be at least 1")
    if n == 1:
        return 0.0, 1.0
    h = 0.002
    m1 = m2 = total = 0.0
    for i in range(9001):
        x = -9.0 + i * h
        cdf = _Phi(x)
        if cdf <= 0.0:
            continue
        dens = n * _phi(x) * math.exp((n - 1) * math.log(cdf))
        w = 0.5 if i in (0, 9000) else 1.0
        total += w * dens
        m1 += w * dens * x
        m2 += w * dens * x * x
    mean = m1 / total
    return mean, math.sqrt(max(0.0, m2 / total - mean * mean))


def expected_normal_max(n: int) -> float:
    """``E[max of n standard normals]``: 0 for n = 1, 0.564 for 2, 1.42 for 8, 3.97 for 16,384."""
    return normal_max_moments(n)[0]

