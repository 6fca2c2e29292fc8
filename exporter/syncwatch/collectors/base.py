"""Collector framework in the node_exporter manner.

* **Registry.** Each collector module registers a factory under a name with a default on/off
  (``@register("gpu", default=True, help=...)``). The ``--collector.NAME`` / ``--no-collector.NAME``
  flags and their ``SYNCWATCH_COLLECTOR_NAME`` twins are derived from that one table
  (``syncwatch.collectors.add_flags``).
* **Collector protocol.** A collector has ``update(errors) -> list[Metric]``: it reads its source
  (blocking is allowed: it runs on its own thread), returns fresh metric families, appends a short
  message to ``errors`` for each per-file or per-device problem it tolerated, and raises ``NoData``
  when its source is absent on this node (no NVML, no InfiniBand). Optional ``close()``.
* **Runner.** ``CollectorRunner`` gives every collector one worker thread that calls ``update`` on
  its own schedule, times it, and keeps the last snapshot. Its ``collect()`` (what the daemon's
  ``/metrics`` calls) only reads those snapshots: a failing or hanging collector never fails or
  delays a scrape. A call still running after ``timeout`` marks the collector failed; while it is
  stuck no further call is made (one worker, never a thread per cycle), and the last good snapshot
  is served until it is older than ``stale_after``, then withdrawn rather than frozen.

Self-health per collector: ``syncwatch_collector_success{collector}`` (1 = last cycle clean, also
when the source is simply absent; 0 = it raised, reported a problem, or overran its timeout) and
``syncwatch_collector_duration_seconds{collector}``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric

log = logging.getLogger("syncwatch.collectors")


class NoData(Exception):
    """The collector's source does not exist on this node: a quiet no-data case, not an error."""


@dataclass
class CollectorOptions:
    """What collector factories may depend on. ``sysfs``/``procfs`` route every host read."""
    sysfs: str = "/sys"
    procfs: str = "/proc"
    net_exclude: str = r"^(lo|veth.+)$"
    net_virtual: bool = False  # also collect virtual interfaces (see NetCollector)


@dataclass(frozen=True)
class CollectorSpec:
    name: str
    factory: Callable[[CollectorOptions], object]
    default: bool
    help: str


COLLECTORS: dict[str, CollectorSpec] = {}


def check_period(name: str, seconds: float) -> None:
    """``ValueError`` naming ``name`` unless ``seconds`` is positive and finite. NaN passes
    "<= 0": a NaN interval made the worker spin without pause and its snapshots never count as
    fresh; an infinite one ends the worker in Event.wait (OverflowError)."""
    if not 0 < seconds < math.inf:
        raise ValueError(f"{name} must be positive and finite, got {seconds:g}")


def register(name: str, *, default: bool, help: str):
    """Decorator registering ``factory(options) -> collector`` under ``name``."""
    def deco(factory):
        if name in COLLECTORS:
            raise ValueError(f"collector {name!r} registered twice")
        COLLECTORS[name] = CollectorSpec(name, factory, default, help)
        return factory
    return deco


class RateLimitedLog:
    """Logs a collector's errors at most once per ``every`` seconds, counting what it held back."""

    def __init__(self, name: str, every: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.name, self.every, self.clock = name, every, clock
        self._next = 0.0
        self._suppressed = 0
        self._failing = False

    def error(self, msg: str) -> None:
        self._failing = True
        now = self.clock()
        if now < self._next:
            self._suppressed += 1
            return
        extra = f" ({self._suppressed} similar messages suppressed)" if self._suppressed else ""
        log.error("collector %s: %s%s", self.name, msg, extra)
        self._suppressed = 0
        self._next = now + self.every

    def ok(self) -> None:
        if self._failing:
            log.info("collector %s: recovered", self.name)
        self._failing = False
        self._next = 0.0
        self._suppressed = 0


@dataclass
class _Outcome:
    success: bool
    duration: float


@dataclass
class _Worker:
    """One collector, one thread. All fields are replaced whole, so readers need no lock."""
    name: str
    collector: object
    interval: float
    timeout: float
    clock: Callable[[], float]
    log: RateLimitedLog
    busy_since: float | None = None
    outcome: _Outcome | None = None
    snapshot: tuple[list[Metric], float] | None = None  # families, time taken
    stop_event: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def cycle(self) -> None:
        """Run one ``update`` and record its outcome (never raises)."""
        start = self.clock()
        self.busy_since = start
        errors: list[str] = []
        families: list[Metric] | None
        try:
            families = [f for f in self.collector.update(errors) if f.samples]
            success = not errors
            if errors:
                self.log.error("; ".join(errors[:5]) + (f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""))
        except NoData as e:
            families, success = [], True
            log.debug("collector %s: no data: %s", self.name, e)
        except Exception as e:  # noqa: BLE001 - any collector bug must stay inside the collector
            families, success = None, False
            self.log.error(f"{type(e).__name__}: {e}")
        end = self.clock()
        duration = end - start
        if duration > self.timeout:
            success = False
            self.log.error(f"update took {duration:.3f}s, over the {self.timeout:g}s timeout")
        elif success:
            self.log.ok()
        if families is not None:
            self.snapshot = (families, end)
        self.outcome = _Outcome(success, duration)
        self.busy_since = None

    def loop(self) -> None:
        while not self.stop_event.is_set():
            start = self.clock()
            self.cycle()
            self.stop_event.wait(max(0.0, self.interval - (self.clock() - start)))


class CollectorRunner:
    """Runs collectors off the event loop and serves their last snapshots.

    Implements the prometheus_client collector protocol (``collect()``) plus ``start``/``stop``,
    which is what the daemon's ``extra_collectors`` expects.
    """

    def __init__(self, collectors: Mapping[str, object], *, interval: float = 5.0, timeout: float = 2.0,
                 stale_after: float | None = None, clock: Callable[[], float] = time.monotonic):
        check_period("collector interval", interval)
        check_period("collector timeout", timeout)
        self.stale_after = stale_after if stale_after is not None else 3 * interval + timeout
        self.clock = clock
        self._workers = [_Worker(name, c, interval, timeout, clock, RateLimitedLog(name, clock=clock))
                         for name, c in collectors.items()]

    @property
    def names(self) -> list[str]:
        return [w.name for w in self._workers]

    def start(self) -> None:
        for w in self._workers:
            if w.thread is None:
                w.thread = threading.Thread(target=w.loop, name=f"syncwatch-collector-{w.name}", daemon=True)
                w.thread.start()

    def run_once(self) -> None:
        """One synchronous cycle of every collector (tests, benchmarks, one-shot use)."""
        for w in self._workers:
            w.cycle()

    def stop(self, join_timeout: float = 2.0) -> None:
        """Stop the workers. A worker stuck in a hung call is left behind (it is a daemon thread)
        and its collector is not closed under it."""
        for w in self._workers:
            w.stop_event.set()
        deadline = self.clock() + join_timeout
        for w in self._workers:
            if w.thread is not None:
                w.thread.join(max(0.0, deadline - self.clock()))
                if w.thread.is_alive():
                    log.warning("collector %s: still busy at shutdown, abandoned", w.name)
                    continue
            close = getattr(w.collector, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as e:  # noqa: BLE001
                    log.warning("collector %s: close failed: %s", w.name, e)

    def collect(self):
        now = self.clock()
        success = GaugeMetricFamily("syncwatch_collector_success",
                                    "1 if the collector's last cycle succeeded (also when its source is "
                                    "absent), 0 if it failed, reported errors or overran its timeout.",
                                    labels=["collector"])
        duration = GaugeMetricFamily("syncwatch_collector_duration_seconds",
                                     "Duration of the collector's last cycle (of the running call, once "
                                     "that overruns its timeout).", labels=["collector"])
        data: list[Metric] = []
        for w in self._workers:
            busy, outcome, snapshot = w.busy_since, w.outcome, w.snapshot
            if busy is not None and now - busy > w.timeout:
                success.add_metric([w.name], 0)
                duration.add_metric([w.name], now - busy)
            elif outcome is not None:
                success.add_metric([w.name], 1 if outcome.success else 0)
                duration.add_metric([w.name], outcome.duration)
            if snapshot is not None and now - snapshot[1] <= self.stale_after:
                data.extend(snapshot[0])
        return [success, duration, *data]
