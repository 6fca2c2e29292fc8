"""``syncwatch project``: scaling projection from the current scale to larger node counts.

A synchronous step ends when the slowest rank arrives, plus the collective:
``T = max_i compute_i + C``. The projection keeps the measured cluster's make-up and replicates it
(``k = R'/R`` copies of the measured ranks):

* slowest rank — from a recorded run, the per-step maximum compute ``M`` has the empirical CDF
  ``G``; ``k`` replicas give ``G(t)^k``, whose moments are exact sums over the sorted sample
  (heavy tails, rare stalls and persistent stragglers carry over). From Prometheus counters
  only, per-rank compute is taken as Gaussian, ``sigma`` fitted to the mean slack:
  ``mean slack = E[M] - mu = sigma e_R``, and ``E[M'] = mu + sigma e_R'`` (``e_N`` = expected
  maximum of N standard normals, ``orderstats``). Without the skew exchange the slack, and with
  it ``sigma``, the coupling and the collective, are estimated from mean waits (``JobView``):
  jitter averages out of them, so the projection's growth is a floor, and it says so.
* collective — the baseline collective time grows with the inter-node all-reduce:
  ring ``(n'-1)/n' / ((n-1)/n)`` of bandwidth term plus ``2 (n'-n) alpha``; tree
  ``ceil(log2 n') / ceil(log2 n)``; ``none`` keeps it as measured (the simulator's assumption).
* congestion episodes — from a recorded run, steps whose collective exceeds 1.5x the baseline (the
  median step); from Prometheus, whose windows each mix quiet and congested steps, the baseline is
  the 20th-percentile window and q and f solve the per-step collective's mean and variance (the
  step CV's variance less the slowest rank's; ``_window_episodes``). Their probability
  ``q`` grows as ``(n'/n)^gamma`` (gamma = 2: pairwise flow collisions on an oversubscribed
  fabric), their inflation ``f`` stays. Where ``q`` reaches 1 every step is an episode: the
  steps are uniformly slower, and the variance episodes add, ``q(1-q)``, falls to 0, so the
  projected step CV drops there. A fabric that congested is not uniformly slow; the projection
  says so (``congestion_saturated``) and its CV from there on is a floor.

Then ``E[T'] = E[M'] + c' (1 + q'(f-1))``, ``Var T' = Var M' + c'^2 (f-1)^2 q'(1-q')``, step CV
= sd/mean, coupling = ``(E[M'] - mu) / E[T']`` (mean slack over step time), throughput
``R' b / E[T']``. Weak scaling keeps the per-rank batch; strong scaling keeps the global batch
(per-rank compute shrinks by ``1/k``). The sync wall is the node count of the highest throughput:
beyond it adding nodes no longer shortens the job. The model's step CV at the measured scale is
checked against the measured one (``cv_check``): where they differ more than 2x, so do the
projected CVs.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

from .. import cli
from .common import AnalysisError, command, emit_json, pct, plural
from .orderstats import normal_max_moments
from .recording import select
from .source import add_source_flags, view_from_args
from .view import FEW_WINDOWS, JobView

EPISODE = 1.5  # a step's collective above this x baseline is a congestion episode
# from Prometheus: the mean collective must exceed the quiet windows' by this share to hold episodes;
# over four exchange periods a window's collective time errs by up to ~9 % (view.py), a healthy
# job's mean sits a few % above its 20th-percentile window
MIN_EXCESS = 0.10
# the model's step CV at the measured scale against the measured one: the daemon's CV over its
# last 100 steps, read at a few window ends, read 0.6-2.9 % on one healthy run with the window
# grid, as a rare stall or episode fell inside or outside them; beyond a factor of 2 the model is
# missing (or inventing) variability
CV_DISAGREE = 2.0
# measured inputs read from slack, estimated from mean waits without the skew exchange
ESTIMATED = ["coupling", "sigma", "collective"]
ESTIMATE_NOTE = ("estimated from mean waits (skew exchange off): coupling and sigma are lower bounds (jitter "
                 "averages out of them), the collective an upper bound (it keeps that jitter); the projected "
                 "coupling and slowest-rank growth are a floor")


@dataclass
class Measurement:
    nodes: int
    ranks: int
    steps: int
    method: str                      # "recorded steps" or "prometheus counters (gaussian)"
    mean_compute: float              # mu: mean per-rank compute per step
    collective: float                # c: baseline collective time per step
    congestion_probability: float    # q
    congestion_inflation: float      # f
    samples_per_rank_step: float | None
    mean_step: float                 # measured
    step_cv: float | None
    coupling: float | None
    sigma: float | None = None       # gaussian method
    step_max_compute: list[float] | None = None  # recorded method: per-step max compute, sorted
    estimated: list[str] = field(default_factory=list)  # inputs estimated from mean waits (K = 0)
    notes: list[str] = field(default_factory=list)      # the source's warnings (partial data)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("step_max_compute")
        return d


def measure_run(run: dict, steps: list[dict]) -> Measurement:
    """Exact measurement from a recorded run's steps."""
    nodes = len(set(run["rank_node"]))
    ranks = len(run["rank_node"])
    if len(steps) < 10:
        raise AnalysisError(f"only {plural(len(steps), 'step')} in range: the projection needs at least 10")
    maxc, mins, all_c, secs = [], [], 0.0, []
    for s in steps:
        comp = [s["seconds"] - w for w in s["waits"]]
        maxc.append(max(comp))
        all_c += sum(comp)
        mins.append(min(s["waits"]))
        secs.append(s["seconds"])
    mu = all_c / (ranks * len(steps))
    c, q, f = _episodes(mins)
    mean_step = sum(secs) / len(secs)
    sd = statistics.pstdev(secs)
    slack = sum(maxc) / len(maxc) - mu
    return Measurement(nodes=nodes, ranks=ranks, steps=len(steps), method="recorded steps",
                       mean_compute=mu, collective=c, congestion_probability=q, congestion_inflation=f,
                       samples_per_rank_step=run.get("samples_per_step"), mean_step=mean_step,
                       step_cv=sd / mean_step, coupling=slack / mean_step, step_max_compute=sorted(maxc))


def _episodes(collectives: list[float]) -> tuple[float, float, float]:
    """(baseline, episode probability, mean inflation in episodes) of per-step collective times.

    A zero baseline (no collective in most steps) holds no episodes, as from Prometheus
    (``_window_episodes``): an inflation over nothing is no factor."""
    base = statistics.median(collectives)
    if base <= 0:
        return 0.0, 0.0, 1.0
    high = [x for x in collectives if x > EPISODE * base]
    q = len(high) / len(collectives)
    f = (sum(high) / len(high) / base) if high else 1.0
    return base, q, f


def measure_view(v: JobView) -> Measurement:
    """From Prometheus counters: windowed sums; per-rank compute taken as Gaussian."""
    steps = v.total("steps")
    ranks = len(v.rank_node)
    step_s, sync, slack = v.total("step_seconds"), v.total("sync_seconds"), v.total("slack_seconds")
    mean_step = step_s / steps
    mu = (step_s - sync) / steps
    mean_slack = slack / steps
    e_max, sd_max = normal_max_moments(ranks) if ranks > 1 else (1.0, 0.0)
    sigma = mean_slack / e_max if ranks > 1 else 0.0
    coll = [x for x in v.collective_series() if x is not None]
    if not coll:
        raise AnalysisError("no complete window in range to measure the collective time")
    # the daemon's CV covers its last W steps at each window end: their variances average, not the CVs
    step_var = [(cv * m) ** 2 for cv, m in zip(v.cv, v.mean_step_series()) if cv is not None and m is not None]
    var_t = sum(step_var) / len(step_var) if step_var else None
    mean_coll = (sync - slack) / steps
    c, q, f = _window_episodes(coll, mean_coll, None if var_t is None else var_t - (sigma * sd_max) ** 2)
    return Measurement(nodes=len(v.nodes), ranks=ranks, steps=int(steps / max(1, ranks)),
                       method="prometheus counters (gaussian)", mean_compute=mu, collective=c,
                       congestion_probability=q, congestion_inflation=f,
                       samples_per_rank_step=v.samples_per_rank_step, mean_step=mean_step,
                       step_cv=math.sqrt(var_t) / mean_step if var_t is not None else None,
                       coupling=slack / step_s, sigma=sigma,
                       estimated=[] if v.has_exact() else list(ESTIMATED),
                       notes=[n for n in (v.warnings_note(),) if n])


def _window_episodes(windows: list[float], mean: float, step_var: float | None) -> tuple[float, float, float]:
    """(baseline, episode probability q, inflation f) of the collective from per-window means.

    A window of n steps holding a share q_w of episodes reads ``c (1 + q_w (f - 1))``: windows of
    tens to hundreds of steps mix quiet and congested steps, so no window shows f, and the median
    window sits near the mean. The baseline ``c`` is the 20th percentile of the windows (the quiet
    fifth, as ``diagnose`` reads it; an upper bound where every window holds episodes). Two moments
    of the per-step collective then give q and f: the mean ``c (1 + e)`` with ``e = q (f - 1)``,
    and the variance ``V = c^2 (f - 1)^2 q (1 - q)``, which is the measured per-step variance of the
    step time less the slowest rank's (``step_var``, from the daemon's step CV). Hence
    ``f - 1 = (V / c^2 + e^2) / e`` and ``q = e / (f - 1)``. Window means vary less than steps do,
    so their variance is a floor of V (and V itself without a step CV in range). Fewer than
    ``FEW_WINDOWS`` windows hold no episodes: the quiet fifth of two or three is an extrapolation
    below the smallest ([10, 12] gave 9.2), and a straggler job a minute old read episodes in 79 %
    of its steps.
    """
    if len(windows) < FEW_WINDOWS:  # the 20th percentile of 2 or 3 fell below the smallest
        return mean, 0.0, 1.0
    base = statistics.quantiles(windows, n=5)[0]
    if base <= 0:
        return 0.0, 0.0, 1.0
    excess = mean / base - 1
    if excess < MIN_EXCESS:
        return base, 0.0, 1.0
    floor = statistics.pvariance(windows)
    var = floor if step_var is None else max(step_var, floor)
    spread = (var / base ** 2 + excess ** 2) / excess
    return base, excess / spread, 1 + spread


def _max_moments(sorted_sample: list[float], k: float) -> tuple[float, float]:
    """Mean and sd of the maximum of ``k`` independent draws from the empirical distribution."""
    m = len(sorted_sample)
    m1 = m2 = 0.0
    prev = 0.0
    for j, x in enumerate(sorted_sample, 1):
        cur = (j / m) ** k
        w = cur - prev
        m1 += w * x
        m2 += w * x * x
        prev = cur
    return m1, math.sqrt(max(0.0, m2 - m1 * m1))


@dataclass
class Options:
    scaling: str = "weak"            # weak: per-rank batch fixed; strong: global batch fixed
    algorithm: str = "ring"
    latency_us: float = 0.0          # alpha per inter-node all-reduce step
    congestion_exponent: float = 2.0


def collective_at(m: Measurement, nodes: int, o: Options) -> float:
    n = m.nodes
    if o.algorithm == "none":
        return m.collective
    if o.algorithm == "tree":
        grow = math.ceil(math.log2(max(2, nodes))) / math.ceil(math.log2(max(2, n)))
        return m.collective * grow
    grow = ((nodes - 1) / nodes) / ((n - 1) / n)
    return m.collective * grow + 2 * (nodes - n) * o.latency_us * 1e-6


def project_at(m: Measurement, nodes: int, o: Options) -> dict:
    ranks = nodes * m.ranks // m.nodes
    k = ranks / m.ranks
    shrink = 1 / k if o.scaling == "strong" else 1.0
    mu = m.mean_compute * shrink
    if m.step_max_compute is not None:
        em, sm = _max_moments(m.step_max_compute, k)
    else:
        e, sd = normal_max_moments(max(1, ranks))
        em, sm = m.mean_compute + m.sigma * e, m.sigma * sd
    em, sm = em * shrink, sm * shrink
    c = collective_at(m, nodes, o)
    q = min(1.0, m.congestion_probability * (nodes / m.nodes) ** o.congestion_exponent)
    f = m.congestion_inflation
    mean = em + c * (1 + q * (f - 1))
    sd = math.sqrt(sm * sm + (c * (f - 1)) ** 2 * q * (1 - q))
    batch = (m.samples_per_rank_step or 1.0) * (shrink * ranks)
    return {"nodes": nodes, "ranks": ranks, "mean_step_seconds": mean, "step_cv": sd / mean,
            "coupling": (em - mu) / mean, "sync_tax": (em - mu + c * (1 + q * (f - 1))) / mean,
            "collective_seconds": c, "congestion_probability": q,
            "congestion_saturated": q >= 1.0 and f > 1.0,
            "throughput": batch / mean,
            "throughput_unit": "samples/s" if m.samples_per_rank_step else "rank-steps/s"}


def sync_wall(m: Measurement, o: Options, max_nodes: int) -> dict:
    counts, x = set(), float(m.nodes)
    while x <= max_nodes:
        counts.add(int(round(x)))
        x *= 2 ** (1 / 8)
    counts.add(max_nodes)
    curve = [project_at(m, n, o) for n in sorted(counts) if n >= m.nodes]
    best = max(curve, key=lambda p: p["throughput"])
    reached = best["nodes"] < curve[-1]["nodes"]
    return {"nodes": best["nodes"], "throughput": best["throughput"], "reached": reached,
            "max_nodes": max_nodes,
            "curve": [{"nodes": p["nodes"], "throughput": p["throughput"],
                       "mean_step_seconds": p["mean_step_seconds"]} for p in curve]}


def projection(m: Measurement, targets: list[int], o: Options, max_nodes: int) -> dict:
    if m.nodes < 2:
        raise AnalysisError("the measurement spans one node: the inter-node collective cannot be "
                            "projected (measure on at least 2 nodes)")
    base = project_at(m, m.nodes, o)
    rows = []
    for n in targets:
        p = project_at(m, n, o)
        p["scaling_efficiency"] = p["throughput"] / (base["throughput"] * n / m.nodes) \
            if o.scaling == "weak" else base["mean_step_seconds"] / p["mean_step_seconds"] / (n / m.nodes)
        rows.append(p)
    return {"measured": m.to_dict(), "model_at_measured": base, "step_cv_check": cv_check(m, base),
            "options": asdict(o), "projections": rows, "sync_wall": sync_wall(m, o, max_nodes)}


def cv_check(m: Measurement, base: dict) -> dict | None:
    """The model's step CV at the measured scale against the measured one (None: none measured).

    Every projected CV grows from the model's variability; one that misses the measured at its own
    scale by more than ``CV_DISAGREE`` (episodes the windows averaged away, steps slowed together,
    rare stalls) projects a CV that far off.
    """
    if not m.step_cv:
        return None
    ratio = base["step_cv"] / m.step_cv
    return {"model": base["step_cv"], "measured": m.step_cv, "ratio": ratio,
            "agrees": 1 / CV_DISAGREE <= ratio <= CV_DISAGREE}


# ---------------------------------------------------------------- CLI

def register(subparsers) -> None:
    p = subparsers.add_parser("project", help="project step time, CV, coupling and throughput to more nodes",
                              description="Scaling projection from the measured scale (Prometheus or a recorded run).")
    add_source_flags(p)
    cli.add_flag(p, "--nodes", default=None,
                 help="node counts to project to, comma separated (default: 2x, 4x, 8x, 16x the measured)")
    cli.add_flag(p, "--scaling", default="weak", choices=("weak", "strong"),
                 help="weak: per-rank batch fixed; strong: global batch fixed")
    cli.add_flag(p, "--algorithm", default="ring", choices=("ring", "tree", "none"),
                 help="inter-node all-reduce whose cost growth to apply (none: collective time stays as measured)")
    cli.add_flag(p, "--latency-us", type=float, default=0.0, help="all-reduce per-step latency alpha, microseconds")
    cli.add_flag(p, "--congestion-exponent", type=float, default=2.0,
                 help="congestion episodes' probability grows as (nodes ratio) ** this")
    cli.add_flag(p, "--max-nodes", type=int, default=None, help="largest node count of the sync-wall sweep "
                                                              "(default 64x the measured)")
    p.set_defaults(func=run)


def measurement(view: JobView, run_data: dict | None) -> Measurement:
    """Exact from a recorded run's steps, else from the view's counters."""
    if run_data is not None:
        return measure_run(run_data, select(run_data, view.start, view.end))
    return measure_view(view)


def _targets(args, n: int) -> list[int]:
    text = args.nodes
    if not text:
        return [2 * n, 4 * n, 8 * n, 16 * n]
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise AnalysisError(f"{cli.named(args, '--nodes')} {text!r}: expected comma-separated "
                            "node counts") from None
    if not out or min(out) < n:  # the model extrapolates up: at 1 node a ring all-reduce is free
        raise AnalysisError(f"{cli.named(args, '--nodes')}: node counts must be at least the {n} "
                            "measured (the projection runs from the measured scale up)")
    return out


def summary(res: dict) -> str:
    m, base = res["measured"], res["model_at_measured"]
    unit = base["throughput_unit"]
    lines = [f"syncwatch project: measured {plural(m['ranks'], 'rank')} on {plural(m['nodes'], 'node')}, "
             f"{plural(m['steps'], 'step', ',')} "
             f"({m['method']}), {res['options']['scaling']} scaling, {res['options']['algorithm']} all-reduce",
             f"  measured   mean step {1e3 * m['mean_step']:.1f} ms, step CV {pct(m['step_cv'])}, coupling "
             f"{pct(m['coupling'])}; collective {1e3 * m['collective']:.1f} ms, congestion episodes "
             f"{pct(m['congestion_probability'])} of steps",
             *([f"  {ESTIMATE_NOTE}"] if m["estimated"] else []),
             *[f"  note: {n}" for n in m["notes"]],
             "",
             f"  {'nodes':>6} {'ranks':>6} {'step':>10} {'step CV':>8} {'coupling':>9} {'throughput':>14} {'efficiency':>10}",
             f"  {base['nodes']:>6} {base['ranks']:>6} {1e3 * base['mean_step_seconds']:>8.1f}ms "
             f"{pct(base['step_cv']):>8} {pct(base['coupling']):>9} {base['throughput']:>14.1f} {'(model)':>10}"]
    for p in res["projections"]:
        lines.append(f"  {p['nodes']:>6} {p['ranks']:>6} {1e3 * p['mean_step_seconds']:>8.1f}ms "
                     f"{pct(p['step_cv']):>8} {pct(p['coupling']):>9} {p['throughput']:>14.1f} "
                     f"{pct(p['scaling_efficiency']):>10}")
    w = res["sync_wall"]
    lines.append(f"  (throughput in {unit})")
    check = res["step_cv_check"]
    if check is not None and not check["agrees"]:
        low = check["ratio"] < 1
        lines.append(f"  step CV check: the model gives {pct(check['model'])} at the measured scale against "
                     f"{pct(check['measured'])} measured (off by more than {CV_DISAGREE:g}x): "
                     + ("it lacks variability the job has (steps slowed together, rare stalls, or congestion "
                        "episodes in every window, which the windows average away), so the projected step "
                        "CVs are floors" if low else
                        "it holds variability the job does not show, so the projected step CVs are overstated"))
    saturated = [p["nodes"] for p in res["projections"] if p["congestion_saturated"]]
    if saturated:
        lines.append(f"  congestion episodes in every step from {min(saturated)} nodes: the model's "
                     "variance from them vanishes there, so that step CV and those beyond are floors")
    if w["reached"]:
        lines.append(f"  sync wall: {w['nodes']} nodes — beyond it adding nodes no longer shortens the job "
                     f"(peak throughput {w['throughput']:.1f} {unit})")
    else:
        lines.append(f"  sync wall: not reached up to {w['max_nodes']} nodes (throughput still rising)")
    return "\n".join(lines)


@command("project")
def run(args) -> int:
    for flag, value in (("--latency-us", args.latency_us), ("--congestion-exponent", args.congestion_exponent)):
        if not (math.isfinite(value) and value >= 0):
            raise AnalysisError(f"{cli.named(args, flag)} must be a finite number ≥ 0 "
                                f"(got {value})")
    m = measurement(*view_from_args(args))
    if args.max_nodes is not None and args.max_nodes < m.nodes:
        raise AnalysisError(f"{cli.named(args, '--max-nodes')} {args.max_nodes} is below the "
                            f"{m.nodes} measured nodes (the sync-wall sweep runs from the measured "
                            "node count up)")
    o = Options(scaling=args.scaling, algorithm=args.algorithm, latency_us=args.latency_us,
                congestion_exponent=args.congestion_exponent)
    res = projection(m, _targets(args, m.nodes), o, args.max_nodes or 64 * m.nodes)
    if args.json:
        emit_json(res)
    else:
        print(summary(res))
    return 0
