"""Every dashboard query, executed against a real Prometheus fed by real daemons.

Three simulated train jobs (a persistent straggler with a hot, throttled GPU under it, the same
straggler in a job whose ranks run without the skew exchange (K = 0), and a job that restarts
twice) send to one node daemon per simulated node; the straggler jobs' daemons also run the
GPU/NIC/InfiniBand collectors over a fake NVML and sysfs trees. A Prometheus from the Debian package
scrapes them with the recording and alerting rules loaded (windows scaled down). Each panel query is
substituted exactly as Grafana would (``dashboards.queries.substitute``) and must parse and return
at least one series for the job it is meant for; the straggler map, hardware and fleet dashboards
must also point at the injected culprit, with the exchange from its exact series and without it
from the rules' estimates.
"""

from __future__ import annotations

import shutil
import sys
import time

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT))
from dashboards import queries  # noqa: E402
from dashboards.sandbox import Sandbox, Snapshot  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="prometheus missing (Debian package prometheus)")

STRAGGLER, RESTARTS = "dash-straggler", "dash-restarts"
#: The straggler scenario again, its ranks without the skew exchange (K = 0).
ESTIMATED = "dash-k0-straggler"
# simulated run before querying (rule windows are scaled by 0.05): the efficiency ratio's trailing
# baseline (1h ending 35m back) has its first value 40 rule minutes into a job, 2 minutes here
RUN_SECONDS = 125
SETTLE_SECONDS = 60       # then at most this long for the last panels' first data (a loaded machine)
RANGE_OFFSET = 6          # dashboard range starts this long after the jobs started

#: Panels meant for the restarts scenario; every other panel is checked against the straggler job.
MEANT_FOR = {
    ("syncwatch-job-overview", "Restarts and re-run steps"): RESTARTS,
    ("syncwatch-job-overview", "Restarts and re-run work"): RESTARTS,
    ("syncwatch-efficiency", "Re-run ratio"): RESTARTS,
    ("syncwatch-efficiency", "Checkpoint and evaluation time share"): RESTARTS,
}

#: Queries with no value without the skew exchange, by design: the estimate from mean waits has no tail.
NO_ESTIMATE = {("syncwatch-job-overview", "Barrier skew", "B")}

DASHBOARDS = queries.load_all()
ALL_QUERIES = [q for d in DASHBOARDS.values() for q in queries.panel_queries(d)]


class Run(Snapshot):
    """The sandbox after its run: one fixed dashboard time range for every query, the panel's job
    selected (``MEANT_FOR``), node and rank "All" unless a test selects them."""

    def __init__(self, box: Sandbox):
        super().__init__(box, start=box.started_at + RANGE_OFFSET, end=time.time())
        self.straggler_rank, self.straggler_node, _ = box.straggler(box.jobs[0])
        _, self.estimated_node, _ = box.straggler(box.jobs[1])

    def _selected(self, q: queries.PanelQuery, selected: dict) -> dict:
        return {"train_job": MEANT_FOR.get((q.dashboard, q.panel), STRAGGLER), "node": None,
                "rank": None, **selected}

    def expr(self, q: queries.PanelQuery, selected: dict | None = None) -> str:
        return super().expr(q, self._selected(q, selected or {}))

    def run(self, q: queries.PanelQuery, selected: dict | None = None) -> list[dict]:
        return super().run(q, self._selected(q, selected or {}))

    def panel(self, uid: str, title: str, ref: str = "A", **selected) -> list[dict]:
        (q,) = [q for q in queries.panel_queries(DASHBOARDS[uid]) if q.panel == title and q.ref_id == ref]
        return self.run(q, selected)


@pytest.fixture(scope="module")
def run():
    box = Sandbox({STRAGGLER: "straggler", ESTIMATED: "straggler", RESTARTS: "restarts"},
                  hardware_jobs=2, without_exchange=(ESTIMATED,))
    box.start()
    try:
        box.wait_for_data(RUN_SECONDS)
        yield settled(box)
    finally:
        box.stop()


def settled(box: Sandbox) -> Run:
    """The run once every panel has data, or ``SETTLE_SECONDS`` later. On a loaded machine an
    alert's ``for`` or a rule's first window ended after ``RUN_SECONDS``, and a panel had no data
    yet: the tests asserted the machine's speed, not the panel."""
    deadline = time.time() + SETTLE_SECONDS
    while True:
        run = Run(box)
        if time.time() > deadline or (
                all(run.run(q) for q in ALL_QUERIES)
                and all(run.run(q, {"train_job": ESTIMATED}) for q in ESTIMATED_QUERIES)):
            return run
        box.wait_for_data(time.time() - box.started_at + 2)


def _mean(series: dict) -> float:
    """Mean of a range series, NaN points (0/0 before the first event) left out."""
    vals = [float(v) for _, v in series["values"] if v != "NaN"]
    return sum(vals) / len(vals) if vals else float("nan")


def _value(series: dict) -> float:
    """An instant query's value, or a range query's last value (what a stat panel shows)."""
    return float(series["value"][1] if "value" in series else series["values"][-1][1])


@pytest.mark.parametrize("q", ALL_QUERIES, ids=lambda q: f"{q.dashboard}:{q.panel}:{q.ref_id}")
def test_every_panel_query_returns_data(run, q):
    result = run.run(q)
    assert result, f"no series for {run.expr(q)}"


def test_straggler_map_names_the_injected_straggler(run):
    uid, rank, node = "syncwatch-straggler-map", str(run.straggler_rank), run.straggler_node
    top = sorted(run.panel(uid, "Top ranks by last arrivals"), key=_value, reverse=True)
    assert (top[0]["metric"]["rank"], top[0]["metric"]["node"]) == (rank, node)
    assert _value(top[0]) > 5 * _value(top[1])
    top_nodes = sorted(run.panel(uid, "Top nodes by last arrivals"), key=_value, reverse=True)
    assert top_nodes[0]["metric"]["node"] == node
    share = run.panel(uid, "Last-arrival share per rank")
    assert max(share, key=_mean)["metric"]["rank"] == rank and max(map(_mean, share)) > 0.7
    # The heatmap's cold row: the straggler never waits, everyone else waits for it.
    slack = run.panel(uid, "Slack share by rank over time")
    assert len(slack) == 8 and min(slack, key=_mean)["metric"]["rank"] == rank
    phases = run.panel(uid, "Phase breakdown per rank")
    sync = {s["metric"]["rank"]: _value(s) for s in phases if s["metric"]["phase"] == "sync"}
    assert min(sync, key=sync.get) == rank


def test_node_and_rank_variables_filter(run):
    uid = "syncwatch-straggler-map"
    only_node = run.panel(uid, "Top ranks by last arrivals", node=[run.straggler_node])
    assert {s["metric"]["node"] for s in only_node} == {run.straggler_node}
    only_rank = run.panel(uid, "Slack share by rank over time", rank=["0", str(run.straggler_rank)])
    assert {s["metric"]["rank"] for s in only_rank} == {"0", str(run.straggler_rank)}


def _sim(run, train_job: str):
    """The simulator thread running ``train_job`` in the sandbox."""
    return run.box.sims[[job.train_job for job in run.box.jobs].index(train_job)]


def test_hardware_dashboard_points_at_the_hot_node(run):
    uid, node = "syncwatch-hardware", run.straggler_node
    late = run.panel(uid, "Lateness of the ranks per node")
    assert max(late, key=_mean)["metric"]["node"] == node
    throttled = [s for s in run.panel(uid, "GPU throttle reasons") if _mean(s) > 0]
    assert {(s["metric"]["node"], s["metric"]["reason"]) for s in throttled} >= {(node, "sw_thermal")}
    assert {s["metric"]["node"] for s in throttled} == {node}
    hottest = max(run.panel(uid, "GPU temperature"), key=_mean)
    assert hottest["metric"]["node"] == node
    xid = run.panel(uid, "XID errors")
    assert [(s["metric"]["node"], s["metric"]["xid"], _value(s)) for s in xid] == [(node, "13", 1.0)]


def test_job_overview_reads_as_a_persistent_straggler(run):
    uid = "syncwatch-job-overview"
    (conc,) = run.panel(uid, "Straggler concentration")
    assert _mean(conc) > 0.7
    (coupling,) = run.panel(uid, "Coupling score")
    truth = _sim(run, STRAGGLER).truth  # the whole run's: the panel's windows follow it within ~5 %
    assert _mean(coupling) == pytest.approx(
        sum(truth.slack_seconds) / sum(r.step_seconds for r in truth.reported), rel=0.15)
    ideal = run.panel(uid, "Throughput against ideal linear scaling", "B")
    measured = run.panel(uid, "Throughput against ideal linear scaling", "A")
    assert _mean(ideal[0]) >= 0.9 * _mean(measured[0])
    components = {s["metric"]["component"] for s in
                  run.panel(uid, "Instability score and its components", "B")}
    assert components >= {"cv", "skew", "oscillation", "rerun"}


def test_restart_panels_count_the_restarts(run):
    uid = "syncwatch-job-overview"
    (restarts,) = run.panel(uid, "Restarts and re-run steps", "A", train_job=RESTARTS)
    (rerun,) = run.panel(uid, "Restarts and re-run steps", "B", train_job=RESTARTS)
    n = _value(restarts)  # the simulator restarts twice; both panels read the same scrape
    assert n in (1, 2)
    truth = sum(r.rerun_steps for r in _sim(run, RESTARTS).truth.restarts[:int(n)])
    # the daemons' count (30, or 40 after both), or where an old attempt still shows, the rules'
    # estimate from the steps, a scrape interval's steps above it at most (docs/rules.md)
    assert truth <= _value(rerun) <= 1.1 * truth
    ratio = run.panel("syncwatch-efficiency", "Re-run ratio", "A", train_job=RESTARTS)
    assert 0 < _mean(ratio[0]) < 1
    none = run.panel(uid, "Restarts and re-run steps", "A", train_job=STRAGGLER)
    assert all(_value(s) == 0 for s in none)


def test_fleet_lists_every_job_once(run):
    (instability,) = [q for q in queries.panel_queries(DASHBOARDS["syncwatch-fleet"])
                      if q.panel == "Train jobs by instability" and q.ref_id == "A"]
    jobs = [s["metric"]["train_job"] for s in run.run(instability)]
    assert sorted(jobs) == sorted([STRAGGLER, ESTIMATED, RESTARTS])


def test_energy_panels_attribute_waiting_power(run):
    uid = "syncwatch-efficiency"
    (waiting,) = run.panel(uid, "Power burned waiting at barriers", "A")
    (total,) = run.panel(uid, "Power burned waiting at barriers", "B")
    assert 0 < _mean(waiting) < _mean(total)
    (per_sample,) = run.panel(uid, "Energy per sample")
    assert _mean(per_sample) > 0


# --- without the skew exchange (K = 0): the panels show the rules' estimates from mean waits ---

ESTIMATED_QUERIES = [q for q in ALL_QUERIES
                     if (q.dashboard, q.panel) not in MEANT_FOR
                     and (q.dashboard, q.panel, q.ref_id) not in NO_ESTIMATE]


@pytest.mark.parametrize("q", ESTIMATED_QUERIES, ids=lambda q: f"{q.dashboard}:{q.panel}:{q.ref_id}")
def test_without_the_skew_exchange_every_panel_query_returns_data(run, q):
    result = run.run(q, {"train_job": ESTIMATED})
    assert result, f"no series for {run.expr(q, {'train_job': ESTIMATED})}"


def test_without_the_skew_exchange_the_straggler_map_names_the_straggler(run):
    uid, rank, node = "syncwatch-straggler-map", str(run.straggler_rank), run.estimated_node
    top = sorted(run.panel(uid, "Top ranks by last arrivals", train_job=ESTIMATED), key=_value, reverse=True)
    assert (top[0]["metric"]["rank"], top[0]["metric"]["node"]) == (rank, node)
    assert _value(top[0]) > 5 * _value(top[1])
    top_nodes = sorted(run.panel(uid, "Top nodes by last arrivals", train_job=ESTIMATED), key=_value,
                       reverse=True)
    assert top_nodes[0]["metric"]["node"] == node
    share = run.panel(uid, "Last-arrival share per rank", train_job=ESTIMATED)
    assert max(share, key=_mean)["metric"]["rank"] == rank and max(map(_mean, share)) > 0.7
    slack = run.panel(uid, "Slack share by rank over time", train_job=ESTIMATED)
    assert len(slack) == 8 and min(slack, key=_mean)["metric"]["rank"] == rank
    only = run.panel(uid, "Slack share by rank over time", train_job=ESTIMATED, rank=["0", rank])
    assert {s["metric"]["rank"] for s in only} == {"0", rank}
    per_node = run.box.jobs[1].ranks_per_node
    first = run.straggler_rank // per_node * per_node
    for title in ("Top ranks by last arrivals", "Last-arrival share per rank"):
        on_node = run.panel(uid, title, train_job=ESTIMATED, node=[node])
        assert {int(s["metric"]["rank"]) for s in on_node} == set(range(first, first + per_node)), title


def test_without_the_skew_exchange_the_late_node_and_the_scores_show_the_estimates(run):
    late = max(run.panel("syncwatch-hardware", "Lateness of the ranks per node", train_job=ESTIMATED),
               key=_mean)
    assert late["metric"]["node"] == run.estimated_node and _mean(late) > 0
    uid = "syncwatch-job-overview"
    (conc,) = run.panel(uid, "Straggler concentration", train_job=ESTIMATED)
    assert _mean(conc) > 0.7
    (coupling,) = run.panel(uid, "Coupling score", train_job=ESTIMATED)
    assert _mean(coupling) > 0.02
    (skew,) = run.panel(uid, "Barrier skew", "A", train_job=ESTIMATED)
    (step,) = run.panel(uid, "Step time p50 / p99 and mean", "C", train_job=ESTIMATED)
    assert 0.02 < _mean(skew) / _mean(step) < 0.2
    assert run.panel(uid, "Barrier skew", "B", train_job=ESTIMATED) == []     # no tail to estimate
    fleet = {ref: {s["metric"]["train_job"]: _value(s) for s in run.panel("syncwatch-fleet",
                                                                          "Train jobs by instability", ref)}
             for ref in "BD"}
    assert fleet["B"][ESTIMATED] > 0.02 and fleet["D"][ESTIMATED] > 0.7
    uid = "syncwatch-efficiency"
    (idle,) = run.panel(uid, "GPUs idle at barriers", train_job=ESTIMATED)
    assert _mean(idle) == pytest.approx(8 * _mean(coupling), rel=0.2)   # 8 ranks, each its slack share
    (waiting,) = run.panel(uid, "Power burned waiting at barriers", "A", train_job=ESTIMATED)
    (total,) = run.panel(uid, "Power burned waiting at barriers", "B", train_job=ESTIMATED)
    assert 0 < _mean(waiting) < _mean(total)
    (share,) = run.panel(uid, "Energy burned waiting in range", "B", train_job=ESTIMATED)
    assert 0 < _value(share) < 1


def test_with_the_skew_exchange_no_panel_reads_an_estimate_after_its_first_exchange(run):
    """The estimates' input, recorded for jobs without exact slack in the last 10m only, is gone
    for the job with the exchange within two evaluations of its first slack: its panels show exact
    values alone from then on (their estimate branch is per job, ``or on (train_job)``, and kept to
    jobs with that input)."""
    def times(expr: str) -> list[float]:
        series = run.box.prometheus.query_range(expr, run.box.started_at, run.end, run.step)
        return sorted(t for s in series for t, _ in s["values"])

    exact = times(f'syncwatch_slack_seconds_total{{train_job="{STRAGGLER}"}}')
    estimated = times(f'train_job_rank:syncwatch_sync_wait:mean5m{{train_job="{STRAGGLER}"}}')
    assert exact and all(t <= exact[0] + 2 * run.box.scrape_interval for t in estimated)
