"""Efficiency and cost: is scaling still paying?"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import stat, timeseries
from syncwatch.rules.thresholds import THRESHOLDS

from .common import (JOB, RATE, dashboard, estimated, legend_table, panel, query,
                     thresholds, train_job_variable, unit_override)

UID = "syncwatch-efficiency"


def _per_rank_gpu(expr: str) -> str:
    """A GPU rate expression (labels uuid, ...) joined to the job's ranks through the GPU uuid each
    rank reports: one series per rank with labels train_job, rank.

    Summed by uuid first: one GPU may have two series in the window, one after the other (NVML
    initialized again without a GPU that fell off the bus renumbers those after it, same uuid
    under another ``gpu``; a restarted daemon may come back under another ``instance``). The
    join found duplicate series on its one side and failed for the rate window after it, over
    ``$__range`` for as long as the range held both; rate() divides each one's increase by the
    whole window, so their sum is the GPU's rate (max read a part of it)."""
    return (f'(sum by (uuid) ({expr}) * on (uuid) group_right () '
            f'topk by (train_job, rank) (1, syncwatch_rank_info{{{JOB}}}))')


def _energy_rate(window: str) -> str:
    """Watts drawn by each rank's GPU over ``window``."""
    return _per_rank_gpu(f'rate(syncwatch_gpu_energy_joules_total[{window}])')


#: Each rank's estimated slack share (5 m) for a job without the skew exchange (K = 0).
SLACK_ESTIMATE = estimated(f'train_job_rank:syncwatch_slack:ratio5m{{{JOB}}}')


def _slack_share(window: str) -> str:
    """Each rank's share of its time idle at the barrier over ``window``: its slack per step of the
    skew exchange over its mean step time. Slack reaches the daemons K steps at a time, so it is
    divided by the steps the exchanges covered (the count of rank 0's skew histogram), as on the
    Straggler map, never by the steps of the window; a window without an exchange has no value."""
    return (f'(rate(syncwatch_slack_seconds_total{{{JOB}}}[{window}]) / on (train_job) group_left () '
            f'(sum by (train_job) (rate(syncwatch_barrier_skew_seconds_count{{{JOB}}}[{window}])) > 0)'
            f' / (rate(syncwatch_step_seconds_total{{{JOB}}}[{window}])'
            f' / rate(syncwatch_steps_total{{{JOB}}}[{window}])))')


def _waiting_watts(window: str, slack_estimate: str) -> str:
    """Watts of the job's GPUs spent idle at barriers: each rank's GPU power times its slack share
    over ``window``, or for a job without any slack in it, ``slack_estimate`` (the estimate from
    mean waits of a job without the skew exchange)."""
    slack_share = f'({_slack_share(window)} or on (train_job) {slack_estimate})'
    return (f'sum by (train_job) ({slack_share} * on (train_job, rank) group_left () '
            f'sum by (train_job, rank) ({_energy_rate(window)}))')


def build() -> db.Dashboard:
    samples = f'syncwatch_samples_total{{{JOB}}}[{RATE}]'
    per_gpu = f'sum by (train_job) (rate({samples})) / count by (train_job) (rate({samples}))'
    waiting_now = _waiting_watts(RATE, SLACK_ESTIMATE)
    # Over the range: the estimated slack shares averaged over it. A job with exact slack anywhere
    # in the range reads only that (its record holds no estimate after its first exchange).
    waiting_range = _waiting_watts(
        "$__range", f'avg_over_time(train_job_rank:syncwatch_slack:ratio5m{{{JOB}}}[$__range])')
    return (
        dashboard(UID, "syncwatch / Efficiency and cost",
                  "Is scaling still paying? Per-GPU output against its baseline, energy per sample, "
                  "energy burned at barriers, re-run work and checkpoint time.",
                  train_job_variable())
        .with_row(db.Row("Output per GPU"))
        .with_panel(
            panel(stat.Panel(), "Efficiency against baseline",
                  "Per-GPU throughput now divided by its trailing baseline. 100 % = each GPU still "
                  "produces what it did; below 90 % (orange) the job pays for GPUs that wait, "
                  "below 80 % (red) for 30 m SyncwatchEfficiencyDrift warns.",
                  query(f'train_job:syncwatch_efficiency:ratio_to_baseline{{{JOB}}}', "{{train_job}}"),
                  unit="percentunit", w=6)
            .thresholds(thresholds((None, "red"), (0.8, "orange"), (0.9, "green"))))
        .with_panel(
            panel(timeseries.Panel(), "Per-GPU efficiency against baseline",
                  "The same ratio over time. A step down at a scale-up means the new size does not "
                  "pay; a slow slide means coupling grows (see Job overview).",
                  query(f'train_job:syncwatch_efficiency:ratio_to_baseline{{{JOB}}}', "efficiency"),
                  unit="percentunit", w=9)
            .min(0))
        .with_panel(
            panel(timeseries.Panel(), "Throughput per GPU against its baseline",
                  "Samples per second per GPU now, and the trailing baseline the efficiency ratio "
                  "divides by (its 1 h average ending 35 m ago; none in a job's first 40 m). The "
                  "gap is the output each GPU lost.",
                  query(per_gpu, "samples/s per GPU"),
                  query(f'train_job:syncwatch_samples_per_gpu:baseline1h{{{JOB}}}', "baseline"),
                  unit="short", w=9)
            .min(0))
        .with_row(db.Row("Energy"))
        .with_panel(
            panel(timeseries.Panel(), "Energy per sample",
                  "Joules the job's GPUs spend per sample processed (5 m), and its trailing "
                  "baseline (its 1 h average ending 35 m ago; none in a job's first 40 m). Rising "
                  "while throughput is flat: energy outpacing output (waiting GPUs still draw "
                  f"power). Above {THRESHOLDS.energy_warn:g}x the baseline for 30 m "
                  "SyncwatchEnergyOutpacingOutput warns.",
                  query(f'train_job:syncwatch_energy_per_sample:joules5m{{{JOB}}}', "J / sample"),
                  query(f'train_job:syncwatch_energy_per_sample:baseline1h{{{JOB}}}', "baseline"),
                  unit="joule", w=6)
            .min(0))
        .with_panel(
            panel(timeseries.Panel(), "GPUs idle at barriers",
                  "How many GPUs' worth of time the job spends idle waiting for slower peers (sum "
                  "of the ranks' slack shares: slack per step of the skew exchange / mean step "
                  "time): 2.5 = two and a half GPUs paid for doing nothing. With the skew exchange "
                  "(every K = 50 steps) an interval without one has no point. Without it (K = 0) an "
                  "estimate: the sum of the ranks' slack shares estimated from their mean waits over "
                  "5 m (a lower bound: jitter averages out).",
                  query(f'sum by (train_job) ({_slack_share(RATE)})'
                        f' or on (train_job) sum by (train_job) ({SLACK_ESTIMATE})',
                        "GPUs idle"),
                  unit="short", w=6)
            .min(0))
        .with_panel(
            panel(timeseries.Panel(), "Power burned waiting at barriers",
                  "GPU power of each rank weighted by the share of its time it idled at the barrier, "
                  "summed over the job, beside the job's whole GPU power. The ratio of the two is "
                  "the share of the energy bill paid for waiting. With the skew exchange (every "
                  "K = 50 steps) an interval without one has no point. Without it (K = 0) "
                  "the idle share is estimated from the ranks' mean waits over 5 m (a lower bound).",
                  query(waiting_now, "while waiting"),
                  query(f'sum by (train_job) ({_energy_rate(RATE)})', "all GPUs of the job"),
                  unit="watt", w=6)
            .min(0))
        .with_panel(
            panel(stat.Panel(), "Energy burned waiting in range",
                  "Energy of the job's GPUs in the shown range spent idle at barriers, and its share "
                  "of all their energy. Without the skew exchange (K = 0) an estimate from the "
                  "ranks' mean waits (a lower bound).",
                  query(f'{waiting_range} * $__range_s', "joules while waiting", instant=True),
                  query(f'{waiting_range} / on (train_job) '
                        f'sum by (train_job) ({_energy_rate("$__range")})', "share of GPU energy", instant=True),
                  w=6)
            .override_by_name("share of GPU energy", [unit_override("percentunit")])
            .unit("joule"))
        .with_row(db.Row("Work lost"))
        .with_panel(
            panel(timeseries.Panel(), "Re-run ratio",
                  "Share of the steps computed in the last hour that repeated work lost at a restart "
                  "(steps between the last checkpoint and the failure), counted across the node "
                  "daemons: a restart that moved rank 0 to another node included (the alerting "
                  "view). Each step up is one restart; a tall step says the checkpoint interval is "
                  "too long for the failure rate. Not since the job began: no daemon holds the "
                  "re-runs of a restart that moved rank 0.",
                  query(f'train_job:syncwatch_rerun:ratio1h{{{JOB}}}', "last hour"),
                  unit="percentunit")
            .min(0))
        .with_panel(
            panel(timeseries.Panel(), "Checkpoint and evaluation time share",
                  "Share of the ranks' time spent in the planned pauses (5 m): the checkpoint "
                  "phase and the eval phase. Together with the re-run ratio the checkpoint share "
                  "sets the checkpoint interval: more frequent checkpoints cost this, rarer ones "
                  "cost re-runs. The evaluation share is what the evaluation interval costs.",
                  query(f'train_job_phase:syncwatch_phase:ratio5m{{{JOB}, phase="checkpoint"}}',
                        "checkpointing"),
                  query(f'train_job_phase:syncwatch_phase:ratio5m{{{JOB}, phase="eval"}}',
                        "evaluating"),
                  unit="percentunit")
            .min(0).legend(legend_table("mean", "lastNotNull")))
    )

