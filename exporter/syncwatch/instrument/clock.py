"""Where time comes from: the host's monotonic clock, or CUDA events on the current stream.

A *mark* is an opaque point in time. ``HostClock`` marks are ``perf_counter_ns`` integers, ready
at once. ``CudaEventClock`` marks are CUDA events recorded on the current stream: on a GPU the host
runs ahead of the device, so a host clock times kernel launches, not kernels. An event is only
read once ``query()`` says the device has passed it, so a step's figures are resolved lazily
(usually a step later) and nothing ever calls ``synchronize()`` on the hot path.

``CudaEventClock`` takes the event factory as an argument (default
``torch.cuda.Event(enable_timing=True)``) so it is tested on machines without a GPU with a fake
shaped exactly like ``torch.cuda.Event``: ``record()``, ``query()``, ``elapsed_time(end)`` in ms.
"""

from __future__ import annotations

import time


class HostClock:
    """Monotonic host clock: for CPU training (gloo), where the host does the work itself."""

    lazy = False  # marks are ready at once

    mark = staticmethod(time.perf_counter_ns)

    def enter_thread(self) -> None:
        """Called first by a thread that reads marks it did not take (the records thread)."""

    amount = staticmethod(float)  # a step's samples or tokens as a number (see CudaEventClock)

    @staticmethod
    def ready(mark) -> bool:
        return True

    @staticmethod
    def elapsed(start, end) -> float:
        return (end - start) * 1e-9

    def release(self, mark) -> None:
        pass


class CudaEventClock:
    """CUDA events recorded on the current stream, recycled through a small pool."""

    lazy = True

    def __init__(self, event_factory=None, pool_size: int = 512, device: int | None = None,
                 side_stream=None):
        if event_factory is None:
            import torch

            def event_factory():
                return torch.cuda.Event(enable_timing=True)
        self._factory = event_factory
        self._pool: list = []
        self._pool_size = pool_size
        self._device = device
        self._side_stream = side_stream or self._own_stream
        self._stream = None

    def enter_thread(self) -> None:
        """Make the rank's GPU the calling thread's current device, as torch's pin-memory thread
        does: a new thread starts on device 0, and the records thread queries and times the
        events recorded on the training thread's device."""
        if self._device is not None:
            import torch
            torch.cuda.set_device(self._device)

    def mark(self):
        try:
            ev = self._pool.pop()  # atomic: marks are taken on several threads
        except IndexError:
            ev = self._factory()
        ev.record()  # on the current stream of the calling thread
        return ev

    def amount(self, value) -> float:
        """A step's samples or tokens as a number, read by the records thread once the step's
        events have passed. A CUDA tensor (``tokens=mask.sum()``) is copied on a stream of the
        records thread's own: the step is done, so its value is computed, where a copy on the
        current stream waits behind all the work queued since, a collective hung on the device
        included, and that would stop the heartbeats of a rank that is alive."""
        if getattr(value, "is_cuda", False):
            with self._side_stream():
                return float(value)
        return float(value)

    def _own_stream(self):
        """``torch.cuda.stream`` of a stream from torch's pool, which does not wait for the
        default stream's work."""
        import torch
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self._device)
        return torch.cuda.stream(self._stream)

    @staticmethod
    def ready(mark) -> bool:
        return mark.query()

    @staticmethod
    def elapsed(start, end) -> float:
        return start.elapsed_time(end) * 1e-3

    def release(self, mark) -> None:
        """Give a resolved event back for reuse (re-recording an event is allowed)."""
        if len(self._pool) < self._pool_size:
            self._pool.append(mark)
