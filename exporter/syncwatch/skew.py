"""Exact per-step slack and skew from collective waits, without clock synchronization.

A collective releases all ranks at (almost) the same moment, so a rank's wait inside it is
``release - arrival``. For step s: ``slack_i(s) = wait_i(s) - min_j wait_j(s)`` is the time rank i
idled because others were later, ``skew(s) = max_j wait_j(s) - min_j wait_j(s)`` and the last
arrival is the rank whose wait equals the minimum.

Every K steps each rank all-reduces its last K waits twice (MIN and MAX of a K-vector): O(K) bytes
whatever the world size. ``derive`` turns the result into what the rank reports. Where K steps take
longer than ``EXCHANGE_SECONDS``, the windows after the first are shorter (``window_size``): results
arriving every 50 steps of 10 s, 8 minutes apart, left the 5- and 10-minute rates of the rules
without a single window in many of their ranges, and the alerts built on them never held for their
``for:``. The real exchange (``syncwatch.instrument``) and the simulator share both functions.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .protocol import SKEW_BUCKETS, SkewHistogram

EXCHANGE_SECONDS = 30.0  # the most time one window should take, where K steps take longer


@dataclass(frozen=True, slots=True)
class WindowResult:
    slack_seconds: float      # sum of this rank's slack over the window
    last_arrivals: int        # steps of the window in which this rank arrived last
    skews: tuple[float, ...]  # per-step skew (max - min wait), meaningful on every rank
    step_seconds: float = 0.0  # the window's median step time, the slowest rank's (MAX)


def window_size(step_seconds: float, most: int, seconds: float = EXCHANGE_SECONDS) -> int:
    """The size of the windows after the first: the steps that take ``seconds`` at the first
    window's ``step_seconds`` (its median, all-reduced MAX: the same on every rank, so every rank
    cuts the same windows), at most ``most`` (K) and at least 1. ``seconds`` <= 0: K; infinite
    (never shorter than K) or NaN, as ``SYNCWATCH_SKEW_SECONDS`` may give it: K, the quotient
    capped before it becomes an integer (``int`` of an infinite or NaN one raises)."""
    if not seconds > 0 or not step_seconds > 0:
        return most
    return max(1, int(min(most, seconds // step_seconds)))


def derive(my_waits, mins, maxs) -> WindowResult:
    """``my_waits``: this rank's waits for the K steps; ``mins``/``maxs``: their MIN/MAX over ranks.

    Ties (several ranks with the minimum wait) count as a last arrival for each of them: with real
    clocks exact ties do not happen, and in the simulator they mean ranks truly arrived together.
    """
    slack = 0.0
    last = 0
    for w, lo in zip(my_waits, mins):
        slack += w - lo
        if w <= lo:
            last += 1
    return WindowResult(slack, last, tuple(hi - lo for lo, hi in zip(mins, maxs)))


@dataclass(slots=True)
class SkewAccumulator:
    """Global rank 0's cumulative skew histogram, in the protocol's fixed buckets."""
    count: int = 0
    total: float = 0.0
    counts: list[int] = field(default_factory=lambda: [0] * len(SKEW_BUCKETS))

    def observe(self, skew: float) -> None:
        self.count += 1
        self.total += skew
        i = bisect.bisect_left(SKEW_BUCKETS, skew)
        if i < len(SKEW_BUCKETS):
            self.counts[i] += 1

    def snapshot(self) -> SkewHistogram:
        cumulative, running = [], 0
        for c in self.counts:
            running += c
            cumulative.append(running)
        return SkewHistogram(self.count, self.total, tuple(cumulative))
