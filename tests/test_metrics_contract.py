"""docs/metrics.md against what the exporter really exports: every family, its type and its labels.

The exported side is built from the code, not from a list: the daemon's own families from a
``State`` fed one rank that uses every optional series (exact skew exchange, tokens, skew
histogram, a heartbeat, an end record), the collectors' self-health from a ``CollectorRunner``,
and the hardware families from the collectors' golden expositions (tests/fixtures/golden, which
the collector tests pin to the collectors' real output). A family added to the code and not to
the page, or a label renamed in one of them, fails here instead of leaving a rule, a panel or a
reader with a series that the page describes otherwise.

The same exported side then checks the contract's users: every series, label and label value that
the rules (and their promtool tests' input series), the dashboards and the analysis CLI read.
"""

from __future__ import annotations

import re
import sys

import pytest
import yaml
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from collector_helpers import GOLDEN
from conftest import ROOT
from daemon_helpers import WALL0, RankSim, identity
from syncwatch.collectors import COLLECTORS, CollectorRunner
from syncwatch.daemon import DaemonConfig
from syncwatch.daemon.exposition import families
from syncwatch.daemon.state import State
from syncwatch.protocol import END_REASONS, PHASES, Decoder, SkewHistogram

sys.path.insert(0, str(ROOT))
from dashboards import queries  # noqa: E402

METRICS_MD = ROOT / "docs" / "metrics.md"
PER_RANK = {"train_job", "rank"}  # the per-rank table lists only the labels beyond these


def _family_labels(fam) -> set[str]:
    return {k for s in fam.samples for k in s.labels if k != "le"}


def _daemon() -> list:
    state, decoder = State(DaemonConfig(socket=None)), Decoder()
    sim = RankSim(identity(0, world=1, gpu=0, uuid="GPU-0"), exact=True, tokens=True)
    for s in range(1, 8):
        state.apply(decoder.decode(sim.step(s, 0.1 + 0.01 * (s % 2), slack=0.01, last_arrival=True,
                                            checkpoint=s == 2,
                                            skew=SkewHistogram(s, 0.001 * s, (0,) * 3 + (s,) * 13))))
    state.apply(decoder.decode(sim.enc.heartbeat(WALL0 + 8, 7, WALL0 + 7, "sync", 0.5, 14)))
    state.apply(decoder.decode(sim.enc.end(WALL0 + 9, 7)))
    state.reject("bad_magic")
    return families(state.snapshot())


class _One:
    def update(self, errors):
        g = GaugeMetricFamily("syncwatch_test_value", "test")
        g.add_metric([], 1)
        return [g]


def _self_health() -> list:
    runner = CollectorRunner({"one": _One()})
    runner.run_once()
    return [f for f in runner.collect() if f.name.startswith("syncwatch_collector_")]


def _hardware() -> list:
    return [f for path in sorted(GOLDEN.glob("*.prom"))
            for f in text_string_to_metric_families(path.read_text())]


def _exposed(f) -> str:
    return f.name + "_total" if f.type == "counter" else f.name


def exported() -> dict[str, tuple[str, set[str]]]:
    """name (as exposed, counters with _total) -> (type, label names)."""
    out: dict[str, tuple[str, set[str]]] = {}
    for f in _hardware() + _self_health() + _daemon():
        t, labels = out.get(_exposed(f), (f.type, set()))
        assert t == f.type, f.name
        out[_exposed(f)] = (t, labels | _family_labels(f))
    return out


def documented() -> dict[str, tuple[str | None, set[str]]]:
    """The tables of docs/metrics.md: name -> (type, or None where the table has no type column,
    label names)."""
    out: dict[str, tuple[str | None, set[str]]] = {}
    section = header = None
    for line in METRICS_MD.read_text().splitlines():
        if line.startswith("## "):
            section, header = line, None
            continue
        if not line.startswith("| ") or line.startswith("| ---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        names = re.findall(r"`(syncwatch_[a-z_]+)`", cells[0])
        col = dict(zip(header, cells))
        kind = col["type"].split()[0] if "type" in col else None
        text = col.get("more labels", col.get("labels", ""))
        labels = {w.strip() for w in re.sub(r"\([^)]*\)", "", text).split(",") if w.strip()}
        if section.startswith("## Per rank"):
            labels |= PER_RANK
        for n in names:
            assert n not in out, f"{n} listed twice in docs/metrics.md"
            out[n] = (kind, labels)
    return out


def test_every_exported_family_is_documented_with_its_labels_and_type():
    exp, doc = exported(), documented()
    assert sorted(set(exp) - set(doc)) == [], "exported, missing from docs/metrics.md"
    assert sorted(set(doc) - set(exp)) == [], "in docs/metrics.md, not exported"
    wrong = {n: (doc[n], exp[n]) for n in exp
             if doc[n][1] != exp[n][1] or doc[n][0] not in (None, exp[n][0])}
    assert wrong == {}, "docs/metrics.md (type, labels) differ from the exporter's"
    # the tables without a type column rely on the contract's rule: counters, and only they, end in _total
    untyped = {n: t for n, (t, _) in exp.items()
               if doc[n][0] is None and (t == "counter") != n.endswith("_total")}
    assert untyped == {}


# --- the contract's users read only what is exported -------------------------------------------
#
# The rules (and the series their promtool tests feed them), the dashboards' queries, legends and
# variables, and the analysis CLI's queries, each checked against the exported families above and
# the recording rules' outputs: a series name that nothing exports (a typo, a renamed family, a
# counter without its _total), a matcher or a by/on/group_left on a label that no series read there
# carries, a label value that is never exported (phase="synch") returns no data without an error.
# The promtool tests cannot see it when their input series carry the same mistake, and the
# dashboards' query test needs a Prometheus.

SCRAPE = {"instance", "job"}     # target labels Prometheus adds to every scraped series
PROMETHEUS = {"up": SCRAPE}      # Prometheus' own series the rules read (SyncwatchDaemonDown)
ALERT_LABELS = {"alertname", "alertstate", "severity"}  # ALERTS' own; its others are the alerts'
ENUMERATED = ("phase", "reason", "direction", "type", "collector", "component")  # fixed value sets
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
             "bool", "offset", "atan2"}
_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_AGGREGATIONS = {"sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "topk",
                 "bottomk", "quantile", "count_values"}
_TOKEN = re.compile(r"""\s+|\#[^\n]*|(?P<str>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*')|(?P<var>\$\{[^}]*\}|\$\w+)
                        |(?P<num>\d[\w.]*)|(?P<id>[A-Za-z_][\w:]*)|(?P<op>=~|!~|!=|==|>=|<=|.)""", re.X)
RULE_FILES = sorted((ROOT / "alerts").glob("*.rules.yml"))


def _rules() -> list[dict]:
    return [r for p in RULE_FILES for g in yaml.safe_load(p.read_text())["groups"] for r in g["rules"]]


def readable() -> tuple[dict[str, set[str]], dict[tuple[str, str], set[str]]]:
    """(series name -> its label names, (series name, label) -> its values for ``ENUMERATED``):
    the exported series as Prometheus stores them (histograms as _bucket/_sum/_count, the scrape's
    target labels added) and the recording rules' outputs, whose labels are their level's
    (``train_job_rank:`` keeps train_job and rank), their rule's static labels and what a
    ``group_left`` adds."""
    labels: dict[str, set[str]] = {k: set(v) for k, v in PROMETHEUS.items()}
    values: dict[tuple[str, str], set[str]] = {}
    for f in _hardware() + _self_health() + _daemon():
        names = [_exposed(f)] + ([f.name + s for s in ("_bucket", "_sum", "_count")]
                                 if f.type == "histogram" else [])
        for n in names:
            le = {"le"} if n.endswith("_bucket") else set()
            labels.setdefault(n, set(SCRAPE)).update(_family_labels(f) | le)
            for s in f.samples:
                for k, v in s.labels.items():
                    if k in ENUMERATED:
                        values.setdefault((n, k), set()).add(v)
    # values the fixtures above do not all show: every heartbeat phase, end reason and collector
    values[("syncwatch_rank_phase_elapsed_seconds", "phase")] = set(PHASES)
    values[("syncwatch_rank_end_timestamp_seconds", "reason")] = set(END_REASONS)
    for n in ("syncwatch_collector_success", "syncwatch_collector_duration_seconds"):
        values[(n, "collector")] = set(COLLECTORS)
    for r in _rules():
        if "record" not in r:
            continue
        level = r["record"].split(":")[0]
        assert level.startswith("train_job"), r["record"]
        own = {"train_job"} | set(filter(None, level.removeprefix("train_job").split("_")))
        own |= set(r.get("labels") or {})
        own |= {w for m in re.findall(r"group_left\s*\(([^)]*)\)", r["expr"]) for w in re.findall(r"\w+", m)}
        labels.setdefault(r["record"], set()).update(own)
        for k, v in (r.get("labels") or {}).items():
            if k in ENUMERATED:
                values.setdefault((r["record"], k), set()).add(v)
    # Prometheus' ALERTS (the dashboards list a job's firing alerts): any label an alert may keep
    labels["ALERTS"] = ALERT_LABELS | set().union(*labels.values())
    values[("ALERTS", "alertname")] = {r["alert"] for r in _rules() if "alert" in r}
    return labels, values


def _scan(expr: str) -> tuple[list[tuple[str | None, list[tuple[str, str, str]]]], list[str], set[str]]:
    """A PromQL expression's selectors (name, [(label, op, value)]), the labels its by / without /
    on / ignoring / group_left / group_right lists name, and its string literals (labels that
    label_replace or count_values may add)."""
    toks = [(m.lastgroup, m.group(m.lastgroup)) for m in _TOKEN.finditer(expr) if m.lastgroup]
    toks.append(("end", ""))
    selectors, lists = [], []
    strings = {v[1:-1] for k, v in toks if k == "str"}
    i = 0
    while i < len(toks) - 1:
        kind, v = toks[i]
        nxt = toks[i + 1][1]
        if kind == "id" and v in _LISTS and nxt == "(":
            j = i + 2
            while toks[j][1] != ")":
                if toks[j][0] in ("id", "str"):
                    lists.append(toks[j][1].strip("\"'"))
                j += 1
            i = j + 1
            continue
        if kind == "id" and (nxt == "(" or v in _KEYWORDS or (v in _AGGREGATIONS and nxt in _LISTS)):
            i += 1
            continue
        if (kind == "id" and nxt == "{") or (kind, v) == ("op", "{"):
            j, matchers = (i + 2 if kind == "id" else i + 1), []
            while toks[j][1] != "}":
                if toks[j][0] == "id":
                    value = toks[j + 2]
                    matchers.append((toks[j][1], toks[j + 1][1],
                                     value[1][1:-1] if value[0] == "str" else value[1]))
                    j += 3
                else:
                    j += 1
            name = v if kind == "id" else next((val for lab, op, val in matchers
                                                if lab == "__name__" and op == "="), None)
            selectors.append((name, matchers))
            i = j + 1
            continue
        if kind == "id":
            selectors.append((v, []))
        i += 1
    return selectors, lists, strings


def problems(where: str, expr: str, labels: dict, values: dict, uses: tuple[str, ...] = ()) -> list[str]:
    """What in ``expr`` (and the labels ``uses`` reads from its result: a legend's, an annotation's)
    reads a series, label or value that is never exported."""
    selectors, lists, strings = _scan(expr)
    out, present = [], set(strings)
    for name, matchers in selectors:
        if name is None:
            continue
        if name not in labels:
            out.append(f"{where}: no series {name}")
            continue
        present |= labels[name]
        for lab, op, val in matchers:
            if lab not in labels[name] | {"__name__"}:
                out.append(f"{where}: {name} has no label {lab} ({lab}{op}{val!r})")
            domain = values.get((name, lab))
            if domain is None or "$" in val or op not in ("=", "=~"):
                continue
            alternatives = [val] if op == "=" else val.encode().decode("unicode_escape").split("|")
            for alt in alternatives:
                if not any((alt == d) if op == "=" else re.fullmatch(alt, d) for d in domain):
                    out.append(f"{where}: {name}{{{lab}{op}{val!r}}}: {alt!r} is none of {sorted(domain)}")
    for lab in [*lists, *uses]:
        if lab not in present:
            out.append(f"{where}: label {lab} is on none of the series it reads")
    return out


def _analysis_queries() -> list[str]:
    """Every query the analysis commands send (``view.from_prometheus``, the one place they query),
    captured from a fake Prometheus whose answers take it down every path."""
    from syncwatch.analysis.common import AnalysisError
    from syncwatch.analysis.view import from_prometheus

    class Fake:
        url, warnings = "http://fake", []
        key = (("attempt", "1"), ("instance", "i0"), ("node", "n0"), ("rank", "0"), ("train_job", "j"))

        def __init__(self, known: bool):
            self.known, self.exprs = known, []

        def query(self, expr, t):
            self.exprs.append(expr)
            return {self.key: [(t, 1.0)]} if self.known else {}

        def samples(self, expr, t):
            self.exprs.append(expr)
            return {self.key: [(t - 30 + i, float(i)) for i in range(30)]}

        def query_range(self, expr, start, end, step):
            self.exprs.append(expr)
            return {self.key: [(start + i * step, 1.0) for i in range(round((end - start) / step) + 1)]}

        def scalar(self, expr, t, default=None):
            self.exprs.append(expr)
            return 1.0

    known, unknown = Fake(True), Fake(False)
    from_prometheus(known, "j", 1000.0, 1600.0)
    with pytest.raises(AnalysisError, match="unknown train job"):
        from_prometheus(unknown, "j", 1000.0, 1600.0)
    return known.exprs + unknown.exprs


def test_the_checker_finds_what_returns_no_data():
    labels, values = readable()
    found = problems("x", 'sum by (node) (rate(syncwatch_step_total[5m]))'
                          ' / on (rank) sum by (rank) (syncwatch_steps_total{phase="sync"})'
                          ' + max(syncwatch_phase_seconds_total{phase="synch"})'
                          ' + max(syncwatch_gpu_throttle_active{reason=~"thermal|hot"})', labels, values)
    assert sorted(found) == sorted([
        "x: no series syncwatch_step_total",
        "x: syncwatch_steps_total has no label phase (phase='sync')",
        "x: syncwatch_phase_seconds_total{phase='synch'}: 'synch' is none of "
        f"{sorted(values[('syncwatch_phase_seconds_total', 'phase')])}",
        "x: syncwatch_gpu_throttle_active{reason=~'thermal|hot'}: 'hot' is none of "
        f"{sorted(values[('syncwatch_gpu_throttle_active', 'reason')])}",
        "x: label node is on none of the series it reads"])
    assert problems("x", 'label_replace(up, "node", "$1", "instance", "(.*)")', labels, values,
                    uses=("node",)) == []


def test_rules_dashboards_and_analysis_read_only_exported_series_labels_and_values():
    labels, values = readable()
    found, checked = [], 0
    for r in _rules():
        name = r.get("record") or r.get("alert")
        uses = tuple(lab for text in (r.get("annotations") or {}).values()
                     for lab in re.findall(r"\$labels\.(\w+)", text) if lab not in (r.get("labels") or {}))
        found += problems(f"rule {name}", r["expr"], labels, values, uses)
        checked += 1
    for path in sorted((ROOT / "alerts" / "tests").glob("*.test.yml")):
        for group in yaml.safe_load(path.read_text())["tests"]:
            for s in group.get("input_series", []):
                found += problems(f"{path.name} input", s["series"], labels, values)
            for case in group.get("promql_expr_test", []):
                found += problems(f"{path.name} expr", case["expr"], labels, values)
            checked += 1
    for board in queries.load_all().values():
        for q in queries.panel_queries(board):
            found += problems(f"{q.dashboard} › {q.panel} {q.ref_id}", q.expr, labels, values,
                              tuple(re.findall(r"\{\{\s*(\w+)\s*\}\}", q.legend)))
            checked += 1
        for var in queries.variables(board).values():
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", str(var.get("query", "")).strip())
            if m:
                found += problems(f"{board['uid']} ${var['name']}", m[1], labels, values, (m[2],))
                checked += 1
    for expr in _analysis_queries():
        found += problems("analysis", expr, labels, values)
        checked += 1
    assert found == []
    assert checked >= 200
