"""``syncwatch diagnose``: classify a train job's state into the synchronization failure modes.

Each detector reads the ``JobView`` and either stays silent or returns a ``Finding``: the observed
phenomenon with its evidence (series and values), the structural cause, the decision options and
a confidence. The thresholds live in ``Thresholds``; docs/analysis.md explains each signature.

| mode | signature |
| --- | --- |
| straggler (persistent) | one rank arrives last in most steps, and the others idle for it (coupling) |
| straggler (transient)  | high coupling, last arrivals spread over ranks |
| oscillation            | lag-1 autocorrelation of step time strongly negative |
| fabric contention      | collective time (wait not explained by slack) inflated by a share of the step in 10 % of windows, or in fewer that congestion counters follow; two at least |
| thermal coupling       | persistent straggler's node throttles / runs ≥ 5 °C hotter, or the straggling node moves between nodes |
| topology mismatch      | collective time grows faster than bytes moved, without congestion |
| checkpoint-restart     | restarts and re-run steps in the range |
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

from ..rules.thresholds import THRESHOLDS
from .common import command, emit_json, lag1, ms, pct, plural
from .prom import quote
from .recording import MIN_WINDOW_STEPS
from .source import add_source_flags, view_from_args
from .view import (AUTOCORRELATION_MIN_STEPS, BYTES_SERIES, CONGESTION_SERIES, FEW_WINDOWS, THERMAL_THROTTLE,
                   JobView)

# without the skew exchange a straggler is named from mean waits: one that leads on average, not
# one counted last step by step, so its finding is this much less sure
ESTIMATE_PENALTY = 0.1
# the scores read from slack and last arrivals, estimated from mean waits without the exchange
ESTIMATED_SCORES = ["coupling", "straggler_concentration", "collective_seconds"]
FEW_STEPS = 100  # below this many steps in range a healthy verdict says it rests on too few
FEW_LAST_ARRIVALS = MIN_WINDOW_STEPS  # below this many in range no straggler is named


@dataclass(frozen=True)
class Thresholds:
    coupling: float = 0.05             # share of rank-time idled for slower peers worth a finding
    persistent_share: float = 0.5      # one rank's share of last arrivals: a persistent straggler
    rotating_node_share: float = 0.6   # mean per-window share of the top node: node-level straggling ...
    rotating_node_excess: float = 0.45  # ... and this far from an even split (1/nodes) to all: 72.5 % of 2
    oscillation: float = -0.5          # lag-1 autocorrelation of step time
    collective_inflation: float = 1.5  # window collective time / quiet baseline (20th percentile) ...
    inflation_cost: float = 0.05       # ... its excess over the baseline / the window's mean step
    inflated_windows: float = 0.1      # share of windows inflated: contention, not a blip
    correlation: float = 0.5           # Pearson r of collective time and congestion counters
    topology_growth: float = 1.3       # collective time growth (late / early) ...
    bytes_growth: float = 1.1          # ... while bytes per step grow less than this
    hot_margin_celsius: float = 5.0    # straggling node this much hotter than the others
    throttle_match: float = 0.5        # share of windows whose straggling node throttles then ...
    throttle_chance: float = 2.0       # ... and this many times the share of nodes throttling


@dataclass
class Finding:
    mode: str
    title: str
    phenomenon: str
    evidence: list[dict]
    cause: str
    options: list[str]
    confidence: float
    subject: dict = field(default_factory=dict)   # rank / node named by the finding

    @property
    def confidence_word(self) -> str:
        return "high" if self.confidence >= 0.8 else "medium" if self.confidence >= 0.5 else "low"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["confidence_word"] = self.confidence_word
        return d


@dataclass
class Diagnosis:
    job: str
    source: str
    start: float
    end: float
    ranks: int
    nodes: int
    steps: float
    scores: dict
    findings: list[Finding]
    notes: list[str]
    estimated: list[str] = field(default_factory=list)  # scores estimated from mean waits (K = 0)
    job_windows: int = FEW_WINDOWS  # windows the job ran through (those with a collective time)
    windows: int = FEW_WINDOWS      # windows of the range

    @property
    def healthy(self) -> bool:
        return not self.findings

    @property
    def verdict(self) -> str:
        if self.findings:
            return f"{plural(len(self.findings), 'structural problem')} found"
        if self.steps < FEW_STEPS:
            return (f"no structural problem found in {plural(self.steps, 'step', '.0f')}, too few to rule any "
                    "out: widen the range")
        if self.job_windows < FEW_WINDOWS:
            return (f"no structural problem found in what could be assessed: the job ran through "
                    f"{self.job_windows} of the range's windows, too few for fabric contention: "
                    + _fewer_windows_advice(self.windows))
        if self.estimated:
            return ("no structural problem found in what could be measured: without the skew exchange, "
                    "transient jitter and a straggling node that moves between nodes are not ruled out")
        return "no structural problem found"

    def to_dict(self) -> dict:
        return {"job": self.job, "source": self.source, "start": self.start, "end": self.end,
                "ranks": self.ranks, "nodes": self.nodes, "steps": self.steps, "scores": self.scores,
                "estimated": self.estimated, "healthy": self.healthy, "verdict": self.verdict,
                "findings": [f.to_dict() for f in self.findings], "notes": self.notes}


# ---------------------------------------------------------------- helpers

def _rank_sel(v: JobView, rank: int) -> str:
    """The label matchers of one rank's series, as an evidence line quotes them: pasted into
    Prometheus they select that rank (its series carry no ``node`` label)."""
    return f"train_job={quote(v.job)},rank={quote(str(rank))}"


def _node_sel(v: JobView, node: str) -> str:
    """A selector of the daemon (``instance``) of ``node`` among the job's ranks: the GPU series
    carry the instance, not the node."""
    return f"syncwatch_rank_info{{train_job={quote(v.job)},node={quote(node)}}}"


def _vals(xs) -> list[float]:
    return [x for x in xs if x is not None and math.isfinite(x)]


def _mean(xs) -> float | None:
    v = _vals(xs)
    return sum(v) / len(v) if v else None


def _pearson(a: list[float | None], b: list[float | None]) -> float | None:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    if len(pairs) < 4:
        return None
    xs, ys = zip(*pairs)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sx = math.sqrt(sum((x - mx) ** 2 for x in xs))
    sy = math.sqrt(sum((y - my) ** 2 for y in ys))
    if sx == 0 or sy == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in pairs) / (sx * sy)


def _node_sum(rows: dict[str, list[float | None]]) -> list[float | None]:
    out: list[float | None] = []
    for i in range(len(next(iter(rows.values())))):
        vals = [r[i] for r in rows.values() if r[i] is not None]
        out.append(sum(vals) if vals else None)
    return out


def scores(v: JobView) -> dict:
    step_s, steps = v.total("step_seconds"), v.total("steps")
    ranks = max(1, len(v.rank_node))
    la = {r: v.total("last_arrivals", r) for r in v.ranks}
    la_total = sum(la.values())
    restarts, rerun = v.restarts_in_range()
    return {
        "mean_step_seconds": step_s / steps if steps else None,
        "sync_tax": v.total("sync_seconds") / step_s if step_s else None,
        "coupling": v.total("slack_seconds") / step_s if step_s else None,
        "straggler_concentration": max(la.values()) / la_total if la_total else None,
        "step_cv": _mean(v.cv),
        "step_autocorrelation": _mean(v.autocorrelation),
        "collective_seconds": _mean(v.collective_series()),
        "steps": steps / ranks,
        "rerun_steps": rerun,
        "restarts": restarts,
    }


# ---------------------------------------------------------------- detectors

def detect_stragglers(v: JobView, s: dict, th: Thresholds) -> list[Finding]:
    coupling = s["coupling"] or 0.0
    la = {r: v.total("last_arrivals", r) for r in v.ranks}
    total = sum(la.values())
    # a share of a few last arrivals is chance: over 4 steps of a healthy 32-rank job one rank
    # took 2 (50 %) in 7 of 40 ranges and read as a persistent straggler
    if total < FEW_LAST_ARRIVALS:
        return []
    top = max(la, key=la.get)
    share = la[top] / total
    node = v.rank_node[top]
    exact = v.has_exact()
    idle = (f"{pct(coupling)} of all rank-time idled waiting for slower peers" if exact else
            f"{pct(coupling)} of all rank-time idled waiting for slower peers (estimated from mean waits: "
            "a lower bound)")
    evidence = [
        {"series": "train_job:syncwatch_coupling:ratio5m", "value": round(coupling, 4), "reading": idle},
        {"series": f'syncwatch_last_arrivals_total{{{_rank_sel(v, top)}}}', "value": la[top],
         "reading": f"rank {top} arrived last in {pct(share)} of last arrivals ({la[top]:.0f} of {total:.0f})"}
        if exact else
        {"series": f'syncwatch_phase_seconds_total{{phase="sync",{_rank_sel(v, top)}}} / ignoring (phase) '
                   f'syncwatch_steps_total{{{_rank_sel(v, top)}}}, per window', "value": round(la[top], 1),
         "reading": f"rank {top} had the smallest mean wait in windows holding {pct(share)} of the steps "
                    f"(ranks within {pct(THRESHOLDS.last_arrival_tie)} of the step of it share a window)"},
        {"series": "train_job:syncwatch_straggler_concentration:ratio10m", "value": round(share, 4),
         "reading": f"1/N would be {pct(1 / max(1, len(la)))}"},
    ]
    if share >= th.persistent_share and coupling >= th.coupling / 2:
        slack_other = _mean([v.total("slack_seconds", r) / max(1.0, v.total("steps", r))
                             for r in v.ranks if r != top])
        evidence.append({"series": "syncwatch_slack_seconds_total / syncwatch_steps_total (other ranks)"
                                   if exact else f"mean wait − rank {top}'s mean wait (other ranks)",
                         "value": round(slack_other or 0.0, 6),
                         "reading": f"every other rank idles {1e3 * (slack_other or 0):.1f} ms per step for it"})
        arrives = (f"arrives last at the gradient collective in {pct(share)} of steps" if exact else
                   f"has the smallest mean wait at the gradient collective, so it arrives last, in windows "
                   f"holding {pct(share)} of steps (estimated from mean waits: the exact skew exchange is off)")
        return [Finding(
            mode="straggler_persistent", title=f"Persistent straggler: rank {top} on {node}",
            phenomenon=f"Rank {top} (node {node}) {arrives}; {'the other rank waits' if len(la) == 2 else f'the other {len(la) - 1} ranks wait'} for it, "
                       f"{'' if exact else 'an estimated '}{pct(coupling)} of all rank-time is idle.",
            evidence=evidence,
            cause="One slow rank sets the pace of a synchronous job: its local slowness (a degraded GPU, "
                  "a throttling or misconfigured node, a slower data shard) is amplified to every rank at "
                  "every collective.",
            options=[f"cordon node {node} and restart the job without it (or swap the GPU of rank {top})",
                     f"inspect rank {top}'s GPU clocks, throttle reasons and data loading",
                     "rebalance: give the slow rank a smaller share of the batch if its slowness is structural"],
            confidence=min(0.95, 0.5 + share / 2) - (0 if exact else ESTIMATE_PENALTY),
            subject={"rank": top, "node": node})]
    if coupling >= th.coupling and not node_dominates(node_rotation(v)[0], len(v.nodes), th):
        return [Finding(
            mode="straggler_transient", title="Transient jitter amplified by synchronization",
            phenomenon=f"{'' if exact else 'At least '}{pct(coupling)} of all rank-time is idle at the "
                       f"collective{'' if exact else ' (estimated from mean waits)'}, yet last arrivals "
                       f"are spread over ranks (the most frequent last arrival holds {pct(share)}).",
            evidence=evidence,
            cause="Independent per-rank jitter (OS noise, data loading, garbage collection, page faults) "
                  "is amplified by the order statistics of the slowest rank: every step waits for the "
                  "worst draw among all ranks, and that worst draw grows with the rank count.",
            options=["remove jitter sources: pin CPU cores, more data-loader workers and prefetch, "
                     "disable Python GC during steps",
                     "synchronize less often: gradient accumulation (more micro-batches per step)",
                     "overlap communication with the backward pass",
                     "scale down: the expected slowest rank grows with the rank count"],
            confidence=min(0.9, 0.4 + coupling * 4))]
    return []


def node_rotation(v: JobView) -> tuple[float, list[str]]:
    """(mean per-window share of the node that arrived last most, the sequence of those nodes)."""
    rows = v.node_last_arrivals()
    shares, tops = [], []
    for i in range(len(v.times)):
        col = {n: rows[n][i] for n in rows}
        tot = sum(col.values())
        if tot <= 0:
            continue
        top = max(col, key=col.get)
        shares.append(col[top] / tot)
        tops.append(top)
    return (sum(shares) / len(shares) if shares else 0.0), tops


def node_dominates(share: float, nodes: int, th: Thresholds) -> bool:
    """Whether the top node's mean per-window share of last arrivals is node-level straggling: at
    least ``rotating_node_share``, and ``rotating_node_excess`` of the way from an even split
    (1/nodes) to all of them. The share alone meant chance over two nodes: one of them takes more
    than 60 % of a window's last arrivals in most windows of 10 steps (62 % on average), and every
    healthy 2-node job read as a straggling node rotating between its two nodes."""
    even = 1 / max(1, nodes)
    return share >= max(th.rotating_node_share, even + th.rotating_node_excess * (1 - even))


def throttling_tops(v: JobView) -> tuple[float, float, list[str]]:
    """(share of windows whose node of the most last arrivals throttled thermally in that window,
    mean share of the nodes throttling in a window: what chance would match, those nodes)."""
    rows, throttle = v.node_last_arrivals(), v.hardware.get("gpu_thermal_throttle", {})
    windows, hits, chance, nodes = 0, 0, 0.0, []
    for i in range(len(v.times)):
        col = {n: rows[n][i] for n in rows}
        if sum(col.values()) <= 0:
            continue
        windows += 1
        hot = {n for n, r in throttle.items() if r[i] is not None and r[i] > 0}
        chance += len(hot & set(rows)) / len(rows)
        top = max(col, key=col.get)
        if top in hot:
            hits += 1
            nodes.append(top)
    if not windows:
        return 0.0, 0.0, []
    return hits / windows, chance / windows, nodes


def detect_thermal(v: JobView, s: dict, th: Thresholds, found: list[Finding]) -> list[Finding]:
    temps = v.hardware.get("gpu_temperature_celsius", {})
    throttle = v.hardware.get("gpu_thermal_throttle", {})
    evidence, conf, subject = [], 0.0, {}
    straggler = next((f for f in found if f.mode == "straggler_persistent"), None)
    if straggler:
        node = straggler.subject["node"]
        thr = _mean(throttle.get(node, []))
        if thr:
            evidence.append({"series": f"{THERMAL_THROTTLE} and on (instance) " + _node_sel(v, node),
                             "value": round(thr, 3), "reading": f"thermal throttling active {pct(thr)} of the time "
                                                               f"on the straggling node {node}"})
            conf = max(conf, 0.9)
        hot = _hotter(temps, node)
        if hot is not None and hot >= th.hot_margin_celsius:
            evidence.append({"series": "syncwatch_gpu_temperature_celsius and on (instance) " + _node_sel(v, node),
                             "value": round(hot, 1),
                             "reading": f"{node} runs {hot:.1f} °C hotter than the other nodes"})
            conf = max(conf, 0.75)
        subject = {"node": node}
    if not straggler and v.has_exact():
        share, tops = node_rotation(v)
        distinct = sorted(set(tops))
        la_nodes = v.node_last_arrivals()
        totals = {n: sum(r) for n, r in la_nodes.items()}
        overall = max(totals.values()) / max(1.0, sum(totals.values()))
        # over many nodes the straggling node's share of a window stays below node_dominates
        # (16 x 2 ranks: 47 %, 32 x 1: 33 %, where 60 % is asked): its GPUs throttling in the
        # windows it straggles, far more often than chance, carry the finding there
        matched, by_chance, throttled = throttling_tops(v)
        by_throttle = (len(set(throttled)) >= 2 and matched >= th.throttle_match
                       and matched >= th.throttle_chance * by_chance)
        if ((node_dominates(share, len(v.nodes), th) or by_throttle) and len(distinct) >= 2
                and overall < th.persistent_share + 0.2):
            evidence.append({"series": "syncwatch_last_arrivals_total summed by node, per window",
                             "value": round(share, 3),
                             "reading": f"in each window one node takes {pct(share)} of last arrivals, "
                                        f"but the straggling node moves: {', '.join(distinct)}"})
            step_ac = lag1([x for x in v.mean_step_series() if x is not None], min_points=4)
            if step_ac is not None:
                evidence.append({"series": "train_job:syncwatch_step_seconds:mean5m (lag-1 autocorrelation "
                                           "across windows)", "value": round(step_ac, 3),
                                 "reading": "step time drifts slowly" if step_ac > 0.3 else "step time drift"})
            conf = 0.55
            hw = [n for n in distinct if _mean(throttle.get(n, [])) or ((_hotter(temps, n) or 0) >= th.hot_margin_celsius)]
            if by_throttle:
                evidence.append({"series": f"{THERMAL_THROTTLE} of the node arriving last most, per window",
                                 "value": round(matched, 3),
                                 "reading": f"in {pct(matched)} of windows the node arriving last most throttles "
                                            f"then ({pct(by_chance)} by chance: the share of nodes throttling)"})
            if hw:
                evidence.append({"series": "syncwatch_gpu_throttle_active / syncwatch_gpu_temperature_celsius",
                                 "value": len(hw), "reading": f"straggling nodes {', '.join(hw)} throttle or run hot"})
            if by_throttle or hw:
                conf = 0.85
            elif not (temps or throttle):
                evidence.append({"series": "syncwatch_gpu_*", "value": None,
                                 "reading": "no GPU telemetry in range to confirm the thermal cause"})
            subject = {"nodes": distinct}
    if not evidence:
        return []
    where = subject.get("node") or ", ".join(subject.get("nodes", []))
    return [Finding(
        mode="thermal_coupling", title=f"Thermal coupling: {where}",
        phenomenon=_sentence("; ".join(e["reading"] for e in evidence if e["value"] is not None)),
        evidence=evidence,
        cause="A GPU that heats up lowers its clocks (thermal or hardware slowdown); in a synchronous job "
              "that node's slowdown becomes every rank's wait, and as nodes heat and cool in turn the "
              "straggler moves between them.",
        options=[f"check cooling, airflow and inlet temperature of {where}; cordon a node that throttles persistently",
                 "cap power or clocks uniformly so all nodes run at the same, sustainable speed",
                 "schedule the job away from the hot rack / row"],
        confidence=conf, subject=subject)]


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + "."


def _hotter(temps: dict[str, list], node: str) -> float | None:
    mine = _mean(temps.get(node, []))
    others = _vals([_mean(r) for n, r in temps.items() if n != node])
    if mine is None or not others:
        return None
    return mine - statistics.median(others)


def detect_oscillation(v: JobView, s: dict, th: Thresholds) -> list[Finding]:
    ac = s["step_autocorrelation"]
    if ac is None or ac > th.oscillation:
        return []
    return [Finding(
        mode="oscillation", title="Synchronization oscillation",
        phenomenon=f"Step time alternates long/short: lag-1 autocorrelation {ac:.2f} "
                   f"(step CV {pct(s['step_cv'])}).",
        evidence=[{"series": "syncwatch_step_autocorrelation (mean over ranks)", "value": round(ac, 3),
                   "reading": "strongly negative: a long step is followed by a short one"},
                  {"series": "syncwatch_step_cv (least disturbed rank)", "value": round(s["step_cv"] or 0, 4),
                   "reading": f"{pct(s['step_cv'])} step-time variation"}],
        cause="A feedback loop around the synchronization point: work that one step defers lands on the "
              "next (prefetch or data-loader refill racing compute, alternating bucket or pipeline "
              "schedules, a controller over-correcting), so ranks fall into a two-step rhythm.",
        options=["profile two consecutive steps: find the work that moves between them (data refill, "
                 "optimizer offload, logging or evaluation every other step)",
                 "bound prefetch/refill so each step does the same work",
                 "pin the collective algorithm and bucket order (no autotuning between steps)"],
        confidence=min(0.95, 0.5 + (-ac - 0.5)))]


def detect_fabric(v: JobView, s: dict, th: Thresholds) -> list[Finding]:
    """Fabric contention: windows whose collective time is inflated over its quiet baseline.

    A window counts as inflated only where the excess also costs ``inflation_cost`` of its mean
    step: the ratio alone is blind to scale, and a collective of 1 % of the step (0.2 ms in 20 ms)
    doubling in episodes on a loaded machine read as contention at 0.9 with the fabric counters
    following it, for an excess of 1 % of the step, ahead of the jitter that cost the job 6 %.
    """
    coll = v.collective_series()
    vals = _vals(coll)
    if len(vals) < FEW_WINDOWS:
        return []
    base = statistics.quantiles(vals, n=5)[0]  # quiet windows: episodes may fill half of them
    if base <= 0:
        return []
    costs = [(x - base) / step for x, step in zip(coll, v.mean_step_series())
             if x is not None and math.isfinite(x) and x >= th.collective_inflation * base and step]
    inflated = [c for c in costs if c >= th.inflation_cost]
    frac = len(inflated) / len(vals)
    congestion = {name: _node_sum(rows) for name, rows in v.hardware.items()
                  if name in CONGESTION_SERIES and rows}
    tax = v.sync_tax_series()
    corr = {name: _pearson(coll, series) for name, series in congestion.items()}
    corr_tax = {name: _pearson(tax, series) for name, series in congestion.items()}
    best = max((c for c in list(corr.values()) + list(corr_tax.values()) if c is not None), default=None)
    # one inflated window is one event, whatever the counters do then: a correlation over
    # windows that one outlier drives (the simulator's rare congested step) read 0.9 on a
    # straggler job without any fabric problem, and over a short range one window is past the
    # share of windows (1 of 8: a host stall in one window read as contention)
    pattern = len(inflated) >= 2
    episodes = pattern and frac >= th.inflated_windows
    follows = pattern and best is not None and best >= th.correlation
    if not episodes and not follows:
        return []
    # without the skew exchange the slack taken out is estimated from mean waits: the "collective
    # time" is the smallest mean wait, which still holds late arrivals that move from rank to rank
    spread_known = v.has_exact()
    measure, formula = (("collective time per step", "(sync − slack) / steps") if spread_known
                        else ("collective time per step (estimated)",
                              "smallest mean wait of the ranks (skew exchange off)"))
    evidence = [{"series": f"{measure} = {formula}", "value": round(base, 6),
                 "reading": f"baseline {1e3 * base:.1f} ms per step"},
                {"series": f"{measure}, inflated windows", "value": round(max(vals), 6),
                 "reading": f"{pct(frac)} of windows at ≥ {th.collective_inflation}x baseline and "
                            f"≥ {pct(th.inflation_cost)} of their step over it (up to {pct(max(inflated))}), "
                            f"peak {1e3 * max(vals):.1f} ms ({max(vals) / base:.1f}x)"},
                {"series": "train_job:syncwatch_sync_tax:ratio5m", "value": round(s["sync_tax"] or 0, 4),
                 "reading": f"sync tax {pct(s['sync_tax'])}, peak window "
                            f"{pct(max(_vals(tax), default=0))}"}]
    for what_, rs in (("collective time", corr), ("sync tax", corr_tax)):
        for name, c in rs.items():
            if c is not None:
                evidence.append({"series": f"{name} (sum over nodes)", "value": round(c, 3),
                                 "reading": f"correlation with {what_} r = {c:.2f}"})
    if follows:
        conf = 0.9
    elif congestion:
        conf = 0.5
        evidence.append({"series": ", ".join(congestion), "value": None,
                         "reading": "congestion counters do not follow the collective time"})
    else:
        conf = 0.65
        evidence.append({"series": "syncwatch_ib_port_xmit_wait_total, syncwatch_roce_*", "value": None,
                         "reading": "no fabric counters in range to confirm" + (
                             "; the collective itself slowed while arrival spread (slack) did not explain it"
                             if spread_known else "")})
    if not spread_known and conf < 0.9:  # unless the fabric counters follow it: a guess
        conf -= 0.2
        evidence.append({"series": "syncwatch_slack_seconds_total", "value": None,
                         "reading": "no slack in range (exact skew exchange off): late arrivals that move from "
                                    "rank to rank (bursts of jitter) stay in the smallest mean wait and would "
                                    "inflate it the same way"})
    what = (f"The gradient collective itself slows down in episodes ({pct(frac)} of windows, up to "
            f"{max(vals) / base:.1f}x its baseline) — not the ranks' arrival spread." if spread_known else
            f"The collective time, estimated as the smallest mean wait, grows in episodes ({pct(frac)} of "
            f"windows, up to {max(vals) / base:.1f}x its baseline); with the skew exchange off, a slower "
            "collective cannot be told apart from late arrivals that move from rank to rank.")
    return [Finding(
        mode="fabric_contention", title="Fabric contention",
        phenomenon=what,
        evidence=evidence,
        cause="Traffic of this job (or a neighbour) collides on an oversubscribed fabric: flows share "
              "links and switch buffers, congestion control (ECN/CNP, InfiniBand credit waits) throttles "
              "them, and every rank waits for the slowest transfer.",
        options=["change placement: pack the job under fewer leaf switches / one rail group, away from "
                 "noisy neighbours", "change the collective algorithm (tree or hierarchical instead of "
                 "flat ring; NCCL_ALGO) to cut cross-spine traffic",
                 "check adaptive routing, ECN/PFC configuration and link health on the affected ports",
                 "overlap communication with compute so episodes hide behind backward"],
        confidence=conf)]


def detect_topology(v: JobView, s: dict, th: Thresholds) -> list[Finding]:
    bytes_rows = next((v.hardware[n] for n in BYTES_SERIES if v.hardware.get(n)), None)
    if not bytes_rows:
        return []
    coll = v.collective_series()
    steps = v.steps_per_window()
    per_step_bytes = [b * v.window / st if b is not None and st else None
                      for b, st in zip(_node_sum(bytes_rows), steps)]
    half = len(coll) // 2
    if half < 2:
        return []
    c_early, c_late = _mean(coll[:half]), _mean(coll[half:])
    b_early, b_late = _mean(per_step_bytes[:half]), _mean(per_step_bytes[half:])
    if not (c_early and c_late and b_early and b_late):
        return []
    growth, bgrowth = c_late / c_early, b_late / b_early
    # each kind of congestion counter summed over nodes (their units differ: IB transmit-wait
    # ticks, RoCE packets); any one of them rising is congestion
    cong_growth = None
    for name in CONGESTION_SERIES:
        if v.hardware.get(name):
            series = _node_sum(v.hardware[name])
            e, late = _mean(series[:half]), _mean(series[half:])
            growth_of = (late / e) if e else (math.inf if late else 1.0)
            cong_growth = growth_of if cong_growth is None else max(cong_growth, growth_of)
    if growth < th.topology_growth or bgrowth >= th.bytes_growth or (cong_growth or 1.0) >= th.topology_growth:
        return []
    return [Finding(
        mode="topology_mismatch", title="Topology mismatch",
        phenomenon=f"Collective time grew {growth:.2f}x across the range while the bytes moved per step grew "
                   f"only {bgrowth:.2f}x, without rising congestion counters.",
        evidence=[{"series": "collective time per step, first vs second half"
                             + ("" if v.has_exact() else " (estimated: smallest mean wait, skew exchange off)"),
                   "value": [round(c_early, 6), round(c_late, 6)],
                   "reading": f"{1e3 * c_early:.1f} ms -> {1e3 * c_late:.1f} ms"},
                  {"series": "NIC/IB bytes per step (sum over nodes)", "value": [round(b_early), round(b_late)],
                   "reading": f"{bgrowth:.2f}x"}],
        cause="The collective's communication pattern does not match the physical topology: more hops, "
              "cross-rail or cross-spine paths, or ranks placed so a ring crosses the network more often "
              "than needed — time grows without more data.",
        options=["make placement topology-aware (contiguous nodes per leaf, rank order following the rails)",
                 "use a hierarchical / tree collective (NCCL_ALGO=Tree, NCCL topology file)",
                 "check for a degraded link that forced routes onto longer paths"],
        confidence=0.6)]


def detect_restarts(v: JobView, s: dict, th: Thresholds) -> list[Finding]:
    restarts, rerun = s["restarts"], s["rerun_steps"]
    if restarts <= 0 and rerun <= 0:
        return []
    steps = s["steps"] or 0.0
    # failures per running time: a range begun before the job (the default hour) read the MTBF,
    # and so Young's interval, long by the time the job was not yet running
    span = v.running_seconds
    evidence = [{"series": "syncwatch_job_restarts_total, syncwatch_job_attempt", "value": restarts,
                 "reading": f"{plural(restarts, 'restart', '.0f')} in {span / 60:.1f} min"},
                {"series": "syncwatch_job_rerun_steps_total, syncwatch_steps_total - syncwatch_last_step",
                 "value": rerun,
                 "reading": f"{plural(rerun, 'step', '.0f')} computed twice ({pct(rerun / steps if steps else None)} of the steps run)"}]
    options = ["find and remove the failing component: cordon the node behind the failures (XID errors, "
               "link flaps, ECC) before the next restart",
               "checkpoint asynchronously so a shorter interval costs little"]
    if restarts > 0 and v.checkpoints and v.checkpoint_cost:
        from .checkpoint import young_interval
        t_ckpt = v.checkpoint_cost
        mtbf = span / restarts
        interval = young_interval(t_ckpt, mtbf)
        mean_step = s["mean_step_seconds"] or 1.0
        evidence.append({"series": "syncwatch_checkpoint_seconds_total / syncwatch_checkpoints_total",
                         "value": round(t_ckpt, 3),
                         "reading": f"a checkpoint costs {t_ckpt:.2f} s (global rank 0's, {v.checkpoints:.0f} in "
                                    f"range); observed MTBF {mtbf / 60:.1f} min"})
        options.insert(1, f"set the checkpoint interval to Young's optimum sqrt(2 T_ckpt MTBF) = {interval:.0f} s "
                          f"(~{plural(interval / mean_step, 'step', '.0f')}) for the observed failure rate")
    options.append("scale down: cluster MTBF falls as 1/nodes, and every failure re-runs work on all of them")
    return [Finding(
        mode="checkpoint_restart", title="Checkpoint-restart amplification",
        phenomenon=f"The job restarted {plural(restarts, 'time', '.0f')} and re-ran {plural(rerun, 'step', '.0f')}.",
        evidence=evidence,
        cause="Every failure of any node stops all ranks: the job pays the restart and recomputes every "
              "step since the last checkpoint, so failures cost work in proportion to the checkpoint "
              "interval and their rate in proportion to the node count.",
        options=options, confidence=0.9 if restarts >= 2 else 0.7)]


def _fewer_windows_advice(windows: int) -> str:
    """What gives the job more windows: a range of fewer than ``FEW_WINDOWS`` is too short (its
    windows cannot get narrower than their least width), a longer one too wide for the job."""
    if windows < FEW_WINDOWS:
        return "widen the range"
    return "narrow --start and --end to the job"


def diagnose(v: JobView, th: Thresholds = Thresholds()) -> Diagnosis:
    s = scores(v)
    notes = [n for n in (v.warnings_note(),) if n]
    if s["steps"] < FEW_STEPS:
        notes.append(f"only {plural(s['steps'], 'step', '.0f')} in range: fewer than the {FEW_STEPS} the daemons' "
                     "step-time CV spans, and a straggler, an oscillation or congestion episodes may "
                     "not show in so few")
    if s["step_autocorrelation"] is None:
        notes.append(f"no step-time autocorrelation in range that rests on {AUTOCORRELATION_MIN_STEPS} steps (a "
                     f"process's first {AUTOCORRELATION_MIN_STEPS} after its start or a restart are too few): "
                     "oscillation not assessed")
    job_windows = len(_vals(v.collective_series()))
    if job_windows < FEW_WINDOWS:
        notes.append(f"the job ran through {job_windows} of the range's {plural(len(v.times), 'window')} of "
                     f"{v.window:.0f} s: fabric contention and topology mismatch need {FEW_WINDOWS} and "
                     "were not assessed; " + _fewer_windows_advice(len(v.times)))
    exact = v.has_exact()
    if not exact:
        notes.append("no slack / last-arrival counters (exact skew exchange off): slack, coupling and last "
                     "arrivals are estimated from each rank's mean wait per window, which names a persistent "
                     "straggler; jitter whose last rank changes from step to step averages out of them, so "
                     "transient jitter is not ruled out")
    gpu = any(n in v.hardware for n in ("gpu_temperature_celsius", "gpu_thermal_throttle"))
    if exact and not gpu:
        notes.append("no GPU telemetry in range: thermal causes inferred from arrival patterns only")
    elif gpu and not exact:
        notes.append("no exact last arrivals (skew exchange off): a straggling node that moves between nodes "
                     "not assessed; only a persistent straggler's node is checked against GPU telemetry")
    elif not exact:
        notes.append("no GPU telemetry in range and no exact last arrivals (skew exchange off): thermal "
                     "coupling not assessed")
    if not any(n in v.hardware for n in CONGESTION_SERIES):
        notes.append("no InfiniBand/RoCE congestion counters in range: fabric contention inferred from "
                     + ("collective time only" if exact else
                        "the collective time estimated as the smallest mean wait only"))
    if not any(n in v.hardware for n in BYTES_SERIES):
        notes.append("no NIC/IB byte counters in range: topology mismatch not assessed")
    found: list[Finding] = []
    found += detect_stragglers(v, s, th)
    found += detect_thermal(v, s, th, found)
    if any(f.mode == "thermal_coupling" for f in found):
        found = [f for f in found if f.mode != "straggler_transient"]
    found += detect_oscillation(v, s, th)
    found += detect_fabric(v, s, th)
    found += detect_topology(v, s, th)
    found += detect_restarts(v, s, th)
    found.sort(key=lambda f: -f.confidence)
    return Diagnosis(job=v.job, source=v.source, start=v.start, end=v.end, ranks=len(v.rank_node),
                     nodes=len(v.nodes), steps=s["steps"], scores=s, findings=found, notes=notes,
                     estimated=[] if v.has_exact() else list(ESTIMATED_SCORES), job_windows=job_windows,
                     windows=len(v.times))


# ---------------------------------------------------------------- CLI

def summary(d: Diagnosis) -> str:
    s = d.scores
    est = estimate_mark(d)
    lines = [f"syncwatch diagnose: train job {d.job} — {plural(d.ranks, 'rank')} on {plural(d.nodes, 'node')}, "
             f"{plural(d.steps, 'step', ',.0f')} ({d.source})",
             f"  mean step {ms(s['mean_step_seconds'])}, sync tax {pct(s['sync_tax'])}, coupling "
             f"{pct(s['coupling'])}{est('coupling')}, step CV {pct(s['step_cv'])}, straggler concentration "
             f"{pct(s['straggler_concentration'])}{est('straggler_concentration')}"]
    if d.healthy:
        lines.append(f"  {d.verdict}")
    for i, f in enumerate(d.findings, 1):
        lines.append(f"\n{i}. {f.title}  [confidence {f.confidence_word}, {f.confidence:.2f}]")
        lines.append(f"   observed: {f.phenomenon}")
        for e in f.evidence:
            lines.append(f"     - {e['series']}: {e['reading']}")
        lines.append(f"   cause: {f.cause}")
        lines.append("   options:")
        lines += [f"     * {o}" for o in f.options]
    if d.notes:
        lines.append("")
        lines += [f"  note: {n}" for n in d.notes]
    return "\n".join(lines)


def estimate_mark(d: Diagnosis):
    """``mark(score)``: the words that follow an estimated score's value ("" for a measured one)."""
    return lambda name: " (estimated from mean waits)" if name in d.estimated else ""


def register(subparsers) -> None:
    p = subparsers.add_parser("diagnose", help="classify a train job's state into synchronization failure modes",
                              description="Diagnose a train job from Prometheus or a recorded run.")
    add_source_flags(p)
    p.set_defaults(func=run)


@command("diagnose")
def run(args) -> int:
    view, _ = view_from_args(args)
    d = diagnose(view)
    if args.json:
        emit_json(d.to_dict())
    else:
        print(summary(d))
    return 0
