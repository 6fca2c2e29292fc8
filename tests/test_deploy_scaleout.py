"""deploy/scale-out: a rack agent and a ruler remote-write into a real VictoriaMetrics on loopback.

The agent runs the shipped ``prometheus-agent.yml`` (only the TSDB URL and the intervals are
changed); its raw syncwatch series must come back out of VictoriaMetrics with the rack label.
Agent mode evaluates no rules. vmalert (the VictoriaMetrics ruler of the production setup, in
Debian's victoria-metrics package) is run only to parse the shipped rule files; a server-mode
Prometheus stands in for the ruler's evaluation: it evaluates the shipped recording rules over the same daemon and remote-writes the results with the agent's
remote_write settings; a recording rule's series must come back out of VictoriaMetrics too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.parse

import pytest
import yaml

from deploy_helpers import ROOT, wait_for
from syncwatch.stack import free_port, http_get

VM = shutil.which("victoria-metrics")
PROMETHEUS = shutil.which("prometheus")
VMALERT = shutil.which("vmalert")
pytestmark = [
    pytest.mark.skipif(not VM, reason="victoria-metrics (Debian package victoria-metrics) is not installed"),
    pytest.mark.skipif(not PROMETHEUS, reason="prometheus (Debian package prometheus) is not installed"),
]
JOB = "scaleout-test"
RULE = "train_job:syncwatch_step_seconds:mean5m"




class Process:
    """A server process on loopback, stopped with SIGTERM (SIGKILL after 10 s)."""

    def __init__(self, args: list[str], log):
        self.log = log
        self.proc = subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT)

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def agent_flag() -> str:
    out = subprocess.run([PROMETHEUS, "--version"], capture_output=True, text=True).stdout
    major = int(out.split("version ", 1)[1].split(".", 1)[0])
    return "--agent" if major >= 3 else "--enable-feature=agent"


@pytest.fixture
def victoria(tmp_path):
    port = free_port()
    vm = Process([VM, f"-httpListenAddr=127.0.0.1:{port}", f"-storageDataPath={tmp_path / 'vm'}",
                  "-retentionPeriod=1d", "-loggerLevel=ERROR"], tmp_path / "vm.log")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_get(url + "/health").strip() == b"OK", 30, "VictoriaMetrics", log=vm.log)
    yield url
    assert vm.stop() == 0


@pytest.fixture
def fed_daemon(sock_path):
    """A real syncwatch daemon receiving step records of a 2-rank job every 50 ms."""
    from syncwatch.daemon.app import DaemonThread
    from syncwatch.daemon.config import DaemonConfig
    from syncwatch.protocol import PHASES, Cumulative, Encoder, Identity
    from syncwatch.sender import Sender

    stop = threading.Event()

    def in_forward(seconds):
        return tuple(seconds if p == "forward" else 0.0 for p in PHASES)

    def feed():
        ranks = [Encoder(Identity(JOB, 0, r, r, 2, "node-a", os.getpid())) for r in range(2)]
        sender = Sender(path=sock_path)
        totals = [Cumulative() for _ in ranks]
        step = 0
        while not stop.wait(0.05):
            step += 1
            for enc, t in zip(ranks, totals):
                t.steps, t.step_seconds = step, step * 0.05
                t.phase_seconds = in_forward(t.step_seconds)
                t.samples = step * 32.0
                sender.send(enc.step(step, time.time(), 0.05, 0.0, in_forward(0.05),
                                     step, 32.0, 0.0, t))
        sender.close()

    with DaemonThread(DaemonConfig(listen="127.0.0.1:0", socket=sock_path, udp=None)) as daemon:
        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        yield f"127.0.0.1:{daemon.port}"
        stop.set()
        feeder.join(5)


def export(vm_url: str, selector: str) -> list[dict]:
    query = urllib.parse.urlencode({"match[]": selector})
    return [json.loads(line) for line in http_get(f"{vm_url}/api/v1/export?{query}").decode().splitlines() if line]


def test_agent_and_ruler_remote_write_into_victoriametrics(tmp_path, victoria, fed_daemon):
    write_url = victoria + "/api/v1/write"

    # The rack agent: the shipped file, with the daemon as its file_sd target.
    agent = yaml.safe_load((ROOT / "deploy" / "scale-out" / "prometheus-agent.yml").read_text())
    assert agent["scrape_configs"][0]["file_sd_configs"][0]["files"] == ["targets/*.json"]
    rack = agent["global"]["external_labels"]["rack"]
    agent["global"]["scrape_interval"] = "1s"
    remote = agent["remote_write"][0]
    assert remote["url"].endswith("/insert/0/prometheus/api/v1/write")  # vminsert of the cluster
    remote["url"] = write_url  # single-node VictoriaMetrics takes the same protocol here
    remote["queue_config"]["batch_send_deadline"] = "1s"
    (tmp_path / "agent" / "targets").mkdir(parents=True)
    (tmp_path / "agent" / "targets" / "daemons.json").write_text(json.dumps([{"targets": [fed_daemon]}]))
    (tmp_path / "agent" / "prometheus.yml").write_text(yaml.safe_dump(agent))

    # The ruler stand-in: the shipped single-node config with the rules, writing like the agent.
    ruler = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    ruler["global"].update(scrape_interval="1s", evaluation_interval="1s")
    ruler.pop("alerting", None)
    ruler["rule_files"] = [str(ROOT / "alerts" / "recording.rules.yml")]
    ruler["scrape_configs"][0]["static_configs"] = [{"targets": [fed_daemon]}]
    ruler["remote_write"] = [remote]
    (tmp_path / "ruler").mkdir()
    (tmp_path / "ruler" / "prometheus.yml").write_text(yaml.safe_dump(ruler))

    servers = []
    try:
        for name, mode in (("agent", [agent_flag(), f"--storage.agent.path={tmp_path / 'agent' / 'wal'}"]),
                           ("ruler", [f"--storage.tsdb.path={tmp_path / 'ruler' / 'data'}"])):
            servers.append(Process([PROMETHEUS, f"--config.file={tmp_path / name / 'prometheus.yml'}",
                                    f"--web.listen-address=127.0.0.1:{free_port()}", *mode],
                                   tmp_path / f"{name}.log"))

        raw = wait_for(lambda: [s for s in export(victoria, '{__name__="syncwatch_steps_total"}')
                                if s["metric"].get("rack") == rack],
                       45, "the agent's syncwatch_steps_total in VictoriaMetrics", log=servers[0].log)
        assert {s["metric"]["rank"] for s in raw} == {"0", "1"}
        assert all(s["metric"]["train_job"] == JOB for s in raw)

        recorded = wait_for(lambda: [s for s in export(victoria, f'{{__name__="{RULE}"}}')
                                     if s["values"]],
                            45, f"the recording rule {RULE} in VictoriaMetrics", log=servers[1].log)
        assert [s["metric"]["train_job"] for s in recorded] == [JOB]
        # 50 ms steps: the mean step time the rule computed, read back from the TSDB.
        assert recorded[0]["values"][-1] == pytest.approx(0.05, rel=0.05)
    finally:
        codes = [s.stop() for s in servers]
    assert codes == [0, 0], "Prometheus did not stop cleanly"


def test_deploy_md_shows_the_agent_flag_of_this_prometheus():
    """deploy.md showed only ``prometheus --agent``, a flag Prometheus 2.x does not know
    (``unknown long flag '--agent'`` from Debian 12's 2.42): the rack agent's command line for
    the installed Prometheus must be among the documented ones."""
    docs = (ROOT / "docs" / "deploy.md").read_text()
    assert f"prometheus {agent_flag()} --config.file=prometheus-agent.yml" in docs


@pytest.mark.skipif(not VMALERT, reason="vmalert (Debian package victoria-metrics) is not installed")
def test_vmalert_accepts_the_shipped_rules():
    """The scale-out ruler loads alerts/*.rules.yml as they are (deploy/scale-out/docker-compose.yml):
    vmalert parses every expression (MetricsQL) and annotation template of them."""
    result = subprocess.run([VMALERT, f"-rule={ROOT / 'alerts'}/*.rules.yml", "-dryRun",
                             "-loggerLevel=ERROR"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
