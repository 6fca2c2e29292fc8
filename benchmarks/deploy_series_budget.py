"""Series a real daemon exports per rank and per node: the input of docs/deploy.md's sizing table.

Starts a daemon, sends four step records and one heartbeat per rank for RANKS ranks of one job
(rank 0 with the skew histogram, exact-mode counters, tokens reported), scrapes /metrics and
counts series: those with a ``rank`` label (per rank), and the rest (per node and job, daemon
self-health). Then runs the hardware collectors once over a fake 8-GPU node (FakeNvml's healthy
GPUs; the sysfs tree of tests/fixtures/sysfs/healthy with 8 mlx5 RoCE ports and its 2 Ethernet
NICs, as benchmarks/collectors_bench.py does) and counts their series per GPU, per port and per
NIC: the collectors' own code decides those counts, not the driver. Last, the active series per
GPU of such a node (one rank and one RoCE port per GPU), the input of docs/deploy.md's sizing.

With --node-per-rank each rank reports a node name of its own (pods without NODE_NAME report
their pod's host name): the worst case, each rank with its own per-node histograms. The render
time (text format, median of 5) is printed either way.

    python benchmarks/deploy_series_budget.py [--node-per-rank] [RANKS]
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "exporter"))

from prometheus_client import generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from prometheus_client.registry import CollectorRegistry  # noqa: E402

from syncwatch.collectors import CollectorRunner  # noqa: E402
from syncwatch.collectors.fake_nvml import FakeNvml, healthy_node  # noqa: E402
from syncwatch.collectors.gpu import GpuCollector  # noqa: E402
from syncwatch.collectors.infiniband import InfinibandCollector  # noqa: E402
from syncwatch.collectors.net import NetCollector  # noqa: E402

from syncwatch.daemon.app import REGISTRY, DaemonThread, render  # noqa: E402
from syncwatch.daemon.config import DaemonConfig  # noqa: E402
from syncwatch.protocol import PHASES, Cumulative, Encoder, Identity, SkewHistogram  # noqa: E402
from syncwatch.sender import Sender  # noqa: E402


SYSFS = ROOT / "tests" / "fixtures" / "sysfs" / "healthy" / "class"
GPUS = PORTS = 8
SCRAPE_INTERVAL = 15.0


def hardware_series() -> dict[str, collections.Counter]:
    """Series of each hardware collector on the fake node, by ``gpu`` or ``device`` label
    (``""`` for the collector's own, unlabelled series)."""
    tmp = Path(tempfile.mkdtemp(prefix="sw-bench-"))
    try:
        shutil.copytree(SYSFS / "net", tmp / "class" / "net")
        for i in range(PORTS):
            shutil.copytree(SYSFS / "infiniband" / "mlx5_1",
                            tmp / "class" / "infiniband" / f"mlx5_{i}")
        found = {}
        for name, collector in (("gpu", GpuCollector(nvml=FakeNvml(healthy_node(GPUS)))),
                                ("infiniband", InfinibandCollector(str(tmp))),
                                ("net", NetCollector(str(tmp)))):
            runner = CollectorRunner({name: collector})
            runner.run_once()
            registry = CollectorRegistry()
            registry.register(runner)
            found[name] = collections.Counter(
                s.labels.get("gpu") or s.labels.get("device") or ""
                for family in text_string_to_metric_families(generate_latest(registry).decode())
                for s in family.samples)
        return found
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(ranks: int = 8, node_per_rank: bool = False) -> None:
    sock = os.path.join(tempfile.mkdtemp(prefix="sw-bench-"), "ingest.sock")
    with DaemonThread(DaemonConfig(listen="127.0.0.1:0", socket=sock)) as daemon:
        sender = Sender(path=sock)
        for rank in range(ranks):
            node = f"pod-{rank}" if node_per_rank else "node-a"
            enc = Encoder(Identity("bench", 0, rank, rank, ranks, node, os.getpid(), gpu=rank,
                                   gpu_uuid=f"GPU-{rank:04d}"))
            phases = tuple(0.01 for _ in PHASES)
            # four steps of unequal length: the step CV leaves the first out and the lag-1
            # autocorrelation needs three more, so both per-rank gauges are exported as in a
            # running job (two steps showed neither and undercounted by two per rank)
            elapsed = 0.0
            for step, seconds in enumerate((0.07, 0.08, 0.06, 0.09), start=1):
                elapsed += seconds
                totals = Cumulative(steps=step, step_seconds=elapsed,
                                    phase_seconds=tuple(p * step for p in phases),
                                    slack_seconds=0.001 * step, last_arrivals=1,
                                    samples=32.0 * step, tokens=4096.0 * step)
                skew = SkewHistogram(count=step, sum=0.001 * step) if rank == 0 else None
                sender.send(enc.step(step, time.time(), seconds, 0.01, phases, step, 32.0, 4096.0,
                                     totals, exact=True, has_tokens=True, skew=skew))
            sender.send(enc.heartbeat(time.time(), 4, time.time(), "sync", 0.01, 4))
            if rank % 32 == 31:  # the retry queue holds 1024 records: let the daemon catch up
                sender.flush(10.0)
        sender.flush(10.0)
        time.sleep(0.5)
        with urllib.request.urlopen(daemon.url + "/metrics", timeout=60) as r:
            text = r.read().decode()
        renders = []
        for _ in range(5):
            t0 = time.perf_counter()
            render(daemon.app[REGISTRY], "", False)
            renders.append(time.perf_counter() - t0)
    per_rank = other = 0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "rank" in s.labels:
                per_rank += 1
            else:
                other += 1
    where = "each reporting its own node name" if node_per_rank else "on one node"
    print(f"daemon, {ranks} ranks of one job {where}:")
    print(f"  series with a rank label: {per_rank} ({per_rank / ranks:.1f} per rank)")
    print(f"  other series (per node and job histograms, job gauges, self-health): {other}")
    print(f"  all series: {per_rank + other}; render (text format): "
          f"{sorted(renders)[2]:.3f} s (median of 5); records dropped by the sender: "
          f"{sender.dropped}")
    hw = hardware_series()
    print(f"hardware collectors, fake node of {GPUS} GPUs, {PORTS} RoCE ports, "
          f"{len([k for k in hw['net'] if k])} Ethernet NICs:")
    total = 0
    for name, unit in (("gpu", "GPU"), ("infiniband", "port"), ("net", "NIC")):
        units = [k for k in hw[name] if k]
        n = sum(hw[name][k] for k in units)
        total += sum(hw[name].values())
        print(f"  {name}: {n / len(units):.1f} series per {unit}, "
              f"{hw[name]['']} of the collector itself")
    per_gpu = per_rank / ranks + (other + total) / GPUS
    print(f"per GPU of an {GPUS}-GPU node (one rank each): {per_gpu:.1f} active series, "
          f"{per_gpu / SCRAPE_INTERVAL:.2f} samples/s at a {SCRAPE_INTERVAL:g} s scrape interval")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ranks", type=int, nargs="?", default=8, help="ranks of the one job (default 8)")
    parser.add_argument("--node-per-rank", action="store_true",
                        help="each rank reports a node name of its own (pods without NODE_NAME)")
    args = parser.parse_args()
    main(args.ranks, args.node_per_rank)
