"""`syncwatch stack up` next to `syncwatch demo`: the native stack starts, scrapes the demo's
daemons, evaluates the shipped rules, runs with the shipped config, and stops cleanly."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel of this checkout, as ``pip install .`` builds it."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(ROOT)], check=True, timeout=300, capture_output=True)
    (built,) = out.glob("syncwatch-*.whl")
    return built


def with_these_dependencies(site: Path) -> None:
    """Make this environment's dependencies importable from ``site``, after what is installed
    there (a .pth file: its lines go to the end of sys.path)."""
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "zz-deps.pth").write_text("\n".join(deps) + "\n")


def installed_env(**extra: str) -> dict[str, str]:
    """The environment without this checkout on PYTHONPATH: the installed copy is imported."""
    return {k: v for k, v in subprocess_env(**extra).items() if k != "PYTHONPATH"}


def stack_up_rule_files(python: str, env: dict[str, str], cwd: Path) -> set[str]:
    """Run ``syncwatch stack up`` with ``python``: the rule files its Prometheus loaded. SIGTERM
    stops it, and it exits 0."""
    stack = subprocess.Popen([python, "-m", "syncwatch", "stack", "up", "--prometheus-port", "0",
                              "--alertmanager-port", "0", "--data-dir", str(cwd / "data")],
                             env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        lines = [stack.stdout.readline() for _ in range(3)]
        assert lines[2] == "Ctrl-C stops.\n", "".join(lines) + stack.stdout.read()
        prom = re.search(r"prometheus\s+http://127\.0\.0\.1:(\d+)", lines[0])
        rules = api(int(prom[1]), "rules")["groups"]
        stack.send_signal(signal.SIGTERM)
        assert stack.wait(30) == 0
    finally:
        if stack.poll() is None:
            stack.kill()
            stack.wait()
    return {g["file"] for g in rules}


def shipped_rules(share: Path) -> set[str]:
    return {str(share / "alerts" / f.name) for f in (ROOT / "alerts").glob("*.rules.yml")}


def test_stack_up_runs_from_a_wheel_installed_without_the_checkout(tmp_path, wheel):
    """``pip install .`` (the systemd deploy) installs the package alone: ``stack up`` looked for
    deploy/ and alerts/ beside it and failed with "No such file or directory". The wheel carries
    them as data under <prefix>/share/syncwatch, and the stack runs from there."""
    installed = subprocess.run([sys.executable, "-m", "pip", "show", "-f", "syncwatch"],
                               capture_output=True, text=True).stdout
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    # into that venv through --python: with --prefix, pip uninstalled this environment's own
    # (editable) syncwatch as an "upgrade"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                    "-q", "--no-deps", str(wheel)], check=True, timeout=300, capture_output=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    with_these_dependencies(site)
    env = installed_env()
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import syncwatch; print(syncwatch.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr  # not the checkout's
    rules = stack_up_rule_files(str(venv / "bin" / "python"), env, tmp_path)
    assert rules == shipped_rules(venv / "share" / "syncwatch")
    assert subprocess.run([sys.executable, "-m", "pip", "show", "-f", "syncwatch"],
                          capture_output=True, text=True).stdout == installed  # left as it was


def base_python() -> Path:
    """The interpreter this environment was made from (itself outside a virtual environment)."""
    return Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"


def test_stack_up_runs_from_a_wheel_installed_with_pip_user(tmp_path, wheel):
    """``pip install --user`` puts the data files under the user base (``~/.local/share/syncwatch``,
    or $PYTHONUSERBASE's), not under sys.prefix: ``stack up`` looked only in
    <sys.prefix>/share/syncwatch and failed although the files were installed."""
    python = base_python()
    if not python.is_file():
        pytest.skip(f"{python} (the base interpreter) is not there")
    user_base = tmp_path / "userbase"
    env = installed_env(PYTHONUSERBASE=str(user_base))
    env.pop("PYTHONNOUSERSITE", None)
    # pip runs under that interpreter; Debian's marks itself externally managed (PEP 668), which
    # refuses --user installs too
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--user",
                    "--no-deps", "--break-system-packages", str(wheel)],
                   check=True, timeout=300, capture_output=True, env=env)
    site = next(user_base.glob("lib/python3*/site-packages"))
    with_these_dependencies(site)
    where = subprocess.run([str(python), "-c", "import syncwatch; print(syncwatch.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr
    assert stack_up_rule_files(str(python), env, tmp_path) == shipped_rules(user_base / "share" / "syncwatch")


def test_installed_by_debians_system_pip_it_finds_its_data_under_usr_local(tmp_path, wheel):
    """Debian's system Python installs with pip into /usr/local (its posix_local scheme), the
    data files under /usr/local/share/syncwatch, while its sys.prefix is /usr: ``stack up``
    looked in /usr/share/syncwatch. Installed here in a private mount namespace, over an empty
    /usr/local."""
    debian = "/usr/bin/python3"
    probe = ("import sys, sysconfig; "
             "print(sysconfig.get_default_scheme(), *sys.version_info[:2])")
    scheme = subprocess.run([debian, "-c", probe], capture_output=True, text=True
                            ) if Path(debian).is_file() else None
    mine = "posix_local {} {}".format(*sys.version_info[:2])
    if scheme is None or scheme.stdout.strip() != mine:  # the wheel is built for this Python
        pytest.skip(f"needs Debian's /usr/bin/python3 (its posix_local install scheme) of this "
                    f"Python's version, {sys.version_info[0]}.{sys.version_info[1]}")
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare (util-linux) for a mount namespace")
    deps = "\n".join(p for p in sys.path if p.endswith("site-packages"))
    script = r"""
set -e
mount -t tmpfs tmpfs /usr/local
"$1" -m pip --python "$2" install -q --no-cache-dir --no-deps --break-system-packages "$3"
site=$("$2" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
printf '%s\n' "$4" > "$site/zz-deps.pth"
exec "$2" -c 'import sys; from syncwatch import stack; print(sys.prefix, stack.__file__, stack.shipped("alerts"))'
"""
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                             "sh", sys.executable, debian, str(wheel), deps],
                            capture_output=True, text=True, env=installed_env(), cwd=tmp_path,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    prefix, module, alerts = result.stdout.split()
    assert prefix == "/usr" and module.startswith("/usr/local/lib/python3"), result.stdout
    assert alerts == "/usr/local/share/syncwatch/alerts"
