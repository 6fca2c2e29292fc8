"""Where time comes from: the host's monotonic clock, or CUDA events on the current stream.

A *mark* is an opaque point in time. ``HostClock`` marks are ``perf_counter_ns`` integers, ready
at once. ``CudaEventClock`` marks are CUDA events recorded on the current stream: on a GPU the host
runs ahead of the device, so a host clock times kernel launches, not kernels. An event is only
read once ``query()`` says the device has passed it, so a step's figures are resolved lazily
(usually a step later) and nothing ever calls ``synchronize()`` on the hot path.

``CudaEventClock`` takes the event factory as an argument (default
``torch.cuda.Event(enable_timing=True)``) so it is tested on machines without a GPU with a fake
shaped exactly like ``torch.cuda.Event``: ``record(stream)``, ``query()``, ``elapsed_time(end)``
in ms.

A mark is the hot path's cost on CUDA, 13 of them a step with six phases. Measured on an H100
(``benchmarks/instrument_hot_path.py --device cuda``, torch 2.11): ``event.record()`` took 11.9
us, 8.1 of them in ``torch.cuda.current_stream()``, which builds a Python stream object each
call; the CUDA call itself (``cudaEventRecord``) takes 2.0. So a mark calls torch's C
functions directly: the current device and its current stream's raw handle (0.4 us together),
the stream object from a cache keyed by both, and the C ``record`` under ``Event.record``: 3.5
us a mark there, that sequence of calls timed in a warm loop (the hot-path figures in
docs/instrumentation.md were taken with the lookup in a function of its own and
``Event.record(stream)``: two Python frames more).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, NamedTuple


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


class TorchCalls(NamedTuple):
    """The torch calls a mark makes, and the one that tells a released event's device."""

    device: Callable[[], int]                 # the calling thread's current device
    raw_stream: Callable[[int], int]          # a device's current stream's handle (cudaStream_t)
    stream: Callable[[int], object]           # a device's current stream as an object
    record: Callable[[object, object], None]  # record an event on a stream
    event_device: Callable[[object], int]     # the device an event was recorded on


def torch_calls() -> TorchCalls:
    """torch's private calls where it has them (``torch._C._cuda_getDevice``,
    ``_cuda_getCurrentRawStream``, ``_CudaEventBase.record``, in torch since 1.10: C functions,
    no Python frame, which cost 1-3 us each after a backward has left the caches cold), else
    its public ones."""
    import torch
    get_device = getattr(torch._C, "_cuda_getDevice", None)
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    base = getattr(torch._C, "_CudaEventBase", None)
    if get_device is None or raw_stream is None or base is None:
        return TorchCalls(torch.cuda.current_device,
                          lambda device: torch.cuda.current_stream(device).cuda_stream,
                          torch.cuda.current_stream, torch.cuda.Event.record, _event_device)
    return TorchCalls(get_device, raw_stream, torch.cuda.current_stream, base.record,
                      _event_device)


def _event_device(event) -> int:
    return event.device.index


class CudaEventClock:
    """CUDA events recorded on the current stream, recycled through a pool per device (an event
    records on its own device only: torch refuses another's stream).

    ``device``: the rank's GPU, whose current stream (on the calling thread) a mark records on,
    as torch's ops on that GPU's tensors use it, whatever the thread's current device (default:
    the current device). ``calls``: ``torch_calls()`` (default: torch's; with ``event_factory``
    given, fakes' calls: device 0, its stream None, ``event.record(stream)``). A mark looks the
    stream up in a cache of stream objects keyed by the device and the stream's raw handle (the
    legacy default stream's is 0 on every device), as ``torch.cuda.current_stream()`` would
    answer, without building the object each call; past ``MOST_STREAMS`` (``ExternalStream``
    handles without end: torch's own streams are a fixed pool, 32 per priority and device) the
    cache starts again. ``side_stream``: the context manager under which the records thread
    reads a CUDA tensor; default: with torch's own events, a stream of torch's pool, made here;
    with ``event_factory`` given, none (the current stream) unless given."""

    MOST_STREAMS = 256

    lazy = True

    def __init__(self, event_factory=None, pool_size: int = 512, device: int | None = None,
                 side_stream=None, calls: TorchCalls | None = None):
        if event_factory is None:
            import torch

            def event_factory():
                return torch.cuda.Event(enable_timing=True)
            calls = calls or torch_calls()
            if side_stream is None:
                # Made here, at init() on the training thread. The first stream taken from a
                # device's pool creates the pool, and that waits for the work queued on the
                # device: made in the records thread, the first read of a CUDA tensor amount
                # waited 2.0 s behind a 2 s kernel on an H100, and would wait forever behind a
                # hung collective, the heartbeats with it.
                stream = torch.cuda.Stream(device=device)

                def side_stream():
                    return torch.cuda.stream(stream)
        self._factory = event_factory
        self._calls = calls or FAKE_CALLS
        self._get_device, self._raw_stream, self._make_stream, self._record = self._calls[:4]
        self._streams: dict = {}
        self._pools: dict[int, list] = {}
        self._pool_size = pool_size
        self._device = device
        self._side_stream = side_stream or contextlib.nullcontext

    def enter_thread(self) -> None:
        """Make the rank's GPU the calling thread's current device, as torch's pin-memory thread
        does: a new thread starts on device 0, and the records thread queries and times the
        events recorded on the training thread's device."""
        if self._device is not None:
            import torch
            torch.cuda.set_device(self._device)

    def mark(self):
        device = self._device  # the rank's GPU, also from a thread whose current device is
        if device is None:     # another (its work there runs on its current stream of this one)
            device = self._get_device()
        try:
            ev = self._pools[device].pop()  # atomic: marks are taken on several threads
        except (KeyError, IndexError):
            ev = self._factory()
        key = device, self._raw_stream(device)
        try:
            stream = self._streams[key]
        except KeyError:
            stream = self._new_stream(key)
        self._record(ev, stream)
        return ev

    def _new_stream(self, key):
        """The stream object of ``key``, made and cached. Threads share the cache: a lookup
        that races a reset makes the stream again."""
        if len(self._streams) >= self.MOST_STREAMS:
            self._streams.clear()
        stream = self._streams[key] = self._make_stream(key[0])
        return stream

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

    @staticmethod
    def ready(mark) -> bool:
        return mark.query()

    @staticmethod
    def elapsed(start, end) -> float:
        return start.elapsed_time(end) * 1e-3

    def release(self, mark) -> None:
        """Give a resolved event back for reuse on its device (re-recording an event is
        allowed). A script whose threads mark on different devices (``model.to("cuda:1")``
        without ``set_device``: the training thread on device 0, autograd's on 1) got events of
        one device for the other's marks, and torch refused each such record."""
        device = self._device if self._device is not None else self._calls.event_device(mark)
        pool = self._pools.setdefault(device, [])
        if len(pool) < self._pool_size:
            pool.append(mark)


def _record_method(event, stream):
    event.record(stream)


FAKE_CALLS = TorchCalls(lambda: 0, lambda device: 0, lambda device: None, _record_method,
                        lambda event: 0)
