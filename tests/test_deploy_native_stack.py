"""`syncwatch stack up` next to `syncwatch demo`: the native stack starts, scrapes the demo's
daemons, evaluates the shipped rules, runs with the shipped config, and stops cleanly."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import urllib.parse
import urllib.request

import pytest
import yaml

from conftest import subprocess_env
from deploy_helpers import ROOT, wait_for
from syncwatch.stack import free_port

pytestmark = [
    pytest.mark.skipif(not shutil.which("prometheus"),
                       reason="prometheus (Debian package prometheus) is not installed"),
    pytest.mark.skipif(not shutil.which("prometheus-alertmanager") and not shutil.which("alertmanager"),
                       reason="alertmanager (Debian package prometheus-alertmanager) is not installed"),
]
JOB = "stack-test"


def api(port: int, path: str, **params):
    url = f"http://127.0.0.1:{port}/api/v1/{path}?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())["data"]




def syncwatch(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "syncwatch", *args], env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def demo_targets(demo: subprocess.Popen, nodes: int) -> list[str]:
    """The daemon addresses the demo prints (it picks free ports with --base-port 0)."""
    targets = []
    while len(targets) < nodes:
        line = demo.stdout.readline()
        if not line:
            pytest.fail(f"demo exited ({demo.wait()}) before printing its daemons")
        targets += re.findall(r"scrape http://(127\.0\.0\.1:\d+)/metrics", line)
    return targets


def test_stack_scrapes_the_demo_evaluates_rules_and_stops_cleanly():
    demo = syncwatch("demo", "--nodes=2", "--ranks-per-node=2", "--base-port=0", "--step-time=0.05",
                     f"--job={JOB}", "--summary-every=1000")
    stack = None
    try:
        targets = demo_targets(demo, 2)
        prom_port, am_port = free_port(), free_port()
        stack = syncwatch("stack", "up", f"--targets={','.join(targets)}",
                          f"--prometheus-port={prom_port}", f"--alertmanager-port={am_port}",
                          "--scrape-interval=1s")
        procs = (demo, stack)
        wait_for(lambda: {t["health"] for t in api(prom_port, "targets")["activeTargets"]} == {"up"},
                 60, "both demo daemons scraped", procs)

        # The running configuration is the shipped file's: same job, same limits.
        shipped = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
        running = yaml.safe_load(api(prom_port, "status/config")["yaml"])
        for key in ("job_name", "sample_limit", "label_limit", "label_name_length_limit",
                    "label_value_length_limit"):
            assert running["scrape_configs"][0][key] == shipped["scrape_configs"][0][key], key
        assert running["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == [
            f"127.0.0.1:{am_port}"]

        groups = wait_for(lambda: [g for g in api(prom_port, "rules")["groups"]
                                   if g["lastEvaluation"] > "2000"], 30, "rule evaluation", procs)
        assert {g["file"].rsplit("/", 1)[-1] for g in groups} == {
            p.name for p in (ROOT / "alerts").glob("*.rules.yml")}
        assert all(r["health"] == "ok" for g in groups for r in g["rules"]), groups
        value = wait_for(lambda: api(prom_port, "query",
                                     query=f'train_job:syncwatch_step_seconds:mean5m{{train_job="{JOB}"}}')["result"],
                         30, "a recording rule's value for the demo job", procs)
        # the demo's straggler: its 0.05 s of compute 8 % slower, then the collective (0.15 x)
        assert float(value[0]["value"][1]) == pytest.approx(0.05 * (1.08 + 0.15), rel=0.05)
        with urllib.request.urlopen(f"http://127.0.0.1:{am_port}/api/v2/status", timeout=5) as r:
            assert json.loads(r.read())["cluster"]["status"] in ("ready", "disabled")
    finally:
        if stack is not None:
            stack.send_signal(signal.SIGTERM)
            try:
                code = stack.wait(20)
            except subprocess.TimeoutExpired:
                stack.kill()
                code = "timeout"
        demo.send_signal(signal.SIGINT)
        demo.wait(20)
    assert code == 0, stack.stdout.read()
    for port in (prom_port, am_port):  # both servers are gone
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2)


def test_stack_up_runs_from_a_wheel_installed_without_the_checkout(tmp_path):
    """``pip install .`` (the systemd deploy) installs the package alone: ``stack up`` looked for
    deploy/ and alerts/ beside it and failed with "No such file or directory". The wheel carries
    them as data under <prefix>/share/syncwatch, and the stack runs from there."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "wheel"), str(ROOT)], check=True, timeout=300,
                   capture_output=True)
    (wheel,) = (tmp_path / "wheel").glob("syncwatch-*.whl")
    installed = subprocess.run([sys.executable, "-m", "pip", "show", "-f", "syncwatch"],
                               capture_output=True, text=True).stdout
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    # into that venv through --python: with --prefix, pip uninstalled this environment's own
    # (editable) syncwatch as an "upgrade"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                    "-q", "--no-deps", str(wheel)], check=True, timeout=300, capture_output=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    # the dependencies from this environment, after the installed syncwatch on the path
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "zz-deps.pth").write_text("\n".join(deps) + "\n")
    env = {k: v for k, v in subprocess_env().items() if k != "PYTHONPATH"}
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import syncwatch; print(syncwatch.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr  # not the checkout's
    stack = subprocess.Popen([str(venv / "bin" / "python"), "-m", "syncwatch", "stack", "up",
                              "--prometheus-port", "0", "--alertmanager-port", "0",
                              "--data-dir", str(tmp_path / "data")],
                             env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        lines = [stack.stdout.readline() for _ in range(3)]
        assert lines[2] == "Ctrl-C stops.\n", "".join(lines) + stack.stdout.read()
        prom = re.search(r"prometheus\s+http://127\.0\.0\.1:(\d+)", lines[0])
        rules = api(int(prom[1]), "rules")["groups"]
        assert {g["file"] for g in rules} == {str(venv / "share" / "syncwatch" / "alerts" / f.name)
                                             for f in (ROOT / "alerts").glob("*.rules.yml")}
        stack.send_signal(signal.SIGTERM)
        assert stack.wait(30) == 0
    finally:
        if stack.poll() is None:
            stack.kill()
            stack.wait()
    assert subprocess.run([sys.executable, "-m", "pip", "show", "-f", "syncwatch"],
                          capture_output=True, text=True).stdout == installed  # left as it was
