"""Straggler map: who is everyone waiting for?"""

from __future__ import annotations

from grafana_foundation_sdk.builders import barchart, heatmap, table, timeseries
from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import heatmap as hm

from syncwatch.rules.thresholds import THRESHOLDS

from .common import (JOB, ON_NODE, RANKS, RATE, dashboard, estimated, legend_table, node_variable,
                     panel, query, rank_variable, train_job_variable)

UID = "syncwatch-straggler-map"


def build() -> db.Dashboard:
    # Without the skew exchange (K = 0) a job has no slack or last-arrival series: each panel
    # falls back, per job (`or on (train_job)`), to the rules' estimates from the ranks' mean waits.
    slack_estimate = estimated(f'train_job_rank:syncwatch_slack:ratio5m{{{RANKS}}}')
    last_arrival_estimate = estimated(
        f'train_job_rank:syncwatch_last_arrival:ratio10m{{{RANKS}, node=~"$node"}}')
    # Last arrivals in the range: without the exchange, the steps of each rank in the range times
    # the share of the range's one-minute windows in which its mean wait was the smallest.
    arrivals_range = (f'(increase(syncwatch_last_arrivals_total{{{RANKS}}}[$__range]) or on (train_job) '
                      f'sum by (train_job, rank) (avg_over_time(train_job_rank:syncwatch_last_arrival:estimate1m'
                      f'{{{RANKS}}}[$__range]) * on (train_job, rank) '
                      f'sum by (train_job, rank) (increase(syncwatch_steps_total{{{RANKS}}}[$__range]))))')
    # Slack and last arrivals reach the daemons K steps at a time, when the skew exchange
    # completes; per interval they are divided by the steps that exchange covered (the count of
    # rank 0's skew histogram), never by the steps of the interval (with 3 s steps: 50 steps of
    # slack over 20 steps of time, then nothing). An interval without an exchange has no value.
    exchanged = (f'on (train_job) group_left () (sum by (train_job) '
                 f'(rate(syncwatch_barrier_skew_seconds_count{{{JOB}}}[{RATE}])) > 0)')
    step_time = (f'(rate(syncwatch_step_seconds_total{{{RANKS}}}[{RATE}])'
                 f' / rate(syncwatch_steps_total{{{RANKS}}}[{RATE}]))')
    sequence = f'syncwatch_collective_sequence{{{JOB}}}'
    return (
        dashboard(UID, "syncwatch / Straggler map",
                  "Who is everyone waiting for? Slack and last arrivals per rank, located on nodes.",
                  train_job_variable(), node_variable(), rank_variable())
        .with_row(db.Row("Who arrives last"))
        .with_panel(
            panel(heatmap.Panel(), "Slack share by rank over time",
                  "One row per rank, one column per interval; colour = share of the rank's step time "
                  "it idled at the barrier waiting for others (slack per step of the skew exchange / "
                  "mean step time). Waiting ranks are hot. A persistently cold row among hot ones is "
                  "the straggler: it never waits because everyone waits for it. Uniform warmth means "
                  "jitter with no single culprit. With the skew exchange (every K = 50 steps) a "
                  "column without one is empty. Without it (K = 0) the colour is an estimate from "
                  "the ranks' mean waits over 5 m (mean wait minus the smallest, over the mean step "
                  "time): it shows a persistent straggler's cold row, but jitter averages out of it.",
                  query(f'sum by (rank) ((rate(syncwatch_slack_seconds_total{{{RANKS}}}[{RATE}])'
                        f' / {exchanged} / {step_time} or on (train_job) {slack_estimate}) {ON_NODE})',
                        "{{rank}}"),
                  unit="percentunit", w=24, h=10)
            .calculate(False)
            .rows_frame(heatmap.RowsHeatmapOptions().layout(cm.HeatmapCellLayout.UNKNOWN).value("slack share"))
            .color(heatmap.HeatmapColorOptions().mode(hm.HeatmapColorMode.SCHEME).scheme("Oranges")
                   .scale(hm.HeatmapColorScale.LINEAR).steps(64).min(0))
            .y_axis(heatmap.YAxisConfig().axis_label("rank"))
            .filter_values(heatmap.FilterValueRange())  # keep 0-slack cells: the straggler's row
            .cell_gap(1).show_tooltip())
        .with_panel(
            panel(timeseries.Panel(), "Last-arrival share per rank",
                  "Share of steps in which each rank arrived last at the barrier (the rank the "
                  "step waited for). Even jitter gives every rank about 1/N; one line near 1 is a "
                  "persistent straggler. An interval without a skew exchange has no point. Without "
                  "the exchange (K = 0) it is an estimate over the one-minute windows of the last "
                  "10 m: a window goes to the rank with the smallest mean wait, shared equally with "
                  f"every rank within {100 * THRESHOLDS.last_arrival_tie:g} % of the step of it (the share "
                  "SyncwatchPersistentStraggler reads; even jitter shares every window).",
                  query(f'sum by (train_job, rank) (rate(syncwatch_last_arrivals_total{{{RANKS}}}[{RATE}]) {ON_NODE})'
                        f' / on (train_job) group_left () (sum by (train_job) '
                        f'(rate(syncwatch_last_arrivals_total{{{JOB}}}[{RATE}])) > 0)'
                        f' or on (train_job) sum by (train_job, rank) ({last_arrival_estimate})',
                        "rank {{rank}}"),
                  unit="percentunit")
            .min(0).max(1).legend(legend_table("mean", "max").sort_by("Mean").sort_desc(True)))
        .with_panel(
            panel(table.Panel(), "Top ranks by last arrivals",
                  "Ranks that were last at the barrier most often in the shown range, with their "
                  "node. The first row is the rank everyone waited for most; compare its count with "
                  "the steps in the range. Without the skew exchange (K = 0) the count is an "
                  "estimate: the rank's steps in the one-minute windows in which its mean wait was "
                  f"the smallest, shared equally with the ranks within {100 * THRESHOLDS.last_arrival_tie:g} % "
                  "of the step of it.",
                  query(f'topk(10, sum by (train_job, rank, node) ({arrivals_range} {ON_NODE}))',
                        instant=True, table=True),
                  w=6)
            .sort_by([cb.TableSortByFieldState().display_name("Value").desc(True)]))
        .with_panel(
            panel(table.Panel(), "Top nodes by last arrivals",
                  "Last arrivals summed over the ranks of each node. One node on top with several "
                  "of its ranks in the rank table points at the node (cooling, power, NIC, host "
                  "contention), not the rank: see Hardware coupling. Without the skew exchange "
                  "(K = 0), summed from the estimated counts of the rank table.",
                  query(f'topk(10, sum by (train_job, node) ({arrivals_range} {ON_NODE}))',
                        instant=True, table=True),
                  w=6)
            .sort_by([cb.TableSortByFieldState().display_name("Value").desc(True)]))
        .with_row(db.Row("Where the time goes"))
        .with_panel(
            panel(barchart.Panel(), "Phase breakdown per rank",
                  "Share of each rank's time per phase over the shown range (data, forward, backward, "
                  "optimizer, sync, checkpoint, eval, other). The straggler shows the smallest sync share "
                  "(it does not wait); a larger data or forward share names what makes it slow.",
                  query(f'sum by (rank, phase) (rate(syncwatch_phase_seconds_total{{{RANKS}}}[$__range]) {ON_NODE})',
                        instant=True, table=True),
                  unit="percentunit", w=24, h=9)
            .with_transformation(dm.DataTransformerConfig(
                id_val="groupingToMatrix",
                options={"columnField": "phase", "rowField": "rank", "valueField": "Value"}))
            .stacking(cm.StackingMode.PERCENT).x_tick_label_rotation(0)
            .legend(cb.VizLegendOptions().show_legend(True).placement(cm.LegendPlacement.RIGHT)
                    .display_mode(cm.LegendDisplayMode.LIST)))
        .with_row(db.Row("Hangs and desync"))
        .with_panel(
            panel(timeseries.Panel(), "Collective sequence lag per rank",
                  "How many collectives each rank is behind the most advanced rank of the job. "
                  "Each node's daemon is scraped at its own moment, so in a running job the lines "
                  "of a node move together between zero and the collectives the job runs between "
                  "two scrapes: not a rank behind. In a hang the sequences stop and the lag holds: "
                  "the rank whose line stays above zero while the others sit at zero is the one "
                  "behind: the others are blocked in a collective it never entered.",
                  query(f'max by (train_job) ({sequence}) - on (train_job) group_right () '
                        f'(syncwatch_collective_sequence{{{RANKS}}} {ON_NODE})', "rank {{rank}}"),
                  query(f'max by (train_job) ({sequence}) - min by (train_job) ({sequence})',
                        "spread (max − min)"),
                  unit="short")
            .min(0).legend(legend_table("max", "lastNotNull").sort_by("Last *").sort_desc(True)))
        .with_panel(
            panel(timeseries.Panel(), "Last step per rank",
                  "Number of the last step each rank completed. Lines climb together in a "
                  "running job; flat lines while the ranks still report (Current phase per rank) "
                  "are a stall, and a rank whose line stops below the others' is the one behind. "
                  "A restart drops a line to the step the job resumed from.",
                  query(f'syncwatch_last_step{{{RANKS}}} {ON_NODE}', "rank {{rank}}"),
                  unit="short")
            .legend(legend_table("min", "lastNotNull").sort_by("Last *")))
        .with_panel(
            panel(table.Panel(), "Current phase per rank",
                  "Each rank's phase at its last heartbeat and how long it has been in it. A stuck "
                  "job shows most ranks in sync for minutes and the rank behind elsewhere (data, "
                  "forward, checkpoint...): that rank is the one to inspect.",
                  query(f'syncwatch_rank_phase_elapsed_seconds{{{RANKS}}} {ON_NODE}',
                        instant=True, table=True),
                  unit="s", w=24)
            .sort_by([cb.TableSortByFieldState().display_name("Value").desc(True)]))
    )
