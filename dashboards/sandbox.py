"""A small cluster on loopback for checking and picturing the dashboards.

Simulated train jobs (``syncwatch.sim``) send through the real wire protocol to one real node daemon
per simulated node; the daemons of the first job also run the real GPU, NIC and InfiniBand
collectors over the simulator's hardware (``syncwatch.sim.hardware``: a fake NVML and sysfs trees
advanced from the simulation, as this machine has neither GPUs nor InfiniBand). Under the straggler
scenario the slow rank's GPU runs hot and throttled; the sandbox adds one XID event on it. A real Prometheus (Debian package) scrapes every
daemon and evaluates the recording and alerting rules, rendered with their windows scaled down so a
minute of simulation fills them.

    with Sandbox({"demo-straggler": "straggler", "demo-restarts": "restarts"}) as box:
        box.wait_for_data(40)
        box.prometheus.query("train_job:syncwatch_coupling:ratio5m")
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import queries

#: Grafana's $__rate_interval for a scrape interval: max(interval + scrape, 4 x scrape).
RATE_INTERVAL_SCRAPES = 4
#: The simulated ranks' skew exchange period K (steps).
EXCHANGE_EVERY = 20


@dataclass(frozen=True)
class SimJob:
    train_job: str
    scenario: str
    nodes: int
    ranks_per_node: int
    hardware: bool
    params: dict | None = None      # simulator model overrides on top of the scenario
    exchange_every: int = EXCHANGE_EVERY   # the ranks' skew exchange period K; 0 = off

    @property
    def node_prefix(self) -> str:
        return f"{self.train_job}-node"

    def node(self, n: int) -> str:
        return f"{self.node_prefix}{n:02d}"


class Sandbox:
    """Simulated jobs -> node daemons (+ fake hardware) -> Prometheus with the rules."""

    def __init__(self, jobs: dict[str, str | tuple[str, dict]], *, nodes: int = 2,
                 ranks_per_node: int = 4, step_scale: float = 0.1, scrape_interval: float = 1.0,
                 rule_scale: float = 0.05, hardware_jobs: int = 1, seed: int = 0,
                 without_exchange: tuple[str, ...] = ()):
        """``jobs``: train_job -> simulator scenario, or (scenario, model parameter overrides).
        Each simulated second lasts ``step_scale``
        real seconds; rule windows are multiplied by ``rule_scale``. The first ``hardware_jobs``
        jobs get fake GPUs and NICs. The ranks of each job run the skew exchange every
        ``EXCHANGE_EVERY`` steps, those of the jobs named in ``without_exchange`` not at all
        (K = 0)."""
        self.jobs = []
        for i, (name, spec) in enumerate(jobs.items()):
            scenario, params = (spec, None) if isinstance(spec, str) else spec
            self.jobs.append(SimJob(name, scenario, nodes, ranks_per_node, i < hardware_jobs, params,
                                    0 if name in without_exchange else EXCHANGE_EVERY))
        self.step_scale, self.scrape_interval, self.rule_scale, self.seed = (
            step_scale, scrape_interval, rule_scale, seed)
        self.rate_interval = RATE_INTERVAL_SCRAPES * scrape_interval
        self.workdir = Path(tempfile.mkdtemp(prefix="sw-box-", dir="/tmp"))  # short: socket paths
        self.daemons: list = []           # DaemonThread, one per simulated node
        self.urls: list[str] = []         # their /metrics base URLs
        self.sims: list = []
        self.prometheus = None
        self.started_at = 0.0
        self.hardware: list = []          # SimulatedHardware, one per job with hardware

    # -- the straggler's node gets a hot, throttled GPU under the straggling rank --------------
    def straggler(self, job: SimJob) -> tuple[int, str, int]:
        """(rank, node, local rank) of the straggler scenario's slow rank."""
        from syncwatch.sim.scenarios import straggler_rank
        rank = straggler_rank(job.nodes * job.ranks_per_node)
        n, local = divmod(rank, job.ranks_per_node)
        return rank, job.node(n), local

    def start(self) -> "Sandbox":
        from syncwatch.daemon.app import DaemonThread
        from syncwatch.daemon.config import DaemonConfig
        from syncwatch.rules.render import write as write_rules
        from syncwatch.sim.hardware import SimulatedHardware
        from syncwatch.sim.scenarios import ScenarioThread
        from syncwatch.stack import Prometheus, wait_until

        try:
            targets: dict[str, list[dict]] = {}
            hardware: dict[str, SimulatedHardware] = {}
            for job in self.jobs:
                targets[job.train_job] = []
                if job.hardware:
                    hw = hardware[job.train_job] = SimulatedHardware(
                        job.nodes, job.ranks_per_node, job.node_prefix, period=self.scrape_interval / 2)
                    self.hardware.append(hw)
                for n in range(job.nodes):
                    extra = ()
                    if job.hardware:
                        extra = (hardware[job.train_job].nodes[n].collectors(self.scrape_interval / 2),)
                    sock = str(self.workdir / f"{len(self.daemons)}.sock")
                    config = DaemonConfig(listen="127.0.0.1:0", socket=sock)
                    daemon = DaemonThread(config, extra_collectors=extra)
                    running = daemon.start()
                    self.daemons.append(daemon)
                    self.urls.append(running.url)
                    targets[job.train_job].append({"socket": running.socket_path})
            for job in self.jobs:  # an XID on the straggler's GPU, once its collector watches for XIDs
                if job.hardware and job.scenario == "straggler":
                    rank, _, local = self.straggler(job)
                    nvml = hardware[job.train_job].nodes[rank // job.ranks_per_node].nvml
                    wait_until(lambda: nvml.watching(local), 20, what="the GPU collector's XID event set")
                    nvml.xid(local, 13)  # graphics engine exception
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
                                     node_prefix=job.node_prefix, exchange_every=job.exchange_every)
                if job.train_job in hardware:
                    hardware[job.train_job].follow(sim.driver)
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
        for hw in self.hardware:
            hw.close()
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
