"""Drive simulated ranks through the real wire protocol and sender to real daemons.

Each simulated rank has its own ``Encoder`` and ``Sender`` (as a real rank does) aimed at its
node's daemon. What each rank sends is what ``syncwatch.instrument`` sends: one step record per
step with the step's values and the rank's cumulative counters, heartbeats every
``heartbeat_every`` seconds (phase and time in it), an end record when the run completes. The
exact skew exchange runs every ``exchange_every`` steps with ``skew.derive`` on the MIN/MAX of the
ranks' waits over the window, exactly as the real exchange does (with its windows after the first
sized by ``skew.window_size`` for ``exchange_seconds``); global rank 0 carries the
``SkewAccumulator`` histogram. As in the real monitor, a process's records say ``exact`` (and
rank 0's carry the histogram) only from its first exchange result on: before it, the daemon
exports no slack or last arrivals and the rules use their fallbacks. The exchange of the window
that a run's last step completes runs before that step's records go out, so a finished run
reports every step's slack; a crash (restart) loses the partial window, as a real crash does.

Clocks: ``fast=True`` runs on a virtual clock (no sleeping; wall times are ``start_wall`` + virtual
seconds, so a fixed ``start_wall`` makes every record deterministic) and sends in strict order: a
record that meets the Unix socket's full 11-datagram queue is retried by its sender's thread and
the driver waits for it to leave before the next record, so nothing is lost or reordered and the
daemon's state is the same on every run; a long step carries at most
``MAX_FAST_HEARTBEATS_PER_STEP`` heartbeats per rank, its last one among them. ``fast=False``
sleeps so each step takes its simulated time x ``time_scale`` and stamps records with the real
wall clock (the demo); each ``run()`` paces from its own start.

``time_scale`` (real-time mode only) stretches real time and nothing else: the durations the
records carry stay in virtual seconds (step seconds, waits, phase times, slack, skew, a
heartbeat's time in its phase; ``heartbeat_every`` and ``exchange_seconds`` are virtual seconds
too). Real time are the wall stamps, the heartbeats' spacing (``heartbeat_every`` x
``time_scale`` real seconds) and the simulated hardware (``sim.hardware``: energy, busy time,
counter rates). A rank's ``rate(syncwatch_step_seconds_total)`` reads 1 / ``time_scale``.
"""

from __future__ import annotations

import collections
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..daemon.config import DaemonConfig
from ..daemon.state import cv_steps
from ..protocol import MAX_GPU, MAX_WORLD, PHASES, Cumulative, Encoder, Identity
from ..sender import Sender
from ..skew import EXCHANGE_SECONDS, SkewAccumulator, derive, window_size
from .model import (I_CKPT, I_EVAL, I_SYNC, Model, Params, Restart, StepTruth, is_whole,
                    lag1_autocorrelation, step_cv)

N_PHASES = len(PHASES)
# a simulated rank reports its local rank as its GPU index, which the protocol bounds
MAX_RANKS_PER_NODE = MAX_GPU
# Fast mode sends at most this many heartbeats per rank and step, spread over it. The daemon keeps
# a heartbeat's phase and time in it until the next record, the highest step and collective
# sequence, and no time of it: the step's last heartbeat sets what the others would have. One
# every ``heartbeat_every`` seconds of a step of 5e5 s sent 100000 per rank and step, for minutes.
MAX_FAST_HEARTBEATS_PER_STEP = 20


def node_name(prefix: str, n: int) -> str:
    return f"{prefix}{n:02d}"


def gpu_uuid(node: str, local: int) -> str:
    """The uuid a simulated rank reports: one GPU per local rank, unique per simulated node."""
    return f"GPU-{node}-{local}"


@dataclass
class GroundTruth:
    """What really happened, and what the ranks reported, for tests and the demo's summary."""
    params: Params
    job: str
    steps: list[StepTruth] = field(default_factory=list)      # every executed step (keep_steps)
    restarts: list[Restart] = field(default_factory=list)
    recent_step_seconds: collections.deque = field(default_factory=lambda: collections.deque(maxlen=1000))
    recent_last_arrival: collections.deque = field(default_factory=lambda: collections.deque(maxlen=1000))
    recent_skew: collections.deque = field(default_factory=lambda: collections.deque(maxlen=1000))
    # what the daemons' per-rank windows hold: this attempt's step times after its processes'
    # first step (their warm-up), each less its checkpoint and eval time (planned pauses, not
    # jitter)
    window_step_seconds: collections.deque = field(default_factory=lambda: collections.deque(maxlen=1000))
    slack_seconds: list[float] = field(default_factory=list)   # per rank, all steps (model truth)
    last_arrivals: list[int] = field(default_factory=list)     # per rank, all steps (model truth)
    reported: list[Cumulative] = field(default_factory=list)   # per rank: totals in its last record
    skew_histogram: SkewAccumulator = field(default_factory=SkewAccumulator)  # rank 0's, this attempt
    executed_steps: int = 0
    congested_steps: int = 0     # executed steps inside a fabric congestion episode
    last_step: int = 0
    attempt: int = 0
    virtual_seconds: float = 0.0
    records_sent: int = 0        # datagrams handed to the senders (steps, heartbeats, ends)
    step_records: int = 0
    heartbeat_records: int = 0
    end_records: int = 0
    dropped: int = 0             # records the senders dropped, all attempts (0 in fast mode)

    def cv(self, window: int = 100, seconds: float = DaemonConfig.cv_seconds) -> float:
        """Step-time CV over those of the last ``window`` steps that took ``seconds`` together
        (what a daemon's ``syncwatch_step_cv`` shows: its --window, --cv-seconds)."""
        xs = list(self.window_step_seconds)[-window:]
        return step_cv(xs[len(xs) - cv_steps(xs, seconds):])

    def autocorrelation(self, window: int = 100) -> float:
        """Lag-1 autocorrelation, as ``cv`` (a daemon's ``syncwatch_step_autocorrelation``)."""
        return lag1_autocorrelation(list(self.window_step_seconds)[-window:])

    @property
    def rerun_steps(self) -> int:
        return sum(r.rerun_steps for r in self.restarts)

    def top_straggler(self, last: int = 0) -> tuple[int, int]:
        """(rank, last arrivals) of the rank that arrived last most often: over the last ``last``
        steps (at most 1000) when given, else over the whole run."""
        if last:
            counts = [0] * self.params.world_size
            for r in list(self.recent_last_arrival)[-last:]:
                counts[r] += 1
        else:
            counts = self.last_arrivals
        rank = max(range(len(counts)), key=counts.__getitem__)
        return rank, counts[rank]


class _Rank:
    """One simulated training process: identity, encoder, sender and its cumulative counters."""

    def __init__(self, identity: Identity, target: dict, retry_seconds: float):
        self.identity = identity
        self.encoder = Encoder(identity)
        self.sender = Sender(path=target.get("socket"), udp=target.get("udp"),
                             retry_seconds=retry_seconds, retry_queue=4096) if target else None
        self.steps = 0
        self.step_seconds = 0.0
        self.phase_seconds = [0.0] * N_PHASES
        self.slack = 0.0
        self.last_arrivals = 0
        self.samples = 0.0
        self.checkpoints = 0
        self.seq = 0
        self.last_step = 0
        self.last_step_wall = 0.0
        self.window: list[float] = []

    def counts(self) -> tuple[int, int, int, int]:
        """(dropped, internal errors, and those of the last record delivered) for a record."""
        if self.sender is None:
            return 0, 0, 0, 0
        return self.sender.dropped, 0, *self.sender.delivered

    def totals(self) -> Cumulative:
        return Cumulative(self.steps, self.step_seconds, tuple(self.phase_seconds), self.slack,
                          self.last_arrivals, self.samples, 0.0, self.checkpoints, *self.counts())

    def send(self, data: bytes, in_order_within: float = 0.0,
             counts: tuple[int, int] | None = None) -> None:
        """Send; with ``in_order_within`` > 0 (fast mode) also wait up to that long for a record
        that met a full socket queue to leave, so the node's records reach the daemon in exactly
        the order they were produced (a deterministic daemon state, down to float sums).
        ``counts``: the (dropped, internal errors) the record carries."""
        if self.sender is None:
            return
        self.sender.send(data, counts)
        if in_order_within and self.sender.pending():
            deadline = time.monotonic() + in_order_within
            while self.sender.pending() and time.monotonic() < deadline:
                time.sleep(0.0002)


class Driver:
    """Runs a ``Model`` and sends what its ranks would send.

    ``targets``: one dict per node, ``{"socket": path}`` or ``{"udp": "127.0.0.1:PORT"}``, saying
    where that node's ranks send; ``None`` runs the model without sending anything.
    ``time_scale``: real-time mode's real seconds per virtual second; the records' durations stay
    virtual seconds, their wall stamps are real (the module's docstring).
    """

    def __init__(self, params: Params, seed: int = 0, *, targets: list[dict] | None = None,
                 job: str = "sim", fast: bool = True, time_scale: float = 1.0,
                 exchange_every: int = 50, exchange_seconds: float = EXCHANGE_SECONDS,
                 heartbeat_every: float = 5.0,
                 start_wall: float | None = None, keep_steps: bool = True, send_end: bool = True,
                 node_prefix: str = "sim-node-", retry_seconds: float = 30.0):
        if targets is not None and len(targets) != params.nodes:
            raise ValueError(f"{len(targets)} targets for {params.nodes} nodes")
        if params.ranks_per_node > MAX_RANKS_PER_NODE or params.world_size > MAX_WORLD:
            raise ValueError(f"{params.nodes} nodes x {params.ranks_per_node} ranks: the protocol "
                             f"identifies at most {MAX_RANKS_PER_NODE} ranks per node (one GPU "
                             f"index each) and {MAX_WORLD} in all")
        # NaN passes a "<= 0" check: a NaN time_scale ran unpaced (no sleep), a NaN
        # heartbeat_every sent no heartbeat, an infinite time_scale died mid-run (OverflowError)
        # and a fractional exchange_every never filled a window
        if not (is_whole(exchange_every) and exchange_every >= 0):
            raise ValueError(f"exchange_every must be a whole number of steps >= 0, not {exchange_every!r}")
        if not heartbeat_every > 0:
            raise ValueError(f"heartbeat_every must be > 0, not {heartbeat_every}")
        if not 0 < time_scale < math.inf:
            raise ValueError(f"time_scale must be positive and finite, not {time_scale}")
        self.p = params
        self.model = Model(params, seed)
        self.targets = targets
        self.job = job
        self.fast = fast
        self.time_scale = time_scale
        self.exchange_every = exchange_every
        self.exchange_seconds = exchange_seconds
        self.K = exchange_every  # the next window's size, set again by each attempt's first
        self._sized = False
        self._exact = False      # this attempt's first exchange is done
        self.heartbeat_every = heartbeat_every
        self.start_wall = time.time() if start_wall is None else start_wall
        self.keep_steps = keep_steps
        self.send_end = send_end
        self.node_prefix = node_prefix
        self.retry_seconds = retry_seconds
        self._in_order = retry_seconds if fast else 0.0
        W = params.world_size
        self.truth = GroundTruth(params, job, slack_seconds=[0.0] * W, last_arrivals=[0] * W)
        self._window_steps: list[StepTruth] = []
        self._next_heartbeat = heartbeat_every
        self._t0 = time.monotonic()  # when virtual time 0 was, in real time: set by each run()
        self.stepping = False
        """A step is under way (real time: the driver waits for its end); False before the run,
        in a restart's downtime and once the run is over: the simulated GPUs' busy time."""
        self.after_step: list[Callable[[], None]] = []
        """Callables run in the driver's thread after each step's records went out (no arguments):
        what must move in lockstep with the records, such as the simulated hardware."""
        self.ranks: list[_Rank] = []
        self._spawn(attempt=0)

    # -- processes -------------------------------------------------------------------------

    def _spawn(self, attempt: int) -> None:
        """Start the attempt's processes: fresh identities (new pids), counters and senders."""
        for r in self.ranks:
            if r.sender is not None:
                r.sender.close()
                self.truth.dropped += r.sender.dropped
        p = self.p
        self.ranks = []
        for g in range(p.world_size):
            n, local = divmod(g, p.ranks_per_node)
            ident = Identity(train_job=self.job, attempt=attempt, rank=g, local_rank=local,
                             world_size=p.world_size, node=node_name(self.node_prefix, n),
                             pid=100_000 + attempt * 65_536 + g, gpu=local,
                             gpu_uuid=gpu_uuid(node_name(self.node_prefix, n), local))
            target = self.targets[n] if self.targets is not None else None
            self.ranks.append(_Rank(ident, target, self.retry_seconds))
        self._window_steps = []
        self.K, self._sized = self.exchange_every, False  # new processes: K, then sized again
        self._exact = False
        self.truth.skew_histogram = SkewAccumulator()
        self.truth.window_step_seconds.clear()  # a new process: the daemons start a new window
        self._process_steps = 0
        self.truth.reported = [r.totals() for r in self.ranks]
        self.truth.attempt = attempt

    # -- clocks ----------------------------------------------------------------------------

    def _wall(self, virtual: float) -> float:
        return self.start_wall + virtual if self.fast else time.time()

    def _wait_until(self, virtual: float, stop: threading.Event | None) -> bool:
        """Real-time mode: sleep until virtual time ``virtual``. False if stopped."""
        if self.fast:
            return not (stop is not None and stop.is_set())
        delay = self._t0 + virtual * self.time_scale - time.monotonic()
        if stop is None:
            if delay > 0:
                time.sleep(delay)
            return True
        return not stop.wait(max(0.0, delay))

    # -- the run ---------------------------------------------------------------------------

    def run(self, steps: int = 0, stop: threading.Event | None = None) -> GroundTruth:
        """Execute ``steps`` steps (re-runs included; 0 = until ``stop`` is set) and return the truth."""
        if not is_whole(steps):  # run(2.5) ran 3 steps, run(True) one
            raise ValueError(f"steps must be a whole number, not {steps!r}")
        if steps <= 0 and stop is None:
            raise ValueError("give a step count or a stop event")
        done = 0
        completed = False
        if not self.fast:
            # pace from now, on the virtual time the model has reached: from the driver's
            # construction, a pause before run() (or between two runs) was virtual time to catch
            # up, its steps sent without sleeping
            self._t0 = time.monotonic() - self.model.time * self.time_scale
        try:
            while steps <= 0 or done < steps:
                event = self.model.next()
                if isinstance(event, Restart):
                    self.stepping = False       # the job is down until the new attempt's step
                    self.truth.restarts.append(event)
                    for r in self.ranks:        # the processes die: their senders go with them
                        if r.sender is not None:
                            r.sender.flush(self.retry_seconds if self.fast else 1.0)
                    self._spawn(event.attempt)
                    self._next_heartbeat = max(self._next_heartbeat, event.start)
                    if not self._wait_until(event.start, stop):
                        break
                    continue
                self.stepping = True
                if not self._heartbeats_during(event, stop):
                    break
                if not self._wait_until(event.start + event.step_seconds, stop):
                    break
                done += 1
                self._step(event, last=steps > 0 and done == steps)
                for fn in self.after_step:
                    fn()
            else:
                completed = True
        finally:
            self.stepping = False
            self._finish(completed)
        return self.truth

    def _heartbeats_during(self, s: StepTruth, stop) -> bool:
        end = s.start + s.step_seconds
        if self.fast and self._next_heartbeat < end:
            first, every = self._next_heartbeat, self.heartbeat_every
            due = math.ceil((end - first) / every)  # first + j every for j < due: before the end
            while due > 1 and first + (due - 1) * every >= end:
                due -= 1
            while first + due * every < end:
                due += 1
            if due > MAX_FAST_HEARTBEATS_PER_STEP:  # every stride-th, the step's last one kept
                stride = -(-due // MAX_FAST_HEARTBEATS_PER_STEP)
                for j in range((due - 1) % stride, due, stride):
                    self._heartbeat(s, first + j * every)
                self._next_heartbeat = first + due * every
                return not (stop is not None and stop.is_set())
        while self._next_heartbeat < end:
            t = self._next_heartbeat
            if not self._wait_until(t, stop):
                return False
            self._heartbeat(s, t)
            self._next_heartbeat += self.heartbeat_every
        return True

    def _heartbeat(self, s: StepTruth, t: float) -> None:
        offset = t - s.start
        wall = self._wall(t)
        for i, r in enumerate(self.ranks):
            phase, elapsed = _phase_at(s.phases[i], offset)
            counts = r.counts()
            # a rank in ``sync`` has entered this step's collective: the monitor counts a
            # collective when it is entered, so that a rank stuck before it reads as behind
            seq = r.seq + 1 if phase == "sync" else r.seq
            r.send(r.encoder.heartbeat(wall, r.last_step, r.last_step_wall, phase, elapsed, seq,
                                       *counts), self._in_order, counts[:2])
        self.truth.heartbeat_records += len(self.ranks)
        self.truth.records_sent += len(self.ranks)

    def _step(self, s: StepTruth, last: bool) -> None:
        truth = self.truth
        p = self.p
        end = s.start + s.step_seconds
        wall = self._wall(end)
        idle = s.idle  # waits and own pauses: what the exchange compares
        lo = min(idle)
        # a checkpoint step counts one whatever its duration (checkpoint_seconds may be 0), as
        # the monitor counts every checkpoint phase: the model resumes restarts from them
        checkpoint = bool(p.checkpoint_every) and s.step % p.checkpoint_every == 0
        for i, r in enumerate(self.ranks):
            ph = s.phases[i]
            r.steps += 1
            r.step_seconds += s.step_seconds
            for k in range(N_PHASES):
                r.phase_seconds[k] += ph[k]
            r.samples += p.samples_per_step
            r.checkpoints += checkpoint and (i == 0 or not p.rank0_pauses)
            r.seq += 1
            r.last_step = s.step
            r.last_step_wall = wall
        # the model's truth, whether processes run or not (none after a run: a driver that runs
        # again, as the hardware tests step one, still keeps every step's truth)
        for i, w in enumerate(idle):
            truth.slack_seconds[i] += w - lo
            if w <= lo:
                truth.last_arrivals[i] += 1
        if self.K:
            self._window_steps.append(s)
            if len(self._window_steps) == self.K or last:
                self._exchange()
        # as the real monitor: not exact, and no skew histogram, until the first result is back
        exact = self._exact
        skew = truth.skew_histogram.snapshot() if exact else None
        for i, r in enumerate(self.ranks):
            totals = r.totals()
            truth.reported[i] = totals
            r.send(r.encoder.step(s.step, wall, s.step_seconds, s.waits[i], s.phases[i], r.seq,
                                  p.samples_per_step, 0.0, totals, exact=exact,
                                  skew=skew if i == 0 else None), self._in_order,
                   (totals.dropped_records, totals.internal_errors))
        n = len(self.ranks)
        truth.step_records += n
        truth.records_sent += n
        truth.executed_steps += 1
        truth.congested_steps += s.congested
        truth.last_step = s.step
        truth.virtual_seconds = end
        truth.recent_step_seconds.append(s.step_seconds)
        self._process_steps += 1
        if self._process_steps > 1:
            paused = s.phases[0][I_CKPT] + s.phases[0][I_EVAL]
            truth.window_step_seconds.append(max(s.step_seconds - paused, 0.0))
        truth.recent_last_arrival.append(s.last_arrivals[0])
        truth.recent_skew.append(s.skew)
        if self.keep_steps:
            truth.steps.append(s)

    def _exchange(self) -> None:
        """The MIN/MAX all-reduce of the window's idle times (waits and own pauses), then
        ``derive`` on every rank."""
        window = self._window_steps
        idle = [s.idle for s in window]
        mins = [min(x) for x in idle]
        maxs = [max(x) for x in idle]
        for i, r in enumerate(self.ranks):
            res = derive([x[i] for x in idle], mins, maxs)
            r.slack += res.slack_seconds
            r.last_arrivals += res.last_arrivals
            if i == 0:
                for k in res.skews:
                    self.truth.skew_histogram.observe(k)
        self._window_steps = []
        self._exact = True
        if not self._sized:
            self._sized = True
            self.K = window_size(statistics.median(s.step_seconds for s in window),
                                 self.exchange_every, self.exchange_seconds)

    def _finish(self, completed: bool) -> None:
        t = self.truth
        wall = self._wall(t.virtual_seconds)
        for r in self.ranks:
            if completed and self.send_end:
                r.send(r.encoder.end(wall, r.last_step, "completed"), self._in_order)
                t.end_records += 1
                t.records_sent += 1
        for r in self.ranks:
            if r.sender is not None:
                r.sender.flush(self.retry_seconds if self.fast else 1.0)
        for r in self.ranks:
            if r.sender is not None:
                r.sender.close()
                t.dropped += r.sender.dropped
        self.ranks = []


def _phase_at(phases: tuple[float, ...], offset: float) -> tuple[str, float]:
    """The phase a rank is in ``offset`` seconds into its step, and the time spent in it so far.

    Phases run in the order data, forward, backward, optimizer, checkpoint, eval, then sync.
    """
    order = (0, 1, 2, 3, I_CKPT, I_EVAL, I_SYNC)
    t = 0.0
    for k in order:
        if offset < t + phases[k]:
            return PHASES[k], offset - t
        t += phases[k]
    return "sync", max(0.0, offset - (t - phases[I_SYNC]))
