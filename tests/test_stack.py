"""The native stack harness: real Prometheus / Alertmanager on loopback, started, queried, stopped."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import ROOT, subprocess_env
from syncwatch.rules.render import write
from syncwatch.stack import Prometheus, StackError, http_get, wait_until

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="prometheus missing (Debian package: prometheus)")


class _Exporter(ThreadingHTTPServer):
    """A /metrics endpoint whose step counter advances by 10 per scrape."""

    def __init__(self):
        self.scrapes = 0
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server API)
        self.server.scrapes += 1
        n = self.server.scrapes * 10
        body = (f'syncwatch_steps_total{{train_job="j",rank="0"}} {n}\n'
                f'syncwatch_step_seconds_total{{train_job="j",rank="0"}} {n * 0.5}\n').encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def exporter():
    srv = _Exporter()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_prometheus_scrapes_evaluates_the_rules_and_answers_queries(exporter, tmp_path):
    rules = write(tmp_path / "rules", 0.05)
    prom = Prometheus([exporter], rule_files=rules).start()
    workdir = prom.workdir
    try:
        wait_until(prom.targets_up, 20, what="the target to be up")
        groups = prom.api("rules")["groups"]
        assert len(groups) == 8 and all(r["health"] != "err" for g in groups for r in g["rules"])
        # the recorded mean step time comes from the rules evaluating the scraped counters
        mean = wait_until(lambda: prom.value("train_job:syncwatch_step_seconds:mean5m"), 30,
                          what="the recording rule to produce a value")
        assert mean == pytest.approx(0.5)
        now = time.time()
        series = prom.query_range("syncwatch_steps_total", now - 5, now, 1)
        assert series and series[0]["metric"]["train_job"] == "j"
        with pytest.raises(StackError, match="parse error"):
            prom.query("sum(")
    finally:
        prom.stop()
    assert prom.proc is None and not workdir.exists()


def test_a_prometheus_that_cannot_start_raises_with_its_log(tmp_path):
    bad = Prometheus([], extra_scrape_configs=[{"job_name": "x", "scrape_interval": "soon"}])
    with pytest.raises(StackError, match="did not start") as err:
        bad.start(timeout=10)
    assert "soon" in str(err.value) or "parse" in str(err.value).lower()
    assert "(it exited with code " in str(err.value)  # it failed at once, not "within 10s"
    bad.stop()


def test_a_port_held_by_something_not_http_is_reported_without_a_traceback():
    """--prometheus-port taken by a server that answers in another protocol: the readiness probe
    got http.client.BadStatusLine, which it did not catch, and the command died with a traceback
    (leaving Prometheus to exit on its own). Now Prometheus' own bind error is reported."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def speak_ssh():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            with conn:
                conn.recv(4096)
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

    threading.Thread(target=speak_ssh, daemon=True).start()
    try:
        r = subprocess.run([sys.executable, "-m", "syncwatch", "stack", "up", "--no-alertmanager",
                            "--prometheus-port", str(port), "--targets", "127.0.0.1:1"],
                           capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=60)
    finally:
        server.close()
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("syncwatch stack up: prometheus did not start: ")
    assert "address already in use" in r.stderr


def test_a_port_held_by_another_prometheus_is_reported_before_anything_is_said_to_run(exporter):
    """--prometheus-port taken by a server that answers the readiness probe (a Prometheus the
    Debian package runs on 9090): that server was taken for ours, whose URL was printed as running
    before ours exited with the bind error in its log."""
    port = exporter.rsplit(":", 1)[1]
    r = subprocess.run([sys.executable, "-m", "syncwatch", "stack", "up", "--no-alertmanager",
                        "--prometheus-port", port, "--targets", "127.0.0.1:1"],
                       capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=60)
    assert r.returncode == 1 and r.stdout == "", r.stdout
    assert r.stderr == (f"syncwatch stack up: prometheus did not start: 127.0.0.1:{port}: address already in "
                        f"use (another port, or 0 for a free one)\n")


def test_an_interrupted_start_stops_the_server(monkeypatch):
    """Ctrl-C while Prometheus starts: it runs in its own session (the terminal's SIGINT does not
    reach it) and the caller did not hold it yet, so start() must stop it."""
    pids = []

    def interrupted(self):
        pids.append(self.proc.pid)
        raise KeyboardInterrupt

    monkeypatch.setattr(Prometheus, "_ready", interrupted)
    prom = Prometheus([])
    try:
        with pytest.raises(KeyboardInterrupt):
            prom.start(timeout=10)
        assert prom.proc is None
        with pytest.raises(ProcessLookupError):
            os.kill(pids[0], 0)
    finally:
        if prom.proc is not None:
            prom.proc.kill()
        prom.stop()


@pytest.mark.parametrize("flag,value,says", [
    ("--time-scale", "0", "--time-scale must be a positive number, got 0"),
    ("--time-scale", "nan", "--time-scale must be a positive number, got nan"),
    ("--scrape-interval", "5", "--scrape-interval '5' is not a Prometheus duration"),
    ("--scrape-interval", "1.5s", "--scrape-interval '1.5s' is not a Prometheus duration"),
    ("--targets", "nope", "--targets 'nope': expected daemon host:port pairs"),
    ("--targets", "127.0.0.1:9477,:9478", "--targets '127.0.0.1:9477,:9478': expected daemon host:port pairs"),
    ("--targets", ",", "--targets ',': expected daemon host:port pairs"),
    # an OverflowError traceback from bind()
    ("--prometheus-port", "70000", "--prometheus-port must be a port 0-65535 (0 = free), got 70000"),
    ("--alertmanager-port", "-1", "--alertmanager-port must be a port 0-65535 (0 = free), got -1"),
])
def test_stack_up_rejects_bad_flags_in_one_line(flag, value, says):
    r = subprocess.run([sys.executable, "-m", "syncwatch", "stack", "up", "--prometheus-port", "0",
                        "--alertmanager-port", "0", flag, value],
                       capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"syncwatch stack up: {says}" + {
        "--scrape-interval": " (e.g. 5s, 1m, 1m30s)",
        "--targets": ", comma separated (e.g. 127.0.0.1:9477,node2:9477)"}.get(flag, ""), r.stderr


@pytest.mark.parametrize("var,value,says", [
    ("SYNCWATCH_TIME_SCALE", "0", "--time-scale (from SYNCWATCH_TIME_SCALE) must be a positive "
                                  "number, got 0"),
    ("SYNCWATCH_TARGETS", "nope", "--targets (from SYNCWATCH_TARGETS) 'nope': expected daemon "
                                  "host:port pairs, comma separated (e.g. 127.0.0.1:9477,node2:9477)"),
])
def test_stack_up_names_the_variable_a_bad_value_came_from(var, value, says):
    """Named by its flag alone, which no one had typed."""
    r = subprocess.run([sys.executable, "-m", "syncwatch", "stack", "up", "--prometheus-port", "0",
                        "--alertmanager-port", "0"], capture_output=True, text=True,
                       env=subprocess_env(**{var: value}), cwd=ROOT, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == f"syncwatch stack up: {says}", r.stderr


@pytest.mark.skipif(shutil.which("prometheus-alertmanager") is None and shutil.which("alertmanager") is None,
                    reason="Alertmanager missing (Debian package: prometheus-alertmanager)")
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_stack_up_runs_both_until_interrupted(exporter, sig):
    proc = subprocess.Popen(
        [sys.executable, "-m", "syncwatch", "stack", "up", "--targets", exporter,
         "--prometheus-port", "0", "--alertmanager-port", "0", "--scrape-interval", "1s",
         "--time-scale", "0.05"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=ROOT)
    try:
        urls = {}
        deadline = time.monotonic() + 60
        while len(urls) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            m = re.match(r"(prometheus|alertmanager)\s+(http://\S+)", line)
            if m:
                urls[m[1]] = m[2]
        assert len(urls) == 2, proc.stderr.read() if proc.poll() is not None else urls
        for url in urls.values():
            assert http_get(url + "/-/ready")
        wait_until(lambda: b'"health":"up"' in http_get(urls["prometheus"] + "/api/v1/targets"), 20,
                   what="the daemon target to be up")
        proc.send_signal(getattr(signal, sig))  # Ctrl-C, kill, a closed terminal
        assert proc.wait(20) == 0
        for url in urls.values():
            with pytest.raises(OSError):
                urllib.request.urlopen(url + "/-/ready", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(shutil.which("prometheus-alertmanager") is None and shutil.which("alertmanager") is None,
                    reason="Alertmanager missing (Debian package: prometheus-alertmanager)")
def test_stack_up_runs_the_given_alertmanager_config_as_it_is(tmp_path):
    """--alertmanager-config was read with PyYAML and written back for Alertmanager: YAML 1.1 read
    the time interval's ``end_time: 17:00`` (what Alertmanager's documentation writes) as the
    sexagesimal 1020, and Alertmanager refused the copy ("couldn't parse timestamp 1020") of a
    file amtool accepts; the copy also moved its relative template path off its directory."""
    config = tmp_path / "alertmanager.yml"
    config.write_text((ROOT / "deploy" / "alertmanager" / "alertmanager.yml").read_text() + """
time_intervals:
  - name: office-hours
    time_intervals:
      - times:
          - start_time: 09:00
            end_time: 17:00
templates: ['templates/*.tmpl']
""")
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "syncwatch.tmpl").write_text('{{ define "syncwatch.title" }}x{{ end }}\n')
    proc = subprocess.Popen(
        [sys.executable, "-m", "syncwatch", "stack", "up", "--targets", "127.0.0.1:1",
         "--prometheus-port", "0", "--alertmanager-port", "0", "--alertmanager-config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=ROOT)
    try:
        url = None
        for line in proc.stdout:
            m = re.match(r"alertmanager\s+(http://\S+)", line)
            if m:
                url = m[1]
                break
        if url is None:
            proc.wait(20)
            pytest.fail(proc.stderr.read())
        loaded = json.loads(http_get(url + "/api/v2/status"))["config"]["original"]
        assert 'end_time: "17:00"' in loaded, loaded
        assert f"- {tmp_path}/templates/*.tmpl" in loaded, loaded
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ``stack up`` whose Popen holds on for 2 s after forking the first server (Alertmanager), the
# window where a stop signal once raised inside Popen: the server ran, the stack did not hold it
SLOW_POPEN = """
import pathlib, subprocess, sys, time
real = subprocess.Popen
class Popen(real):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        pathlib.Path(sys.argv[1]).touch()
        time.sleep(2)
subprocess.Popen = Popen
from syncwatch.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.skipif(shutil.which("prometheus-alertmanager") is None and shutil.which("alertmanager") is None,
                    reason="Alertmanager missing (Debian package: prometheus-alertmanager)")
def test_a_stop_signal_while_a_server_is_being_forked_leaves_none_running(tmp_path):
    data, forked = tmp_path / "stack-data", tmp_path / "forked"
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_POPEN, str(forked), "stack", "up", "--targets", "127.0.0.1:1",
         "--prometheus-port", "0", "--alertmanager-port", "0", "--data-dir", str(data)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=ROOT)
    try:
        wait_until(forked.exists, 30, what="Alertmanager to be forked")
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(20) == 0, proc.stderr.read()
        left = subprocess.run(["pgrep", "-f", str(data)], capture_output=True, text=True).stdout
        assert left == "", left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["pkill", "-f", str(data)], capture_output=True)


@pytest.mark.skipif(shutil.which("prometheus-alertmanager") is None and shutil.which("alertmanager") is None,
                    reason="Alertmanager missing (Debian package: prometheus-alertmanager)")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_stack_up_stopped_while_it_starts_leaves_no_server_running(tmp_path, sig):
    """A signal while Alertmanager starts (before anything is ready): the servers run in
    sessions of their own, so a stack that died of the signal left them running."""
    data = tmp_path / "stack-data"
    proc = subprocess.Popen(
        [sys.executable, "-m", "syncwatch", "stack", "up", "--targets", "127.0.0.1:1",
         "--prometheus-port", "0", "--alertmanager-port", "0", "--data-dir", str(data)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=ROOT)
    try:
        wait_until(lambda: (data / "alertmanager" / "alertmanager.log").exists(), 30,
                   what="Alertmanager to be started")
        proc.send_signal(getattr(signal, sig))
        proc.wait(20)
        left = subprocess.run(["pgrep", "-f", str(data)], capture_output=True, text=True).stdout
        assert left == "", left  # no Prometheus or Alertmanager with our data directory
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["pkill", "-f", str(data)], capture_output=True)
