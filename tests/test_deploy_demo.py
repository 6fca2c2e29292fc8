"""`syncwatch demo --send-to`: the compose demo's simulator feeding an already running daemon."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import urllib.request

import pytest
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
        assert "warning" not in result.stderr, result.stderr
        with urllib.request.urlopen(daemon.url + "/metrics", timeout=5) as r:
            families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    steps = {s.labels["rank"]: s.value for s in families["syncwatch_steps"].samples
             if s.name == "syncwatch_steps_total" and s.labels["train_job"] == "compose-demo"}
    assert set(steps) == {"0", "1", "2", "3"}
    assert min(steps.values()) > 0


def test_demo_sending_to_no_socket_says_so(tmp_path):
    """A typo in ``--send-to`` looked like a working demo: exit 0 and the usual summary lines (the
    simulator's own numbers), while every record was dropped."""
    missing = tmp_path / "ingest.sock"
    result = subprocess.run(
        [sys.executable, "-m", "syncwatch", "demo", f"--send-to={missing}", "--nodes=1",
         "--ranks-per-node=2", "--step-time=0.05", "--duration=1"],
        env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert (f"syncwatch demo: warning: {missing} is not a socket (yet): nothing is received until "
            "a daemon listens there") in result.stderr


def test_demo_sending_to_a_daemon_needs_no_temporary_directory(tmp_path, monkeypatch, capsys):
    """--send-to starts no daemon, yet the demo made a temporary socket directory it never used:
    where there is none to make (the compose demo's read-only container), it died in
    FileNotFoundError. Its ranks reach the running daemon without one."""
    from syncwatch import cli
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-directory"))
    with pytest.raises(FileNotFoundError):
        tempfile.mkdtemp()
    sock = str(tmp_path / "ingest.sock")
    with DaemonThread(DaemonConfig(listen="127.0.0.1:0", socket=sock)) as d:
        assert cli.main(["demo", "--send-to", sock, "--nodes", "1", "--ranks-per-node", "2",
                         "--duration", "1.5", "--step-time", "0.05"]) == 0
        body = urllib.request.urlopen(d.url + "/metrics", timeout=5).read().decode()
    assert "every node sends to the daemon on " + sock in capsys.readouterr().out
    assert re.search(r'syncwatch_steps_total\{rank="1",train_job="sim-straggler"\} [1-9]', body), body[:2000]
