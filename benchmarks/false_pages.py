"""False pages: healthy jobs of many shapes, hours of simulated time on the real pipeline, must page nothing.

The alert drill's pipeline (syncwatch.rules.drill.pipeline): simulated jobs send to real daemons
(one per simulated node), real Prometheus scrapes them every 1 s and evaluates the shipped rules
rendered at --time-scale, real Alertmanager routes to a webhook. Every job is healthy (no
straggler, no growing variance), each of another shape: checkpoints, evaluations, saves on rank 0
alone, the calibrated cluster at 4 nodes x 8 ranks, one-off stalls, a late start, no skew
exchange, a warm-up ramp (at 1 s and at 10 s steps). Times are simulated: a step of 1 s runs in
1 s x --time-scale, the daemons' CV window and the rules' windows are scaled alike, and so are
the heartbeat (5 s) and the skew exchange's window cut (30 s); K is the shipped 50.

    python benchmarks/false_pages.py [--minutes 120] [--time-scale 0.05] [--seed 0] [--workdir DIR]

Prints, per job, its simulated duration and steps and every alert that went pending or fired
(when, in simulated minutes since the job's start, and the alert's value), then
"healthy jobs: N, alerts fired: M"; exits 1 when an alert fired. --workdir keeps Prometheus'
data (DIR/prom/data) to query after the run.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

from syncwatch.rules.drill import NODES, RANKS_PER_NODE, pipeline  # noqa: E402
from syncwatch.sim.model import Params  # noqa: E402
from syncwatch.sim.scenarios import ScenarioThread  # noqa: E402
from syncwatch.skew import EXCHANGE_SECONDS  # noqa: E402
from syncwatch.stack import wait_until  # noqa: E402

HEARTBEAT_SECONDS = 5.0       # the instrumentation's default, simulated seconds
STALL_EVERY_MINUTES = 20.0    # the one-off stalls' spacing
WARMUP_STEPS = 200            # the warm-up ramp: step s computes 1 + WARMUP_SLOWDOWN x
WARMUP_SLOWDOWN = 1.0         # (1 - s / WARMUP_STEPS)² times as long, 1x from step 200 on


@dataclass(frozen=True)
class Shape:
    name: str
    what: str
    step_seconds: float                      # compute per step, simulated (the collective adds 15 %)
    params: dict = field(default_factory=dict)
    nodes: int = NODES
    ranks_per_node: int = RANKS_PER_NODE
    start_minute: float = 0.0
    exchange_every: int = 50
    warmup: bool = False


def shapes(minutes: float) -> list[Shape]:
    """The healthy job shapes of a soak of ``minutes`` simulated minutes."""
    slow = 10.0
    step = slow * (1 + Params.collective_seconds)           # ~ the slow jobs' step, simulated
    every = round(STALL_EVERY_MINUTES * 60 / step)
    stalls = tuple(range(every, int(minutes * 60 / step) + 1, every))
    return [
        Shape("checkpoint", "1 s steps, a 20 s checkpoint every 200 steps", 1.0,
              dict(checkpoint_every=200, checkpoint_seconds=20.0)),
        Shape("eval", "10 s steps, a 60 s evaluation every 50 steps", slow,
              dict(eval_every=50, eval_seconds=6.0)),
        Shape("rank0-saves", "1 s steps, a 20 s checkpoint every 200 steps on rank 0 alone", 1.0,
              dict(checkpoint_every=200, checkpoint_seconds=20.0, rank0_pauses=True)),
        Shape("cluster", "1 s steps, the calibrated healthy cluster at 4 nodes x 8 ranks", 1.0,
              nodes=4, ranks_per_node=8),
        Shape("one-off-stalls", f"10 s steps, a 30 s stall on rank 0 every {every} steps (about "
                                f"{STALL_EVERY_MINUTES:g} minutes): at steps "
                                f"{', '.join(map(str, stalls)) or 'none in this run'}", slow,
              dict(stall_at=stalls, stall_at_seconds=3.0) if stalls else {}),
        Shape("late-start", f"1 s steps, started {minutes / 3:.3g} minutes in", 1.0,
              start_minute=minutes / 3),
        Shape("no-exchange", "1 s steps without the skew exchange (K = 0)", 1.0, exchange_every=0),
        *(Shape(f"warmup-{t:g}s", f"{t:g} s steps, the first {WARMUP_STEPS} slower "
                                  f"({1 + WARMUP_SLOWDOWN:g}x falling to 1x)", t, warmup=True)
          for t in (1.0, slow)),
    ]


def ramp(step: int) -> float:
    """The warm-up's compute factor at ``step`` (1-based)."""
    return 1.0 + WARMUP_SLOWDOWN * max(0.0, 1.0 - step / WARMUP_STEPS) ** 2


def ramp_hook(model, compute: float):
    """An ``after_step`` callable that sets the model's compute time for its next step."""
    def after_step():
        if model.step < WARMUP_STEPS:
            model.p = model.p.with_(compute_seconds=compute * ramp(model.step + 1))
    return after_step


@dataclass
class Episode:
    """An alert active without a break: pending, maybe firing, until it went or the run ended."""
    labels: dict
    pending: float | None = None
    pending_value: float | None = None
    firing: float | None = None
    firing_value: float | None = None
    peak: float | None = None
    ended: float | None = None


@dataclass
class Job:
    shape: Shape | None                      # None: the alerts of no train job (the pipeline's own)
    name: str
    thread: ScenarioThread | None = None
    start: float | None = None
    behind: float = 0.0                      # the most its simulator fell behind real time, real s
    episodes: list[Episode] = field(default_factory=list)
    open: dict = field(default_factory=dict)   # labels key -> its episode, while active
    pages: int = 0


def observe(prom, jobs: dict[str, Job], now: float) -> None:
    """One look at Prometheus' active alerts: open, advance and close each job's episodes (an
    alert of no job in ``jobs``, the Watchdog aside, goes to the job named "")."""
    seen = set()
    for a in prom.alerts():
        if a["labels"]["alertname"] == "SyncwatchWatchdog":
            continue
        job = jobs.get(a["labels"].get("train_job", ""), jobs[""])
        key = tuple(sorted(a["labels"].items()))
        seen.add((job.name, key))
        value = float(a["value"])
        ep = job.open.get(key)
        if ep is None:
            ep = job.open[key] = Episode(a["labels"])
            job.episodes.append(ep)
        if ep.pending is None:
            ep.pending, ep.pending_value = now, value
        if a["state"] == "firing" and ep.firing is None:
            ep.firing, ep.firing_value = now, value
        ep.peak = value if ep.peak is None else max(ep.peak, value)
    for job in jobs.values():
        for key in [k for k in job.open if (job.name, k) not in seen]:
            job.open.pop(key).ended = now


def missed(prom, jobs: dict[str, Job], seconds: float) -> list[tuple[str, str, str]]:
    """(train job, alert, state) of the alerts the ALERTS series held in the last ``seconds``
    that no look saw so (a pending of one evaluation between two looks, say)."""
    out = []
    for r in prom.query(f'max_over_time(ALERTS{{alertname!="SyncwatchWatchdog"}}[{int(seconds) + 1}s])'):
        m = r["metric"]
        job = jobs.get(m.get("train_job", ""), jobs[""])
        seen = any(e.labels["alertname"] == m["alertname"]
                   and (m["alertstate"] == "pending" or e.firing) for e in job.episodes)
        if not seen:
            out.append((m.get("train_job", "-"), m["alertname"], m["alertstate"]))
    return out


def grouped(episodes: list[Episode]) -> list[list[Episode]]:
    """Episodes of one alert that came and went at the same looks (one per rank, say), together."""
    groups: dict[tuple, list[Episode]] = {}
    for ep in episodes:
        groups.setdefault((ep.labels["alertname"], ep.pending, ep.firing, ep.ended), []).append(ep)
    return list(groups.values())


def values(xs) -> str:
    xs = list(xs)
    lo, hi = min(xs), max(xs)
    return f"{lo:.4g}" if lo == hi else f"{lo:.4g} to {hi:.4g}"


def describe(group: list[Episode], start: float, scale: float) -> str:
    """One line for a group of ``grouped``: the alert, its series' rank/node/instance labels, when
    (simulated minutes since ``start``) it went pending and fired, its values, when it went."""
    ep = group[0]
    minute = lambda t: (t - start) / scale / 60  # noqa: E731
    where = {k: sorted({e.labels[k] for e in group}, key=lambda v: (len(v), v))
             for k in ("rank", "node", "instance") if k in ep.labels}
    text = ep.labels["alertname"] + "".join(f" {k} {','.join(v)}" for k, v in where.items())
    text += f": pending at {minute(ep.pending):.1f} min (value {values(e.pending_value for e in group)})"
    if ep.firing is not None:
        text += f", FIRING at {minute(ep.firing):.1f} min (value {values(e.firing_value for e in group)})"
    text += f", peak {values(e.peak for e in group)}, "
    text += f"gone at {minute(ep.ended):.1f} min" if ep.ended else "active at the end"
    return text


def start_job(job: Job, pl, seed: int, scale: float) -> None:
    s = job.shape
    compute = s.step_seconds * scale
    params = dict(s.params, compute_seconds=compute * (ramp(1) if s.warmup else 1))
    job.thread = ScenarioThread("healthy", pl.targets[:s.nodes], s.nodes, s.ranks_per_node,
                                seed=seed, job=job.name, params=params,
                                exchange_every=s.exchange_every,
                                exchange_seconds=EXCHANGE_SECONDS * scale,
                                heartbeat_every=HEARTBEAT_SECONDS * scale)
    if s.warmup:
        job.thread.driver.after_step.append(ramp_hook(job.thread.driver.model, compute))
    job.start = time.time()
    job.thread.start()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=120.0, help="simulated minutes (default 120)")
    ap.add_argument("--time-scale", type=float, default=0.05, help="real seconds per simulated "
                    "second, the rules rendered at it (default 0.05: 120 minutes run in 6)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", help="keep the rules and Prometheus' data here")
    args = ap.parse_args()
    scale = args.time_scale
    jobs = {f"soak-{s.name}": Job(s, f"soak-{s.name}") for s in shapes(args.minutes)}
    healthy = list(jobs.values())
    jobs[""] = Job(None, "")
    nodes = max(j.shape.nodes for j in healthy)
    with pipeline(scale, nodes=nodes, workdir=args.workdir) as pl:
        wait_until(pl.prom.targets_up, 60, what="Prometheus' first scrape of the daemons")
        t0 = time.time()
        end = t0 + args.minutes * 60 * scale
        report_at = t0
        try:
            while True:
                now = time.time()
                for i, job in enumerate(healthy):
                    if job.thread is None and now >= t0 + job.shape.start_minute * 60 * scale:
                        start_job(job, pl, args.seed * 100 + i, scale)
                    elif job.thread is not None:
                        if job.thread.error is not None:
                            raise RuntimeError(f"{job.name}: simulator failed: {job.thread.error!r}")
                        job.behind = max(job.behind, now - job.start - job.thread.driver.model.time)
                observe(pl.prom, jobs, now)
                if now >= report_at:
                    active = sorted({f"{j.name or '-'}: {e.labels['alertname']}"
                                     for j in jobs.values() for e in j.open.values()})
                    print(f"[{(now - t0) / scale / 60:6.1f} min] active: {', '.join(active) or 'none'}",
                          file=sys.stderr, flush=True)
                    report_at += 10 * 60 * scale
                if now >= end:
                    break
                time.sleep(0.5)
            lost = missed(pl.prom, jobs, time.time() - t0)
            for note in pl.notifications():
                for a in note["payload"]["alerts"]:
                    if a["status"] == "firing" and a["labels"]["alertname"] != "SyncwatchWatchdog":
                        jobs.get(a["labels"].get("train_job", ""), jobs[""]).pages += 1
        finally:
            for job in healthy:
                if job.thread is not None:
                    job.thread.stop()
    print(f"time scale {scale:g}, {args.minutes:g} simulated minutes, seed {args.seed}")
    for job in jobs.values():
        if job.shape is None:
            print("\nalerts of no train job (daemons, hardware)")
        else:
            s, truth = job.shape, job.thread.truth
            print(f"\n{job.name}: {s.what}; {s.nodes} x {s.ranks_per_node} ranks")
            print(f"  ran {job.thread.driver.model.time / scale / 60:.1f} simulated minutes, "
                  f"{truth.executed_steps} steps (at most {job.behind:.2f} real s behind its "
                  f"pace); notifications: {job.pages}")
        for group in grouped(job.episodes):
            print(f"  {describe(group, job.start or t0, scale)}")
        if not job.episodes:
            print("  no alert pending or firing")
    for job_name, name, state in lost:
        print(f"in ALERTS but missed by the looks: {job_name}: {name} {state}")
    pending = sum(len(j.episodes) for j in jobs.values())
    fired = (sum(e.firing is not None for j in jobs.values() for e in j.episodes)
             + sum(state == "firing" for *_, state in lost))
    print(f"\nalert series that went pending: {pending}, of which fired: {fired}")
    print(f"healthy jobs: {len(healthy)}, alerts fired: {fired}")
    return 1 if fired else 0


if __name__ == "__main__":
    sys.exit(main())
