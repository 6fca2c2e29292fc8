"""The per-rank recorder: phases, collective waits, step records, heartbeats.

Torch-free on purpose (the simulator and the unit tests drive it directly); ``syncwatch.instrument``
builds one from ``torch.distributed`` and hooks it into DDP and the collectives.

Threads that touch it: the training thread (phases, steps, wrapped collectives), the autograd and
communication threads (gradients ready and collectives done, see ``hooks``), the heartbeat
thread (reads a few attributes) and the skew-exchange thread (appends results to a deque). They
share only single attribute writes and ``deque``/``list`` appends, which are atomic in CPython:
no locks on the hot path.

Every entry point catches its own exceptions: an internal error is counted, logged once, and
reported to the daemon in the next record; it never reaches the training code.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time

from ..protocol import PHASE_INDEX, Cumulative, Encoder, Identity
from ..skew import SkewAccumulator
from .clock import HostClock

log = logging.getLogger("syncwatch.instrument")

SYNC = PHASE_INDEX["sync"]
OTHER = PHASE_INDEX["other"]
CHECKPOINT = PHASE_INDEX["checkpoint"]
_NPH = len(PHASE_INDEX)
MAX_PENDING = 64  # lazily timed (CUDA) steps waiting for their events; beyond this the oldest go


def phase_index(name: str) -> int:
    """A phase name's index; names outside the protocol's phases count as ``other``."""
    return PHASE_INDEX.get(name, OTHER)


class _Phase:
    """Context manager timing one phase. A plain class: ~4x cheaper than @contextmanager."""

    __slots__ = ("_m", "_idx", "_start", "_sync0", "_prev", "_prev_since", "active")

    def __init__(self, monitor: Monitor, idx: int):
        self._m = monitor
        self._idx = idx
        self.active = False

    def __enter__(self):
        m = self._m
        try:
            self.active = True
            self._start = start = m._mark()
            self._sync0 = len(m._sync)
            self._prev, self._prev_since = m.phase_idx, m.phase_since
            m.phase_idx = self._idx
            m.phase_since = start if not m._lazy else time.perf_counter_ns()
        except Exception:
            m._error()
        return self

    def __exit__(self, *exc):
        m = self._m
        try:
            end = m._mark()
            if m._ddp_ready is not None:
                m._close_ddp()
            m._spans.append((self._idx, self._start, end, self._sync0, len(m._sync)))
            if self._idx == CHECKPOINT:
                m.totals.checkpoints += 1
            m.phase_idx, m.phase_since = self._prev, self._prev_since
            self.active = False
        except Exception:
            m._error()
        return False  # never swallow the training code's exceptions


class Monitor:
    def __init__(self, identity: Identity, sender, *, clock=None, exchange=None,
                 exchange_every: int = 50, heartbeat_seconds: float = 5.0):
        self.identity = identity
        self.encoder = Encoder(identity)
        self.sender = sender
        self.clock = clock or HostClock()
        self._lazy = self.clock.lazy
        self._mark = self.clock.mark
        self._durations = self._durations_events if self._lazy else self._durations_host
        self.exchange = exchange
        self.exchange_every = exchange_every if exchange is not None else 0
        self.totals = Cumulative(phase_seconds=[0.0] * _NPH)
        self._skew = SkewAccumulator() if identity.rank == 0 and exchange is not None else None
        self._skew_snapshot = None
        self._exact = False
        self._has_tokens = False
        self.errors = 0
        self.closed = False
        # this step
        self._spans: list = []   # (phase index, start mark, end mark, sync index lo, hi)
        self._sync: list = []    # (start mark, end mark) of collective waits
        self._grad: tuple | None = None  # the step's gradient-sync wait (DDP), also in _sync
        self._ddp_ready = None   # mark when the (latest bucket's) gradients were ready
        self._ddp_done = None    # mark when the (latest bucket's) collective was done
        self._step_start = self.clock.mark()
        self._phases = {name: _Phase(self, i) for name, i in PHASE_INDEX.items()}
        self._pending: collections.deque = collections.deque()
        self._window: list[float] = []
        # progress, read by the heartbeat thread
        self._seq = itertools.count(1)
        self.collective_sequence = 0
        self.last_step = 0
        self.last_step_wall = 0.0
        self.phase_idx = OTHER
        self.phase_since = time.perf_counter_ns()
        # inside a collective: DDP buckets entered (autograd thread) vs completed (communication
        # threads, through an atomic counter), and blocking wrapped collectives (caller's thread)
        self._ddp_in = 0
        self._ddp_out = itertools.count(1)
        self._ddp_out_n = 0
        self._coll_in = 0
        self.sync_since = 0
        self._stop = threading.Event()
        self._heartbeat = None
        if heartbeat_seconds > 0:
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, args=(heartbeat_seconds,),
                                               name="syncwatch-heartbeat", daemon=True)
            self._heartbeat.start()

    # ------------------------------------------------------------------ training-thread API

    def phase(self, name: str) -> _Phase:
        """A context manager timing phase ``name`` (one reusable object per name: no allocation)."""
        p = self._phases.get(name)
        if p is None or p.active:  # first use of a custom name, or the same phase nested
            p = _Phase(self, PHASE_INDEX.get(name, OTHER))
            if len(self._phases) < 64:
                self._phases.setdefault(name, p)
        return p

    def step(self, samples: float = 0.0, tokens: float | None = None, step: int | None = None) -> None:
        """End the current step. ``step``: the job's own step number (default: previous + 1)."""
        try:
            end = self._mark()
            wall = time.time()
            if self._ddp_ready is not None:
                self._close_ddp()
            if step is None:
                number = self.last_step + 1
            else:
                number = int(step)
                if number <= self.last_step:
                    self._new_attempt(number)
            if tokens is not None:
                self._has_tokens = True
            rec = (number, wall, self._step_start, end, self._spans, self._sync, self._grad,
                   float(samples) if samples > 0 else 0.0,
                   float(tokens) if tokens is not None and tokens > 0 else 0.0,
                   self.collective_sequence, self.encoder)
            self._spans, self._sync, self._grad = [], [], None
            self._step_start = end
            self.last_step, self.last_step_wall = number, wall
            if self._lazy:
                self._pending.append(rec)
                self._resolve()
            else:
                self._emit(rec)
        except Exception:
            self._error()

    # ------------------------------------------------------------------ collectives

    def collective_entered(self) -> None:
        self.collective_sequence = next(self._seq)

    def bucket_ready(self, collectives: int = 1) -> None:
        """Gradients are computed: a DDP bucket's hook entry (wrapper path, autograd thread), or
        all of backward's (hook-free path: its first final callback), launching ``collectives``
        all-reduces."""
        try:
            for _ in range(collectives):
                self.collective_sequence = next(self._seq)
            self._ddp_ready = ready = self._mark()
            if not self.in_sync():
                self.sync_since = ready if not self._lazy else time.perf_counter_ns()
            self._ddp_in += 1
        except Exception:
            self._error()

    def bucket_done(self) -> None:
        """The bucket's collective finished (wrapper path, communication thread), or all of them
        (hook-free path: the final callback queued after DDP's finalize)."""
        try:
            self._ddp_done = self._mark()
            self._ddp_out_n = next(self._ddp_out)
        except Exception:
            self._error()

    def bucket_done_then(self, fut):
        """``.then`` callback of a bucket's future: mark it done, pass its value on."""
        self.bucket_done()
        return fut.value()

    def in_sync(self) -> bool:
        return self._coll_in > 0 or self._ddp_in > self._ddp_out_n

    def _close_ddp(self) -> None:
        """Turn the last bucket's ready..done into the step's gradient wait."""
        ready, done = self._ddp_ready, self._ddp_done
        if ready is not None and done is not None:
            self._ddp_ready = self._ddp_done = None
            self._grad = (ready, done)
            self._sync.append(self._grad)

    def timed_collective(self, fn, args, kwargs, async_index: int):
        """Run a collective, timing a blocking one's wait as ``sync``. Its errors are the caller's.

        An ``async_op=True`` call is counted but not timed: its wait happens where the caller
        waits on the returned work."""
        start = None
        try:
            self.collective_sequence = next(self._seq)
            if not (kwargs.get("async_op") or (len(args) > async_index and args[async_index])):
                start = self.clock.mark()
                if not self.in_sync():
                    self.sync_since = time.perf_counter_ns()
                self._coll_in += 1
        except Exception:
            self._error()
            start = None
        if start is None:
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        finally:
            try:
                self._coll_in -= 1
                self._sync.append((start, self.clock.mark()))
            except Exception:
                self._error()

    # ------------------------------------------------------------------ records

    def _resolve(self) -> None:
        """Emit the lazily timed steps whose events the device has passed, oldest first."""
        pending, ready = self._pending, self.clock.ready
        while pending:
            rec = pending[0]
            if not ready(rec[3]) or (rec[6] is not None and not ready(rec[6][1])):
                break
            pending.popleft()
            self._emit(rec)
            self._release(rec)
        while len(pending) > MAX_PENDING:
            self._release(pending.popleft())
            self.sender.dropped += 1

    def _release(self, rec) -> None:
        release = self.clock.release
        release(rec[2])  # the previous step's end mark, no longer needed by anyone
        for span in rec[4]:
            release(span[1])
            release(span[2])
        for a, b in rec[5]:
            release(a)
            release(b)

    @staticmethod
    def _durations_host(s0, s1, spans, sync, grad):
        """(step, phases, wait) in seconds from integer nanosecond marks: plain arithmetic."""
        phases = [0.0] * _NPH
        if sync:
            sync_ns = [b - a for a, b in sync]
            for idx, a, b, lo, hi in spans:
                # a phase's own time excludes the collective waits inside it (they are ``sync``)
                d = b - a - (sum(sync_ns[lo:hi]) if hi > lo else 0)
                if d > 0:
                    phases[idx] += d * 1e-9
            phases[SYNC] += sum(sync_ns) * 1e-9
        else:
            for idx, a, b, _, _ in spans:
                if b > a:
                    phases[idx] += (b - a) * 1e-9
        wait = (grad[1] - grad[0]) * 1e-9 if grad is not None else phases[SYNC]
        return max((s1 - s0) * 1e-9, 0.0), phases, max(wait, 0.0)

    def _durations_events(self, s0, s1, spans, sync, grad):
        el = self.clock.elapsed
        sync_d = [max(el(a, b), 0.0) for a, b in sync]
        phases = [0.0] * _NPH
        for idx, a, b, lo, hi in spans:
            phases[idx] += max(el(a, b) - sum(sync_d[lo:hi]), 0.0)
        phases[SYNC] += sum(sync_d)
        wait = max(el(*grad), 0.0) if grad is not None else phases[SYNC]
        return max(el(s0, s1), 0.0), phases, wait

    def _emit(self, rec) -> None:
        number, wall, s0, s1, spans, sync, grad, samples, tokens, seq, encoder = rec
        step_s, phases, wait = self._durations(s0, s1, spans, sync, grad)
        t = self.totals
        t.steps += 1
        t.step_seconds += step_s
        totals = t.phase_seconds
        for i, d in enumerate(phases):
            if d:
                totals[i] += d
        t.samples += samples
        t.tokens += tokens
        if self.exchange_every:
            self._window.append(wait)
            if len(self._window) >= self.exchange_every:
                self.exchange.submit(self._window)
                self._window = []
            self._take_results()
        t.dropped_records = self.sender.dropped
        t.internal_errors = self.errors
        self.sender.send(encoder.step(
            number, wall, step_s, wait, phases, seq, samples, tokens, t, exact=self._exact,
            has_tokens=self._has_tokens, skew=self._skew_snapshot))

    def _take_results(self) -> None:
        results = self.exchange.results
        if not results:
            return
        t = self.totals
        while results:
            r = results.popleft()
            t.slack_seconds += r.slack_seconds
            t.last_arrivals += r.last_arrivals
            if self._skew is not None:
                for s in r.skews:
                    self._skew.observe(s)
        self._exact = True
        if self._skew is not None:
            self._skew_snapshot = self._skew.snapshot()

    def _new_attempt(self, number: int) -> None:
        """The step number went backwards: the job resumed from an earlier step in this process."""
        self.identity = dataclasses.replace(self.identity, attempt=self.identity.attempt + 1)
        self.encoder = Encoder(self.identity)
        log.info("syncwatch: step %d after %d: attempt %d", number, self.last_step,
                 self.identity.attempt)

    # ------------------------------------------------------------------ heartbeat, shutdown

    def heartbeat(self) -> None:
        try:
            now = time.perf_counter_ns()
            if self.in_sync():
                idx, since = SYNC, self.sync_since
            else:
                idx, since = self.phase_idx, self.phase_since
            phase = _PHASE_NAMES[idx]
            self.sender.send(self.encoder.heartbeat(
                time.time(), self.last_step, self.last_step_wall, phase,
                max(now - since, 0) * 1e-9, self.collective_sequence, self.sender.dropped,
                self.errors))
        except Exception:
            self._error()

    def _heartbeat_loop(self, interval: float) -> None:
        self.heartbeat()
        while not self._stop.wait(interval):
            self.heartbeat()

    def shutdown(self, reason: str = "completed", timeout: float = 2.0) -> None:
        """Flush what can be flushed within ``timeout`` s, send the end record, stop threads."""
        if self.closed:
            return
        self.closed = True
        try:
            self._stop.set()
            end = time.monotonic() + timeout
            while self._pending and time.monotonic() < end:
                self._resolve()
                if self._pending:
                    time.sleep(0.005)
            if self.exchange is not None:
                self.exchange.drain(max(end - time.monotonic(), 0.0))
                self.exchange.stop(0.1)
            self.sender.send(self.encoder.end(time.time(), self.last_step, reason))
            self.sender.flush(0.5)
            if self._heartbeat is not None:
                self._heartbeat.join(0.5)
        except Exception:
            self._error()
        finally:
            self.sender.close()

    def _error(self) -> None:
        self.errors += 1
        if self.errors == 1:
            log.warning("syncwatch: internal error (counted, training continues)", exc_info=True)


_PHASE_NAMES = tuple(sorted(PHASE_INDEX, key=PHASE_INDEX.get))
