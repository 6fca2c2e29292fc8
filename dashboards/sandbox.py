"""A small cluster on loopback for checking and picturing the dashboards.

Simulated train jobs (``syncwatch.sim``) send through the real wire protocol to one real node daemon
per simulated node; the daemons of the first job also run the real GPU, NIC and InfiniBand
collectors over a fake NVML and sysfs trees (this machine has neither GPUs nor InfiniBand), whose
counters a ticker advances so rates are not zero. A real Prometheus (Debian package) scrapes every
daemon and evaluates the recording and alerting rules, rendered with their windows scaled down so a
minute of simulation fills them.

    with Sandbox({"demo-straggler": "straggler", "demo-restarts": "restarts"}) as box:
        box.wait_for_data(40)
        box.prometheus.query("train_job:syncwatch_coupling:ratio5m")
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import queries

REPO = Path(__file__).resolve().parent.parent
SYSFS_FIXTURES = REPO / "tests" / "fixtures" / "make_sysfs.py"

#: Grafana's $__rate_interval for a scrape interval: max(interval + scrape, 4 x scrape).
RATE_INTERVAL_SCRAPES = 4


@dataclass(frozen=True)
class SimJob:
    train_job: str
    scenario: str
    nodes: int
    ranks_per_node: int
    hardware: bool
    params: dict | None = None      # simulator model overrides on top of the scenario

    def node(self, n: int) -> str:
        return f"{self.train_job}-node{n:02d}"

    def gpu_uuid(self, n: int, local: int) -> str:
        """The uuid the simulator reports for node ``n``, local rank ``local``."""
        from syncwatch.sim.driver import gpu_uuid
        return gpu_uuid(self.node(n), local)


def _load_sysfs_writer():
    spec = importlib.util.spec_from_file_location("syncwatch_make_sysfs", SYSFS_FIXTURES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Ticker(threading.Thread):
    """Advances the fake hardware like a busy node: GPU energy by power x time, NIC and IB
    counters by traffic, and congestion counters where ``congested`` says so."""

    def __init__(self, nvmls: list, sysfs_roots: list[Path], period: float = 0.5):
        super().__init__(name="syncwatch-sandbox-ticker", daemon=True)
        self.nvmls, self.roots, self.period = nvmls, sysfs_roots, period
        self.stop_event = threading.Event()

    @staticmethod
    def _bump(path: Path, by: int) -> None:
        """Add ``by`` to a counter file, replacing it whole: a reader never sees it half written
        (sysfs attributes read atomically)."""
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(f"{int(path.read_text()) + by}\n")
        os.replace(tmp, path)

    def run(self) -> None:
        last = time.monotonic()
        while not self.stop_event.wait(self.period):
            now = time.monotonic()
            dt, last = now - last, now
            for nvml in self.nvmls:
                for gpu in nvml.gpus:
                    gpu.energy_mj += int(gpu.power_mw * dt)
            for i, root in enumerate(self.roots):
                net = root / "class" / "net"
                for dev in net.iterdir() if net.is_dir() else ():
                    self._bump(dev / "statistics" / "rx_bytes", int(2e9 * dt))
                    self._bump(dev / "statistics" / "tx_bytes", int(2e9 * dt))
                ib = root / "class" / "infiniband"
                for port in ib.glob("*/ports/*"):
                    self._bump(port / "counters" / "port_xmit_data", int(5e8 * dt))
                    self._bump(port / "counters" / "port_rcv_data", int(5e8 * dt))
                    self._bump(port / "counters" / "port_xmit_wait", int((4e5 if i == 0 else 2e4) * dt))
                    if (port / "hw_counters").is_dir():
                        self._bump(port / "hw_counters" / "np_cnp_sent", int(300 * dt))
                        self._bump(port / "hw_counters" / "rp_cnp_handled", int(280 * dt))
                        self._bump(port / "hw_counters" / "np_ecn_marked_roce_packets", int(500 * dt))


class Sandbox:
    """Simulated jobs -> node daemons (+ fake hardware) -> Prometheus with the rules."""

    def __init__(self, jobs: dict[str, str | tuple[str, dict]], *, nodes: int = 2,
                 ranks_per_node: int = 4, step_scale: float = 0.1, scrape_interval: float = 1.0,
                 rule_scale: float = 0.05, hardware_jobs: int = 1, seed: int = 0):
        """``jobs``: train_job -> simulator scenario, or (scenario, model parameter overrides).
        Each simulated second lasts ``step_scale``
        real seconds; rule windows are multiplied by ``rule_scale``. The first ``hardware_jobs``
        jobs get fake GPUs and NICs."""
        self.jobs = []
        for i, (name, spec) in enumerate(jobs.items()):
            scenario, params = (spec, None) if isinstance(spec, str) else spec
            self.jobs.append(SimJob(name, scenario, nodes, ranks_per_node, i < hardware_jobs, params))
        self.step_scale, self.scrape_interval, self.rule_scale, self.seed = (
            step_scale, scrape_interval, rule_scale, seed)
        self.rate_interval = RATE_INTERVAL_SCRAPES * scrape_interval
        self.workdir = Path(tempfile.mkdtemp(prefix="sw-box-", dir="/tmp"))  # short: socket paths
        self.daemons: list = []           # DaemonThread, one per simulated node
        self.urls: list[str] = []         # their /metrics base URLs
        self.runners: list = []
        self.sims: list = []
        self.prometheus = None
        self.started_at = 0.0
        self._ticker: _Ticker | None = None

    # -- the straggler's node gets a hot, throttled GPU under the straggling rank --------------
    def straggler(self, job: SimJob) -> tuple[int, str, int]:
        """(rank, node, local rank) of the straggler scenario's slow rank."""
        from syncwatch.sim.scenarios import straggler_rank
        rank = straggler_rank(job.nodes * job.ranks_per_node)
        n, local = divmod(rank, job.ranks_per_node)
        return rank, job.node(n), local

    def _fake_gpus(self, job: SimJob, n: int):
        import pynvml
        from syncwatch.collectors.fake_nvml import FakeGpu, FakeNvml
        gpus = [FakeGpu(uuid=job.gpu_uuid(n, local), temperature=55 + local,
                        power_mw=380_000 + 2_000 * local, energy_mj=10**9)
                for local in range(job.ranks_per_node)]
        if job.scenario == "straggler":
            _, node, local = self.straggler(job)
            if node == job.node(n):
                hot = gpus[local]
                hot.temperature, hot.sm_clock_mhz, hot.power_mw = 88, 1410, 300_000
                hot.reasons = pynvml.nvmlClocksEventReasonSwThermalSlowdown
                nvml = FakeNvml(gpus)
                nvml.xid(local, 13)  # one XID event (graphics engine exception) on the hot GPU
                return nvml
        return FakeNvml(gpus)

    def start(self) -> "Sandbox":
        from syncwatch.collectors import CollectorRunner
        from syncwatch.collectors.gpu import GpuCollector
        from syncwatch.collectors.infiniband import InfinibandCollector
        from syncwatch.collectors.net import NetCollector
        from syncwatch.daemon.app import DaemonThread
        from syncwatch.daemon.config import DaemonConfig
        from syncwatch.rules.render import write as write_rules
        from syncwatch.sim.scenarios import ScenarioThread
        from syncwatch.stack import Prometheus

        try:
            nvmls, roots = [], []
            targets: dict[str, list[dict]] = {}
            for job in self.jobs:
                targets[job.train_job] = []
                for n in range(job.nodes):
                    extra = ()
                    if job.hardware:
                        root = self.workdir / "sysfs" / job.node(n)
                        _load_sysfs_writer().healthy(root)
                        nvml = self._fake_gpus(job, n)
                        runner = CollectorRunner({"gpu": GpuCollector(nvml=nvml),
                                                  "net": NetCollector(sysfs=str(root)),
                                                  "infiniband": InfinibandCollector(sysfs=str(root))},
                                                 interval=self.scrape_interval / 2, timeout=2.0)
                        nvmls.append(nvml)
                        roots.append(root)
                        self.runners.append(runner)
                        extra = (runner,)
                    sock = str(self.workdir / f"{len(self.daemons)}.sock")
                    config = DaemonConfig(listen="127.0.0.1:0", socket=sock, node=job.node(n))
                    daemon = DaemonThread(config, extra_collectors=extra)
                    running = daemon.start()
                    self.daemons.append(daemon)
                    self.urls.append(running.url)
                    targets[job.train_job].append({"socket": running.socket_path})
            self._ticker = _Ticker(nvmls, roots, period=self.scrape_interval / 2)
            self._ticker.start()
            rule_files = write_rules(self.workdir / "rules", self.rule_scale)
            scrape = f"{self.scrape_interval:g}s"
            self.prometheus = Prometheus([u.split("//", 1)[1] for u in self.urls],
                                         scrape_interval=scrape, evaluation_interval=scrape,
                                         rule_files=rule_files, workdir=str(self.workdir / "prometheus"))
            (self.workdir / "prometheus").mkdir(exist_ok=True)
            self.prometheus.start()
            for i, job in enumerate(self.jobs):
                sim = ScenarioThread(job.scenario, targets[job.train_job], job.nodes, job.ranks_per_node,
                                     seed=self.seed + i, job=job.train_job, time_scale=self.step_scale,
                                     params=job.params,
                                     node_prefix=f"{job.train_job}-node", exchange_every=20)
                sim.start()
                self.sims.append(sim)
            self.started_at = time.time()
            return self
        except BaseException:
            self.stop()
            raise

    def wait_for_data(self, seconds: float) -> None:
        """Let the simulation run ``seconds`` (from start); raise if a simulator thread died."""
        while True:
            for sim in self.sims:
                if sim.error is not None:
                    raise RuntimeError(f"simulator {sim.name} failed: {sim.error!r}") from sim.error
            left = self.started_at + seconds - time.time()
            if left <= 0:
                return
            time.sleep(min(left, 1.0))

    def stop(self) -> None:
        for sim in self.sims:
            sim.stop()
        if self.prometheus is not None:
            self.prometheus.stop()
        if self._ticker is not None:
            self._ticker.stop_event.set()
            self._ticker.join(2)
        for daemon in self.daemons:
            daemon.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "Sandbox":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Snapshot:
    """One dashboard time range over the sandbox's Prometheus: runs panel queries the way Grafana
    sends them (variables and ``$__rate_interval`` / ``$__range`` substituted by
    ``queries.substitute``), range queries at ``step`` resolution, instant queries at ``end``."""

    def __init__(self, box: Sandbox, start: float, end: float, step: float = 1.0,
                 rate_interval: float | None = None):
        self.box, self.start, self.end, self.step = box, float(int(start)), float(int(end)), step
        self.rate_interval = rate_interval or box.rate_interval
        self.dashboards = queries.load_all()

    def expr(self, q: queries.PanelQuery, selected: dict) -> str:
        return queries.substitute(q.expr, self.dashboards[q.dashboard], selected,
                                  rate_interval=self.rate_interval,
                                  range_seconds=self.end - self.start)

    def run(self, q: queries.PanelQuery, selected: dict) -> list[dict]:
        e = self.expr(q, selected)
        if q.instant:
            return self.box.prometheus.query(e, self.end)
        return self.box.prometheus.query_range(e, self.start, self.end, self.step)
