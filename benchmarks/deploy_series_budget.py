"""Series a real daemon exports per rank and per node: the input of docs/deploy.md's sizing table.

Starts a daemon, sends one step record and one heartbeat per rank for RANKS ranks of one job
(rank 0 with the skew histogram, exact-mode counters), scrapes /metrics and counts series: those
with a ``rank`` label (per rank), and the rest (per node and job, daemon self-health). Hardware
collectors are not run (no GPUs or InfiniBand here); their series are counted from the metric
contract in docs/deploy.md.

    python benchmarks/deploy_series_budget.py [RANKS]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from syncwatch.daemon.app import DaemonThread  # noqa: E402
from syncwatch.daemon.config import DaemonConfig  # noqa: E402
from syncwatch.protocol import PHASES, Cumulative, Encoder, Identity, SkewHistogram  # noqa: E402
from syncwatch.sender import Sender  # noqa: E402


def main(ranks: int = 8) -> None:
    sock = os.path.join(tempfile.mkdtemp(prefix="sw-bench-"), "ingest.sock")
    with DaemonThread(DaemonConfig(listen="127.0.0.1:0", socket=sock)) as daemon:
        sender = Sender(path=sock)
        for rank in range(ranks):
            enc = Encoder(Identity("bench", 0, rank, rank, ranks, "node-a", os.getpid(), gpu=rank,
                                   gpu_uuid=f"GPU-{rank:04d}"))
            phases = tuple(0.01 for _ in PHASES)
            for step in (1, 2):
                totals = Cumulative(steps=step, step_seconds=0.07 * step,
                                    phase_seconds=tuple(p * step for p in phases),
                                    slack_seconds=0.001 * step, last_arrivals=1, samples=32.0 * step)
                skew = SkewHistogram(count=step, sum=0.001 * step) if rank == 0 else None
                sender.send(enc.step(step, time.time(), 0.07, 0.01, phases, step, 32.0, 0.0, totals,
                                     exact=True, skew=skew))
            sender.send(enc.heartbeat(time.time(), 2, time.time(), "sync", 0.01, 2))
        sender.flush(2.0)
        time.sleep(0.5)
        with urllib.request.urlopen(daemon.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    per_rank = other = 0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "rank" in s.labels:
                per_rank += 1
            else:
                other += 1
    print(f"daemon, {ranks} ranks of one job on one node:")
    print(f"  series with a rank label: {per_rank} ({per_rank / ranks:.1f} per rank)")
    print(f"  other series (per node and job histograms, job gauges, self-health): {other}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
