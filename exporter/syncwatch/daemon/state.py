"""Bounded in-memory state of the ranks and jobs a daemon hears from.

Per record the work is a handful of plain attribute updates under one ``threading.Lock`` (the
reader threads write, the scrape reads a snapshot). Everything costly — CV, lag-1
autocorrelation, building metric families — happens at scrape time on a snapshot, so the reader
never waits on a render for longer than the snapshot copy.

Bounds: at most ``max_ranks`` ranks (over all jobs) and ``max_jobs`` jobs; further ranks / jobs
are rejected with reason ``rank_limit`` / ``job_limit``. A rank silent for ``rank_ttl`` seconds is
removed; a rank that sent its end record stays ``job_grace`` seconds; a job without ranks stays
``job_grace`` seconds after its last record (so restarts are still counted across a short crash).

Counters are the ranks' own cumulative values: the daemon exports the latest it has seen, so a
lost datagram or a daemon restart loses nothing. Records of a step at or before the last step
record seen from the same process are duplicates or out of order and change nothing but liveness,
except the last step's record sent again by a rank's shutdown (``_resent``): it carries the skew
exchange's last results and the rank's latest drop and error counts.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from dataclasses import dataclass

from ..protocol import (PAUSES, PHASE_INDEX, REJECT_REASONS, Cumulative, EndRecord,
                        HeartbeatRecord, Identity, ProtocolError, Record, SkewHistogram,
                        StepRecord)
from .config import DaemonConfig

# Histogram buckets (upper bounds, seconds) of the per-node, per-job histograms.
# Step times: ~10 buckets a decade (steps of 20-33 %), so p50/p99 of a 1 s step read to ~10 %.
# Per node and job, never per rank, so the extra buckets do not touch the per-rank budget.
STEP_BUCKETS = (0.001, 0.0025, 0.005) + tuple(round(m * 10.0 ** e, 6) for e in range(-2, 2)
                     for m in (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8)) + (100.0, 120.0)
WAIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_CHECKPOINT = PHASE_INDEX["checkpoint"]
_PAUSES = tuple(PHASE_INDEX[name] for name in PAUSES)
# A record of a lower attempt than a rank's current process, from another process, is a late one
# of an older attempt (stale) while that current process lives. Once it has sent its end record,
# or been silent this long (three of the ranks' default 5 s heartbeats), it is a new process
# whose attempt is lower: two resumes in one process (attempts 1, 2), then a launcher restart (1).
SUPERSEDE_SECONDS = 15.0
COUNTED_HERE = frozenset({"rank_limit", "job_limit", "identity_conflict"})  # by apply() itself


class Histogram:
    """Per-bucket (non-cumulative) counts; the last slot counts values above every bound."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(le, cumulative count), ..., ("+Inf", count)]`` as prometheus_client wants it."""
        out, running = [], 0
        for bound, c in zip(self.bounds, self.counts):
            running += c
            out.append((repr(float(bound)), running))
        out.append(("+Inf", self.count))
        return out

    def copy(self) -> "Histogram":
        h = Histogram(self.bounds)
        h.counts, h.sum, h.count = list(self.counts), self.sum, self.count
        return h


class RankState:
    __slots__ = ("ident", "totals", "exact", "has_tokens", "step_seen", "window", "version",
                 "stats", "last_step", "last_step_wall", "seq", "hb_phase", "hb_elapsed",
                 "dropped", "errors", "seen", "end", "superseded")

    def __init__(self, ident: Identity, window: int, now: float):
        self.ident = ident
        self.totals: Cumulative | None = None   # latest cumulative counters (step records)
        self.exact = False
        self.has_tokens = False
        self.step_seen = -1                     # step number of the last step record applied
        self.window: deque[float] = deque(maxlen=window)
        self.version = 0                        # bumped on every window append
        self.stats: tuple[int, float | None, float | None] = (-1, None, None)  # version, cv, ac
        # the highest step seen (step records, heartbeats) and its wall-clock end: the end of
        # the step, not the latest time any record carried (one record stamped in the future, a
        # clock stepped back since, had pinned the timestamp and blinded SyncwatchJobStalled)
        self.last_step = -1
        self.last_step_wall = 0.0
        self.seq = 0
        self.hb_phase: str | None = None
        self.hb_elapsed = 0.0
        self.dropped = -1                       # highest dropped-records count this process
        self.errors = -1                        # and internal-errors count reported; -1: none yet
        self.seen = now                         # monotonic time of the last record
        # (wall time, reason) of the rank's end record: the rank ended, it was not lost
        self.end: tuple[float, str] | None = None
        # ((pid, nonce), attempt) of the process of the same attempt this one took over from: a
        # restart in place, unless that one speaks again (identity_conflict)
        self.superseded: tuple[tuple[int, int], int] | None = None


class JobState:
    __slots__ = ("ranks", "hists", "nodes", "seen", "world_size", "r0_process", "attempt", "skew",
                 "restarts", "rerun_steps", "checkpoint_seconds", "checkpoints",
                 "checkpoints_known", "max_step", "prev_max_step", "restart_pending")

    def __init__(self, now: float):
        self.ranks: dict[int, RankState] = {}
        self.hists: dict[str, tuple[Histogram, Histogram]] = {}  # node -> (step, sync wait)
        self.nodes: dict[str, int] = {}  # node -> how many of the job's current ranks are on it
        self.seen = now
        # Job-level, from global rank 0 only (r0_process, its (pid, nonce), is None until rank 0
        # is heard of).
        self.world_size = 0
        self.r0_process: tuple[int, int] | None = None
        self.attempt = 0
        self.skew: SkewHistogram | None = None
        self.restarts = 0
        self.rerun_steps = 0
        self.checkpoint_seconds = 0.0
        self.checkpoints = 0
        # whether the two are rank 0's current process's: from its step records, or 0 from its
        # start. A daemon (re)started under a running rank 0 hears a heartbeat or its end record
        # first: it exported 0 until the next step record, and Prometheus read the drop from the
        # old daemon's values as a reset and counted the process's every checkpoint again
        self.checkpoints_known = False
        self.max_step = -1          # highest step rank 0's current process completed
        self.prev_max_step = -1     # the previous process's highest step, after a process change
        # None: no process change pending; "counted": a restart (higher attempt) waiting for the new
        # attempt's first step to count re-run steps; "check": a new process of the same attempt, a
        # restart only if its first step goes backwards.
        self.restart_pending: str | None = None


@dataclass(frozen=True, slots=True)
class RankView:
    ident: Identity
    totals: Cumulative | None
    exact: bool
    has_tokens: bool
    cv: float | None
    autocorrelation: float | None
    last_step: int
    last_step_wall: float
    seq: int
    hb_phase: str | None
    hb_elapsed: float
    end: tuple[float, str] | None


@dataclass(frozen=True, slots=True)
class JobView:
    train_job: str
    ranks: list[RankView]
    hists: dict[str, tuple[Histogram, Histogram]]
    has_rank0: bool
    world_size: int
    attempt: int
    skew: SkewHistogram | None
    restarts: int
    rerun_steps: int
    checkpoint_seconds: float
    checkpoints: int
    checkpoints_known: bool


@dataclass(frozen=True, slots=True)
class Snapshot:
    jobs: list[JobView]
    records: int
    rejected: dict[str, int]
    client_dropped: int
    client_errors: int
    ranks_active: int


def _check_totals(r: RankState, rec: StepRecord) -> None:
    """A later step of the same process must not carry fewer steps than an earlier one: the
    exported counter would go down, which Prometheus reads as a reset and counts again."""
    held = r.totals
    if held is not None and rec.step > r.step_seen and rec.totals.steps < held.steps:
        ident = rec.identity
        raise ProtocolError("bad_value", f"train job {ident.train_job!r} rank {ident.rank} pid "
                                         f"{ident.pid}: steps_total went down from {held.steps} "
                                         f"to {rec.totals.steps} at step {rec.step}")


def _move_node(job: JobState, old: str | None, new: str | None) -> None:
    """Account for a rank of ``job`` leaving node ``old`` and/or arriving on node ``new``.

    The per-node histograms are kept only for nodes a current rank of the job is on: a rank's
    node label can change with every new process (in Kubernetes without NODE_NAME it is the pod
    name), and histograms kept for every node ever seen grew without bound, ~70 series each,
    whatever --max-ranks said. A job whose last rank left keeps its histograms through the grace
    period; they go when a rank on another node takes the job up again.
    """
    if old == new:
        return
    if new is not None:
        if not job.nodes:
            for stale in [n for n in job.hists if n != new]:
                del job.hists[stale]
        job.nodes[new] = job.nodes.get(new, 0) + 1
    if old is not None:
        left = job.nodes[old] - 1
        if left:
            job.nodes[old] = left
        else:
            del job.nodes[old]
            if job.nodes:
                job.hists.pop(old, None)


CV_MIN_STEPS = 4  # the CV's window never holds fewer steps than this (if the window has them)


def cv_steps(xs, seconds: float) -> int:
    """How many of the latest step times in ``xs`` the CV is over: those that add up to at most
    ``seconds`` (the steps of the last ``seconds`` of training), at least ``CV_MIN_STEPS``.

    The CV's window is bounded in time so that one stall does not page. The variance alert asks
    for its 5m CV above threshold for 10m; a CV over 100 steps held one 30 s stall for 17
    minutes at 10 s steps, and that paged as growing variance. Within 4 minutes of steps a
    single stall leaves the 5m average in under 10m, while repeated stalls keep it up. Steps
    slower than a minute keep 4 steps, longer than 4 minutes: there a stall of many step times
    can still page."""
    n, total = 0, 0.0
    for x in reversed(xs):
        total += x
        if total > seconds and n >= CV_MIN_STEPS:
            break
        n += 1
    return n


def window_stats(xs, cv_seconds: float = math.inf) -> tuple[float | None, float | None]:
    """(coefficient of variation, lag-1 autocorrelation) of step times ``xs``; None where
    undefined. The CV is over the latest ``cv_steps(xs, cv_seconds)`` of them, the
    autocorrelation over all (one stall moves it toward 0, never toward the oscillation alert's
    negative values)."""
    n = len(xs)
    if n < 2:
        return None, None
    mean = math.fsum(xs) / n
    dev = [x - mean for x in xs]
    ss = math.fsum(d * d for d in dev)
    ac = None
    if n >= 3 and ss > 0:
        ac = math.fsum(a * b for a, b in zip(dev, dev[1:])) / ss
    k = cv_steps(xs, cv_seconds)  # at least 2: min(n, CV_MIN_STEPS)
    if k < n:
        tail = xs[n - k:]
        mean = math.fsum(tail) / k
        ss = math.fsum((x - mean) ** 2 for x in tail)
    return (math.sqrt(ss / k) / mean if mean > 0 else None), ac


class State:
    def __init__(self, config: DaemonConfig, clock=time.monotonic):
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self.jobs: dict[str, JobState] = {}
        self.n_ranks = 0
        self.records = 0                                    # accepted records
        self.rejected = dict.fromkeys(REJECT_REASONS, 0)
        self.client_dropped = 0                             # sum of increases of ranks' dropped counts
        self.client_errors = 0                              # ... of their internal-error counts

    # -- ingest side -------------------------------------------------------------------------

    def reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def apply(self, rec: Record) -> None:
        """Apply one decoded record. Raises ``ProtocolError``: rank_limit, job_limit and
        identity_conflict (``COUNTED_HERE``), which it counts; bad_value (a step count that
        went down), which the caller counts, as it counts the decoder's."""
        ident = rec.identity
        now = self._clock()
        with self._lock:
            try:
                r, job = self._rank(ident, now)
            except ProtocolError as e:
                self.rejected[e.reason] += 1
                raise
            if r is not None and type(rec) is StepRecord:
                _check_totals(r, rec)
            self.records += 1
            if r is None:
                return  # a record of an older attempt than the one we follow: stale
            r.seen = job.seen = now
            if ident.rank == 0:
                self._rank0_identity(job, ident)
            if type(rec) is StepRecord:
                self._step(job, r, rec)
            elif type(rec) is HeartbeatRecord:
                self._heartbeat(r, rec)
            else:
                self._end(r, rec)
            if ident.rank == 0 and r.last_step > job.max_step and (
                    r.last_step_wall > 0 or r.last_step > 0):  # an end record's 0: no step yet
                # rank 0's highest step, as its heartbeats and end record tell it too: a daemon
                # started under a hung rank 0 hears only those, and a lost step record is no
                # step not run (the restart after them counted no or too few re-run steps, and
                # a restart in place none at all)
                job.max_step = r.last_step

    def _rank(self, ident: Identity, now: float) -> tuple[RankState | None, JobState]:
        job = self.jobs.get(ident.train_job)
        if job is None:
            if len(self.jobs) >= self.config.max_jobs:
                raise ProtocolError("job_limit", f"train job {ident.train_job!r} not tracked: "
                                                 f"already {len(self.jobs)} jobs (--max-jobs)")
            if self.n_ranks >= self.config.max_ranks:
                raise self._rank_limit(ident)
            job = self.jobs[ident.train_job] = JobState(now)
        r = job.ranks.get(ident.rank)
        if r is not None and r.ident is ident:  # the decoder caches identities: the common case
            return r, job
        if r is None:
            if self.n_ranks >= self.config.max_ranks:
                raise self._rank_limit(ident)
            self.n_ranks += 1
        elif (ident.process, ident.attempt) == r.superseded:
            # The process this one took over from speaks again: both live, the same rank of the
            # same attempt (two runs sharing a job name, or two names the sanitizer made one).
            # Taken in turn, each replaced the other's state: the counters swung between the two
            # runs' (a reset at every scrape), and each swing to the lower step was a restart.
            raise ProtocolError("identity_conflict",
                                f"train job {ident.train_job!r} rank {ident.rank} attempt "
                                f"{ident.attempt}: pid {ident.pid} on {ident.node} is still "
                                f"running, after pid {r.ident.pid} on {r.ident.node} took over as "
                                f"the same rank: two runs with one job name? The later one is kept")
        elif ident.attempt < r.ident.attempt and (
                ident.process == r.ident.process
                or not (r.end or now - r.seen > SUPERSEDE_SECONDS)):
            return None, job
        elif ident.process == r.ident.process and ident.attempt == r.ident.attempt:
            _move_node(job, r.ident.node, ident.node)
            r.ident = ident  # same process, equal identity decoded anew (cache turnover)
            return r, job
        # A new rank, or a new process / attempt for it: fresh state (counter resets are fine).
        _move_node(job, None if r is None else r.ident.node, ident.node)
        before = None if r is None else (r.ident.process, r.ident.attempt)
        r = job.ranks[ident.rank] = RankState(ident, self.config.window, now)
        r.superseded = before if before is not None and before[1] == ident.attempt else None
        return r, job

    def _rank_limit(self, ident: Identity) -> ProtocolError:
        return ProtocolError("rank_limit", f"train job {ident.train_job!r} rank {ident.rank} not "
                                           f"tracked: already {self.n_ranks} ranks (--max-ranks)")

    def _rank0_identity(self, job: JobState, ident: Identity) -> None:
        job.world_size = ident.world_size
        if job.r0_process is None:
            job.r0_process, job.attempt = ident.process, ident.attempt
            return
        if ident.process == job.r0_process and ident.attempt == job.attempt:
            return
        if ident.attempt > job.attempt:
            job.restarts += 1
            job.restart_pending = "counted"
        else:
            job.restart_pending = "check"
        if job.max_step >= 0:
            job.prev_max_step = job.max_step
        job.max_step = -1
        job.r0_process, job.attempt = ident.process, ident.attempt
        job.skew = None
        # a new process of rank 0: its counters start at 0 (exported as such, a reset)
        job.checkpoint_seconds, job.checkpoints, job.checkpoints_known = 0.0, 0, True

    def _step(self, job: JobState, r: RankState, rec: StepRecord) -> None:
        step = rec.step
        if step <= r.step_seen:
            if step == r.step_seen and rec.totals.steps == r.totals.steps:
                self._resent(job, r, rec)
            return  # duplicate or out of order: the newer record already carried these totals
        r.step_seen = step
        totals = r.totals = rec.totals
        r.exact, r.has_tokens = rec.exact, rec.has_tokens
        # a checkpoint or an evaluation is a planned pause, not jitter: a 30 s save among 0.5 s
        # steps would hold the CV near 4 for W steps, and the variance alert would page on every
        # healthy job that checkpoints or evaluates every few minutes. Nor is a process's first
        # step, its warm-up (the setup since init(), a checkpoint load, torch.compile, the first
        # collectives): a 60 s first step among 5 s steps held the CV near 1 for W steps, past
        # the alert's 10 minutes
        if totals.steps > 1:
            paused = sum(rec.phase_seconds[i] for i in _PAUSES)
            r.window.append(max(rec.step_seconds - paused, 0.0))
            r.version += 1
        if step >= r.last_step:
            r.last_step, r.last_step_wall = step, rec.wall_time
        if rec.collective_sequence > r.seq:
            r.seq = rec.collective_sequence
        self._client_counts(r, totals.dropped_records, totals.internal_errors,
                            totals.reported_dropped, totals.reported_errors)
        node = r.ident.node
        hists = job.hists.get(node)
        if hists is None:
            hists = job.hists[node] = (Histogram(STEP_BUCKETS), Histogram(WAIT_BUCKETS))
        hists[0].observe(rec.step_seconds)
        hists[1].observe(rec.wait_seconds)
        if r.ident.rank == 0:
            self._rank0_step(job, rec)

    def _resent(self, job: JobState, r: RankState, rec: StepRecord) -> None:
        """The last step's record again, from a rank's shutdown: it carries the results of the
        skew exchange's last window, which no later step record will (a plain duplicate carries
        what the state holds already; an older one, less, and changes nothing)."""
        held, t = r.totals, rec.totals
        if t.slack_seconds < held.slack_seconds or t.last_arrivals < held.last_arrivals:
            return
        r.totals, r.exact = t, rec.exact
        if r.ident.rank == 0 and rec.skew is not None and (
                job.skew is None or rec.skew.count >= job.skew.count):
            job.skew = rec.skew
        self._client_counts(r, t.dropped_records, t.internal_errors, t.reported_dropped,
                            t.reported_errors)

    def _rank0_step(self, job: JobState, rec: StepRecord) -> None:
        step = rec.step
        pending = job.restart_pending
        if pending is not None:
            prev = job.prev_max_step
            counted = pending == "counted"
            if not counted and 0 <= prev and step <= prev:
                job.restarts += 1
                counted = True
            if counted and prev >= 0:
                job.rerun_steps += max(0, prev - step + 1)
            job.restart_pending = None
        if step > job.max_step:
            job.max_step = step
        if rec.skew is not None:
            job.skew = rec.skew
        job.checkpoint_seconds = rec.totals.phase_seconds[_CHECKPOINT]
        job.checkpoints = rec.totals.checkpoints
        job.checkpoints_known = True

    def _heartbeat(self, r: RankState, rec: HeartbeatRecord) -> None:
        # in arrival order: one thread of the rank sends them, in order (by their wall times, one
        # stamped in the future had hidden every later one)
        r.hb_phase, r.hb_elapsed = rec.phase, rec.phase_elapsed
        if rec.last_step_wall_time > 0 and rec.last_step >= r.last_step:  # 0: no step yet
            r.last_step, r.last_step_wall = rec.last_step, rec.last_step_wall_time
        if rec.collective_sequence > r.seq:
            r.seq = rec.collective_sequence
        r.end = None
        self._client_counts(r, rec.dropped_records, rec.internal_errors, rec.reported_dropped,
                            rec.reported_errors)

    def _end(self, r: RankState, rec: EndRecord) -> None:
        r.end = (rec.wall_time, rec.reason)
        if rec.last_step > r.last_step:
            r.last_step = rec.last_step

    def _client_counts(self, r: RankState, dropped: int, errors: int, reported_dropped: int,
                       reported_errors: int) -> None:
        """Add what a rank's cumulative drop and error counts grew by (records may come late or
        out of order: a smaller count is an older one). The first record of a process counts
        from the counts a record delivered before it carried: this daemon's predecessor (or this
        daemon, before the rank expired) counted those."""
        if r.dropped < 0:
            r.dropped, r.errors = reported_dropped, reported_errors
        if dropped > r.dropped:
            self.client_dropped += dropped - r.dropped
            r.dropped = dropped
        if errors > r.errors:
            self.client_errors += errors - r.errors
            r.errors = errors

    # -- housekeeping and scrape side --------------------------------------------------------

    def expire(self) -> None:
        """Remove ranks silent past their TTL (ended ranks: past the grace) and empty jobs."""
        now = self._clock()
        ttl, grace = self.config.rank_ttl, self.config.job_grace
        with self._lock:
            for name in list(self.jobs):
                job = self.jobs[name]
                dead = [k for k, r in job.ranks.items()
                        if now - r.seen > (grace if r.end else ttl)]
                for k in dead:
                    _move_node(job, job.ranks.pop(k).ident.node, None)
                self.n_ranks -= len(dead)
                if not job.ranks and now - job.seen > grace:
                    del self.jobs[name]

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"ranks": self.n_ranks, "jobs": len(self.jobs), "records": self.records,
                    "rejected": sum(self.rejected.values())}

    def snapshot(self) -> Snapshot:
        """A consistent copy for one scrape. Window statistics are computed outside the lock and
        cached per rank until its window changes."""
        self.expire()
        todo: list[tuple[RankState, int, tuple[float, ...]]] = []
        raw = []
        with self._lock:
            for name, job in self.jobs.items():
                ranks = []
                for r in job.ranks.values():
                    if r.stats[0] != r.version:
                        todo.append((r, r.version, tuple(r.window)))
                    ranks.append(r)
                rows = [(r, r.ident, r.totals, r.exact, r.has_tokens, r.last_step, r.last_step_wall,
                         r.seq, r.hb_phase, r.hb_elapsed, r.end) for r in ranks]
                hists = {node: (a.copy(), b.copy()) for node, (a, b) in job.hists.items()}
                raw.append((name, rows, hists, 0 in job.ranks, job.world_size, job.attempt,
                            job.skew, job.restarts, job.rerun_steps, job.checkpoint_seconds,
                            job.checkpoints, job.checkpoints_known))
            records, rejected = self.records, dict(self.rejected)
            client = self.client_dropped, self.client_errors
            n_ranks = self.n_ranks
        for r, version, xs in todo:
            r.stats = (version, *window_stats(xs, self.config.cv_seconds))
        jobs = []
        for name, rows, hists, has0, world, attempt, skew, restarts, rerun, *ck in raw:
            views = [RankView(ident, totals, exact, tok, r.stats[1], r.stats[2], last, wall, seq,
                              phase, elapsed, end)
                     for r, ident, totals, exact, tok, last, wall, seq, phase, elapsed, end in rows]
            views.sort(key=lambda v: v.ident.rank)
            jobs.append(JobView(name, views, hists, has0, world, attempt, skew, restarts, rerun,
                                *ck))
        jobs.sort(key=lambda j: j.train_job)
        return Snapshot(jobs, records, rejected, *client, n_ranks)
