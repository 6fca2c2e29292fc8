"""``JobView``: one train job over a time range, cut into windows — what every command analyses.

Two producers fill the same structure:

* ``from_prometheus``: range queries against Prometheus' HTTP API (per-rank counter increases per
  window, the job's gauges and counters, node hardware joined to nodes through ``instance``);
* ``from_run``: a recorded simulator run (``recording``), where the same numbers are summed
  exactly from per-step truth.

Per window and rank it holds steps, step seconds, sync seconds, slack seconds, last arrivals and
samples; per window the job's step CV, lag-1 autocorrelation, restarts and re-run steps; per window
and node the hardware series present (temperature, thermal throttling, fabric congestion, bytes).

A job without the exact skew exchange (K = 0) exports no slack or last arrivals. Its view then
reads estimates of both from each rank's mean wait per window (``estimate_from_waits``), as the
rules do per minute (docs/rules.md, "Without the skew exchange"); ``has_exact()`` tells which.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property

from ..protocol import PAUSES
from ..rules.thresholds import THRESHOLDS
from .common import AnalysisError
from .prom import Prometheus, label, quote

COUNTERS = {  # view field -> (metric, extra selector)
    "steps": ("syncwatch_steps_total", ""),
    "step_seconds": ("syncwatch_step_seconds_total", ""),
    "sync_seconds": ("syncwatch_phase_seconds_total", ',phase="sync"'),
    # a rank's own planned pauses: without the exchange, counted with its waits, as the exchange does
    "pause_seconds": ("syncwatch_phase_seconds_total", f',phase=~"{"|".join(PAUSES)}"'),
    "slack_seconds": ("syncwatch_slack_seconds_total", ""),
    "last_arrivals": ("syncwatch_last_arrivals_total", ""),
    "samples": ("syncwatch_samples_total", ""),
}

# the throttling read as thermal: the thermal reasons, and hw_slowdown (NVML raises it for a high
# temperature, among other causes)
THERMAL_THROTTLE = 'syncwatch_gpu_throttle_active{reason=~".*thermal.*|hw_slowdown"}'
# hardware series per node: name -> (PromQL over one window of W seconds, aggregated by instance)
HARDWARE = {
    "gpu_temperature_celsius": "max by (instance) (syncwatch_gpu_temperature_celsius)",
    "gpu_thermal_throttle": f"max by (instance) ({THERMAL_THROTTLE})",
    "gpu_sm_clock_hertz": "min by (instance) (syncwatch_gpu_sm_clock_hertz)",
    "ib_xmit_wait_rate": "sum by (instance) (rate(syncwatch_ib_port_xmit_wait_total[{w}s]))",
    "roce_congestion_rate": "sum by (instance) (rate(syncwatch_roce_cnp_handled_total[{w}s]) "
                            "+ rate(syncwatch_roce_ecn_marked_total[{w}s]))",
    "net_bytes_rate": "sum by (instance) (rate(syncwatch_nic_transmit_bytes_total[{w}s]))",
    "ib_bytes_rate": "sum by (instance) (rate(syncwatch_ib_port_data_bytes_total[{w}s]))",
}
CONGESTION_SERIES = ("ib_xmit_wait_rate", "roce_congestion_rate")
BYTES_SERIES = ("ib_bytes_rate", "net_bytes_rate")
MAX_WINDOWS = 60
# the shortest range asked of Prometheus: its range selectors here count whole seconds, and one
# under half a second read [0s], which Prometheus answered with HTTP 400 ("duration must be
# greater than 0"); a range that short holds no two scrapes anyway
MIN_RANGE = 1.0
# increase() needs two samples in a window: a window shorter than two scrape intervals holds one
# in most places and reads as no steps there. Two and a half keep two whatever the scrape jitter.
SCRAPES_PER_WINDOW = 2.5
# the exchange's slack lands once per K steps, for the K steps before it: a window lacks up to one
# period's slack and holds up to one period's of the steps before it. Over one period its
# collective time ((sync - slack) / steps) swung 35-67 ms about a true 45 ms (a straggler job read
# as fabric contention); over four, the error is a quarter of that
EXCHANGES_PER_WINDOW = 4
# a window's lag-1 autocorrelation of step time counts where it rests on this many steps: the
# daemons export it from 3 (their window after a process's start or restart), where noise alone
# reads -0.5 or below in 22 % of 4-step windows, 7 % of 10, 1.3 % of 20, 0.2 % of 30 (white
# noise; the healthy simulator's steps alike) and a 4-step range after a restart read oscillation
AUTOCORRELATION_MIN_STEPS = 20
# windows the job ran through that the per-window reads need: diagnose's fabric contention (and
# topology mismatch, two per half) and project's congestion episodes. A range far longer than the
# job (--start now-24h for a 45-minute job), or a job a minute old, holds one or two.
FEW_WINDOWS = 4
WARNINGS_SHOWN = 3  # a partial answer from many stores warns once per store: the first few say enough


@dataclass
class JobView:
    job: str
    source: str
    start: float
    end: float
    window: float
    times: list[float]                                   # end of each window
    rank_node: dict[int, str]
    per_rank: dict[str, dict[int, list[float]]]          # COUNTERS field -> rank -> per window
    cv: list[float | None]
    autocorrelation: list[float | None]
    restarts: list[float | None]                         # cumulative, per window
    rerun_steps: list[float | None]
    hardware: dict[str, dict[str, list[float | None]]] = field(default_factory=dict)
    samples_per_rank_step: float | None = None
    checkpoints: float | None = None                     # checkpoints written in the range
    # what one checkpoint cost the job, mean over the range: global rank 0's checkpoint time per
    # checkpoint (syncwatch_checkpoint_seconds_total / syncwatch_checkpoints_total). Not the
    # checkpoint phase summed over all ranks and divided by their count: where only rank 0 saves
    # (torch's DDP tutorial), that divided its save by the rank count, and Young's interval with it
    checkpoint_cost: float | None = None
    restarts_at_start: float | None = None               # the two counters at the range start
    rerun_steps_at_start: float | None = None            # (None: unknown)
    restarts_from_attempts: float | None = None          # attempts begun in range, across daemons
    rerun_steps_from_steps: float | None = None          # executed steps less step-number progress
    exchanged_steps: list[float | None] | None = None    # per window, the steps whose slack landed
    # the answers' warnings, distinct: a backend that answered in part (Thanos, Mimir: a store or
    # querier that did not answer) still answers "success", and the figures miss its series
    warnings: list[str] = field(default_factory=list)

    def warnings_note(self) -> str | None:
        """What every command notes where the answers came with warnings (None: none came)."""
        if not self.warnings:
            return None
        shown = "; ".join(self.warnings[:WARNINGS_SHOWN])
        more = len(self.warnings) - WARNINGS_SHOWN
        return (f"Prometheus at {self.source} answered with warnings, so the figures may rest on partial data "
                f"(some series missing): {shown}" + (f" (and {more} more)" if more > 0 else ""))

    # ---- job-level sums
    @property
    def ranks(self) -> list[int]:
        return sorted(self.rank_node)

    @property
    def nodes(self) -> list[str]:
        return sorted(set(self.rank_node.values()))

    def rows(self, name: str) -> dict[int, list[float | None]]:
        """Rank -> per-window values of ``name``; slack and last arrivals estimated without the exchange."""
        estimates = self._estimates
        return estimates[name] if estimates is not None and name in estimates else self.per_rank[name]

    @cached_property
    def _estimates(self) -> dict[str, dict[int, list[float | None]]] | None:
        """None with the exchange's results in range; else ``estimate_from_waits`` (computed once)."""
        exact = any(x is not None and math.isfinite(x) and x > 0
                    for row in self.per_rank["last_arrivals"].values() for x in row)
        return None if exact else estimate_from_waits(self)

    def total(self, name: str, rank: int | None = None) -> float:
        rows = [self.rows(name).get(rank, [])] if rank is not None else self.rows(name).values()
        return sum(v for row in rows for v in row if v is not None and math.isfinite(v))

    @property
    def running_seconds(self) -> float:
        """From the start of the first window with a step to the end of the last one: the part of
        the range the job ran (its restarts' downtime included), not the time around it."""
        active = [i for i, n in enumerate(self.window_sum("steps")) if n > 0]
        if not active:
            return self.end - self.start
        return self.times[active[-1]] - max(self.start, self.times[active[0]] - self.window)

    def window_sum(self, name: str) -> list[float]:
        out = [0.0] * len(self.times)
        for row in self.rows(name).values():
            for i, v in enumerate(row):
                if v is not None and math.isfinite(v):
                    out[i] += v
        return out

    def ratio_series(self, num: str, den: str) -> list[float | None]:
        a, b = self.window_sum(num), self.window_sum(den)
        return [x / y if y > 0 else None for x, y in zip(a, b)]

    def mean_step_series(self) -> list[float | None]:
        return self.ratio_series("step_seconds", "steps")

    def sync_tax_series(self) -> list[float | None]:
        return self.ratio_series("sync_seconds", "step_seconds")

    def coupling_series(self) -> list[float | None]:
        return self.ratio_series("slack_seconds", "step_seconds")

    def collective_series(self) -> list[float | None]:
        """Mean collective time per step: the wait not explained by slack (= the smallest wait;
        without the exchange, the smallest mean wait of the window).

        Slack lands once per skew exchange (every K steps) while the waits land every step, so a
        window holds the slack of a few steps before it and lacks that of its last few. Over a
        window the job ran through, that evens out; one it ran through only in part (the range's
        edges, a restart) can hold more lagged slack than its own waits, and its difference means
        nothing. Windows with less than half the median step time read None — a slow window still
        fills its time with steps, so episodes of a slower collective are kept.

        Where the exchanged steps are known (Prometheus: rank 0's skew histogram count), each
        rank's slack counts per exchanged step, times its steps in the window: a window holds a
        whole number of landings, and a straggler's slack, many times the collective, swung the
        difference by up to a landing's slack over the window's steps (a 1 ms collective beside
        32 ms of slack read 0.3-2.2 ms in 20 s windows of 8 or 9 landings).
        """
        sync, slack, steps, busy = (self.window_sum(n) for n in
                                    ("sync_seconds", "slack_seconds", "steps", "step_seconds"))
        if self.exchanged_steps is not None and self.has_exact():
            rank_steps = self.per_rank["steps"]
            for i, exchanged in enumerate(self.exchanged_steps):
                if exchanged:
                    slack[i] = sum(row[i] * (rank_steps[r][i] or 0.0) / exchanged
                                   for r, row in self.per_rank["slack_seconds"].items()
                                   if row[i] is not None and r in rank_steps)
        least = statistics.median([b for b in busy if b > 0] or [0.0]) / 2
        return [(a - b) / s if s > 0 and t >= least else None
                for a, b, s, t in zip(sync, slack, steps, busy)]

    def has_exact(self) -> bool:
        """Whether slack and last arrivals are the exchange's counts, not estimates from mean waits."""
        return self._estimates is None

    def node_last_arrivals(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {n: [0.0] * len(self.times) for n in self.nodes}
        for rank, row in self.rows("last_arrivals").items():
            node = self.rank_node.get(rank)
            if node is None:
                continue
            for i, v in enumerate(row):
                if v is not None and math.isfinite(v):
                    out[node][i] += v
        return out

    def restarts_in_range(self) -> tuple[float, float]:
        """(restarts, re-run steps) between the range start and its end.

        The daemons' counters count from their values at the range start, not at the end of the
        first window: a restart inside the first window is one of the range's. A counter that
        falls was reset (the rank-0 daemon restarted) and counts from zero again, as ``increase()``.
        A daemon counts only the restarts it sees rank 0 make, none that moved rank 0 to another
        node, so the attempts begun in range across daemons count too, the larger of the two.
        Where the attempts show restarts the counters missed, the re-run steps are the larger of
        the counters' and the executed steps less the progress of the step numbers (which counts
        every restart's, whatever daemons saw it, to a scrape interval of steps per series
        boundary); elsewhere the counters' exact count stands.
        """
        counted = _increase(self.restarts_at_start, self.restarts)
        rerun = _increase(self.rerun_steps_at_start, self.rerun_steps)
        restarts = max(counted, self.restarts_from_attempts or 0.0)
        if restarts > counted and self.rerun_steps_from_steps is not None:
            rerun = max(rerun, self.rerun_steps_from_steps)
        return restarts, rerun

    def steps_per_window(self) -> list[float]:
        """Job steps per window (the mean over ranks of each rank's steps)."""
        n = max(1, len(self.rank_node))
        return [s / n for s in self.window_sum("steps")]


def estimate_from_waits(v: JobView) -> dict[str, dict[int, list[float | None]]]:
    """Slack and last arrivals per rank and window, estimated from the ranks' mean waits.

    Every rank is released from the collective together, so a difference of mean waits over a
    window is a difference of mean arrival times. With w̄ᵢ rank i's mean wait ((sync + its own
    checkpoint and eval seconds) / steps, as the exchange counts a wait, and the rules' estimate:
    rank 0 saving alone while its peers wait for it in the collective is no late arrival) in the
    window: its slack is (w̄ᵢ − minⱼ w̄ⱼ) × its steps; the window's steps count as
    last arrivals of the rank with the smallest mean wait, shared equally with every rank within
    ``last_arrival_tie`` of the mean step of it (the rules' estimate, per window instead of per
    minute). A persistent straggler is estimated well; jitter whose last rank changes from step
    to step averages out, so both are lower bounds. A window with fewer than two ranks reporting
    has no estimate (None).
    """
    tie = THRESHOLDS.last_arrival_tie
    slack: dict[int, list[float | None]] = {r: [None] * len(v.times) for r in v.per_rank["steps"]}
    last: dict[int, list[float | None]] = {r: [None] * len(v.times) for r in v.per_rank["steps"]}
    for i in range(len(v.times)):
        steps, step_s, waits = {}, 0.0, {}
        for r, row in v.per_rank["steps"].items():
            n = row[i]
            sync = v.per_rank["sync_seconds"].get(r, [None] * len(v.times))[i]
            busy = v.per_rank["step_seconds"].get(r, [None] * len(v.times))[i]
            paused = v.per_rank.get("pause_seconds", {}).get(r, [None] * len(v.times))[i] or 0.0
            if n and n > 0 and sync is not None and busy is not None:
                steps[r], waits[r] = n, (sync + paused) / n
                step_s += busy
        if len(waits) < 2:
            continue
        least = min(waits.values())
        mean_step = step_s / sum(steps.values())
        tied = [r for r, w in waits.items() if w - least <= tie * mean_step]
        job_steps = sum(steps.values()) / len(steps)
        for r, w in waits.items():
            slack[r][i] = (w - least) * steps[r]
            last[r][i] = job_steps / len(tied) if r in tied else 0.0
    return {"slack_seconds": slack, "last_arrivals": last}


# ---------------------------------------------------------------- time range

_REL = re.compile(r"now(?:\s*-\s*(\d+(?:\.\d+)?)\s*([smhd]))?")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_time(text: str, now: float | None = None) -> float:
    """``now``, ``now-2h``, unix seconds, or RFC 3339 (``2024-05-01T12:00:00Z``)."""
    now = time.time() if now is None else now
    t = str(text).strip()
    m = _REL.fullmatch(t)
    if m:
        return now - (float(m.group(1)) * _UNITS[m.group(2)] if m.group(1) else 0.0)
    try:
        seconds = float(t)
    except ValueError:
        pass
    else:
        if math.isfinite(seconds):
            return seconds
    try:
        return datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise AnalysisError(f"cannot read time {text!r} (now, now-2h, unix seconds or RFC 3339)") from None


def windows(start: float, end: float, min_window: float) -> tuple[float, list[float]]:
    """(window seconds, window end times): at most ``MAX_WINDOWS`` windows of at least ``min_window``."""
    if end <= start:
        raise AnalysisError(f"empty time range: --end {fmt_time(end)} is not after --start {fmt_time(start)}")
    width = max(min_window, (end - start) / MAX_WINDOWS)
    n = max(1, int((end - start) // width))
    width = (end - start) / n
    return width, [start + width * (i + 1) for i in range(n)]


# ---------------------------------------------------------------- from Prometheus

def from_prometheus(prom: Prometheus, job: str, start: float, end: float,
                    min_window: float = 15.0) -> JobView:
    windows(start, end, min_window)  # an empty range is refused before asking anything
    span = end - start
    if span < MIN_RANGE:
        raise AnalysisError(f"time range too short: {span:.3g} s between --start and --end; give at least "
                            f"{MIN_RANGE:g} s, and a few scrape intervals for a reading (a counter's increase "
                            "needs two scrapes in range)")
    sel = f"train_job={quote(job)}"
    info = prom.query(f"max by (rank, node, instance) (max_over_time(syncwatch_rank_info{{{sel}}}[{span:.0f}s]))", end)
    if not info:
        known = prom.query(f"group by (train_job) (max_over_time(syncwatch_rank_info[{span:.0f}s]))", end)
        names = sorted(filter(None, (label(k, "train_job") for k in known)))
        hint = f"; train jobs in range: {', '.join(names)}" if names else "; no train job reported in range"
        raise AnalysisError(f"unknown train job {job!r} between {fmt_time(start)} and {fmt_time(end)}{hint}")
    rank_node, instance_node = {}, {}
    for key in info:
        r, node, inst = label(key, "rank"), label(key, "node"), label(key, "instance")
        if r is not None and node is not None:
            rank_node[int(r)] = node
            if inst:
                instance_node[inst] = node

    interval, period = cadences(prom, sel, end, span, sorted(rank_node)) if rank_node else (None, None)
    if interval is not None:
        min_window = max(min_window, SCRAPES_PER_WINDOW * interval)
    if period is not None:
        min_window = max(min_window, EXCHANGES_PER_WINDOW * period)
    width, times = windows(start, end, min_window)
    # Prometheus evaluates on a whole-millisecond grid: windows start and last whole milliseconds,
    # so each answer's timestamps are exactly the window ends asked for
    start = round(start, 3)
    width = max(1, round(width * 1000)) / 1000
    times = [start + width * (i + 1) for i in range(len(times))]
    w = f"{round(width * 1000)}ms"

    def per_window(expr: str) -> dict:
        return prom.query_range(expr, times[0], times[-1], width)

    def align(points: list[tuple[float, float]]) -> list[float | None]:
        return nearest_per_window(points, times, width)

    per_rank: dict[str, dict[int, list[float | None]]] = {}
    for name, (metric, extra) in COUNTERS.items():
        res = per_window(f"sum by (rank) (increase({metric}{{{sel}{extra}}}[{w}]))")
        per_rank[name] = {int(label(k, "rank")): align(v) for k, v in res.items() if label(k, "rank") is not None}
    if sum(v for row in per_rank["steps"].values() for v in row if v) <= 0:
        raise AnalysisError(f"train job {job!r} completed no steps between {fmt_time(start)} and {fmt_time(end)} "
                            "(empty range)")
    arrivals = [x for row in per_rank["last_arrivals"].values() for x in row if x is not None]
    if arrivals and not any(x > 0 for x in arrivals):  # the exchange is on, and none landed
        about = f" (about {period:.0f} s)" if period is not None else ""
        stepped = [i for i in range(len(times)) if any(row[i] for row in per_rank["steps"].values())]
        ran = (stepped[-1] - stepped[0] + 1) * width
        if ran < span - width:
            # the job began (or ended) inside the range: widening it adds nothing. A daemon exports
            # slack and last arrivals from the first landing on, and Prometheus counts no increase
            # from a series' first sample: the job needs two landings in range
            raise AnalysisError(f"no skew-exchange result for train job {job!r} between {fmt_time(start)} and "
                                f"{fmt_time(end)}: the job stepped in only about {ran:.0f} s of the range, and "
                                f"slack and last arrivals land once per exchange period{about} (K steps, or "
                                "30 s of them), the first only as a second follows it; read the job again "
                                "once it has run for a few periods")
        raise AnalysisError(f"no skew-exchange result for train job {job!r} between {fmt_time(start)} and "
                            f"{fmt_time(end)}: slack and last arrivals land once per exchange period{about}, "
                            "and the range holds fewer than the two landings an increase needs; widen the range")

    def job_series(expr: str) -> list[float | None]:
        res = per_window(expr)
        return align(next(iter(res.values()))) if res else [None] * len(times)

    hardware: dict[str, dict[str, list[float | None]]] = {}
    for name, expr in HARDWARE.items():
        res = per_window(expr.replace("{w}s", w))
        rows: dict[str, list[float | None]] = {}
        for k, v in res.items():
            node = instance_node.get(label(k, "instance") or "")
            if node is not None:
                rows[node] = align(v)
        if rows:
            hardware[name] = rows
    samples = prom.scalar(f"sum(increase(syncwatch_samples_total{{{sel}}}[{span:.0f}s])) / "
                          f"sum(increase(syncwatch_steps_total{{{sel}}}[{span:.0f}s]))", end)
    # both counters summed over their series: a restart that moved rank 0 to another node left
    # its checkpoints in two daemons' series, whose ratio is still the mean cost (0 / 0: None).
    # The count took the larger series: 13 of the 23 checkpoints, next to the cost of all 23
    checkpoints = prom.scalar(f"sum(increase(syncwatch_checkpoints_total{{{sel}}}[{span:.0f}s]))", end)
    saving = prom.scalar(f"sum(increase(syncwatch_checkpoint_seconds_total{{{sel}}}[{span:.0f}s]))", end)
    checkpoint_cost = saving / checkpoints if saving is not None and checkpoints else None
    # the job counters at the range start; none there: the job (or the rank-0 daemon, which
    # counts from zero) started inside the range
    at_start = {name: prom.scalar(f"max(syncwatch_job_{name}_total{{{sel}}})", start, default=0.0)
                for name in ("restarts", "rerun_steps")}
    # restarts across daemons: the attempts rank 0's daemons reported in range that were not
    # running at its start (all but the first where none was), and the
    # steps executed (a rank's, summed over its series: a restart on another node is another
    # one) less the progress of the job's step (ranks that completed a step in their process:
    # before its first, a new process reports step 0), from 0 where it had none at the start
    def attempts(expr: str, t: float) -> set[str]:
        return {label(k, "attempt") for k in prom.query(f'group by (attempt) ({expr})', t)}

    values = f'count_values("attempt", syncwatch_job_attempt{{{sel}}})'
    seen = attempts(f"max_over_time(({values})[{span:.0f}s:])", end)
    before = attempts(values, start)    # the attempts running at the start (an old one lingers)
    restarts_from_attempts = float(len(seen - before) if before else max(0, len(seen) - 1))
    job_step = f"max(syncwatch_last_step{{{sel}}} and syncwatch_last_step_timestamp_seconds{{{sel}}})"
    step_end = [x for x in job_series(job_step) if x is not None]
    rerun_from_steps = None
    if step_end:
        executed = max(sum(x for x in row if x is not None) for row in per_rank["steps"].values())
        progress = step_end[-1] - prom.scalar(job_step, start, default=0.0)
        rerun_from_steps = float(max(0, round(executed - progress)))
    return JobView(
        job=job, source=prom.url, start=start, end=end, window=width, times=times,
        rank_node=rank_node, per_rank=per_rank,
        # the least disturbed rank's, as the rules read it (train_job:syncwatch_step_cv:min)
        cv=job_series(f"min(syncwatch_step_cv{{{sel}}})"),
        # a rank's gauge rests on its process's steps but the first (its warm-up), up to W
        autocorrelation=job_series(f"avg(syncwatch_step_autocorrelation{{{sel}}} and "
                                   f"syncwatch_steps_total{{{sel}}} > {AUTOCORRELATION_MIN_STEPS})"),
        restarts=job_series(f"max(syncwatch_job_restarts_total{{{sel}}})"),
        rerun_steps=job_series(f"max(syncwatch_job_rerun_steps_total{{{sel}}})"),
        hardware=hardware, samples_per_rank_step=samples, checkpoints=checkpoints,
        checkpoint_cost=checkpoint_cost,
        restarts_at_start=at_start["restarts"], rerun_steps_at_start=at_start["rerun_steps"],
        restarts_from_attempts=restarts_from_attempts, rerun_steps_from_steps=rerun_from_steps,
        exchanged_steps=job_series(f"sum(increase(syncwatch_barrier_skew_seconds_count{{{sel}}}[{w}]))"),
        warnings=list(prom.warnings))


PERIOD_RANKS = 8  # ranks whose slack tells the exchange's period: all but a straggler idle


def cadences(prom: Prometheus, sel: str, end: float, span: float,
             ranks: list[int]) -> tuple[float | None, float | None]:
    """How often the job's series were scraped, and how often its skew exchange's results land
    (seconds; None where the samples cannot tell), up to the last step in the range (of the rank
    that stepped last; the range end where no step time is exported).

    The scrape interval: the median gap between one rank's raw samples of
    ``syncwatch_steps_total`` over the range (at most its last 10 minutes): that rank's, else the
    first of ``ranks``. The exchange's period: the median gap between the changes of
    ``syncwatch_slack_seconds_total`` (exported with the exchange on), the shortest over up to
    ``PERIOD_RANKS`` ranks spread over the job, over the last 10 minutes however short the range
    (a range holding fewer than the two landings an increase needs is refused, naming that
    period). A rank's slack grows at each exchange where it idled: every rank's but a persistent
    straggler's, whose slack stays put for long. An exchange that lands at every scrape reads as
    the scrape interval.

    Only a few ranks and ten minutes are fetched: a long range at a short scrape interval holds
    millions of samples, a few gaps tell the interval.
    """
    t, rank = end, ranks[0]
    last = prom.query(f"max by (rank) (max_over_time(syncwatch_last_step_timestamp_seconds{{{sel}}}"
                      f"[{span:.0f}s]))", end)
    if last:
        key, points = max(last.items(), key=lambda kv: kv[1][0][1])
        if label(key, "rank") is not None and math.isfinite(points[0][1]):
            rank, t = label(key, "rank"), min(end, points[0][1])

    def gaps(series: str, changes: bool, lookback: float) -> list[float]:
        """The median gap of each series' samples (of its changes)."""
        ms = max(1, round(lookback * 1000))
        out = []
        for pts in prom.samples(f"{series}[{ms}ms]", t).values():
            if changes:
                pts = [p for p, q in zip(pts[1:], pts) if p[1] != q[1]]
            between = [b - a for (a, _), (b, _) in zip(pts, pts[1:]) if b > a]
            if between:
                out.append(statistics.median(between))
        return out

    spread = sorted(set(ranks[::max(1, len(ranks) // PERIOD_RANKS)][:PERIOD_RANKS]))
    interval = gaps(f"syncwatch_steps_total{{{sel},rank={quote(str(rank))}}}", False,
                    min(span, 600.0))
    periods = gaps(f"syncwatch_slack_seconds_total{{{sel},rank=~{quote('|'.join(map(str, spread)))}}}",
                   True, 600.0)
    return (interval[0] if interval else None), (min(periods) if periods else None)


def nearest_per_window(points: list[tuple[float, float]], times: list[float],
                       width: float) -> list[float | None]:
    """Each window's value: the answer's point nearest the window's end, within half a window.

    Prometheus answers exactly at the window ends asked for, but a backend that moves a range's
    start to a multiple of the step (Thanos' query frontend; VictoriaMetrics without ``nocache``)
    answers up to a step earlier. Matched by exact timestamp, every window of such an answer read
    as empty ("completed no steps"); matched to the nearest end, each window reads the evaluation
    at most half a window from its own.
    """
    out: list[float | None] = [None] * len(times)
    off = [width / 2] * len(times)
    for t, v in points:
        i = math.floor((t - times[0]) / width + 0.5)
        if 0 <= i < len(times) and abs(t - times[i]) <= off[i]:
            out[i], off[i] = _finite(v), abs(t - times[i])
    return out


def _increase(before: float | None, cumulative: list[float | None]) -> float:
    vals = [x for x in cumulative if x is not None and math.isfinite(x)]
    prev = before if before is not None else (vals[0] if vals else 0.0)
    total = 0.0
    for x in vals:
        total += x - prev if x >= prev else x
        prev = x
    return total


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def fmt_time(t: float) -> str:
    return datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")
