"""docs/metrics.md against what the exporter really exports: every family, its type and its labels.

The exported side is built from the code, not from a list: the daemon's own families from a
``State`` fed one rank that uses every optional series (exact skew exchange, tokens, skew
histogram, a heartbeat, an end record), the collectors' self-health from a ``CollectorRunner``,
and the hardware families from the collectors' golden expositions (tests/fixtures/golden, which
the collector tests pin to the collectors' real output). A family added to the code and not to
the page, or a label renamed in one of them, fails here instead of leaving a rule, a panel or a
reader with a series that the page describes otherwise.
"""

from __future__ import annotations

import re

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from collector_helpers import GOLDEN
from conftest import ROOT
from daemon_helpers import WALL0, RankSim, identity
from syncwatch.collectors import CollectorRunner
from syncwatch.daemon import DaemonConfig
from syncwatch.daemon.exposition import families
from syncwatch.daemon.state import State
from syncwatch.protocol import Decoder, SkewHistogram

METRICS_MD = ROOT / "docs" / "metrics.md"
PER_RANK = {"train_job", "rank"}  # the per-rank table lists only the labels beyond these


def _family_labels(fam) -> set[str]:
    return {k for s in fam.samples for k in s.labels if k != "le"}


def _daemon() -> dict[str, tuple[str, set[str]]]:
    state, decoder = State(DaemonConfig(socket=None)), Decoder()
    sim = RankSim(identity(0, world=1, gpu=0, uuid="GPU-0"), exact=True, tokens=True)
    for s in range(1, 8):
        state.apply(decoder.decode(sim.step(s, 0.1 + 0.01 * (s % 2), slack=0.01, last_arrival=True,
                                            checkpoint=s == 2,
                                            skew=SkewHistogram(s, 0.001 * s, (0,) * 3 + (s,) * 13))))
    state.apply(decoder.decode(sim.enc.heartbeat(WALL0 + 8, 7, WALL0 + 7, "sync", 0.5, 14)))
    state.apply(decoder.decode(sim.enc.end(WALL0 + 9, 7)))
    state.reject("bad_magic")
    return {f.name: (f.type, _family_labels(f)) for f in families(state.snapshot())}


class _One:
    def update(self, errors):
        g = GaugeMetricFamily("syncwatch_test_value", "test")
        g.add_metric([], 1)
        return [g]


def _self_health() -> dict[str, tuple[str, set[str]]]:
    runner = CollectorRunner({"one": _One()})
    runner.run_once()
    return {f.name: (f.type, _family_labels(f)) for f in runner.collect()
            if f.name.startswith("syncwatch_collector_")}


def _hardware() -> dict[str, tuple[str, set[str]]]:
    out: dict[str, tuple[str, set[str]]] = {}
    for path in sorted(GOLDEN.glob("*.prom")):
        for f in text_string_to_metric_families(path.read_text()):
            t, labels = out.get(f.name, (f.type, set()))
            assert t == f.type, (f.name, path.name)
            out[f.name] = (t, labels | _family_labels(f))
    return out


def exported() -> dict[str, tuple[str, set[str]]]:
    """name (as exposed, counters with _total) -> (type, label names)."""
    out = {**_hardware(), **_self_health(), **_daemon()}
    return {(n + "_total" if t == "counter" else n): (t, labels) for n, (t, labels) in out.items()}


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
