"""Collector cycle time and scrape time for a fake 8-GPU node with 8 InfiniBand/RoCE ports.

    /work/main/.venv/bin/python benchmarks/collectors_bench.py [--cycles 200] [--scrapes 500]

The GPU side runs on FakeNvml (pynvml's API in Python), so its figure is syncwatch's own cost per
cycle, not the driver's latency. Scrapes are timed twice: rendering the runner alone, and a full HTTP GET of /metrics from a
running daemon with the collectors' worker threads cycling. The sysfs side reads a real file tree on disk: 8 mlx5 ports with
RoCE hw_counters (copied from tests/fixtures/sysfs/healthy) and two NICs. Targets (issue 4):
scrape <= 20 ms, collector cycle <= 100 ms.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "exporter"))

from prometheus_client import generate_latest  # noqa: E402
from prometheus_client.registry import CollectorRegistry  # noqa: E402

from syncwatch.collectors import CollectorRunner  # noqa: E402
from syncwatch.collectors.fake_nvml import FakeNvml, healthy_node  # noqa: E402
from syncwatch.collectors.gpu import GpuCollector  # noqa: E402
from syncwatch.collectors.infiniband import InfinibandCollector  # noqa: E402
from syncwatch.collectors.net import NetCollector  # noqa: E402
from syncwatch.daemon.app import DaemonThread  # noqa: E402
from syncwatch.daemon.config import DaemonConfig  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "sysfs" / "healthy"


def build_tree(dst: Path, ports: int) -> None:
    shutil.copytree(FIXTURE / "class" / "net", dst / "class" / "net")
    for i in range(ports):
        shutil.copytree(FIXTURE / "class" / "infiniband" / "mlx5_1", dst / "class" / "infiniband" / f"mlx5_{i}")


def ms(xs: list[float]) -> str:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(len(xs) * 0.99))]
    return f"median {statistics.median(xs) * 1e3:7.3f} ms   p99 {p99 * 1e3:7.3f} ms   max {xs[-1] * 1e3:7.3f} ms"


def http_scrapes(runner: CollectorRunner, n: int) -> list[float]:
    """Full scrapes over loopback HTTP of a daemon serving the runner (workers started)."""
    config = DaemonConfig(listen="127.0.0.1:0", socket=None)
    times = []
    with DaemonThread(config, extra_collectors=[runner]) as daemon:
        time.sleep(0.2)  # let every collector complete a cycle
        for _ in range(n):
            start = time.perf_counter()
            with urllib.request.urlopen(daemon.url + "/metrics", timeout=10) as r:
                r.read()
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--scrapes", type=int, default=500)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--ports", type=int, default=8)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sw-bench-"))
    try:
        build_tree(tmp, args.ports)
        collectors = {"gpu": GpuCollector(nvml=FakeNvml(healthy_node(args.gpus))),
                      "infiniband": InfinibandCollector(str(tmp)),
                      "net": NetCollector(str(tmp))}
        for name, c in collectors.items():
            times = []
            for _ in range(args.cycles):
                start = time.perf_counter()
                c.update([])
                times.append(time.perf_counter() - start)
            print(f"cycle {name:<11} {ms(times)}")
        runner = CollectorRunner(collectors)
        cycles = []
        for _ in range(args.cycles):
            start = time.perf_counter()
            runner.run_once()
            cycles.append(time.perf_counter() - start)
        print(f"cycle {'all':<11} {ms(cycles)}")
        registry = CollectorRegistry()
        registry.register(runner)
        text = generate_latest(registry)
        series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
        scrapes = []
        for _ in range(args.scrapes):
            start = time.perf_counter()
            generate_latest(registry)
            scrapes.append(time.perf_counter() - start)
        print(f"scrape (render, {series} series, {len(text)} bytes) {ms(scrapes)}")
        print(f"scrape (HTTP GET /metrics of a running daemon) {ms(http_scrapes(runner, args.scrapes))}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
