"""Fleet: all train jobs on one page, sorted by instability, for the on-call first look."""

from __future__ import annotations

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import table, timeseries
from grafana_foundation_sdk.models import dashboard as dm

from .common import dashboard, legend_table, panel, query, unit_override
from .job_overview import UID as JOB_OVERVIEW_UID

UID = "syncwatch-fleet"

#: Columns of the fleet table: (header, unit, instant PromQL giving one value per train_job).
COLUMNS = (
    ("instability", "percentunit", "max by (train_job) (train_job:syncwatch_instability:score)"),
    ("coupling", "percentunit", "max by (train_job) (train_job:syncwatch_coupling:ratio5m)"),
    ("sync tax", "percentunit", "max by (train_job) (train_job:syncwatch_sync_tax:ratio5m)"),
    ("straggler concentration", "percentunit",
     "max by (train_job) (train_job:syncwatch_straggler_concentration:ratio10m)"),
    ("efficiency", "percentunit", "max by (train_job) (train_job:syncwatch_efficiency:ratio_to_baseline)"),
    ("mean step", "s", "max by (train_job) (train_job:syncwatch_step_seconds:mean5m)"),
    ("world size", "short", "max by (train_job) (syncwatch_job_world_size)"),
    ("restarts 1h", "short", "max by (train_job) (train_job:syncwatch_restarts:increase1h)"),
    ("since last step", "s", "time() - max by (train_job) (syncwatch_last_step_timestamp_seconds)"),
    ("alerts", "short", 'count by (train_job) (ALERTS{train_job!=""})'),
)


def _fleet_table() -> table.Panel:
    refs = [chr(ord("A") + i) for i in range(len(COLUMNS))]
    p = panel(table.Panel(), "Train jobs by instability",
              "One row per train job, most unstable first. instability and coupling near 0 are "
              "healthy; straggler concentration near 1 names a single straggler; a growing 'since "
              "last step' is a stalled job; alerts counts firing and pending syncwatch alerts. "
              "Click a job to open its Job overview. For a job without the skew exchange (K = 0), "
              "coupling and straggler concentration are estimates from its ranks' mean waits.",
              *(query(expr, instant=True, table=True) for _, _, expr in COLUMNS),
              w=24, h=10)
    p = (p.with_transformation(dm.DataTransformerConfig(id_val="merge", options={}))
         .with_transformation(dm.DataTransformerConfig(id_val="organize", options={
             "excludeByName": {"Time": True},
             "renameByName": {f"Value #{ref}": name for ref, (name, _, _) in zip(refs, COLUMNS)},
         }))
         .sort_by([cb.TableSortByFieldState().display_name("instability").desc(True)]))
    for name, unit, _ in COLUMNS:
        p = p.override_by_name(name, [unit_override(unit)])
    return p.override_by_name("train_job", [dm.DynamicConfigValue(id_val="links", value=[{
        "title": "Job overview",
        "url": f"/d/{JOB_OVERVIEW_UID}?var-train_job=${{__value.raw}}&${{__url_time_range}}",
    }])])


def build() -> db.Dashboard:
    return (
        dashboard(UID, "syncwatch / Fleet",
                  "All train jobs on one page, most unstable first: where to look first when paged.")
        .with_panel(_fleet_table())
        .with_panel(
            panel(timeseries.Panel(), "Instability per job",
                  "Instability score of every train job. A job rising above the others is the one "
                  "to open; all rising together points at shared infrastructure (fabric, storage).",
                  query("sort_desc(max by (train_job) (train_job:syncwatch_instability:score))",
                        "{{train_job}}"),
                  unit="percentunit", w=8)
            .min(0).legend(legend_table("max", "lastNotNull").sort_by("Last *").sort_desc(True)))
        .with_panel(
            panel(timeseries.Panel(), "Coupling per job",
                  "Share of each job's rank-time idled waiting for slower peers; for a job without "
                  "the skew exchange (K = 0) an estimate from its ranks' mean waits.",
                  query("max by (train_job) (train_job:syncwatch_coupling:ratio5m)", "{{train_job}}"),
                  unit="percentunit", w=8)
            .min(0).legend(legend_table("max", "lastNotNull").sort_by("Last *").sort_desc(True)))
        .with_panel(
            panel(timeseries.Panel(), "Time since last step per job",
                  "Seconds since any rank of the job completed a step. It saw-tooths at the step "
                  "time while the job runs; a line that keeps climbing is a stalled or hung job "
                  "(open its Straggler map: collective sequence lag names the rank behind).",
                  query("time() - max by (train_job) (syncwatch_last_step_timestamp_seconds)",
                        "{{train_job}}"),
                  unit="s", w=8)
            .min(0).legend(legend_table("max", "lastNotNull").sort_by("Last *").sort_desc(True)))
    )
