"""Structural tests of the generated Grafana dashboards (no Prometheus needed, except promtool)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from grafana_foundation_sdk.cog import plugins
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

from conftest import ROOT

sys.path.insert(0, str(ROOT))
from dashboards import generate, queries  # noqa: E402
from dashboards.fleet import COLUMNS  # noqa: E402

#: The uids links and bookmarks point at. Changing one breaks every saved link: add, never rename.
EXPECTED_UIDS = {"syncwatch-job-overview", "syncwatch-straggler-map", "syncwatch-hardware",
                 "syncwatch-efficiency", "syncwatch-fleet"}
#: Which variables each dashboard must offer (datasource everywhere).
EXPECTED_VARIABLES = {
    "syncwatch-job-overview": ["datasource", "train_job"],
    "syncwatch-straggler-map": ["datasource", "train_job", "node", "rank"],
    "syncwatch-hardware": ["datasource", "train_job", "node"],
    "syncwatch-efficiency": ["datasource", "train_job"],
    "syncwatch-fleet": ["datasource"],
}

DASHBOARDS = queries.load_all()


def test_committed_json_equals_generator_output():
    assert generate.stale(generate.rendered()) == []
    assert generate.main(["--check"]) == 0


def test_check_fails_on_a_hand_edited_or_orphan_file(tmp_path, monkeypatch, capsys):
    for p in generate.OUT_DIR.glob("*.json"):
        shutil.copy(p, tmp_path / p.name)
    monkeypatch.setattr(generate, "OUT_DIR", tmp_path)
    assert generate.main(["--check"]) == 0
    edited = tmp_path / "syncwatch-fleet.json"
    edited.write_text(edited.read_text().replace("Train jobs by instability", "Jobs"))
    (tmp_path / "orphan.json").write_text("{}")
    assert generate.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "syncwatch-fleet.json" in err and "orphan.json" in err
    assert generate.main([]) == 0           # regenerating repairs the edit (the orphan stays)
    assert edited.read_text() == (generate.OUT_DIR / "syncwatch-fleet.json").read_text()


def test_generator_is_deterministic():
    assert generate.rendered() == generate.rendered()


@pytest.mark.parametrize("uid", sorted(DASHBOARDS))
def test_loads_back_through_the_sdk_models(uid):
    plugins.register_default_plugins()
    data = DASHBOARDS[uid]
    model = dm.Dashboard.from_json(data)
    assert model.uid == uid
    # Round trip: nothing lost (the SDK may add its defaults, e.g. fieldConfig.defaults.custom),
    # and a second round trip changes nothing.
    back = json.loads(json.dumps(model, cls=JSONEncoder))
    _assert_contained(data, back)
    assert json.loads(json.dumps(dm.Dashboard.from_json(back), cls=JSONEncoder)) == back
    for p in model.panels:
        if isinstance(p, dm.RowPanel):
            continue
        assert p.targets, f"{p.title}: no query"
        for t in p.targets:
            assert isinstance(t, pm.Dataquery), f"{p.title}: query not read back as Prometheus"
            assert t.expr and t.ref_id


def _assert_contained(orig, back, path=""):
    """Every key and value of ``orig`` is in ``back``."""
    if isinstance(orig, dict):
        assert isinstance(back, dict), path
        for k, v in orig.items():
            assert k in back, f"{path}/{k} lost"
            _assert_contained(v, back[k], f"{path}/{k}")
    elif isinstance(orig, list):
        assert isinstance(back, list) and len(back) == len(orig), path
        for i, (a, b) in enumerate(zip(orig, back)):
            _assert_contained(a, b, f"{path}[{i}]")
    else:
        assert orig == back, f"{path}: {orig!r} != {back!r}"


def test_uids_stable_unique_and_named_after_their_file():
    assert set(DASHBOARDS) == EXPECTED_UIDS
    for uid, d in DASHBOARDS.items():
        assert d["uid"] == uid and len(uid) <= 40


@pytest.mark.parametrize("uid", sorted(DASHBOARDS))
def test_every_panel_has_title_description_unique_id_and_datasource(uid):
    d = DASHBOARDS[uid]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and 0 not in ids
    ref_ids = set()
    for p in queries.panels(d):
        assert p.get("title", "").strip(), p
        assert len(p.get("description", "").strip()) > 40, f"{p['title']}: description says too little"
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(refs), p["title"]
        ref_ids.update(refs)
        assert 0 < p["gridPos"]["w"] <= 24 and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
    titles = [p["title"] for p in queries.panels(d)]
    assert len(titles) == len(set(titles)), "panel titles must be unique (tests and docs refer to them)"


#: What a job without the skew exchange (K = 0) has only as estimates from its ranks' mean waits:
#: exact series, and the records that fall back to the estimates (docs/rules.md).
EXCHANGE_READS = ("syncwatch_slack", "syncwatch_last_arrival", "syncwatch_barrier_skew", "syncwatch_coupling",
                  "syncwatch_straggler_concentration", "syncwatch_skew_step", "syncwatch_instability:component")


@pytest.mark.parametrize("uid", sorted(DASHBOARDS))
def test_panels_reading_the_skew_exchange_say_what_they_show_without_it(uid):
    for p in queries.panels(DASHBOARDS[uid]):
        if any(s in t["expr"] for t in p["targets"] for s in EXCHANGE_READS):
            assert "(K = 0)" in p["description"] and "estimate" in p["description"], p["title"]


@pytest.mark.parametrize("uid", sorted(DASHBOARDS))
def test_panels_showing_a_share_show_percent(uid):
    """A panel whose description says it shows a share reads as one: the phase breakdown per rank
    (rate of phase seconds: seconds per second) was in unit "s", so its tooltip read a rank's sync
    share of 45 % as "450 ms"."""
    for p in queries.panels(DASHBOARDS[uid]):
        if p["description"].startswith("Share of"):
            assert p["fieldConfig"]["defaults"].get("unit") == "percentunit", p["title"]


def test_efficiency_alerts_read_series_the_efficiency_dashboard_shows():
    """Each recorded series an efficiency alert reads, its value and the baseline it compares
    against, is on a panel of the Efficiency dashboard: Energy per sample showed the 5 m value
    without the trailing baseline SyncwatchEnergyOutpacingOutput divides by (the runbook said
    "no panel: query it"), so the rise that paged could not be seen."""
    rules = yaml.safe_load((ROOT / "alerts" / "efficiency.rules.yml").read_text())
    shown = " ".join(q.expr for q in queries.panel_queries(DASHBOARDS["syncwatch-efficiency"]))
    for rule in rules["groups"][0]["rules"]:
        for record in set(re.findall(r"train_job:syncwatch_[\w:]+", rule["expr"])):
            assert record in shown, f"{rule['alert']} reads {record}, which no panel shows"


def _colour_at(p: dict, value: float) -> str:
    steps = p["fieldConfig"]["defaults"]["thresholds"]["steps"]
    return [s["color"] for s in steps if s["value"] is None or s["value"] <= value][-1]


def test_score_stats_turn_red_where_their_alert_fires():
    """Red on a stat is where the rules page, no earlier and no later
    (exporter/syncwatch/rules/thresholds.py): the instability stat was red from 0.25 while
    SyncwatchJobUnstable warns above 0.5 (the calibration keeps healthy jobs under 0.2), and the
    straggler concentration stat stayed orange up to 0.8 while SyncwatchPersistentStraggler fires
    from a last-arrival share of 0.6."""
    from syncwatch.rules.thresholds import THRESHOLDS as T

    stats = {p["title"]: p for p in queries.panels(DASHBOARDS["syncwatch-job-overview"])}
    for title, alert in (("Coupling score", T.coupling_warn), ("Instability score", T.instability_warn),
                         ("Straggler concentration", T.straggler_share)):
        assert _colour_at(stats[title], alert * 0.99) != "red", title
        assert _colour_at(stats[title], alert * 1.01) == "red", title
    restarts = stats["Restarts and re-run steps"]  # red for the restarts only, at the crash loop
    (override,) = [o for o in restarts["fieldConfig"]["overrides"]
                   if o["matcher"] == {"id": "byName", "options": "restarts (1h)"}]
    (steps,) = [p["value"] for p in override["properties"] if p["id"] == "thresholds"]
    as_restarts = {"fieldConfig": {"defaults": {"thresholds": steps}}}
    assert _colour_at(as_restarts, T.restarts_crit - 1) == "orange"
    assert _colour_at(as_restarts, T.restarts_crit) == "red"
    assert _colour_at(restarts, 10_000) == "orange"  # re-run steps: no alert, never red
    eff = next(p for p in queries.panels(DASHBOARDS["syncwatch-efficiency"])
               if p["title"] == "Efficiency against baseline")
    assert _colour_at(eff, T.efficiency_warn * 0.99) == "red"
    assert _colour_at(eff, T.efficiency_warn * 1.01) != "red"


def test_sync_tax_stat_has_no_alarm_colour():
    """No rule alerts on the sync tax, and it includes the transfer itself: the simulator's
    healthy job spends 15 % of its step there, the straggler job 18 %. Its stat shared the
    coupling score's colours, orange from 10 % and red from 25 % (where SyncwatchCouplingHigh warns
    on coupling), so a healthy job's sync tax read as a warning no alert backed."""
    stat = next(p for p in queries.panels(DASHBOARDS["syncwatch-job-overview"]) if p["title"] == "Sync tax")
    for value in (0, 0.15, 0.3, 0.9):
        assert _colour_at(stat, value) not in ("orange", "red"), value


@pytest.mark.parametrize("uid", sorted(DASHBOARDS))
def test_every_variable_is_used_and_every_used_variable_exists(uid):
    d = DASHBOARDS[uid]
    defs = queries.variables(d)
    assert list(defs) == EXPECTED_VARIABLES[uid]
    assert defs["datasource"]["type"] == "datasource" and defs["datasource"]["query"] == "prometheus"
    exprs = [q.expr for q in queries.panel_queries(d)]
    panel_ds = [p["datasource"]["uid"] for p in queries.panels(d)]
    for name, var in defs.items():
        others = [v.get("query", "") for n, v in defs.items() if n != name and v["type"] == "query"]
        others += [v["datasource"]["uid"] for v in defs.values() if v.get("datasource")]
        assert any(name in queries.referenced(t) for t in exprs + panel_ds + others), f"${name} unused"
    for q in queries.panel_queries(d):
        unknown = queries.referenced(q.expr) - set(defs) - set(queries.BUILTINS)
        assert not unknown, f"{q.panel}: {unknown}"


def test_substitution_follows_grafana_rules():
    d = DASHBOARDS["syncwatch-straggler-map"]
    expr = 'x{train_job="$train_job", node=~"$node", rank=~"${rank}"}[$__rate_interval] $__range $__range_s'
    out = queries.substitute(expr, d, {"train_job": "j.1", "node": None, "rank": ["1", "12"]},
                             rate_interval=60, range_seconds=900)
    assert out == 'x{train_job="j.1", node=~".*", rank=~"(1|12)"}[60s] 900s 900'
    single = queries.substitute('{node=~"$node"}', d, {"node": ["n.1"]}, rate_interval=1, range_seconds=1)
    assert single == r'{node=~"n\\.1"}'
    with pytest.raises(KeyError):
        queries.substitute("$gpu", d, {}, rate_interval=1, range_seconds=1)
    with pytest.raises(KeyError):
        queries.substitute("$train_job", d, {"train_job": None}, rate_interval=1, range_seconds=1)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing (Debian package prometheus)")
def test_every_query_parses_with_promtool(tmp_path):
    """Each substituted query as a recording rule: promtool parses every expression."""
    rules = []
    for uid, d in DASHBOARDS.items():
        selected = {n: (None if v.get("includeAll") else "job") for n, v in queries.variables(d).items()}
        for q in queries.panel_queries(d):
            expr = queries.substitute(q.expr, d, selected, rate_interval=60, range_seconds=3600)
            rules.append({"record": f"parse:{uid.replace('-', '_')}:{len(rules)}", "expr": expr})
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    r = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(rules)} rules found" in r.stdout


# --- panel queries on hand-made series: what a panel shows, checked with promtool's evaluator ---

#: Grafana's $__rate_interval at the provisioned 15 s scrape interval (4 x scrape interval).
RATE_INTERVAL = 60

#: The shipped recording rules: the panels' estimates for jobs without the skew exchange come from
#: them, and never show for a job with it (the tests with the exchange load them too).
RECORDING_RULES = (str(ROOT / "alerts" / "recording.rules.yml"),)


def _panel_expr(uid: str, title: str, ref: str = "A", **selected) -> str:
    d = DASHBOARDS[uid]
    q = next(q for q in queries.panel_queries(d) if q.panel == title and q.ref_id == ref)
    chosen = {n: (None if v.get("includeAll") else "j") for n, v in queries.variables(d).items()}
    return queries.substitute(q.expr, d, {**chosen, **selected}, rate_interval=RATE_INTERVAL,
                              range_seconds=3600)


def _promtool_expect(tmp_path, series: dict[str, str], cases: list[tuple[str, str, list]],
                     rule_files: tuple[str, ...] = ()) -> None:
    """Evaluate each ``(expr, eval_time, expected samples)`` on ``series`` (15 s apart) with
    ``promtool test rules``, the ``rule_files`` (absolute paths) evaluated every 15 s; its report
    names the expression, the expected and the got values."""
    (tmp_path / "none.rules.yml").write_text("groups: []\n")
    test = {"rule_files": list(rule_files) or ["none.rules.yml"], "evaluation_interval": "15s", "tests": [{
        "interval": "15s",
        "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "promql_expr_test": [{"expr": e, "eval_time": t, "exp_samples": exp} for e, t, exp in cases],
    }]}
    path = tmp_path / "panel.test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    r = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def _skew_exchange_job(step_seconds: float, every: int = 50, skew: float = 0.3) -> dict[str, str]:
    """Job ``j``: rank 0 on node a (the straggler, no slack), rank 1 on node b (waits ``skew`` every
    step); the skew exchange of ``every`` steps lands its slack and skew at once, as the ranks do."""
    per_scrape = 15 / step_seconds
    exchanges = every * step_seconds / 15          # scrapes between two exchanges
    assert per_scrape.is_integer() and exchanges.is_integer()
    n, k = 40, int(exchanges)

    def stairs(step: float) -> str:
        return " ".join(f"{i * step:g}x{k - 1}" for i in range(n // k))

    total = n // k * k - 1
    series = {'syncwatch_steps_total{train_job="j", rank="%s", instance="%s:9477"}' % (r, node):
              f"0+{per_scrape:g}x{total}" for r, node in (("0", "a"), ("1", "b"))}
    series.update({'syncwatch_step_seconds_total{train_job="j", rank="%s", instance="%s:9477"}' % (r, node):
                   f"0+15x{total}" for r, node in (("0", "a"), ("1", "b"))})
    series.update({
        'syncwatch_rank_info{train_job="j", rank="0", local_rank="0", node="a", gpu="0", uuid="GPU-a0", pid="1", instance="a:9477"}': f"1x{total}",
        'syncwatch_rank_info{train_job="j", rank="1", local_rank="0", node="b", gpu="0", uuid="GPU-b0", pid="2", instance="b:9477"}': f"1x{total}",
        'syncwatch_slack_seconds_total{train_job="j", rank="0", instance="a:9477"}': f"0x{total}",
        'syncwatch_slack_seconds_total{train_job="j", rank="1", instance="b:9477"}': stairs(every * skew),
        'syncwatch_last_arrivals_total{train_job="j", rank="0", instance="a:9477"}': stairs(every),
        'syncwatch_last_arrivals_total{train_job="j", rank="1", instance="b:9477"}': f"0x{total}",
        'syncwatch_barrier_skew_seconds_sum{train_job="j", instance="a:9477"}': stairs(every * skew),
        'syncwatch_barrier_skew_seconds_count{train_job="j", instance="a:9477"}': stairs(every),
    })
    return series


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing (Debian package prometheus)")
def test_rank_lateness_per_node_is_the_skew_less_the_slack_of_the_same_steps(tmp_path):
    """Steps of 3 s, the skew exchange every 50 steps (150 s): an interval with the exchange
    shows the straggler's node 0.3 s late and the waiting node on time; an interval without one
    shows no value, not an estimate from the recording rules either. The slack of 50 steps used
    to be divided by the ~20 steps of the interval (the waiting node read -0.45 s, the average of
    a node holding both went below zero and out of the panel) and an interval without an exchange
    read NaN (0/0), which made the legend's mean and max NaN and its sort useless."""
    lateness = _panel_expr("syncwatch-hardware", "Lateness of the ranks per node", node=None)
    _promtool_expect(tmp_path, _skew_exchange_job(3), [
        (lateness, WITH_EXCHANGE, [{"labels": '{node="a"}', "value": 0.3}, {"labels": '{node="b"}', "value": 0}]),
        (lateness, WITHOUT_EXCHANGE, []),
    ], rule_files=RECORDING_RULES)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing (Debian package prometheus)")
def test_a_node_s_lateness_is_its_latest_rank_s_not_the_average_of_its_ranks(tmp_path):
    """Node a holds the straggler (0.3 s late a step) and a rank that waits for it like node b's:
    the node reads 0.3 s, not 0.15 s. Averaged over 8 GPUs a node's one hot GPU read an eighth
    of its lateness, level with the jitter of healthy nodes."""
    series = _skew_exchange_job(3)
    waiting = {k: v for k, v in series.items() if 'rank="1"' in k}
    for key, values in waiting.items():
        key = key.replace('rank="1"', 'rank="2"').replace('"b:9477"', '"a:9477"')
        series[key.replace('node="b"', 'node="a"').replace('GPU-b0', 'GPU-a1')] = values
    lateness = _panel_expr("syncwatch-hardware", "Lateness of the ranks per node", node=None)
    _promtool_expect(tmp_path, series, [
        (lateness, WITH_EXCHANGE, [{"labels": '{node="a"}', "value": 0.3}, {"labels": '{node="b"}', "value": 0}]),
    ], rule_files=RECORDING_RULES)


#: Evaluation times in _skew_exchange_job(3): the exchange lands at 150 s; the rate window of 225 s
#: ([165 s, 225 s]) holds none.
WITH_EXCHANGE, WITHOUT_EXCHANGE = "165s", "225s"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing (Debian package prometheus)")
def test_straggler_map_reads_the_steps_of_the_skew_exchange(tmp_path):
    """Same job: the heatmap shows rank 1 idle 10 % of its time (0.3 s of each 3 s step) and the
    straggler 0 %, the last-arrival share gives rank 0 every last arrival; an interval without an
    exchange has no value, not an estimate from the recording rules either. The heatmap used to
    divide 50 steps of slack by the ~20 steps of time of the interval (rank 1 read 25 %, then 0 %
    in the next interval: stripes, not rows) and the last-arrival share read NaN (0/0) between
    exchanges."""
    slack_share = _panel_expr("syncwatch-straggler-map", "Slack share by rank over time", node=None, rank=None)
    slack_share = f"round({slack_share}, 0.0001)"
    last_share = _panel_expr("syncwatch-straggler-map", "Last-arrival share per rank", node=None, rank=None)
    _promtool_expect(tmp_path, _skew_exchange_job(3), [
        (slack_share, WITH_EXCHANGE, [{"labels": '{rank="0"}', "value": 0}, {"labels": '{rank="1"}', "value": 0.1}]),
        (slack_share, WITHOUT_EXCHANGE, []),
        (last_share, WITH_EXCHANGE, [{"labels": '{train_job="j", rank="0"}', "value": 1},
                                     {"labels": '{train_job="j", rank="1"}', "value": 0}]),
        (last_share, WITHOUT_EXCHANGE, []),
    ], rule_files=RECORDING_RULES)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing (Debian package prometheus)")
def test_efficiency_reads_the_steps_of_the_skew_exchange(tmp_path):
    """Same job, each GPU drawing 200 W: rank 1 idles 0.3 s of each 3 s step, so the job has 0.1
    GPUs idle and burns 20 W waiting; an interval without an exchange has no value. Both panels
    divided the slack of the exchange's 50 steps by the ~20 steps of time of the interval and read
    0.25 GPUs and 50 W after an exchange, then 0 GPUs and 0 W until the next one: a comb around the
    truth, not a level."""
    series = _skew_exchange_job(3)
    total = 39
    series.update({f'syncwatch_gpu_energy_joules_total{{gpu="0", uuid="GPU-{n}0", instance="{n}:9477"}}':
                   f"0+3000x{total}" for n in "ab"})
    idle = f'round({_panel_expr("syncwatch-efficiency", "GPUs idle at barriers")}, 0.0001)'
    waiting = f'round({_panel_expr("syncwatch-efficiency", "Power burned waiting at barriers")}, 0.0001)'
    _promtool_expect(tmp_path, series, [
        (idle, WITH_EXCHANGE, [{"labels": '{train_job="j"}', "value": 0.1}]),
        (idle, WITHOUT_EXCHANGE, []),
        (waiting, WITH_EXCHANGE, [{"labels": '{train_job="j"}', "value": 20}]),
        (waiting, WITHOUT_EXCHANGE, []),
    ], rule_files=RECORDING_RULES)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing (Debian package prometheus)")
def test_efficiency_joins_a_gpu_renumbered_by_nvml_once(tmp_path):
    """Same job, each GPU drawing 200 W; at 300 s rank 1's daemon re-initialized NVML without a
    GPU that fell off the bus and exports GPU-b0 as gpu="0", no longer gpu="1": the rate window
    holds one uuid under two label sets. The panels' join on uuid found duplicate series on its
    one side ("many-to-many matching not allowed") and failed, for the rate window after it and,
    over $__range, for as long as the range held both. The two series follow each other, and
    rate() divides each one's increase by the whole window: their sum is the GPU's power (max
    read 125 W at 315 s)."""
    series = _skew_exchange_job(3)
    total = 39
    series['syncwatch_gpu_energy_joules_total{gpu="0", uuid="GPU-a0", instance="a:9477"}'] = f"0+3000x{total}"
    series['syncwatch_gpu_energy_joules_total{gpu="1", uuid="GPU-b0", instance="b:9477"}'] = "0+3000x19 stale"
    series['syncwatch_gpu_energy_joules_total{gpu="0", uuid="GPU-b0", instance="b:9477"}'] = "_x20 60000+3000x19"
    title = "Power burned waiting at barriers"
    waiting = f'round({_panel_expr("syncwatch-efficiency", title)}, 0.0001)'
    everything = f'round({_panel_expr("syncwatch-efficiency", title, "B")}, 0.0001)'
    share = f'round({_panel_expr("syncwatch-efficiency", "Energy burned waiting in range", "B")}, 0.01)'
    _promtool_expect(tmp_path, series, [
        (everything, "315s", [{"labels": '{train_job="j"}', "value": 400}]),
        (waiting, "315s", [{"labels": '{train_job="j"}', "value": 20}]),
        (share, "585s", [{"labels": '{train_job="j"}', "value": 0.05}]),
    ], rule_files=RECORDING_RULES)


def _mean_wait_job(step_seconds: float, skew: float = 0.3, transfer: float = 0.05) -> dict[str, str]:
    """The job of ``_skew_exchange_job`` without the skew exchange (K = 0): no slack, last-arrival
    or skew series, only the waits (rank 0 waits ``transfer`` every step, rank 1 ``skew`` more),
    for 15 minutes."""
    per_scrape = 15 / step_seconds
    total = 59
    series = {}
    for r, node, wait in (("0", "a", transfer), ("1", "b", transfer + skew)):
        inst = f'train_job="j", rank="{r}", instance="{node}:9477"'
        series.update({
            f'syncwatch_rank_info{{train_job="j", rank="{r}", local_rank="0", node="{node}", gpu="0", '
            f'uuid="GPU-{node}0", pid="{r}", instance="{node}:9477"}}': f"1x{total}",
            f'syncwatch_steps_total{{{inst}}}': f"0+{per_scrape:g}x{total}",
            f'syncwatch_step_seconds_total{{{inst}}}': f"0+15x{total}",
            f'syncwatch_phase_seconds_total{{{inst}, phase="sync"}}': f"0+{per_scrape * wait:g}x{total}",
        })
    return series


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing (Debian package prometheus)")
def test_without_the_skew_exchange_the_panels_read_the_estimates_from_mean_waits(tmp_path):
    """The job of the two tests above, its ranks without the skew exchange (K = 0), through the
    shipped recording rules: with one rank waiting 0.3 s for the other in every step, the
    estimates from mean waits equal the exact values: rank 1 idle 10 % of its time, rank 0 last in
    every minute, node a 0.3 s late, 0.1 GPUs idle."""
    def expr(uid: str, title: str) -> str:
        return f"round({_panel_expr(uid, title, node=None, rank=None)}, 0.0001)"

    _promtool_expect(tmp_path, _mean_wait_job(3), [
        (expr("syncwatch-straggler-map", "Slack share by rank over time"), "12m",
         [{"labels": '{rank="0"}', "value": 0}, {"labels": '{rank="1"}', "value": 0.1}]),
        (expr("syncwatch-straggler-map", "Last-arrival share per rank"), "12m",
         [{"labels": '{train_job="j", rank="0"}', "value": 1},
          {"labels": '{train_job="j", rank="1"}', "value": 0}]),
        (expr("syncwatch-hardware", "Lateness of the ranks per node"), "12m",
         [{"labels": '{node="a"}', "value": 0.3}, {"labels": '{node="b"}', "value": 0}]),
        (expr("syncwatch-efficiency", "GPUs idle at barriers"), "12m",
         [{"labels": '{train_job="j"}', "value": 0.1}]),
    ], rule_files=RECORDING_RULES)


def _moved_rank0_job() -> dict[str, str]:
    """Job ``j``, one step a second, steps numbered by the job: rank 0 runs on node a (attempt 0)
    until step 1200 at 20 m; the restart puts it on node b (attempt 1, from 22 m), which resumes at
    step 901: 300 steps run again. Daemon a never hears rank 0 again and b meets the job at attempt 1,
    so neither counts the restart or its re-runs (their counters stay 0); only the attempts across
    daemons and the steps against the step numbers show them."""
    old, new = 'train_job="j", rank="0", instance="a:9477"', 'train_job="j", rank="0", instance="b:9477"'
    job_a, job_b = 'train_job="j", instance="a:9477"', 'train_job="j", instance="b:9477"'
    return {
        f'syncwatch_steps_total{{{old}}}': "0+15x80",
        f'syncwatch_last_step{{{old}}}': "0+15x80",
        f'syncwatch_last_step_timestamp_seconds{{{old}}}': "0+15x80",
        f'syncwatch_job_attempt{{{job_a}}}': "0x80",
        f'syncwatch_job_restarts_total{{{job_a}}}': "0x80",
        f'syncwatch_job_rerun_steps_total{{{job_a}}}': "0x80",
        f'syncwatch_steps_total{{{new}}}': "_x88 15+15x151",
        f'syncwatch_last_step{{{new}}}': "_x88 915+15x151",
        f'syncwatch_last_step_timestamp_seconds{{{new}}}': "_x88 1335+15x151",
        f'syncwatch_job_attempt{{{job_b}}}': "_x88 1x151",
        f'syncwatch_job_restarts_total{{{job_b}}}': "_x88 0x151",
        f'syncwatch_job_rerun_steps_total{{{job_b}}}': "_x88 0x151",
    }


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing (Debian package prometheus)")
def test_restart_panels_count_a_restart_that_moved_rank_0_to_another_node(tmp_path):
    """At 50 m the job overview's restart stat and time series, the fleet's restarts column and the
    re-run ratio show the restart and its 300 re-run steps (300 plus half a scrape interval of
    steps, 7.5, from increase()'s extrapolation at the end of rank 0's series on a), a ratio of
    0.11 of the hour's ~2,900 executed steps: the rules' records, which count across daemons.
    They read the daemons' counters and showed 0 restarts and 0 re-run steps (the re-run ratio
    "since the job began" 0)."""
    def expr(uid: str, title: str, ref: str) -> str:
        return f"round({_panel_expr(uid, title, ref)}, 0.01)"

    stat, work = "Restarts and re-run steps", "Restarts and re-run work"
    ov = "syncwatch-job-overview"
    fleet = dict(zip("ABCDEFGHIJ", (c[0] for c in COLUMNS)))
    restarts_ref = next(ref for ref, name in fleet.items() if name.startswith("restarts"))
    _promtool_expect(tmp_path, _moved_rank0_job(), [
        (expr(ov, stat, "A"), "50m", [{"labels": '{train_job="j"}', "value": 1}]),
        (expr(ov, stat, "B"), "50m", [{"labels": '{train_job="j"}', "value": 307.5}]),
        (expr(ov, work, "B"), "50m", [{"labels": '{train_job="j"}', "value": 1}]),
        (expr(ov, work, "C"), "50m", [{"labels": '{train_job="j"}', "value": 307.5}]),
        (expr("syncwatch-fleet", "Train jobs by instability", restarts_ref), "50m",
         [{"labels": '{train_job="j"}', "value": 1}]),
        (expr("syncwatch-efficiency", "Re-run ratio", "A"), "50m",
         [{"labels": '{train_job="j"}', "value": 0.11}]),
    ], rule_files=RECORDING_RULES)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing (Debian package prometheus)")
def test_restart_panel_says_a_step_up_of_the_attempt_is_one_restart_however_tall(tmp_path):
    """Under Slurm with torchrun inside (--max-restarts 3) a requeue after no torchrun restart
    raises the attempt from 0 to 4 (docs/rules.md): on the job overview's restart panel the
    attempt line steps up by 4 where the restarts line reads 1. Its description said "each step
    up of the attempt line is a restart", which reads that step as 4 restarts."""
    job = 'train_job="j", instance="a:9477"'
    _promtool_expect(tmp_path, {
        f'syncwatch_job_attempt{{{job}}}': "0x80 4x80",
        f'syncwatch_job_restarts_total{{{job}}}': "0x80 1x80",
    }, [
        (_panel_expr("syncwatch-job-overview", "Restarts and re-run work", "A"), "30m",
         [{"labels": '{train_job="j"}', "value": 4}]),
        (f'round({_panel_expr("syncwatch-job-overview", "Restarts and re-run work", "B")})', "30m",
         [{"labels": '{train_job="j"}', "value": 1}]),
    ], rule_files=RECORDING_RULES)
    panel = next(p for p in queries.panels(DASHBOARDS["syncwatch-job-overview"])
                 if p["title"] == "Restarts and re-run work")
    assert "not one restart per unit" in panel["description"]
    assert "requeue" in panel["description"]


def _hardware_daemons(node_a: tuple[str, ...]) -> dict[str, str]:
    """Daemon a (one GPU) whose ranks of job ``j`` report the node names ``node_a``, daemon b (one
    GPU) with one rank on node b; both GPUs at 50 °C."""
    series = {}
    for i, node in enumerate(node_a):
        series[f'syncwatch_rank_info{{train_job="j", rank="{i}", local_rank="{i}", node="{node}", '
               f'gpu="0", uuid="GPU-a0", pid="{i + 1}", instance="a:9477"}}'] = "1x20"
    series['syncwatch_rank_info{train_job="j", rank="9", local_rank="0", node="b", gpu="0", '
           'uuid="GPU-b0", pid="9", instance="b:9477"}'] = "1x20"
    for inst in ("a", "b"):
        series[f'syncwatch_gpu_temperature_celsius{{gpu="0", uuid="GPU-{inst}0", instance="{inst}:9477"}}'] = "50x20"
    return series


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing (Debian package prometheus)")
def test_hardware_panels_join_a_daemon_whose_ranks_report_two_node_names(tmp_path):
    """On Kubernetes without NODE_NAME each training pod names its own pod as the node: one daemon
    then serves ranks with two node values. The panels' join kept one series per (instance, node),
    matched two for that daemon's GPU ("many-to-many matching not allowed") and every hardware
    panel failed; it keeps one per daemon, as the alerts do, and the node filter still picks it."""
    uid, title = "syncwatch-hardware", "GPU temperature"
    _promtool_expect(tmp_path, _hardware_daemons(("pod-a", "pod-b")), [
        (f"count({_panel_expr(uid, title, node=None)})", "2m", [{"labels": "{}", "value": 2}]),
        (_panel_expr(uid, title, node=["pod-b"]), "2m",
         [{"labels": '{node="pod-b", gpu="0"}', "value": 50}]),
        (_panel_expr(uid, title, node=["b"]), "2m", [{"labels": '{node="b", gpu="0"}', "value": 50}]),
    ])


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing (Debian package prometheus)")
def test_throttle_reasons_show_only_the_reasons_that_slow_a_gpu_down(tmp_path):
    """A healthy GPU reports benign clock events (idle, application clocks, sync boost, display
    clock): the state timeline showed them red beside the real throttling, and the aggregate
    ``thermal`` twice over its parts. It shows the reasons the throttling alerts read, red only
    where they are active."""
    from syncwatch.rules.thresholds import THRESHOLDS as T

    slowdowns = T.throttle_reasons.split("|")
    series = _hardware_daemons(("a",))
    active = {"a": {"gpu_idle", "applications_clocks", "sync_boost", "display_clock"},
              "b": {"sw_thermal", "thermal"}}
    for inst, on in active.items():
        for reason in (*slowdowns, "gpu_idle", "applications_clocks", "sync_boost", "display_clock", "thermal"):
            series[f'syncwatch_gpu_throttle_active{{gpu="0", uuid="GPU-{inst}0", reason="{reason}", '
                   f'instance="{inst}:9477"}}'] = f"{int(reason in on)}x20"
    expected = [{"labels": f'{{node="{node}", reason="{reason}"}}', "value": int(reason in on)}
                for node, on in active.items() for reason in slowdowns]
    _promtool_expect(tmp_path, series, [
        (_panel_expr("syncwatch-hardware", "GPU throttle reasons", node=None), "2m", expected)])


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing (Debian package prometheus)")
def test_fabric_panels_show_the_rdma_traffic_and_every_ib_link_error(tmp_path):
    """NCCL over InfiniBand or RoCE moves the gradients by RDMA, which the netdev's byte counters
    never see: NIC throughput showed only the host's IP traffic (data loading), not the gradient
    traffic its description spoke of, while the port's data counters went unread. And of the five
    counters SyncwatchIbLinkErrors pages on, the errors panel showed only link-downed: a port
    counting symbol errors paged with every panel at zero."""
    uid = "syncwatch-hardware"
    series = _hardware_daemons(("a",))
    port = 'device="mlx5_0", port="1", instance="a:9477"'
    series[f'syncwatch_ib_port_data_bytes_total{{{port}, direction="receive"}}'] = "0+15000000000x20"
    series[f'syncwatch_ib_port_data_bytes_total{{{port}, direction="transmit"}}'] = "0+30000000000x20"
    series[f'syncwatch_ib_symbol_errors_total{{{port}}}'] = "0+3x20"
    for counter in ("port_rcv_errors", "link_integrity_errors", "buffer_overrun_errors", "link_downed"):
        series[f'syncwatch_ib_{counter}_total{{{port}}}'] = "0x20"
    nic = {q.ref_id: q.expr for q in queries.panel_queries(DASHBOARDS[uid]) if q.panel == "NIC throughput"}
    rdma = [ref for ref, e in nic.items() if "syncwatch_ib_port_data_bytes_total" in e]
    assert len(rdma) == 2, "NIC throughput: the ports' RDMA receive and transmit"
    where = '{node="a", device="mlx5_0", port="1"}'
    errors = next(q for q in queries.panel_queries(DASHBOARDS[uid])
                  if q.panel == "NIC errors, drops and link flaps" and "syncwatch_ib_symbol_errors_total" in q.expr)
    ib_errors = _panel_expr(uid, errors.panel, errors.ref_id, node=None)
    _promtool_expect(tmp_path, series, [
        (_panel_expr(uid, "NIC throughput", rdma[0], node=None), "2m", [{"labels": where, "value": 1e9}]),
        (_panel_expr(uid, "NIC throughput", rdma[1], node=None), "2m", [{"labels": where, "value": -2e9}]),
        (ib_errors, "2m", [
            {"labels": where[:-1] + f', counter="{c}"}}', "value": v}
            for c, v in (("symbol errors", 12), ("receive errors", 0), ("link integrity errors", 0),
                         ("buffer overruns", 0))]),
    ])


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing (Debian package prometheus)")
def test_xid_table_keeps_a_gone_gpu_apart_from_the_one_now_at_its_index(tmp_path):
    """GPU-a3 logged XID 79 and fell off the bus; NVML, initialized again, lists GPU-a4 as index 3,
    and it logs XID 79 too. The daemon keeps the gone GPU's XIDs under its last index: both
    series have gpu="3". Summed by node, gpu and xid the table showed one row, 2 XIDs on gpu 3,
    the gone GPU's added to the healthy one's; by uuid too, a row each."""
    series = _hardware_daemons(("a",))
    for uuid in ("GPU-a3", "GPU-a4"):
        series[f'syncwatch_gpu_xid_errors_total{{gpu="3", uuid="{uuid}", xid="79", instance="a:9477"}}'] = "1x20"
    _promtool_expect(tmp_path, series, [
        (_panel_expr("syncwatch-hardware", "XID errors", node=None), "2m",
         [{"labels": f'{{node="a", gpu="3", uuid="{uuid}", xid="79"}}', "value": 1}
          for uuid in ("GPU-a3", "GPU-a4")]),
    ])


RUNBOOK = ROOT / "docs" / "runbook.md"
#: Dashboard titles as the runbook names them ("syncwatch / Job overview" -> "Job overview").
_BY_TITLE = {d["title"].removeprefix("syncwatch / "): d for d in DASHBOARDS.values()}
#: "Dashboard › *Panel*[, *Panel* and *Panel*] [(what they show)]", wrapped anywhere.
_PANEL_REF = re.compile(
    r"(" + "|".join(r"\s+".join(map(re.escape, t.split())) for t in _BY_TITLE) + r")\s+›\s+"
    r"((?:\*[^*]+\*(?:,\s+|\s+and\s+)?)+)(?:\s*\(((?:[^()]|\([^()]*\))*)\))?")
_SERIES = re.compile(r"`((?:[a-z_]+:)?syncwatch_[a-z0-9_]+(?::[a-z0-9_]+)?)`")


def test_runbook_names_panels_that_exist_and_the_series_they_show():
    """Every "Confirm:" and "Act:" paragraph of the runbook that sends the on-call engineer to a
    panel names it as *Dashboard › Panel*, the panel exists, and each series the runbook says it
    shows (in backticks, in the parentheses after it) is one of the panel's queries. The runbook
    sent them to a "progress panel", a "step-time panel at full resolution" and a CV panel showing
    the alert's 5m average against its baseline, none of which any dashboard had."""
    text = RUNBOOK.read_text()
    refs = 0
    for para in re.split(r"\n\s*\n", text):
        if not para.startswith(("Confirm:", "Act:")):
            continue
        found = list(_PANEL_REF.finditer(para))
        if re.search(r"\bpanels?\b|\bdashboard", para.replace("no panel", "")):
            assert found, f"names a panel without *Dashboard › Panel*: {para[:120]!r}"
        for m in found:
            board = _BY_TITLE[" ".join(m[1].split())]
            titles = {p["title"]: p for p in queries.panels(board)}
            shown = ""
            for title in re.findall(r"\*([^*]+)\*", m[2]):
                title = " ".join(title.split())
                assert title in titles, f"{board['title']} has no panel {title!r}"
                shown += " ".join(t["expr"] for t in titles[title]["targets"])
                refs += 1
            for name in _SERIES.findall(m[3] or ""):
                assert name in shown, f"{m[0]!r}: {name} is not on the panel"
    assert refs >= 30
