"""Building blocks shared by the syncwatch dashboards: the datasource, the variables, panel helpers
and the PromQL fragments every dashboard repeats.

Every panel here is built through the grafana-foundation-sdk builders; the helpers only fix the
habits all syncwatch panels share (Prometheus datasource variable, a description on every panel,
ref ids A, B, C... in query order).
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

#: Every panel and query variable reads from the datasource the ``datasource`` variable selects.
DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")

#: Window of every per-interval rate; Grafana widens it to at least four scrape intervals.
RATE = "$__rate_interval"

#: Selectors shared by the per-job dashboards.
JOB = 'train_job="$train_job"'
RANKS = 'train_job="$train_job", rank=~"$rank"'

#: Multiplying a per-rank expression (labels train_job, rank) by this adds the rank's ``node`` label
#: and keeps only ranks on the selected nodes. ``topk by (...) (1, ...)`` keeps one info series per
#: rank even while a restarted rank's old series (another pid) has not gone stale yet.
ON_NODE = ('* on (train_job, rank) group_left (node) '
           'topk by (train_job, rank) (1, syncwatch_rank_info{train_job="$train_job", node=~"$node"})')

#: Multiplying a hardware series (scraped from a node daemon) by this adds the node name of that
#: daemon's ranks and keeps only the daemons that run ranks of the selected job and nodes. One
#: series per daemon, as the alerts join (``topk by (instance, uuid)``): where one daemon's ranks
#: report two node names (Kubernetes without NODE_NAME, two training pods on a node: each names
#: its pod), one per (instance, node) made the join many-to-many and every hardware panel failed.
ON_DAEMON = ('* on (instance) group_left (node) '
             'topk by (instance) (1, syncwatch_rank_info{train_job="$train_job", node=~"$node"})')


def estimated(record: str) -> str:
    """``record`` (a recorded series holding a job's exact values, or its estimates from mean waits
    where the job runs without the skew exchange) kept for the jobs whose values are estimates only.

    The rules record the ranks' mean waits (``train_job_rank:syncwatch_sync_wait:mean5m``) for jobs
    that exported no exact slack in the last 10 m alone (docs/rules.md, "Without the skew
    exchange"). A panel shows a job's exact series ``or on (train_job)`` this: never the two mixed,
    and no 5 m record filling the intervals between a job's exchanges.
    """
    return f'({record} and on (train_job) train_job_rank:syncwatch_sync_wait:mean5m{{{JOB}}})'


def query(expr: str, legend: str = "", *, instant: bool = False, table: bool = False) -> prometheus.Dataquery:
    """One Prometheus query; ``instant`` for tables and bars that show the value at the range end."""
    q = prometheus.Dataquery().expr(expr).datasource(DATASOURCE)
    if legend:
        q = q.legend_format(legend)
    if instant:
        q = q.instant()
    else:
        q = q.range()
    if table:
        q = q.format(pm.PromQueryFormat.TABLE)
    return q


def panel(builder, title: str, description: str, *queries: prometheus.Dataquery,
          unit: str | None = None, w: int = 12, h: int = 8):
    """Common settings of every panel: title, how-to-read description, datasource, queries A, B, ..."""
    if not description.strip():
        raise ValueError(f"panel {title!r} needs a description")
    b = builder.title(title).description(description).datasource(DATASOURCE).span(w).height(h)
    for i, q in enumerate(queries):
        b = b.with_target(q.ref_id(chr(ord("A") + i)))
    if unit:
        b = b.unit(unit)
    # Explicit defaults so no panel carries ``"options": null`` (the SDK cannot read that back).
    if isinstance(b, stat.Panel):
        b = b.reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]))
    elif isinstance(b, timeseries.Panel):
        b = b.legend(cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.LIST)
                     .placement(cm.LegendPlacement.BOTTOM).show_legend(True))
    return b


def thresholds(*steps: tuple[float | None, str]) -> db.ThresholdsConfig:
    """Absolute thresholds: ``(None, "green"), (0.1, "orange"), ...``."""
    return db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
        [dm.Threshold(value=v, color=c) for v, c in steps])


def legend_table(*calcs: str) -> cb.VizLegendOptions:
    """A table legend at the bottom with the given reductions (``mean``, ``max``, ``lastNotNull``)."""
    return (cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.TABLE)
            .placement(cm.LegendPlacement.BOTTOM).show_legend(True).calcs(list(calcs)))


def datasource_variable() -> db.DatasourceVariable:
    return (db.DatasourceVariable("datasource").label("Data source").type("prometheus")
            .description("Prometheus that scrapes the syncwatch node daemons and evaluates its rules."))


def train_job_variable() -> db.QueryVariable:
    return (db.QueryVariable("train_job").label("Train job").datasource(DATASOURCE)
            .query("label_values(syncwatch_rank_info, train_job)")
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC)
            .description("The training run (label train_job), across its restarts."))


def node_variable() -> db.QueryVariable:
    return (db.QueryVariable("node").label("Node").datasource(DATASOURCE)
            .query('label_values(syncwatch_rank_info{train_job="$train_job"}, node)')
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*")
            .current(dm.VariableOption(selected=True, text="All", value="$__all"))
            .description("Nodes running ranks of the train job."))


def rank_variable() -> db.QueryVariable:
    return (db.QueryVariable("rank").label("Rank").datasource(DATASOURCE)
            .query('label_values(syncwatch_rank_info{train_job="$train_job", node=~"$node"}, rank)')
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.NUMERICAL_ASC)
            .multi(True).include_all(True).all_value(".*")
            .current(dm.VariableOption(selected=True, text="All", value="$__all"))
            .description("Global ranks of the train job on the selected nodes."))


def dashboard(uid: str, title: str, description: str, *variables) -> db.Dashboard:
    """A syncwatch dashboard: stable uid, tags, 1 h range, 30 s refresh, datasource variable first."""
    d = (db.Dashboard(title).uid(uid).description(description).tags(["syncwatch"])
         .time("now-1h", "now").refresh("30s").timezone("browser").editable()
         .tooltip(dm.DashboardCursorSync.CROSSHAIR)
         .link(db.DashboardLink("syncwatch").type(dm.DashboardLinkType.DASHBOARDS).tags(["syncwatch"])
               .as_dropdown(True).include_vars(True).keep_time(True)))
    for v in (datasource_variable(), *variables):
        d = d.with_variable(v)
    return d


def number_panels(dash: dm.Dashboard) -> dm.Dashboard:
    """Give every panel (rows included) a unique id in layout order; the SDK leaves them at 0."""
    for i, p in enumerate(dash.panels or [], start=1):
        p.id_val = i
    return dash


def unit_override(unit: str) -> dm.DynamicConfigValue:
    """Field override property setting the unit (for a panel mixing units)."""
    return dm.DynamicConfigValue(id_val="unit", value=unit)
