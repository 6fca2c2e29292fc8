"""Projection error of ``syncwatch project``: measure N nodes, project to 8N, simulate 8N, compare.

Usage: PYTHONPATH=exporter python benchmarks/projection_error.py [--seeds 5] [--nodes 4] [--steps 4000]
Prints, per seed, projected vs simulated mean step, step CV, coupling and throughput, and the mean
absolute relative error of each. Model-only simulator runs (no daemons): the error is the model's.
"""

from __future__ import annotations

import argparse
import statistics
import time

from syncwatch.analysis import project, recording
from syncwatch.sim.driver import Driver
from syncwatch.sim.model import Params


def simulate(nodes: int, steps: int, seed: int) -> dict:
    truth = Driver(Params(nodes=nodes), seed, targets=None, job="bench").run(steps)
    return recording.from_ground_truth(truth, start_wall=0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4000, help="steps measured at N")
    ap.add_argument("--big-steps", type=int, default=1000, help="steps simulated at 8N")
    ap.add_argument("--algorithm", default="ring", choices=("ring", "tree", "none"),
                    help="collective growth (the simulator keeps its collective time fixed: none)")
    a = ap.parse_args()
    t0 = time.time()
    keys = (("mean step", "mean_step_seconds", "mean_step"), ("step CV", "step_cv", "step_cv"),
            ("coupling", "coupling", "coupling"), ("throughput", "throughput", None))
    errs = {k: [] for k, *_ in keys}
    print(f"measure {a.nodes} nodes x 8 ranks for {a.steps} steps, project to {8 * a.nodes} nodes, "
          f"simulate {8 * a.nodes} nodes for {a.big_steps} steps; collective growth {a.algorithm}")
    for seed in range(a.seeds):
        small = simulate(a.nodes, a.steps, seed)
        m = project.measure_run(small, small["steps"])
        p = project.projection(m, [8 * a.nodes], project.Options(algorithm=a.algorithm), 64 * a.nodes)["projections"][0]
        big = simulate(8 * a.nodes, a.big_steps, 1000 + seed)
        t = project.measure_run(big, big["steps"])
        truth = {"mean_step": t.mean_step, "step_cv": t.step_cv, "coupling": t.coupling,
                 None: t.ranks * t.samples_per_rank_step / t.mean_step}
        row = []
        for name, pk, tk in keys:
            e = (p[pk] - truth[tk]) / truth[tk]
            errs[name].append(abs(e))
            row.append(f"{name} {p[pk]:.4g} vs {truth[tk]:.4g} ({100 * e:+.1f} %)")
        print(f"seed {seed}: " + "; ".join(row))
    print("mean |error|: " + ", ".join(f"{k} {100 * statistics.mean(v):.1f} %" for k, v in errs.items()))
    print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
