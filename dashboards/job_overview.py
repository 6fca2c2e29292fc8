"""Job overview: is this job healthy, and if not, which failure mode?"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import stat, table, timeseries
from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.models import dashboard as dm
from syncwatch.rules.thresholds import THRESHOLDS

from .common import (JOB, RATE, dashboard, legend_table, panel, query, thresholds, train_job_variable)

UID = "syncwatch-job-overview"

#: Red where the rules warn: coupling at SyncwatchCouplingHigh.
_SCORE_THRESHOLDS = thresholds((None, "green"), (0.1, "orange"), (THRESHOLDS.coupling_warn, "red"))
#: The sync tax has no alert and includes the transfer itself (15 % of a healthy simulated job's
#: step): one neutral colour, no warning that no rule backs.
_NO_ALERT = thresholds((None, "blue"))
#: Orange above the calibrated healthy range (docs/rules.md: healthy < 0.2), red at SyncwatchJobUnstable.
_INSTABILITY_THRESHOLDS = thresholds((None, "green"), (0.2, "orange"), (THRESHOLDS.instability_warn, "red"))


def _score(title: str, description: str, expr: str, colours=_SCORE_THRESHOLDS) -> stat.Panel:
    return (panel(stat.Panel(), title, description, query(expr, "{{train_job}}"),
                  unit="percentunit", w=4, h=4)
            .thresholds(colours).min(0).max(1)
            .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"])))


def build() -> db.Dashboard:
    samples = f'syncwatch_samples_total{{{JOB}}}[{RATE}]'
    per_gpu = (f'sum by (train_job) (rate({samples}))'
               f' / count by (train_job) (rate({samples}))')
    # The window just after the range start: `@ start()` pins it, a negative offset moves it forward.
    first = f'syncwatch_samples_total{{{JOB}}}[{RATE}] @ start() offset -{RATE}'
    per_gpu_first = f'sum by (train_job) (rate({first})) / count by (train_job) (rate({first}))'
    world = f'max by (train_job) (syncwatch_job_world_size{{{JOB}}})'
    step_hist = f'sum by (le) (rate(syncwatch_step_duration_seconds_bucket{{{JOB}}}[{RATE}]))'

    return (
        dashboard(UID, "syncwatch / Job overview",
                  "Is this train job healthy, and if not, which failure mode? Scores first, then the "
                  "signals behind them.", train_job_variable())
        .with_row(db.Row("Scores"))
        .with_panel(_score(
            "Coupling score",
            "Share of all rank-time spent idle at the gradient barrier waiting for slower peers "
            "(slack / step time, 5 m). Below 5 % is normal; a rising score means local jitter is "
            "turning into global stalls. The Straggler map says who everyone waits for. Without "
            "the skew exchange (K = 0) an estimate from the ranks' mean waits: right for a "
            "persistent straggler, far below the truth for jitter.",
            f'train_job:syncwatch_coupling:ratio5m{{{JOB}}}'))
        .with_panel(_score(
            "Instability score",
            "0..1 combination of step-time CV, barrier skew per step, step-time oscillation and "
            "re-run work (components in the panel below). High means step times are erratic even "
            "if the mean looks fine. Without the skew exchange (K = 0) its skew is an estimate "
            "from the ranks' mean waits.",
            f'train_job:syncwatch_instability:score{{{JOB}}}', _INSTABILITY_THRESHOLDS))
        .with_panel(_score(
            "Sync tax",
            "Share of step time spent inside gradient synchronization (sync phase / step time, "
            "5 m). It includes the transfer itself; coupling is the part of it that is pure waiting. "
            "No alert reads it: its level depends on the model and the fabric, so it has no "
            "warning colour; compare it with its own history (panels below).",
            f'train_job:syncwatch_sync_tax:ratio5m{{{JOB}}}', _NO_ALERT))
        .with_panel(
            panel(stat.Panel(), "Straggler concentration",
                  "Largest share of last arrivals held by one rank (10 m). 1/N (world size) means "
                  "the barrier waits for a different rank each step (jitter); near 1 means one "
                  "persistent straggler: open the Straggler map. Without the skew exchange (K = 0) "
                  "an estimate: shares of one-minute windows in which a rank's mean wait was the "
                  f"smallest (shared equally with the ranks within {100 * THRESHOLDS.last_arrival_tie:g} % "
                  "of the step of it), not of steps.",
                  query(f'train_job:syncwatch_straggler_concentration:ratio10m{{{JOB}}}', "{{train_job}}"),
                  unit="percentunit", w=4, h=4)
            .thresholds(thresholds((None, "green"), (0.5, "orange"), (THRESHOLDS.straggler_share, "red")))
            .min(0).max(1))
        .with_panel(
            panel(stat.Panel(), "World size and attempt",
                  "Ranks in the job and the current attempt (0 = never restarted; a Slurm requeue of a "
                  "torchrun job adds torchrun's unused restarts + 1).",
                  query(f'max by (train_job) (syncwatch_job_world_size{{{JOB}}})', "world size"),
                  query(f'max by (train_job) (syncwatch_job_attempt{{{JOB}}})', "attempt"),
                  w=4, h=4))
        .with_panel(
            panel(stat.Panel(), "Restarts and re-run steps",
                  "Restarts in the last hour and the steps repeated after them (steps between the "
                  "last checkpoint and each failure), counted across the node daemons by the "
                  "recording rules: a restart that moved rank 0 to another node, which no daemon "
                  "counts, included. Not since the job began: that needs the job's whole history "
                  "of attempts and steps, which no daemon holds and Prometheus only within its "
                  "retention. Any re-run work is throughput paid twice.",
                  query(f'train_job:syncwatch_restarts:increase1h{{{JOB}}}', "restarts (1h)"),
                  query(f'train_job:syncwatch_rerun_steps:increase1h{{{JOB}}}', "re-run steps (1h)"),
                  w=4, h=4)
            .thresholds(thresholds((None, "green"), (1, "orange")))
            # the restarts red where SyncwatchJobCrashLooping pages; re-run steps have no alert
            .override_by_name("restarts (1h)", [dm.DynamicConfigValue(id_val="thresholds", value={
                "mode": "absolute", "steps": [{"value": None, "color": "green"},
                                              {"value": 1, "color": "orange"},
                                              {"value": THRESHOLDS.restarts_crit, "color": "red"}]})]))
        .with_row(db.Row("Which failure mode"))
        .with_panel(
            panel(timeseries.Panel(), "Coupling score and its components",
                  "Coupling (idle share at the barrier) beside the sync tax it is part of and the "
                  "straggler concentration. Coupling up with concentration near 1: one straggler. "
                  "Coupling up with concentration near 1/N: jitter or contention spread over ranks. "
                  "Sync tax up without coupling: the transfer itself got slower (fabric). Without "
                  "the skew exchange (K = 0) coupling and concentration are estimates from the "
                  "ranks' mean waits, which see a persistent straggler but not jitter.",
                  query(f'train_job:syncwatch_coupling:ratio5m{{{JOB}}}', "coupling"),
                  query(f'train_job:syncwatch_sync_tax:ratio5m{{{JOB}}}', "sync tax"),
                  query(f'train_job:syncwatch_straggler_concentration:ratio10m{{{JOB}}}',
                        "straggler concentration"),
                  unit="percentunit")
            .min(0).legend(legend_table("mean", "max", "lastNotNull")))
        .with_panel(
            panel(timeseries.Panel(), "Instability score and its components",
                  "Instability beside its components, each scaled 0..1 by the recording rules: cv "
                  "(step-time coefficient of variation), cv_counters (swings of whole minutes), "
                  "cv_growth (CV against its own baseline), skew (barrier skew per step), "
                  "skew_growth (skew against its own baseline), oscillation (fast/slow "
                  "alternation: negative lag-1 autocorrelation), rerun (share of steps repeated "
                  "after restarts) and restarts (restarts in the last hour). The component that "
                  "rises with the score is the failure mode. Without the skew exchange (K = 0) skew "
                  "and skew_growth read an estimate from the ranks' mean waits.",
                  query(f'train_job:syncwatch_instability:score{{{JOB}}}', "instability"),
                  query(f'train_job:syncwatch_instability:component{{{JOB}}}', "{{component}}"),
                  unit="percentunit")
            .min(0).max(1).legend(legend_table("mean", "max", "lastNotNull")))
        .with_row(db.Row("Throughput and step time"))
        .with_panel(
            panel(timeseries.Panel(), "Throughput against ideal linear scaling",
                  "Samples per second of the whole job, and the ideal: world size times the per-GPU "
                  "throughput first measured in the shown time range (its first rate interval; the "
                  "best per-GPU throughput of the range when the job had not started by then). The "
                  "gap between the lines is throughput lost to coupling, stragglers and scale.",
                  query(f'sum by (train_job) (rate({samples}))', "measured"),
                  query(f'{world} * on (train_job) (({per_gpu_first}) > 0)'
                        f' or {world} * on (train_job) max_over_time(({per_gpu})[$__range:])',
                        "ideal linear scaling"),
                  unit="short")
            .min(0).axis_label("samples/s").legend(legend_table("mean", "lastNotNull")))
        .with_panel(
            panel(timeseries.Panel(), "Step time p50 / p99 and mean",
                  "Step duration quantiles from the per-node histograms of all ranks, and the mean. "
                  "A p99 pulling away from p50 means rare long steps (stalls) dominate the job time.",
                  query(f'histogram_quantile(0.5, {step_hist})', "p50"),
                  query(f'histogram_quantile(0.99, {step_hist})', "p99"),
                  query(f'train_job:syncwatch_step_seconds:mean5m{{{JOB}}}', "mean"),
                  unit="s")
            .min(0).legend(legend_table("mean", "max", "lastNotNull")))
        .with_panel(
            panel(timeseries.Panel(), "Step time CV",
                  "Coefficient of variation of step time over each rank's steps of the last "
                  "--cv-seconds of the daemon (4 minutes by default; at most its last W steps, at "
                  "least 4), each step less the rank's own checkpoint and eval time: one slow step "
                  "shows as a jump that falls back that much later. Synchronous ranks share one "
                  "step time, so the lines agree, unless ranks waited through a peer's checkpoint "
                  "or evaluation (rank 0 saving alone): those waits are the worst rank's, which "
                  "the alerts leave out by reading the least disturbed rank. The variance alert "
                  "reads its 5 m average: it pages above "
                  f"{THRESHOLDS.cv_page:g}, or above {THRESHOLDS.cv_growth_min:g} at "
                  f"{THRESHOLDS.cv_growth_page:g}x the baseline (that average 10-40 m earlier, no "
                  "value in a job's first 10 m). Growth is the early sign of coupling.",
                  query(f'train_job:syncwatch_step_cv:min{{{JOB}}}', "least disturbed rank"),
                  query(f'max by (train_job) (syncwatch_step_cv{{{JOB}}})', "worst rank"),
                  query(f'train_job:syncwatch_step_cv:avg5m{{{JOB}}}', "5m average (alert)"),
                  query(f'train_job:syncwatch_step_cv:baseline{{{JOB}}}', "baseline (10-40m ago)"),
                  unit="percentunit")
            .min(0))
        .with_panel(
            panel(timeseries.Panel(), "Step time autocorrelation",
                  "Lag-1 autocorrelation of step time over each rank's last W steps (as for the CV: "
                  "less checkpoint and eval time, without the first step), and the job's average "
                  "over its ranks, which the oscillation alert reads: it warns below "
                  f"-{THRESHOLDS.oscillation_warn:g}. Near 0 is healthy; strongly negative means fast "
                  "and slow steps alternate; strongly positive, slow stretches lasting several "
                  "steps. Ranks split into two groups of lines point at groups taking turns to wait.",
                  query(f'train_job:syncwatch_step_autocorrelation:avg{{{JOB}}}', "job average (alert)"),
                  query(f'syncwatch_step_autocorrelation{{{JOB}}}', "rank {{rank}}"),
                  unit="short")
            .min(-1).max(1).legend(legend_table("mean", "min", "lastNotNull")))
        .with_panel(
            panel(timeseries.Panel(), "Sync tax and barrier skew",
                  "Share of step time inside synchronization, and the mean barrier skew (spread of "
                  "arrival times) as a share of step time. Skew near the sync tax: the sync phase is "
                  "mostly waiting for late ranks, not transfer. Without the skew exchange (K = 0) "
                  "the skew is an estimate: the spread of the ranks' mean waits (a lower bound).",
                  query(f'train_job:syncwatch_sync_tax:ratio5m{{{JOB}}}', "sync tax"),
                  query(f'train_job:syncwatch_skew_step:ratio5m{{{JOB}}}', "skew / step"),
                  unit="percentunit", w=12)
            .min(0))
        .with_panel(
            panel(timeseries.Panel(), "Barrier skew",
                  "Mean and p99 of the per-step barrier skew (largest slack of a step, 5 m), measured "
                  "exactly by the ranks' MIN/MAX exchange. Compare with the mean step time. Without "
                  "the exchange (K = 0) the mean is an estimate, the spread of the ranks' mean waits "
                  "(a lower bound), and p99 has no value.",
                  query(f'train_job:syncwatch_barrier_skew_seconds:mean5m{{{JOB}}}', "mean"),
                  query(f'train_job:syncwatch_barrier_skew_seconds:p99_5m{{{JOB}}}', "p99"),
                  unit="s", w=12)
            .min(0))
        .with_row(db.Row("Restarts and alerts"))
        .with_panel(
            panel(timeseries.Panel(), "Restarts and re-run work",
                  "Attempt number, and restarts and steps re-run after them over the hour before "
                  "each point, counted across the node daemons (a restart that moved rank 0 to "
                  "another node included). Each step up of the attempt line is a restart, "
                  "whatever its height, not one restart per unit (a Slurm requeue of a torchrun "
                  "job raises the attempt by torchrun's unused restarts + 1; the restarts line "
                  "counts it once); the re-run line rises by the steps lost since the last checkpoint (a long checkpoint "
                  "interval makes each restart expensive) and falls an hour later.",
                  query(f'max by (train_job) (syncwatch_job_attempt{{{JOB}}})', "attempt"),
                  query(f'train_job:syncwatch_restarts:increase1h{{{JOB}}}', "restarts (1h)"),
                  query(f'train_job:syncwatch_rerun_steps:increase1h{{{JOB}}}', "re-run steps (1h)"),
                  unit="short")
            .min(0))
        .with_panel(
            panel(table.Panel(), "Alerts for this job",
                  "syncwatch alerts for this job now, firing and pending (pending: the condition "
                  "holds, its for: window has not run out yet). The alert names the failure mode; "
                  "rank and node columns name the culprit where the alert has them.",
                  query(f'ALERTS{{{JOB}}}', instant=True, table=True))
            .sort_by([cb.TableSortByFieldState().display_name("alertstate")]))
    )
