"""Metric families of the daemon's own data, built fresh at scrape time from a ``State`` snapshot.

Names, types and labels follow the metric contract (DESIGN.md, and docs/metrics.md for what
changed since). Per rank (labels train_job, rank): rank_info, steps, step seconds, 8 phases,
slack and last arrivals (exact mode only), samples, tokens (when reported), step CV,
autocorrelation, last step, its timestamp, collective sequence, the heartbeat phase and, once it
ended, its end — at most 22 series, under the budget of 25.
"""

from __future__ import annotations

import logging

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from .. import __version__
from ..protocol import PHASES, SKEW_BUCKETS
from .state import Snapshot, State

log = logging.getLogger("syncwatch.daemon")

_SKEW_LE = tuple(repr(float(b)) for b in SKEW_BUCKETS)


class StateCollector:
    """prometheus_client collector over the daemon's rank/job state and its self-health.

    Its first render shows the ranks' drop and error counts as 0. A daemon started on a node
    whose ranks dropped records while no daemon ran counts those at once, from the first record
    of each rank, before Prometheus's first scrape of it; exported from that scrape, the count
    was no counter reset to Prometheus unless it was below the last one of the daemon before:
    10 then 100 read as 90 more, a second restart's 100 after the first's 100 as none. A 0
    first is the reset, and increase() counts the next scrape's whole value."""

    def __init__(self, state: State):
        self.state = state
        self._served = False

    def collect(self):
        fams = families(self.state.snapshot(), client_counts=self._served)
        self._served = True
        return fams


def families(snap: Snapshot, client_counts: bool = True) -> list:
    """The metric families of ``snap``; without ``client_counts``, the ranks' drop and error
    counts read 0 (a restarted daemon's first scrape: see ``StateCollector``)."""
    RL = ["train_job", "rank"]
    info = GaugeMetricFamily("syncwatch_rank_info", "Joins a rank to its node, GPU and process (value 1).",
                             labels=RL + ["local_rank", "node", "gpu", "uuid", "pid"])
    steps = CounterMetricFamily("syncwatch_steps", "Steps completed by the rank.", labels=RL)
    step_s = CounterMetricFamily("syncwatch_step_seconds", "Sum of the rank's step durations.",
                                 labels=RL)
    phase_s = CounterMetricFamily("syncwatch_phase_seconds", "Sum of the rank's phase durations.",
                                  labels=RL + ["phase"])
    slack = CounterMetricFamily("syncwatch_slack_seconds",
                                "Sum of the rank's slack: time idled waiting for later ranks (exact mode).",
                                labels=RL)
    last_arr = CounterMetricFamily("syncwatch_last_arrivals",
                                   "Steps in which this rank arrived last at the barrier (exact mode).",
                                   labels=RL)
    samples = CounterMetricFamily("syncwatch_samples", "Samples processed by the rank.", labels=RL)
    tokens = CounterMetricFamily("syncwatch_tokens", "Tokens processed by the rank (when reported).",
                                 labels=RL)
    cv = GaugeMetricFamily("syncwatch_step_cv",
                           "Coefficient of variation of the rank's step time, less its checkpoint and "
                           "eval phases, over those of the last W steps that took at most "
                           "--cv-seconds together (at least 4); a process's first step (its "
                           "warm-up) left out.",
                           labels=RL)
    ac = GaugeMetricFamily("syncwatch_step_autocorrelation",
                           "Lag-1 autocorrelation of the rank's step time, less its checkpoint and "
                           "eval phases, over the last W steps; a process's first step (its "
                           "warm-up) left out.",
                           labels=RL)
    last_step = GaugeMetricFamily("syncwatch_last_step", "Number of the rank's last completed step.",
                                  labels=RL)
    last_ts = GaugeMetricFamily("syncwatch_last_step_timestamp_seconds",
                                "Wall time of the rank's last completed step.", labels=RL)
    seq = GaugeMetricFamily("syncwatch_collective_sequence",
                            "Sequence number of the last collective the rank entered.", labels=RL)
    elapsed = GaugeMetricFamily("syncwatch_rank_phase_elapsed_seconds",
                                "Time the rank had spent in its current phase at its last heartbeat.",
                                labels=RL + ["phase"])
    end = GaugeMetricFamily("syncwatch_rank_end_timestamp_seconds",
                            "Wall time of the rank's end record, labelled with its reason (until "
                            "the rank's series go, --job-grace later).", labels=RL + ["reason"])
    NL = ["train_job", "node"]
    step_h = HistogramMetricFamily("syncwatch_step_duration_seconds",
                                   "Step durations of this node's ranks.", labels=NL)
    wait_h = HistogramMetricFamily("syncwatch_sync_wait_seconds",
                                   "Waits inside the gradient collective of this node's ranks.", labels=NL)
    JL = ["train_job"]
    skew_h = HistogramMetricFamily("syncwatch_barrier_skew_seconds",
                                   "Per-step barrier skew: spread of arrival times (from global rank 0).",
                                   labels=JL)
    world = GaugeMetricFamily("syncwatch_job_world_size", "World size of the job's current attempt.",
                              labels=JL)
    attempt = GaugeMetricFamily("syncwatch_job_attempt", "The job's current attempt.", labels=JL)
    restarts = CounterMetricFamily("syncwatch_job_restarts", "Restarts of the job seen by this daemon.",
                                   labels=JL)
    rerun = CounterMetricFamily("syncwatch_job_rerun_steps",
                                "Steps computed again after restarts (lost since the last checkpoint).",
                                labels=JL)
    ck_s = CounterMetricFamily("syncwatch_checkpoint_seconds",
                               "Time global rank 0's current process spent checkpointing.", labels=JL)
    ck = CounterMetricFamily("syncwatch_checkpoints", "Checkpoints written by global rank 0's current process.",
                             labels=JL)

    for job in snap.jobs:
        j = job.train_job
        for v in job.ranks:
            i = v.ident
            rl = [j, str(i.rank)]
            info.add_metric(rl + [str(i.local_rank), i.node, "" if i.gpu < 0 else str(i.gpu),
                                  i.gpu_uuid, str(i.pid)], 1)
            t = v.totals
            if t is not None:
                steps.add_metric(rl, t.steps)
                step_s.add_metric(rl, t.step_seconds)
                for name, value in zip(PHASES, t.phase_seconds):
                    phase_s.add_metric(rl + [name], value)
                if v.exact:
                    slack.add_metric(rl, t.slack_seconds)
                    last_arr.add_metric(rl, t.last_arrivals)
                samples.add_metric(rl, t.samples)
                if v.has_tokens:
                    tokens.add_metric(rl, t.tokens)
            if v.cv is not None:
                cv.add_metric(rl, v.cv)
            if v.autocorrelation is not None:
                ac.add_metric(rl, v.autocorrelation)
            if v.last_step >= 0:
                last_step.add_metric(rl, v.last_step)
            if v.last_step_wall > 0:
                last_ts.add_metric(rl, v.last_step_wall)
            seq.add_metric(rl, v.seq)
            if v.hb_phase is not None:
                elapsed.add_metric(rl + [v.hb_phase], v.hb_elapsed)
            if v.end is not None:
                end.add_metric(rl + [v.end[1]], v.end[0])
        for node, (sh, wh) in sorted(job.hists.items()):
            step_h.add_metric([j, node], sh.cumulative(), sh.sum)
            wait_h.add_metric([j, node], wh.cumulative(), wh.sum)
        if job.has_rank0:
            world.add_metric([j], job.world_size)
            attempt.add_metric([j], job.attempt)
            restarts.add_metric([j], job.restarts)
            rerun.add_metric([j], job.rerun_steps)
            if job.checkpoints_known:  # not before rank 0's step record tells them
                ck_s.add_metric([j], job.checkpoint_seconds)
                ck.add_metric([j], job.checkpoints)
            if job.skew is not None:
                s = job.skew
                skew_h.add_metric([j], list(zip(_SKEW_LE, s.buckets)) + [("+Inf", s.count)], s.sum)

    records = CounterMetricFamily("syncwatch_ingest_records", "Records accepted by this daemon.")
    records.add_metric([], snap.records)
    rejected = CounterMetricFamily("syncwatch_ingest_rejected", "Records rejected, by reason.",
                                   labels=["reason"])
    for reason, n in snap.rejected.items():
        rejected.add_metric([reason], n)
    dropped = CounterMetricFamily("syncwatch_client_dropped_records",
                                  "Records the ranks reported dropping before they reached the daemon.")
    dropped.add_metric([], snap.client_dropped if client_counts else 0)
    errors = CounterMetricFamily("syncwatch_client_internal_errors",
                                 "Internal errors the ranks' instrumentation reported counting "
                                 "(training went on; each rank logs its first).")
    errors.add_metric([], snap.client_errors if client_counts else 0)
    active = GaugeMetricFamily("syncwatch_ranks_active", "Ranks this daemon currently tracks.")
    active.add_metric([], snap.ranks_active)
    build = GaugeMetricFamily("syncwatch_build_info", "syncwatch version (value 1).", labels=["version"])
    build.add_metric([__version__], 1)

    fams = [info, steps, step_s, phase_s, slack, last_arr, samples, tokens, cv, ac, last_step,
            last_ts, seq, elapsed, end, step_h, wait_h, skew_h, world, attempt, restarts, rerun, ck_s, ck,
            records, rejected, dropped, errors, active, build]
    return [f for f in fams if f.samples]  # a family without series is only noise


class GuardedRegistry:
    """What ``generate_latest`` renders: our collector plus the extra ones, each guarded so that
    one that raises drops only its own families, never the scrape (prometheus_client's
    ``CollectorRegistry.collect`` has no such guard)."""

    def __init__(self, collectors):
        self.collectors = list(collectors)
        self._failed: set[int] = set()

    def collect(self):
        for c in self.collectors:
            try:
                fams = list(c.collect())
            except Exception:
                if id(c) not in self._failed:  # log once per collector until it recovers
                    log.exception("collector %r failed; its metrics are left out of this scrape", c)
                self._failed.add(id(c))
                continue
            self._failed.discard(id(c))
            yield from fams
