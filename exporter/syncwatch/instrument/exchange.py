"""The exact per-step skew exchange (DESIGN.md, "Exact per-step skew without clock sync").

Every K steps each rank hands its last K waits to a background thread, which all-reduces them
twice on a side gloo process group, once with MIN and once with MAX: 2 x 8(K + 1) bytes of payload
per rank per window whatever the world size (K = 50: 816 bytes, two messages). The one more
element is the window's median step time, whose MAX sizes the windows after the first
(``skew.window_size``). The monitor's records thread, as it replays the steps, puts each
window on a queue and, at a later step, picks up finished results from a deque: the training
thread never touches the exchange, and its latency never lands on a step.

Every rank submits the same windows in the same order (windows are cut by resolved step count),
so the side group's collectives match. A hung or departed peer blocks only this thread.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time

from ..skew import WindowResult, derive

log = logging.getLogger("syncwatch.instrument")


class SkewExchange:
    def __init__(self, group, all_reduce, min_op, max_op, make_tensor):
        """``group``: the side gloo group; ``all_reduce``: torch's *original* (unwrapped)
        ``dist.all_reduce``; ``make_tensor(list) -> tensor`` (float64)."""
        self._group = group
        self._all_reduce = all_reduce
        self._min, self._max = min_op, max_op
        self._tensor = make_tensor
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.results: collections.deque[WindowResult] = collections.deque()
        self.windows_done = 0
        self.seconds = 0.0  # wall time spent in exchanges (this thread), for the benchmark
        self.failed = False
        self._submitted = 0
        self._thread = threading.Thread(target=self._run, name="syncwatch-skew", daemon=True)
        self._thread.start()

    def in_flight(self) -> bool:
        return self.windows_done < self._submitted

    def submit(self, waits: list[float], step_seconds: float = 0.0) -> None:
        """Hand over one window of this rank's waits and its median step time (cheap)."""
        self._submitted += 1
        self._inbox.put((waits, step_seconds))

    def _run(self) -> None:
        while True:
            item = self._inbox.get()
            if item is None:
                return
            waits, step_seconds = item
            t0 = time.perf_counter()
            try:
                lo = self._tensor([*waits, step_seconds])
                hi = self._tensor([*waits, step_seconds])
                w1 = self._all_reduce(lo, op=self._min, group=self._group, async_op=True)
                w2 = self._all_reduce(hi, op=self._max, group=self._group, async_op=True)
                w1.wait()
                w2.wait()
                mins, maxs = lo.tolist(), hi.tolist()
                self.results.append(dataclasses.replace(
                    derive(waits, mins[:-1], maxs[:-1]), step_seconds=maxs[-1]))
            except Exception as e:  # peer gone, group destroyed: stop exchanging, keep training
                if not self.failed:
                    log.warning("syncwatch: skew exchange stopped: %s", e)
                self.failed = True
                return
            finally:
                self.seconds += time.perf_counter() - t0
                self.windows_done += 1

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for submitted windows to finish (shutdown only)."""
        end = time.monotonic() + timeout
        while self.windows_done < self._submitted and not self.failed and time.monotonic() < end:
            time.sleep(0.005)
        return self.windows_done >= self._submitted

    def stop(self, timeout: float = 1.0) -> None:
        self._inbox.put(None)
        self._thread.join(timeout)
