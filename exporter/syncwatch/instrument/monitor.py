"""The per-rank recorder: phases, collective waits, step records, heartbeats.

Torch-free on purpose (the unit tests drive it directly); ``syncwatch.instrument`` builds one
from ``torch.distributed`` and hooks it into DDP and the collectives.

Two halves, so that the training thread does as little as possible:

* **The hot path** (the training thread; the autograd and communication threads for the DDP
  marks) only appends an *entry* — a code and a clock mark in a tuple — to a deque: a phase's
  start and end, a collective's start and end, gradients ready and synchronized, a backward's
  end, a step's end.
  ``deque.append`` is atomic in CPython: no locks, no syscalls, no allocation beyond the tuple.
  Phases, ``step()`` and the "synchronized" mark are ``notes.Notes`` objects, in C where built.
* **The records thread** wakes every ``flush_seconds`` (0.2 s), replays the entries into step
  records (phase durations, collective waits taken out of the phases around them, the step's
  gradient wait, cumulative totals, the skew-exchange windows), encodes and sends them, and sends
  the heartbeat every ``heartbeat_seconds``. A record reaches the daemon within
  ``flush_seconds`` of its step's end (on CUDA, once the device has passed the step's events).
  Working through a burst of entries at once also runs that Python with warm caches, where one
  record per ``step()`` call ran it cold after every backward.

Every entry point catches its own exceptions: an internal error is counted, logged once, and
reported to the daemon in the next record; it never reaches the training code.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
import threading
import time
import weakref

from ..protocol import (END_REASONS, MAX_ATTEMPT, MAX_STEP, MAX_TOTAL, PAUSES, PHASE_INDEX,
                        Cumulative, Encoder, Identity)
from ..skew import EXCHANGE_SECONDS, SkewAccumulator, window_size
from .clock import HostClock
from .notes import Notes

log = logging.getLogger("syncwatch.instrument")

SYNC = PHASE_INDEX["sync"]
DATA = PHASE_INDEX["data"]
BACKWARD = PHASE_INDEX["backward"]
OTHER = PHASE_INDEX["other"]
CHECKPOINT = PHASE_INDEX["checkpoint"]
PAUSED = tuple(PHASE_INDEX[name] for name in PAUSES)
_NPH = len(PHASE_INDEX)
MAX_PENDING = 64  # lazily timed (CUDA) steps waiting for their events; beyond this the oldest go
MAX_ENTRIES = 1 << 16  # hot-path entries waiting for the records thread (4-6 k steps of 11-16)
# Each wake-up costs ~60 us of CPU before any work (cold caches): every 0.05 s cost twice the CPU
# per step of every 0.2 s (6 ms steps); 1 s would cost less, but a job turning fast sends a second
# of steps in one burst and loses records (benchmarks/bench_records_thread.py, bench_burst.py).
FLUSH_SECONDS = 0.2
# the most samples or tokens one step() may report: the daemon refuses a record whose cumulative
# total passes protocol.MAX_TOTAL, so one absurd count would lose every later record of the rank
MAX_PER_STEP = MAX_TOTAL / 1000
# step numbers going backwards start at most this many attempts in one process (a resume from a
# checkpoint without a new process is rare); beyond it, step= is taken for a counter that is not
# the job's step (a per-epoch batch index, a constant), which would count a restart every epoch
# or every step, and later ones are numbered previous + 1
MAX_NEW_ATTEMPTS = 16

# Entry codes. A phase's start is its index, its end the index + EXIT. Layouts:
#   (phase, mark) (phase + EXIT, mark) (READY, mark, collectives[, backward]) (DONE, mark)
#   (SYNCED, mark) (ENDED, mark) (LOADED, mark)
#   (COLL, mark) (COLL_END, mark) (SEQ,) (STEP, mark, wall, samples, tokens, step number | None)
#   (WAITED, mark): a wait on an async collective's work begins (ended by a COLL_END)
# ENDED: a backward ended (one under no_sync(); a synchronized one's end is its SYNCED).
# LOADED: ``backward`` ends, its time since the latest backward's end being ``data``.
EXIT = 8
STEP, READY, DONE, COLL, COLL_END, SEQ, SYNCED, ENDED, LOADED, WAITED = range(16, 26)
_SEQ_ENTRY = (SEQ,)


def _number(value) -> bool:
    """Whether ``step()``'s argument is a number (an int, a float, a numpy scalar, a tensor):
    ``float()`` also parses a string ("3") and takes True for 1, and ``int()`` likewise, so
    ``samples=True`` counted a sample and ``step=True`` numbered the step 1."""
    return not isinstance(value, bool) and hasattr(type(value), "__float__")


class Monitor:
    def __init__(self, identity: Identity, sender, *, clock=None, exchange=None,
                 exchange_every: int = 50, exchange_seconds: float = EXCHANGE_SECONDS,
                 heartbeat_seconds: float = 5.0,
                 flush_seconds: float = FLUSH_SECONDS, in_backward=None):
        self.identity = identity
        self.encoder = Encoder(identity)
        self.sender = sender
        self.clock = clock or HostClock()
        self._lazy = self.clock.lazy
        self._mark = self.clock.mark
        self._durations = self._durations_events if self._lazy else self._durations_host
        self.exchange = exchange
        self.exchange_every = exchange_every if exchange is not None else 0
        self.exchange_seconds = exchange_seconds
        self.totals = Cumulative(phase_seconds=[0.0] * _NPH)
        self._skew = SkewAccumulator() if identity.rank == 0 and exchange is not None else None
        self._skew_snapshot = None
        self._exact = False
        self._has_tokens = False
        self.errors = 0
        self._errors_lock = threading.Lock()
        self._refused: set[str] = set()  # step() arguments refused and logged once
        # the training thread: the one that builds the monitor (``init()``; in zero-code mode
        # the one that wraps the model). Only its blocking collectives are its waits, and those
        # of its backward, which autograd runs on a thread of its own for CUDA tensors (FSDP's
        # reduce-scatters): ``in_backward()`` says whether the calling thread runs a backward
        self.thread = threading.get_ident()
        self._in_backward = in_backward or (lambda: False)
        self._new_attempts = 0  # attempts started by step numbers going backwards
        self.closed = False
        # hot path -> records thread
        self._entries: collections.deque = collections.deque(maxlen=MAX_ENTRIES)
        self._put = self._entries.append
        self._notes = Notes(STEP, time.time)
        self._notes.bind(self._put, self._mark, self._error)
        self._phases = {name: self._notes.phase(i, i + EXIT) for name, i in PHASE_INDEX.items()}
        self.step = self._notes.step
        """``step(samples=0, tokens=None, step=None)``: end the current step, which processed
        ``samples`` (and ``tokens``); ``step``: the job's own step number (default: previous + 1)."""
        self.bucket_done = self._notes.mark(DONE)
        """The bucket's collective finished (wrapper path, communication thread). Arguments
        ignored."""
        self.grads_synced = self._notes.mark(SYNCED)
        """All of a backward's collectives finished (hook-free path: the final callback queued
        after DDP's finalize): that backward's wait ends here. Arguments ignored."""
        self.relays: dict = {}
        """The hook-free gradient wait's first callbacks, one per watched model (``hooks``)."""
        self.next_micro_batch = self._notes.mark(LOADED)
        """Zero-code mode's end of ``backward`` at a forward with no optimizer step since the
        one before (gradient accumulation's next micro-batch): its time since the latest
        backward ended (a hook-free gradient sync, or ``backward_ended``) is ``data``, that
        micro-batch's loading. Arguments ignored."""
        self.backward_ended = None
        """Where set (``mark_backward_ends``: zero-code mode), a mark that the hook-free path
        queues as final callback of a backward under ``no_sync()``, whose end nothing else
        marks; the replay then also takes a gradient sync's end as its backward's."""
        # the replay's state: only the records thread (or flush()) touches it, under _lock
        self._lock = threading.Lock()
        # open phases: (index, start mark, sync index, host ns); the start of the current span,
        # None while a phase inside it runs (only the innermost phase's time runs)
        self._stack: list = []
        self._spans: list = []   # this step's phases: (index, start, end, sync index lo, hi)
        self._shared: dict = {}  # id of a mark ending one span and starting the next: its uses
        self._sync: list = []    # this step's collective waits: (start mark, end mark)
        self._colls: list = []   # start marks of blocking collectives not yet ended
        self._grads: list = []   # the step's gradient syncs (DDP): (ready, done), also in _sync
        self._ready = None       # mark when the (latest bucket's) gradients were ready
        self._backward = None    # the latest wrapped bucket's autograd graph task
        self._done = None        # mark when the (latest bucket's) collective was done
        # the latest backward's end since the last phase boundary, as (mark, sync index, owned:
        # an ENDED mark, which nothing else releases; else a gradient sync's end)
        self._ended = None
        self._step_start = self.clock.mark()  # the first step's: moved to its first phase
        self._begun = False      # a phase began or a step ended: the first step has its start
        self._first_start = None  # the first step's start where it is its first phase's start
        self._pending: collections.deque = collections.deque()  # lazily timed steps
        self._window: list[float] = []        # idle times (waits, pauses) not yet exchanged
        self._window_steps: list[float] = []  # and their step times
        self._k = self.exchange_every  # the next window's size; 0 until the first one's result
        self._sized = False            # the first result has sized the windows after it
        self._last = None  # the last step record's own values (_emit), for shutdown's re-send
        # progress, read by the heartbeat
        self.collective_sequence = 0
        self.last_step = 0
        self.last_step_wall = 0.0
        self.phase_idx = OTHER
        self.phase_since = time.perf_counter_ns()
        self.sync_since = 0
        self._ddp_in = self._ddp_out = 0  # DDP gradient syncs begun / ended
        self._coll_in = 0                # blocking wrapped collectives under way
        self._async_works = weakref.WeakSet()  # works of async wrapped collectives not waited on
        # held until shutdown: the records thread sleeps in ``acquire(timeout=...)``, one C call
        # (an ``Event.wait`` runs Condition's Python: 89 us of CPU a wake-up against 60 us)
        self._stop = threading.Lock()
        self._stop.acquire()
        self._thread = threading.Thread(target=self._run, args=(flush_seconds, heartbeat_seconds),
                                        name="syncwatch-records", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ hot path

    def phase(self, name: str):
        """A context manager timing phase ``name`` (one reusable object per name; any name
        outside the protocol's phases is ``other``)."""
        return self._phases.get(name) or self._phases["other"]

    def bucket_ready(self, collectives: int = 1, backward=None) -> None:
        """Gradients are computed: a DDP bucket's hook entry (wrapper path, autograd thread), or
        all of backward's (hook-free path: its first final callback), launching ``collectives``
        all-reduces. ``backward``: the wrapper path's autograd graph task; a bucket of another
        backward than the last one's ends that backward's wait (two wrapped models whose
        backwards share a phase)."""
        try:
            self._put((READY, self._mark(), collectives, backward))
        except Exception:
            self._error()

    def mark_backward_ends(self) -> None:
        """Have the backwards under ``no_sync()`` marked (``backward_ended``), and the replay
        note where each backward ended (those, and the synchronized ones' ``grads_synced``), so
        that ``next_micro_batch`` takes the loading after one as ``data``. Zero-code mode's
        only: a script using the API times its own phases, and would pay for nothing."""
        self.backward_ended = self._notes.mark(ENDED)

    def bucket_done_then(self, fut):
        """``.then`` callback of a bucket's future: mark it done, pass its value on."""
        self.bucket_done()
        return fut.value()

    def timed_collective(self, fn, args, kwargs, async_index: int):
        """Run a collective, timing a blocking one's wait as ``sync``. Its errors are the caller's.

        An ``async_op=True`` call is counted here; its wait is timed where the caller waits on
        the returned work (``timed_wait``). A call on another thread than the training thread
        (``self.thread``) outside a backward: DCP's ``async_save`` uploading in its executor's
        thread, ending in a ``dist.barrier`` while the loop trains on, or a metrics thread. Its
        wait is none of the training thread's: timed, it was counted as ``sync`` of the step it
        ended in (0.15 s of ``sync`` in a 0.03 s step)."""
        timed = False
        try:
            if (kwargs.get("async_op") or (len(args) > async_index and args[async_index])
                    or (threading.get_ident() != self.thread and not self._in_backward())):
                self._put(_SEQ_ENTRY)
            else:
                self._put((COLL, self._mark()))
                timed = True
        except Exception:
            self._error()
        if not timed:
            work = fn(*args, **kwargs)
            if work is not None:
                try:
                    self._async_works.add(work)
                except TypeError:
                    pass  # not a torch Work: a wait on it is not seen
            return work
        try:
            return fn(*args, **kwargs)
        finally:
            try:
                self._put((COLL_END, self._mark()))
            except Exception:
                self._error()

    def timed_wait(self, wait, work, args, kwargs):
        """``work.wait()``: the wait on an async collective's work, timed as ``sync`` as a
        blocking call's is (FSDP2's ``unshard(async_op=True)``, its explicit prefetching, waits
        for its all-gather in the unit's pre-forward; untimed, a rank waiting there for a slow
        one read that wait as its forward, and the exchange saw no slack). Only its first wait,
        and on the threads whose collectives are timed. Its errors are the caller's."""
        timed = False
        try:
            if work in self._async_works:
                self._async_works.discard(work)
                if threading.get_ident() == self.thread or self._in_backward():
                    self._put((WAITED, self._mark()))
                    timed = True
        except Exception:
            self._error()
        if not timed:
            return wait(work, *args, **kwargs)
        try:
            return wait(work, *args, **kwargs)
        finally:
            try:
                self._put((COLL_END, self._mark()))
            except Exception:
                self._error()

    # ------------------------------------------------------------------ replay (records thread)

    def flush(self) -> None:
        """Replay the entries so far and send the records that are ready. The records thread
        calls it every ``flush_seconds``; tests and shutdown call it to be sure."""
        with self._lock:
            entries = self._entries
            if len(entries) >= MAX_ENTRIES:  # the records thread fell behind: the oldest are gone
                self._error(OverflowError(f"the records thread fell behind: its queue filled "
                                          f"up ({MAX_ENTRIES} entries), the oldest dropped"))
            host = time.perf_counter_ns()  # lazy marks are events: "now" is the host time
            lazy, stack, pop = self._lazy, self._stack, entries.popleft
            while entries:
                e = pop()
                try:
                    code = e[0]
                    # phases' starts and ends are most of the entries: handled here, and a
                    # phase with nothing inside (its end next) straight into a span
                    if code < EXIT:
                        if not self._begun:
                            self._begin(e[1])
                        if self._ended is not None:
                            self._forget_ended()
                        if self._done is not None:  # a gradient wait ended before: not this
                            self._close_ddp()       # phase's time (nor an enclosing one's)
                        if stack:
                            self._interrupt(e[1])
                        if entries and entries[0][0] == code + EXIT:
                            end = pop()
                            n = len(self._sync)
                            self._spans.append((code, e[1], end[1], n, n))
                            if stack:
                                self._resume(end[1])
                            else:
                                self.phase_since = host if lazy else end[1]
                            continue
                        h = host if lazy else e[1]
                        stack.append((code, e[1], len(self._sync), h))
                        self.phase_idx, self.phase_since = code, h
                    elif code < STEP:
                        self._end_phase(code - EXIT, e[1], host if lazy else e[1])
                    else:
                        self._replay(e, host if lazy or code == SEQ else e[1])
                except Exception:
                    self._error()
            if self._pending:
                self._resolve()

    def _begin(self, mark) -> None:
        """The first phase of the first step: the step starts here, not at ``init()``. What came
        between (the model's setup, a checkpoint load, a barrier before the loop) is no step's:
        counted in, a first step of minutes among 1 s steps skewed every per-step figure."""
        self._begun = True
        old, self._step_start, self._sync, self._grads = self._step_start, mark, [], []
        if self._done is not None:  # a gradient sync before the loop (a warm-up backward)
            self._ready = self._done = None
        self._first_start = mark  # also its phase's start: that phase's span gives it back
        self.clock.release(old)

    def _replay(self, e, host) -> None:
        """Any entry but a phase's start or end (``flush`` handles those)."""
        code = e[0]
        if code == READY:
            if len(e) > 3 and e[3] is not None:  # a wrapped bucket
                if e[3] != self._backward and self._done is not None:
                    self._close_ddp()  # the first bucket of another backward: the last one's ends
                self._backward = e[3]
            self.collective_sequence += e[2]
            self._ready = e[1]
            self._sync_begins(host)
            self._ddp_in += 1
        elif code == DONE:
            self._done = e[1]
            self._ddp_out += 1
        elif code == SYNCED:  # a whole backward's: closed now, a second backward has its own
            self._done = e[1]
            self._ddp_out += 1
            self._close_ddp()
            if self._done is None and self.backward_ended is not None:
                self._note_ended(e[1], len(self._sync), False)  # where that backward ended
        elif code == ENDED:
            if self._done is not None:  # a gradient wait that ended before: backward's
                self._close_ddp()
            self._note_ended(e[1], len(self._sync), True)
        elif code == LOADED:
            self._loaded(e[1], host)
        elif code == COLL or code == WAITED:
            if code == COLL:
                self.collective_sequence += 1
            self._sync_begins(host)
            self._coll_in += 1
            self._colls.append(e[1])
        elif code == COLL_END:
            self._coll_in -= 1
            if self._colls:
                self._sync.append((self._colls.pop(), e[1]))
        elif code == SEQ:
            self.collective_sequence += 1
        elif code == STEP:
            self._end_step(e, host)

    def _note_ended(self, mark, n, owned) -> None:
        if self._ended is not None:
            self._forget_ended()
        self._ended = (mark, n, owned)

    def _forget_ended(self) -> None:
        """A phase boundary or a step's end: the latest backward's end no longer ends a span."""
        mark, _, owned = self._ended
        self._ended = None
        if owned:
            self.clock.release(mark)

    def _loaded(self, end, host) -> None:
        """``backward`` ends at ``end`` (``next_micro_batch``). Where a backward ended within its
        last span, that span ends there, and the rest, until ``end``, is ``data``: the next
        micro-batch's loading, where without accumulation the loading comes after the
        optimizer's step. Ends like backward's exit otherwise (no backward since the forward:
        a second model's forward in the same step)."""
        if self._done is not None:
            self._close_ddp()
        stack, ended = self._stack, self._ended
        if ended is None or not stack or stack[-1][0] != BACKWARD:
            self._end_phase(BACKWARD, end, host)
            return
        self._ended = None
        mark, n, owned = ended
        _, start, lo, h = stack[-1]
        self._spans.append((BACKWARD, start, mark, lo, n))
        stack[-1] = (DATA, mark, n, h)
        self._share(mark)  # it ends backward's span and starts data's
        if not owned:
            self._share(mark)  # and a gradient wait, in the step's sync
        self._end_phase(DATA, end, host)

    def _sync_begins(self, host) -> None:
        if not self.in_sync():
            self.sync_since = host

    def in_sync(self) -> bool:
        return self._coll_in > 0 or self._ddp_in > self._ddp_out

    def _close_ddp(self) -> None:
        """Turn the last bucket's ready..done into one of the step's gradient waits. A step's
        wait is the sum of its gradient syncs: two DDP models (a GAN's generator and
        discriminator) wait twice a step, and a second backward that DDP does not synchronize
        adds its ~0, where keeping the last one lost the other."""
        ready, done = self._ready, self._done
        if ready is not None and done is not None:
            self._ready = self._done = None
            self._grads.append((ready, done))
            self._sync.append((ready, done))

    def _interrupt(self, mark) -> None:
        """A phase begins inside another: the enclosing one's time so far is a span of its own,
        and it goes on when the inner one ends (``_resume``). Phases are exclusive, as ``sync``
        is: a save inside ``forward`` counted in both, and the phases summed to more than the
        step."""
        code, start, lo, host = self._stack[-1]
        self._spans.append((code, start, mark, lo, len(self._sync)))
        self._share(mark)
        self._stack[-1] = (code, None, None, host)

    def _resume(self, mark) -> None:
        code, _, _, host = self._stack[-1]
        self._stack[-1] = (code, mark, len(self._sync), host)
        self._share(mark)
        self.phase_idx, self.phase_since = code, host

    def _split(self, end) -> None:
        """A step ends inside a phase: the step holds the phase's time so far, the next step the
        rest. Kept whole, the phase went to the step it ended in, and with it the collective
        waits before the step's end that it never subtracted (their indices were the finished
        step's), counted twice: as ``sync`` and as the phase."""
        code, start, lo, host = self._stack[-1]
        self._spans.append((code, start, end, lo, len(self._sync)))
        self._share(end)  # the step's end is also the next step's start: three releases
        self._share(end)
        self._stack[-1] = (code, end, 0, host)

    def _share(self, mark) -> None:
        """``mark`` bounds two spans (it ends one and starts the next), maybe of two steps' records:
        the clock gets it back once both have been released."""
        if self.clock.lazy:
            self._shared[id(mark)] = self._shared.get(id(mark), 0) + 1

    def _end_phase(self, idx: int, end, host) -> None:
        if self._done is not None:
            self._close_ddp()
        if self._ended is not None:
            self._forget_ended()
        stack = self._stack
        for k in range(len(stack) - 1, -1, -1):
            if stack[k][0] == idx:
                break
        else:
            return  # its start was lost (counted where it failed)
        # the innermost phase's time goes on to this end: phases inside the ending one that
        # are still open (the script left them unclosed) end with it
        code, start, lo, _ = stack[-1]
        self._spans.append((code, start, end, lo, len(self._sync)))
        del stack[k:]
        if stack:
            self._resume(end)
        else:
            self.phase_idx, self.phase_since = OTHER, host

    def _end_step(self, e, host) -> None:
        _, end, wall, samples, tokens, number = e
        self._begun = True
        self._close_ddp()
        if self._ended is not None:
            self._forget_ended()
        # no gradient sync spans a step's end: one begun and never ended raised in DDP's
        # finalize (the script caught it), and would read "sync" in every heartbeat from now on
        self._ddp_out = self._ddp_in
        if self._stack:
            self._split(end)
        number = self._step_number(number)
        if number <= self.last_step and self.last_step_wall:  # after a step: a job counting from 0
            if self._new_attempts < MAX_NEW_ATTEMPTS:
                self._new_attempt(number)
            else:
                self._refuse("step", number, f"a step number that goes backwards at most "
                             f"{MAX_NEW_ATTEMPTS} times in a process (the job's own step, not a "
                             f"per-epoch index)", "taken as the previous step + 1")
                number = self.last_step + 1
        if tokens is not None:
            self._has_tokens = True
        rec = (number, wall, self._step_start, end, self._spans, self._sync, self._grads,
               samples, tokens, self.collective_sequence, self.encoder)
        # counted with the step whose time holds them: one after the last step (a final save)
        # was counted, its time never reported
        self.totals.checkpoints += sum(1 for span in self._spans if span[0] == CHECKPOINT)
        self._spans, self._sync, self._grads = [], [], []
        self._step_start = end
        self.last_step, self.last_step_wall = number, wall
        if not self._stack:
            self.phase_since = host
        if self._lazy:
            self._pending.append(rec)
        else:
            self._emit(rec)

    def _resolve(self) -> None:
        """Emit the lazily timed steps whose events the device has passed, oldest first.

        On one stream, passing a step's end passes all of its events. A phase timed on another
        stream (a prefetch inside ``torch.cuda.stream(side)``) can still be behind it, and
        reading its events raises: the step waits for them. A step whose events cannot be read
        once all are passed (a CUDA error) is dropped and counted, its events not recycled: the
        exception, let out of here, stopped the records thread, and with it every later record
        and heartbeat of the rank."""
        pending, ready = self._pending, self.clock.ready
        while pending:
            rec = pending[0]
            try:
                if not ready(rec[3]) or (rec[6] and not ready(rec[6][-1][1])):
                    break
                self._emit(rec)
            except Exception:
                if not self._passed(rec):
                    break
                pending.popleft()
                self.sender.dropped += 1
                self._error()
                continue
            pending.popleft()
            self._release(rec)
        while len(pending) > MAX_PENDING:
            self._release(pending.popleft())
            self.sender.dropped += 1

    def _passed(self, rec) -> bool:
        """Whether the device has passed every event of the step ``rec`` (True where one cannot
        even be queried: it never will be)."""
        marks = [rec[2], rec[3], *(m for s in rec[4] for m in s[1:3]),
                 *(m for pair in rec[5] for m in pair)]
        try:
            return all(map(self.clock.ready, marks))
        except Exception:
            return True

    def _release(self, rec) -> None:
        release = self._release_shared if self._shared else self.clock.release
        start = rec[2]  # the previous step's end mark, no longer needed by anyone; the first
        if start is self._first_start:  # step's is its first phase's start, which that phase's
            self._first_start = None  # span releases, in this step or, ending later, a later one
        else:
            release(start)
        for span in rec[4]:
            release(span[1])
            release(span[2])
        for a, b in rec[5]:
            release(a)
            release(b)

    def _release_shared(self, mark) -> None:
        uses = self._shared.get(id(mark))
        if uses is None:
            self.clock.release(mark)
        elif uses == 1:
            del self._shared[id(mark)]
        else:
            self._shared[id(mark)] = uses - 1

    @staticmethod
    def _durations_host(s0, s1, spans, sync, grads):
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
        wait = sum(max(b - a, 0) for a, b in grads) * 1e-9 if grads else phases[SYNC]
        return max((s1 - s0) * 1e-9, 0.0), phases, wait

    def _durations_events(self, s0, s1, spans, sync, grads):
        el = self.clock.elapsed
        sync_d = [max(el(a, b), 0.0) for a, b in sync]
        phases = [0.0] * _NPH
        for idx, a, b, lo, hi in spans:
            phases[idx] += max(el(a, b) - sum(sync_d[lo:hi]), 0.0)
        phases[SYNC] += sum(sync_d)
        wait = sum(max(el(a, b), 0.0) for a, b in grads) if grads else phases[SYNC]
        return max(el(s0, s1), 0.0), phases, wait

    def _emit(self, rec) -> None:
        number, wall, s0, s1, spans, sync, grads, samples, tokens, seq, encoder = rec
        step_s, phases, wait = self._durations(s0, s1, spans, sync, grads)
        samples = self._amount("samples", samples)  # here: a CUDA tensor's step is done
        tokens = 0.0 if tokens is None else self._amount("tokens", tokens)
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
            self._take_results()
            # what the exchange compares: the step's time not spent on its own compute, its
            # collective waits and its planned pauses. A rank saving a checkpoint alone (rank 0)
            # arrives late by the save, and its peers wait for it, in the gradient all-reduce or
            # a barrier: counted so, every rank idles the same and the save is no skew; the
            # gradient wait alone made rank 0 the last arrival by the whole save
            self._window.append(phases[SYNC] + sum(phases[i] for i in PAUSED))
            self._window_steps.append(step_s)
            self._cut_windows()
        self._last = (number, wall, step_s, wait, phases, seq, samples, tokens, encoder)
        self._send_step()

    def _send_step(self) -> None:
        """Send the last step's record with the totals as they are now."""
        number, wall, step_s, wait, phases, seq, samples, tokens, encoder = self._last
        t = self.totals
        t.reported_dropped, t.reported_errors = self.sender.delivered
        t.dropped_records = self.sender.dropped
        t.internal_errors = self.errors
        self.sender.send(encoder.step(
            number, wall, step_s, wait, phases, seq, samples, tokens, t, exact=self._exact,
            has_tokens=self._has_tokens, skew=self._skew_snapshot),
            (t.dropped_records, t.internal_errors))

    def _cut_windows(self) -> None:
        """Submit the full windows: the first of K steps, the next ones of the size its result
        gives (``skew.window_size``; until it is back, the waits wait)."""
        if self.exchange.failed:  # no result will come: stop collecting
            self.exchange_every, self._window, self._window_steps = 0, [], []
            return
        while self._k and len(self._window) >= self._k:
            k = self._k
            self.exchange.submit(self._window[:k], statistics.median(self._window_steps[:k]))
            del self._window[:k], self._window_steps[:k]
            if not self._sized:
                self._k = 0

    def _take_results(self) -> None:
        results = self.exchange.results
        if not results:
            return
        t = self.totals
        while results:
            r = results.popleft()
            if not self._sized:
                self._sized = True
                self._k = window_size(r.step_seconds, self.exchange_every, self.exchange_seconds)
            t.slack_seconds += r.slack_seconds
            t.last_arrivals += r.last_arrivals
            if self._skew is not None:
                for s in r.skews:
                    self._skew.observe(s)
        self._exact = True
        if self._skew is not None:
            self._skew_snapshot = self._skew.snapshot()

    def _amount(self, name: str, value) -> float:
        """``step()``'s samples or tokens as a float (an int, a float, a one-element tensor:
        ``clock.amount``). Anything else — not a number, not finite, negative, beyond
        ``MAX_PER_STEP`` — is refused: the step still counts, with 0 of it."""
        try:
            x = self.clock.amount(value) if _number(value) else -1.0
        except Exception:
            x = -1.0
        if 0.0 <= x <= MAX_PER_STEP:
            return x
        self._refuse(name, value, f"a number from 0 to {MAX_PER_STEP:g}", "counted as 0")
        return 0.0

    def _step_number(self, value) -> int:
        """``step()``'s ``step`` (the job's own step number), or the previous one + 1 where none
        was given or it is refused (not an integer from 0 to ``MAX_STEP``)."""
        if value is None:
            return self.last_step + 1
        try:
            n = int(value)
            # 7.0 and a one-element tensor are, 7.5, "7" and True are not
            whole = _number(value) and bool(n == value)
        except Exception:
            n, whole = -1, False
        if whole and 0 <= n <= MAX_STEP:
            return n
        self._refuse("step", value, "an integer from 0 to 2**53", "taken as the previous step + 1")
        return self.last_step + 1

    def _refuse(self, name: str, value, expected: str, instead: str) -> None:
        """A bad argument of the training code's ``step()``: counted as an internal error (the
        daemon sees it in ``internal_errors``), logged the first time for each argument."""
        with self._errors_lock:
            self.errors += 1
        if name not in self._refused:
            self._refused.add(name)
            log.warning("syncwatch: step(%s=%.80r) refused, %s: expected %s (counted in "
                        "internal_errors; logged once)", name, value, instead, expected)

    def _new_attempt(self, number: int) -> None:
        """The step number went backwards: the job resumed from an earlier step in this process."""
        self._new_attempts += 1
        attempt = min(self.identity.attempt + 1, MAX_ATTEMPT - 1)  # the protocol's bound
        self.identity = dataclasses.replace(self.identity, attempt=attempt)
        self.encoder = Encoder(self.identity)
        log.info("syncwatch: step %d after %d: attempt %d", number, self.last_step,
                 self.identity.attempt)

    # ------------------------------------------------------------------ heartbeat, shutdown

    def heartbeat(self) -> None:
        """Send liveness, the current phase and the time in it (call after ``flush()``)."""
        try:
            now = time.perf_counter_ns()
            if self.in_sync():
                idx, since = SYNC, self.sync_since
            else:
                idx, since = self.phase_idx, self.phase_since
            reported = self.sender.delivered
            counts = (self.sender.dropped, self.errors)
            self.sender.send(self.encoder.heartbeat(
                time.time(), self.last_step, self.last_step_wall, _PHASE_NAMES[idx],
                max(now - since, 0) * 1e-9, self.collective_sequence, *counts, *reported), counts)
        except Exception:
            self._error()

    def _run(self, flush_seconds: float, heartbeat_seconds: float) -> None:
        """The records thread: replay and send every ``flush_seconds``, heartbeat on its own
        period (0: none). Nothing it calls blocks: sends are non-blocking, the exchange has its
        own thread, CUDA events are only queried."""
        try:
            self.clock.enter_thread()
        except Exception:
            self._error()
        beats = heartbeat_seconds > 0
        if beats:
            self.heartbeat()  # alive from the start
        interval = min(flush_seconds, heartbeat_seconds) if beats else flush_seconds
        next_beat = time.monotonic() + heartbeat_seconds
        while not self._stop.acquire(timeout=interval):
            self.flush()
            if beats and time.monotonic() >= next_beat:
                self.heartbeat()
                next_beat = time.monotonic() + heartbeat_seconds

    def shutdown(self, reason: str = "completed", timeout: float = 2.0) -> None:
        """Flush what can be flushed within ``timeout`` s, send the end record, stop threads."""
        if self.closed:
            return
        self.closed = True
        self._notes.bind()  # phases and steps from now on note nothing
        if reason not in END_REASONS:  # no end record could be encoded: the rank read as lost
            log.warning("syncwatch: shutdown(reason=%.80r) refused, sent as 'failed': expected "
                        "one of %s", reason, ", ".join(END_REASONS))
            reason = "failed"
        try:
            end = time.monotonic() + timeout
            self._stop.release()
            self._thread.join(min(timeout, 0.5))
            self.flush()
            while self._pending and time.monotonic() < end:
                time.sleep(0.005)
                self.flush()
            if self.exchange is not None:
                self.exchange.drain(max(end - time.monotonic(), 0.0))
                with self._lock:  # windows held for the first result, sized now, go too
                    fresh = bool(self.exchange.results)
                    self._take_results()
                    if self.exchange_every:
                        self._cut_windows()
                self.exchange.drain(max(end - time.monotonic(), 0.0))
                self.exchange.stop(0.1)
                with self._lock:
                    fresh = fresh or bool(self.exchange.results)
                    if fresh and self._last is not None:
                        # the last windows' results: no step record follows to carry them, so
                        # the last one goes again (the daemon takes a re-sent step's exchange
                        # totals)
                        self._take_results()
                        self._send_step()
            self.sender.send(self.encoder.end(time.time(), self.last_step, reason))
            self.sender.flush(0.5)
        except Exception:
            self._error()
        finally:
            self.sender.close()

    def _error(self, exc: BaseException | None = None, logged: bool = False) -> None:
        """Count an internal error (``exc``, or the one being handled); log the first, unless
        the caller ``logged`` it."""
        with self._errors_lock:  # the hot path's threads and the records thread all count
            self.errors += 1
            first = self.errors == 1
        if first and not logged:
            log.warning("syncwatch: internal error (counted, training continues)",
                        exc_info=exc if exc is not None else True)


_PHASE_NAMES = tuple(sorted(PHASE_INDEX, key=PHASE_INDEX.get))
