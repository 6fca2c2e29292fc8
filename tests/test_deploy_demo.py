"""`syncwatch demo --send-to`: the compose demo's simulator feeding an already running daemon."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from conftest import subprocess_env
from syncwatch.daemon.app import DaemonThread
from syncwatch.daemon.config import DaemonConfig


def test_demo_sends_to_a_running_daemon_and_starts_none(sock_path):
    with DaemonThread(DaemonConfig(listen="127.0.0.1:0", socket=sock_path)) as daemon:
        result = subprocess.run(
            [sys.executable, "-m", "syncwatch", "demo", f"--send-to={sock_path}", "--nodes=1",
             "--ranks-per-node=4", "--step-time=0.05", "--duration=2", "--job=compose-demo"],
            env=subprocess_env(), capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert "scrape" not in result.stdout  # no daemon of its own
        with urllib.request.urlopen(daemon.url + "/metrics", timeout=5) as r:
            families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    steps = {s.labels["rank"]: s.value for s in families["syncwatch_steps"].samples
             if s.name == "syncwatch_steps_total" and s.labels["train_job"] == "compose-demo"}
    assert set(steps) == {"0", "1", "2", "3"}
    assert min(steps.values()) > 0
