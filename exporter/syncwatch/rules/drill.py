"""Alert drill: inject faults into simulated jobs and watch the real pipeline page.

simulator -> node daemons (UDP on loopback) -> Prometheus (rules rendered at ``time_scale``, 1 s
scrape and evaluation) -> Alertmanager (the shipped routing, fast timers) -> a webhook receiver.

Several train jobs run at once on the same two daemons: one stays healthy, each other one runs
healthy for ``warmup`` seconds and then gets one fault (the simulator's model reads its parameters
on every step, so the switch happens at a known wall time), except a fault that is there from the
job's start (a first collective that never completes). One "fault" must page nothing: a single
stall in a job of slow steps (10 s at time scale 1), which is no growing variance. ``run_drill`` returns, per job, when
the fault started, when Prometheus first had each alert firing, and when the webhook received
each notification. The end-to-end test asserts on it; benchmarks/detection_latency.py prints it.
``pipeline`` is the set-up alone, for jobs of one's own (benchmarks/false_pages.py).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

from ..daemon.app import DaemonThread
from ..daemon.config import DaemonConfig
from ..sim.scenarios import ScenarioThread, scenario_params, straggler_rank
from ..stack import Alertmanager, Prometheus, alertmanager_config_for_test, shipped
from .render import write

NODES, RANKS_PER_NODE = 2, 4
COMPUTE_SECONDS = 0.05       # ~60 ms simulated (and real) steps: ~16 steps/s per job
SLOW_STEP_SECONDS = 10.0     # the one-stall job's compute at time scale 1 (x time_scale in the drill)


def fault_params(fault: str, step: int = 0) -> dict:
    """Model parameters a job switches to at onset, at its step ``step`` (on top of the healthy
    cluster's)."""
    world = NODES * RANKS_PER_NODE
    if fault == "healthy":
        return {}
    if fault == "one-stall":     # rank 0's data loading stalls once, for 3 step times
        return dict(stall_at=(step + 2,), stall_at_seconds=3.0)
    if fault == "variance":      # the simulator's congestion scenario: episodes of slow collectives
        p = scenario_params("congestion", NODES, RANKS_PER_NODE)
        return dict(congestion_every=p.congestion_every,
                    scheduled_congestion_steps=p.scheduled_congestion_steps,
                    scheduled_congestion_factor=p.scheduled_congestion_factor)
    if fault == "straggler":     # the simulator's straggler scenario, starting at onset
        p = scenario_params("straggler", NODES, RANKS_PER_NODE)
        return dict(straggler_rank=p.straggler_rank, straggler_slowdown=p.straggler_slowdown,
                    straggler_from_step=0)
    if fault == "stall":         # one rank hangs in its compute; all keep sending heartbeats
        return dict(straggler_rank=min(2, world - 1), straggler_slowdown=1e5, straggler_from_step=0)
    if fault == "start":         # the first collective never completes, every rank waits in it
        return dict(congestion_every=1, scheduled_congestion_steps=1, scheduled_congestion_factor=1e6)
    raise ValueError(f"unknown fault {fault!r}")


EXPECTED = {  # fault -> the alert that must page for it
    "variance": "SyncwatchStepTimeVarianceGrowing",
    "straggler": "SyncwatchPersistentStraggler",
    "stall": "SyncwatchJobStalled",
    "start": "SyncwatchJobStuckAtStart",
}
AT_START = {"start"}  # faults present from the job's start, not from the end of the warm-up
# after its onset, how long (x time_scale) a fault that must page nothing is watched: at 10 s
# steps a CV over W = 100 steps held the stall for 17 minutes and paged ~13 minutes after it
WATCH_SECONDS = {"one-stall": 20 * 60}


def _scores(prom: Prometheus, job: str | None = None) -> dict[str, float]:
    """train_job -> its instability score now (of ``job`` only, if given)."""
    sel = "" if job is None else f'{{train_job="{job}"}}'
    return {r["metric"]["train_job"]: float(r["value"][1])
            for r in prom.query(f"train_job:syncwatch_instability:score{sel}")}


def straggler_node() -> str:
    from ..sim.driver import node_name
    return node_name("sim-node-", straggler_rank(NODES * RANKS_PER_NODE) // RANKS_PER_NODE)


@dataclass
class JobResult:
    fault: str
    job: str
    onset: float | None = None                                     # wall time the fault started
    pending: dict[str, float] = field(default_factory=dict)        # alertname -> first seen pending
    firing: dict[str, float] = field(default_factory=dict)         # alertname -> first seen firing
    firing_labels: dict[str, dict] = field(default_factory=dict)
    notified: dict[str, float] = field(default_factory=dict)       # alertname -> first notification
    notified_alerts: dict[str, dict] = field(default_factory=dict)  # alertname -> alert (labels, annotations)
    receivers: dict[str, str] = field(default_factory=dict)        # alertname -> receiver


@dataclass
class DrillResult:
    jobs: dict[str, JobResult]
    notifications: list[dict]
    # train_job -> instability score when the job's fault paged (a job without a page: at the
    # end). The score's skew growth is against the job's own earlier skew, so it fades once that
    # baseline holds the fault's regime: read at the end, it depended on how long the drill ran.
    scores: dict[str, float]
    duration: float


class _Webhook(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        self.received: list[dict] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _WebhookHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _WebhookHandler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server API)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        now = time.time()
        with self.server.lock:
            self.server.received.append({"at": now, "receiver": self.path.rsplit("/", 1)[-1],
                                         "payload": json.loads(body)})
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@dataclass
class Pipeline:
    """A running pipeline: node daemons (UDP on loopback), Prometheus with the shipped rules at a
    time scale, Alertmanager with the shipped routing (fast timers) and its webhook receiver."""
    daemons: list[DaemonThread]
    prom: Prometheus
    am: Alertmanager
    webhook: _Webhook

    @property
    def targets(self) -> list[dict]:
        """One simulator target per daemon (``ScenarioThread``'s ``targets``)."""
        return [{"udp": d.udp_address} for d in self.daemons]

    def notifications(self) -> list[dict]:
        """What the webhook received so far: ``{"at", "receiver", "payload"}`` each."""
        with self.webhook.lock:
            return list(self.webhook.received)


@contextmanager
def pipeline(time_scale: float = 0.05, nodes: int = NODES,
             workdir: str | None = None) -> Iterator[Pipeline]:
    """Start ``nodes`` daemons (their CV's ``cv_seconds`` scaled as the rules' windows are),
    Alertmanager, the webhook and Prometheus (1 s scrape and evaluation, rules rendered at
    ``time_scale``); stop them all on exit. ``workdir`` keeps the rules and the servers' data
    (Prometheus' TSDB, to query after the run); without it a temporary directory is removed."""
    work = Path(workdir or tempfile.mkdtemp(prefix="sw-drill-"))
    rule_files = write(work / "rules", time_scale)
    webhook = _Webhook()
    threading.Thread(target=webhook.serve_forever, daemon=True).start()
    am_base = yaml.safe_load(shipped("deploy/alertmanager/alertmanager.yml").read_text())
    daemons, servers = [], []
    try:
        for n in range(nodes):
            d = DaemonThread(DaemonConfig(listen="127.0.0.1:0", socket=None, udp="127.0.0.1:0",
                                          cv_seconds=DaemonConfig.cv_seconds * time_scale))
            d.start()
            daemons.append(d)
        am = Alertmanager(alertmanager_config_for_test(am_base, webhook.url), workdir=str(work / "am"))
        am.start()
        servers.append(am)
        prom = Prometheus([d.url.split("//", 1)[1] for d in daemons], rule_files=rule_files,
                          alertmanager_url=am.url, resend_delay="1s", workdir=str(work / "prom"))
        prom.start()
        servers.append(prom)
        yield Pipeline(daemons, prom, am, webhook)
    finally:
        for srv in reversed(servers):
            srv.stop()
        for d in daemons:
            d.stop()
        webhook.shutdown()
        webhook.server_close()
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def run_drill(faults=("healthy", "variance", "straggler", "stall", "start", "one-stall"), *, time_scale: float = 0.05,
              warmup: float | None = None, timeout: float = 190.0, seed: int = 0,
              exchange_every: int = 10, workdir: str | None = None) -> DrillResult:
    """Run the drill until every expected alert was notified (or ``timeout`` seconds).

    ``exchange_every`` is the jobs' skew exchange period K; 0 runs them without it, so the rules
    see only the waits (their fallback from mean waits). ``warmup`` defaults to 20 minutes at
    ``time_scale`` (60 s at 0.05): the skew growth's baseline (30m ending 10m back) reads no
    window holding a rank's process start, the job's first 5m, and a straggler pages ~16m after
    onset, when it spans onset - 24m to onset + 6m. After 6.7 minutes (20 s) it held 1.7 minutes
    of the healthy job and 6 of the fault, and the straggler's score at its page read 0.29
    (in review)."""
    if warmup is None:
        warmup = 20 * 60 * time_scale
    t_start = time.time()
    sims = []
    jobs = {f"drill-{f}": JobResult(f, f"drill-{f}") for f in faults}
    with pipeline(time_scale, workdir=workdir) as pl:
        prom = pl.prom
        try:
            for i, job in enumerate(jobs.values()):
                slow = job.fault == "one-stall"
                params = dict(compute_seconds=SLOW_STEP_SECONDS * time_scale if slow else COMPUTE_SECONDS)
                if job.fault in AT_START:
                    params.update(fault_params(job.fault))
                s = ScenarioThread("healthy", pl.targets, NODES, RANKS_PER_NODE, seed=seed + i,
                                   job=job.job, params=params, exchange_every=exchange_every,
                                   heartbeat_every=1.0)
                s.start()
                if job.fault in AT_START:
                    job.onset = time.time()
                sims.append((job, s))
            onset_at = time.time() + warmup
            expected = {(EXPECTED[j.fault], j.job) for j in jobs.values() if j.fault in EXPECTED}
            scores: dict[str, float] = {}
            deadline = time.time() + timeout
            while time.time() < deadline:
                now = time.time()
                if now >= onset_at:
                    for job, s in sims:
                        if job.onset is None and job.fault != "healthy":
                            model = s.driver.model
                            model.p = model.p.with_(**fault_params(job.fault, model.step))
                            job.onset = time.time()
                for a in prom.alerts():
                    job = jobs.get(a["labels"].get("train_job", ""))
                    if job and a["state"] == "pending":
                        job.pending.setdefault(a["labels"]["alertname"], now)
                    if job and a["state"] == "firing" and a["labels"]["alertname"] not in job.firing:
                        job.firing[a["labels"]["alertname"]] = now
                        job.firing_labels[a["labels"]["alertname"]] = a["labels"]
                for note in pl.notifications():
                    for a in note["payload"]["alerts"]:
                        job = jobs.get(a["labels"].get("train_job", ""))
                        name = a["labels"]["alertname"]
                        if job and a["status"] == "firing" and name not in job.notified:
                            job.notified[name] = note["at"]
                            job.notified_alerts[name] = a
                            job.receivers[name] = note["receiver"]
                            if name == EXPECTED.get(job.fault):
                                scores.update(_scores(prom, job.job))
                watched = all(j.onset is not None and now >= j.onset + WATCH_SECONDS[j.fault] * time_scale
                              for j in jobs.values() if j.fault in WATCH_SECONDS)
                if watched and all(name in jobs[j].notified for name, j in expected):
                    break
                for _, s in sims:
                    if s.error is not None:
                        raise RuntimeError(f"simulator failed: {s.error!r}") from s.error
                time.sleep(0.5)
            scores = {**_scores(prom), **scores}
            return DrillResult(jobs, pl.notifications(), scores, time.time() - t_start)
        finally:
            for _, s in sims:
                s.stop()
