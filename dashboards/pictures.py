"""Regenerate the dashboard pictures in docs/img/ from the dashboards' own queries.

    PYTHONPATH=exporter python -m dashboards.pictures            # needs the `docs` extra (matplotlib)

Runs a ``Sandbox`` of four simulated train jobs for a few minutes of compressed time (rule windows
x0.05, so "5m" windows span 15 s), then executes every panel query exactly as Grafana would send it
and draws each dashboard with ``dashboards.render``. No Grafana server is involved.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .render import render
from .sandbox import Sandbox, Snapshot

REPO = Path(__file__).resolve().parent.parent

#: The job every per-job picture shows: a persistent straggler on a hot GPU, restarting once,
#: checkpointing and evaluating now and then.
FOCUS = "llm-pretrain"
JOBS = {
    FOCUS: ("straggler", {"checkpoint_every": 100, "checkpoint_seconds": 0.5, "fail_after": (650,),
                          "restart_seconds": 10.0, "eval_every": 150, "eval_seconds": 2.0}),
    "vision-finetune": "healthy",
    "recsys-ranker": "oscillation",
    "speech-asr": "restarts",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards.pictures", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=240.0, help="simulated run before drawing")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img", help="directory for the PNGs")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with Sandbox(JOBS) as box:
        box.wait_for_data(args.seconds)
        # A wider rate window than Grafana's 4 scrapes smooths the simulator's exchange every 20
        # steps (its slack arrives in bursts), as a longer dashboard range would.
        snap = Snapshot(box, start=box.started_at + 15, end=time.time(), step=2, rate_interval=12)
        selected = {"train_job": FOCUS, "node": None, "rank": None}
        for uid, dashboard in snap.dashboards.items():
            def fetch(q):
                try:
                    return snap.run(q, selected)
                except Exception as e:  # noqa: BLE001 - a broken query shows as "No data"
                    print(f"{uid} / {q.panel} / {q.ref_id}: {e}", file=sys.stderr)
                    return []
            path = args.out / f"{uid}.png"
            render(dashboard, fetch, path, t0=snap.start)
            print(f"{path} ({path.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
