"""Detection latency of the alert pipeline: fault onset -> alert firing in Prometheus -> notification.

Runs the alert drill (syncwatch.rules.drill): simulated jobs on two real daemons, real Prometheus
(1 s scrape and evaluation) and Alertmanager (group_wait 1 s), rules rendered at --time-scale.

    python benchmarks/detection_latency.py [--runs 3] [--time-scale 0.05]

Latency is dominated by the rules' windows and for: durations, which scale with --time-scale;
at scale 1 (the shipped rules) multiply the window-bound part by 1/scale (see docs/rules.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

from syncwatch.rules.drill import EXPECTED, run_drill  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--time-scale", type=float, default=0.05)
    args = ap.parse_args()
    rows: dict[str, list[tuple[float, float]]] = {f: [] for f in EXPECTED}
    for run in range(args.runs):
        result = run_drill(time_scale=args.time_scale, seed=run * 10)
        for job in result.jobs.values():
            name = EXPECTED.get(job.fault)
            if name and name in job.notified:
                rows[job.fault].append((job.firing[name] - job.onset, job.notified[name] - job.onset))
            elif name:
                print(f"run {run}: {job.fault}: {name} not notified", file=sys.stderr)
        print(f"run {run}: {result.duration:.0f} s", file=sys.stderr)
    print(f"time scale {args.time_scale:g}, {args.runs} runs; seconds after fault onset (median [min-max])\n")
    print(f"{'fault':10s} {'alert':34s} {'firing in Prometheus':>24s} {'notification received':>24s}")
    for fault, vals in rows.items():
        if not vals:
            continue
        f = [v[0] for v in vals]
        n = [v[1] for v in vals]
        fmt = lambda xs: f"{statistics.median(xs):6.1f} [{min(xs):.1f}-{max(xs):.1f}]"  # noqa: E731
        print(f"{fault:10s} {EXPECTED[fault]:34s} {fmt(f):>24s} {fmt(n):>24s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
