"""Checkpoint interval and expected wall time under failures.

* Young (1974): the interval that minimizes lost time to first order, ``tau = sqrt(2 delta M)``
  for checkpoint cost ``delta`` and mean time between failures ``M``. 30 s at 24 h: 2,277 s.
* Daly (2006), higher order: ``tau = sqrt(2 delta M) [1 + sqrt(delta/(2M))/3 + delta/(18 M)] - delta``
  while ``delta < 2M``, else ``tau = M``.
* Daly's expected wall time for ``W`` seconds of failure-free work, restart cost ``R``, Poisson
  failures: ``T = M exp(R/M) (exp((tau + delta)/M) - 1) W / tau``. It counts the checkpoints, the
  re-run work after each failure (on average about half an interval) and failures that strike
  during a restart or a checkpoint; for ``tau, delta, R << M`` it is
  ``W (1 + delta/tau) (1 + (R + (tau + delta)/2) / M)``.
"""

from __future__ import annotations

import math


def young_interval(checkpoint_seconds: float, mtbf_seconds: float) -> float:
    return math.sqrt(2 * checkpoint_seconds * mtbf_seconds)


def daly_interval(checkpoint_seconds: float, mtbf_seconds: float) -> float:
    d, m = checkpoint_seconds, mtbf_seconds
    if d >= 2 * m:
        return m
    x = d / (2 * m)
    return math.sqrt(2 * d * m) * (1 + math.sqrt(x) / 3 + x / 9) - d


def daly_wall_seconds(work_seconds: float, interval: float, checkpoint_seconds: float,
                      restart_seconds: float, mtbf_seconds: float | None) -> float:
    """Expected wall time of ``work_seconds`` of solve time (see the module docstring).

    Without failures (``mtbf_seconds`` None) it is the work plus one checkpoint per interval.
    Returns ``inf`` when the job cannot be expected to finish (the exponent overflows).
    """
    if work_seconds <= 0:
        return 0.0
    if not mtbf_seconds:
        return work_seconds * (1 + checkpoint_seconds / interval) if math.isfinite(interval) else work_seconds
    m = mtbf_seconds
    try:
        return m * math.exp(restart_seconds / m) * math.expm1((interval + checkpoint_seconds) / m) \
            * work_seconds / interval
    except OverflowError:
        return math.inf
