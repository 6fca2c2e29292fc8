"""Calibrate the instability score against the simulator (model level, no daemons, seconds to run).

For each scenario: 40 minutes (virtual) of the healthy cluster, then the scenario's effect switched
on (``Model.p`` is read on every step), and the score read 15 minutes after onset -- the time the
rules' windows (5m means, a 30m baseline ending 10m back, 1h re-run window) need to see a change.
The score is computed here exactly as the recording rules compute it, from the same thresholds
(``syncwatch.rules.thresholds``), on what the daemon would export: the rolling step CV and lag-1
autocorrelation over the last W = 100 steps (each step less its checkpoint and eval phases, as
the daemon reads them; the CV over those of them in the last 240 s of steps, ``--cv-seconds``), the barrier skew (max - min wait) per step, re-run steps per executed
step, and restarts in the last hour. ``checkpointing`` is the healthy cluster with a 20 s
checkpoint every 300 steps from the start, ``rank0-saves`` the same on global rank 0 alone (the
others wait for it in the collective; the CV read is rank 0's, the least disturbed rank's, as the
rules read it), ``evaluating`` with a 60 s evaluation every 500 steps: healthy too.

    python benchmarks/calibrate_instability.py [--seeds 3] [--nodes 4] [--ranks-per-node 8]

Prints one row per scenario: the components and the score (mean and max over seeds), and checks the
targets: healthy < 0.2, every degraded scenario > 0.5.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

from syncwatch.daemon.config import DaemonConfig  # noqa: E402
from syncwatch.daemon.state import cv_steps  # noqa: E402
from syncwatch.rules.thresholds import THRESHOLDS as T, WINDOWS as WIN  # noqa: E402
from syncwatch.sim.model import (I_CKPT, I_EVAL, Model, Restart,  # noqa: E402
                                 lag1_autocorrelation, step_cv)
from syncwatch.sim.scenarios import scenario_params  # noqa: E402

W = 100          # the daemon's rolling window (steps)
WARMUP = 40 * 60.0
AFTER = 15 * 60.0
COMPONENTS = ("cv", "cv_counters", "cv_growth", "skew", "skew_growth", "oscillation", "rerun",
              "restarts")
SCENARIOS = ("healthy", "checkpointing", "rank0-saves", "evaluating", "straggler", "oscillation",
             "congestion", "thermal", "restarts")
HEALTHY = ("healthy", "checkpointing", "rank0-saves", "evaluating")  # target < 0.2; others > 0.5
# healthy, with planned pauses (not jitter) from the start among steps of 1 s: a 20 s checkpoint
# every 300 steps, a 60 s evaluation every 500
PAUSED = {"checkpointing": dict(checkpoint_every=300, checkpoint_seconds=20.0),
          "rank0-saves": dict(checkpoint_every=300, checkpoint_seconds=20.0, rank0_pauses=True),
          "evaluating": dict(eval_every=500, eval_seconds=60.0)}


def clamp01(x: float) -> float:
    return min(1.0, max(0.0, x))


def component(value: float, ok: float, bad: float) -> float:
    return clamp01((value - ok) / (bad - ok))


def run(name: str, seed: int, nodes: int, rpn: int) -> dict[str, float]:
    if name in PAUSED:
        healthy = degraded = scenario_params("healthy", nodes, rpn, **PAUSED[name])
    else:
        healthy, degraded = scenario_params("healthy", nodes, rpn), scenario_params(name, nodes, rpn)
    if name == "straggler":
        degraded = replace(degraded, straggler_from_step=0)
    model = Model(healthy, seed)
    # (time, rolling cv, rolling autocorr, skew, step seconds, rerun, executed, step less pauses)
    samples = []
    recent: list[float] = []
    onset = None
    rerun = 0
    restarts: list[float] = []  # their times
    while model.time < WARMUP + AFTER:
        if onset is None and model.time >= WARMUP:
            onset = model.time
            model.p = degraded
            if degraded.fail_after:  # failures counted from the onset
                model._fail_after = [model.executed + n for n in degraded.fail_after]
        ev = model.next()
        if isinstance(ev, Restart):
            rerun += ev.rerun_steps
            restarts.append(model.time)
            recent = []     # a new process: the daemon's rolling window starts over
            continue
        # as the daemon's window and mean1m read it
        paced = ev.step_seconds - ev.phases[0][I_CKPT] - ev.phases[0][I_EVAL]
        recent = (recent + [paced])[-W:]
        cv = step_cv(recent[len(recent) - cv_steps(recent, DaemonConfig.cv_seconds):])
        samples.append((model.time, cv, lag1_autocorrelation(recent), ev.skew,
                        ev.step_seconds, rerun, model.executed, paced))
    now = samples[-1][0]

    def window(start: float, end: float):
        return [s for s in samples if start < s[0] <= end]

    minute_means = []
    for k in range(int(WIN.cv_counters // WIN.rate_short)):
        end = now - k * WIN.rate_short
        minute = window(end - WIN.rate_short, end)
        minute_means.append(sum(s[7] for s in minute) / len(minute))
    cv_counters = statistics.pstdev(minute_means) / statistics.fmean(minute_means)
    last5 = window(now - WIN.rate, now)
    cv = statistics.fmean(s[1] for s in last5)
    base = window(now - WIN.baseline_offset - WIN.baseline, now - WIN.baseline_offset)
    growth = cv / max(statistics.fmean(s[1] for s in base), T.cv_growth_floor)
    skew_ratio = statistics.fmean(s[3] for s in last5) / statistics.fmean(s[4] for s in last5)
    skew_base = (statistics.fmean(s[3] for s in base) / statistics.fmean(s[4] for s in base))
    skew_growth = skew_ratio / max(skew_base, T.skew_growth_floor)
    osc = max(0.0, -statistics.fmean(s[2] for s in last5))
    hour = window(now - WIN.restarts, now)
    rerun_ratio = (hour[-1][5] - hour[0][5]) / max(1, hour[-1][6] - hour[0][6])
    restarts_1h = sum(1 for t in restarts if t > now - WIN.restarts)
    comps = {
        "cv": component(cv, T.inst_cv_ok, T.inst_cv_bad),
        "cv_counters": component(cv_counters, T.inst_cv_counters_ok, T.inst_cv_counters_bad),
        "cv_growth": component(growth, T.inst_growth_ok, T.inst_growth_bad),
        "skew": component(skew_ratio, T.inst_skew_ok, T.inst_skew_bad),
        "skew_growth": component(skew_growth, T.inst_skew_growth_ok, T.inst_skew_growth_bad),
        "oscillation": component(osc, T.inst_osc_ok, T.inst_osc_bad),
        "rerun": component(rerun_ratio, T.inst_rerun_ok, T.inst_rerun_bad),
        "restarts": component(restarts_1h, T.inst_restarts_ok, T.inst_restarts_bad),
    }
    prod = 1.0
    for c in comps.values():
        prod *= 1.0 - c
    return {"CV": cv, "CV counters": cv_counters, "growth": growth, "skew/step": skew_ratio,
            "skew growth": skew_growth, "osc": osc, "re-run": rerun_ratio,
            "restarts 1h": restarts_1h, **comps,
            "score": 1.0 - prod}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    args = ap.parse_args()
    raw = ("CV", "CV counters", "growth", "skew/step", "skew growth", "osc", "re-run",
           "restarts 1h")
    print(f"{args.nodes} nodes x {args.ranks_per_node} ranks, {args.seeds} seeds; inputs and score "
          f"15 min after onset (mean over seeds; score max in brackets)\n")
    print(f"{'scenario':12s}" + "".join(f"{k:>12s}" for k in raw) + f"{'score':>16s}")
    ok = True
    for name in SCENARIOS:
        rows = [run(name, seed, args.nodes, args.ranks_per_node) for seed in range(args.seeds)]
        mean = {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}
        lo, hi = min(r["score"] for r in rows), max(r["score"] for r in rows)
        good = hi < 0.2 if name in HEALTHY else lo > 0.5
        ok &= good
        print(f"{name:12s}" + "".join(f"{mean[k]:12.3f}" for k in raw)
              + f"{mean['score']:9.3f} [{hi if name in HEALTHY else lo:.3f}]"
              + ("" if good else "  <-- off target"))
    print("\ncomponents (mean over seeds):")
    print(f"{'scenario':12s}" + "".join(f"{k:>12s}" for k in COMPONENTS))
    for name in SCENARIOS:
        rows = [run(name, seed, args.nodes, args.ranks_per_node) for seed in range(args.seeds)]
        print(f"{name:12s}" + "".join(f"{statistics.fmean(r[k] for r in rows):12.3f}"
                                      for k in COMPONENTS))
    print("\ntargets met" if ok else "\nTARGETS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
