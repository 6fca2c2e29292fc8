"""docker-compose.yml and Dockerfile: valid, every mounted file present, loopback-only, least
privilege, and the configs they mount accepted by promtool and amtool. No Docker engine needed."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import subprocess_env
from deploy_helpers import ROOT, compose_validator, wait_for

COMPOSE_FILES = [ROOT / "docker-compose.yml", ROOT / "deploy" / "scale-out" / "docker-compose.yml"]
# Host paths outside the repository that the compose files mount on purpose.
HOST_PATHS = {"/sys"}
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(text: str) -> str:
    """Compose's ${VAR:-default} with an empty environment: what a user gets by default."""
    return _VAR.sub(lambda m: m.group(2) or "", text)


def load(path) -> dict:
    return yaml.safe_load(interpolate(path.read_text()))


@pytest.fixture(params=COMPOSE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def compose(request):
    return request.param, load(request.param)


def test_compose_file_is_valid_against_the_compose_spec(compose):
    path, doc = compose
    errors = sorted(compose_validator().iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]


def test_compose_spec_check_rejects_a_mistake():
    doc = load(ROOT / "docker-compose.yml")
    doc["services"]["prometheus"]["read_ony"] = True
    assert any("read_ony" in e.message for e in compose_validator().iter_errors(doc))


def bind_sources(path, doc):
    """(service, source path) of every bind mount, relative sources resolved against the file."""
    for name, service in doc["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
            if source.startswith((".", "/")):
                yield name, (path.parent / source).resolve() if source.startswith(".") else source


def test_every_mounted_file_exists(compose):
    path, doc = compose
    mounts = list(bind_sources(path, doc))
    assert mounts
    for service, source in mounts:
        if isinstance(source, str):
            assert source in HOST_PATHS, f"{service}: unexpected host path {source}"
        else:
            assert source.exists(), f"{service}: {source} does not exist"
    for service in doc["services"].values():
        if "build" in service:
            context = path.parent / service["build"]["context"]
            assert (context / service["build"]["dockerfile"]).is_file()


def test_ports_are_published_on_loopback_only(compose):
    path, doc = compose
    published = 0
    for name, service in doc["services"].items():
        for port in service.get("ports", []):
            published += 1
            host_ip = port.get("host_ip") if isinstance(port, dict) else str(port).rsplit(":", 2)[0]
            assert host_ip == "127.0.0.1", f"{name}: {port} is not bound to 127.0.0.1"
        assert service.get("network_mode") != "host", name
    assert published


def test_images_are_pinned(compose):
    path, doc = compose
    for name, service in doc["services"].items():
        if "build" in service:
            continue
        image = service["image"]
        assert re.search(r":v?\d+\.\d+\.\d+(-\w+)?$", image), f"{name}: {image} is not pinned"
        assert image.split("/")[0] in {"prom", "grafana", "victoriametrics"}, image  # official


def test_services_are_least_privileged(compose):
    path, doc = compose
    for name, service in doc["services"].items():
        assert service.get("read_only") is True, name
        assert service.get("cap_drop") == ["ALL"], name
        if service.get("cap_add"):  # only a one-shot chown of volumes, as on Kubernetes
            assert service["cap_add"] == ["CHOWN"], name
            assert service["entrypoint"][0] == "/bin/chown" and service["restart"] == "no", name
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        assert not service.get("privileged"), name
        assert service.get("pid") != "host" and service.get("ipc") != "host", name


# What the images used here ship, read in their Dockerfiles: the user they run as, the owner of
# the directories a named volume is mounted on (a new volume copies the directory's owner; where
# the image has no such directory, the volume is root's), and where they write outside volumes.
IMAGE_USER = {"prom/prometheus": 65534, "prom/alertmanager": 65534, "grafana/grafana": 472,
              "victoriametrics": 0, "syncwatch": 65532}
IMAGE_DIR_OWNER = {("prom/prometheus", "/prometheus"): 65534,
                   ("prom/alertmanager", "/alertmanager"): 65534,
                   ("grafana/grafana", "/var/lib/grafana"): 472,
                   ("syncwatch", "/run/syncwatch"): 65532}
IMAGE_SCRATCH = {"victoriametrics/vmselect": ["/tmp"]}  # /tmp/searchResults, made at start


def image_name(service: dict) -> str:
    return service["image"].rsplit(":", 1)[0]


def image_default(table: dict, image: str):
    return next(v for k, v in table.items() if image == k or image.startswith(k + "/"))


def chowned_by_init(doc: dict, service: dict, target: str) -> int | None:
    """The uid a one-shot service this one waits for chowns ``target`` to, if any."""
    depends = service.get("depends_on", {})
    for name, condition in (depends.items() if isinstance(depends, dict) else []):
        init = doc["services"][name]
        if condition.get("condition") != "service_completed_successfully":
            continue
        argv = init.get("entrypoint", [])
        if argv[:1] == ["/bin/chown"] and target in argv[2:]:
            return int(argv[1].split(":")[0])
    return None


def test_named_volumes_are_writable_by_their_service(compose):
    """vmstorage ran as 65532 on a new volume that is root's (its image has no /storage): it
    exits at start ("cannot create lock file /storage/flock.lock: permission denied"), and
    Alertmanager as 65532 could not write its silences and notification log to a volume that
    is nobody's, so silences vanished with every restart."""
    path, doc = compose
    assert "install -d -o 65532 -g 65532 -m 0750 /run/syncwatch" in (ROOT / "Dockerfile").read_text()
    checked = 0
    for name, service in doc["services"].items():
        image = "syncwatch" if "build" in service else image_name(service)
        uid = int(str(service.get("user", image_default(IMAGE_USER, image))).split(":")[0])
        for volume in service.get("volumes", []):
            source, target, *mode = volume.split(":")
            if source.startswith((".", "/")) or mode == ["ro"] or uid == 0:
                continue
            owner = chowned_by_init(doc, service, target)
            if owner is None:
                owner = IMAGE_DIR_OWNER.get((image, target), 0)
            assert owner == uid, f"{name} runs as {uid}; its volume at {target} is {owner}'s"
            checked += 1
    assert checked


def test_read_only_services_have_their_scratch_space(compose):
    """vmselect makes /tmp/searchResults at start and exits where it cannot: with a read-only
    root file system it needs /tmp mounted writable."""
    path, doc = compose
    for name, service in doc["services"].items():
        if "build" in service:
            continue
        for scratch in IMAGE_SCRATCH.get(image_name(service), []):
            writable = service.get("tmpfs", []) + [v.split(":")[1] for v in service.get("volumes", [])]
            assert scratch in writable, f"{name}: {scratch} is read-only"


def test_daemon_and_demo_share_the_ingest_socket():
    doc = load(ROOT / "docker-compose.yml")
    services = doc["services"]
    daemon, demo = services["syncwatch"], services["demo"]
    assert "/sys:/host/sys:ro" in daemon["volumes"] and "--path.sysfs=/host/sys" in daemon["command"]
    assert "syncwatch-ingest:/run/syncwatch" in daemon["volumes"]
    assert "syncwatch-ingest:/run/syncwatch:ro" in demo["volumes"]
    assert "--socket=/run/syncwatch/ingest.sock" in daemon["command"]
    assert "--send-to=/run/syncwatch/ingest.sock" in demo["command"] and "--nodes=1" in demo["command"]
    assert demo["profiles"] == ["demo"] and demo["network_mode"] == "none"
    assert doc["volumes"]["syncwatch-ingest"]["name"] == "syncwatch-ingest"  # for other projects
    # Prometheus and Alertmanager reach the daemon on 127.0.0.1 as the native stack does.
    for name in ("syncwatch", "prometheus", "alertmanager"):
        assert services[name]["network_mode"] == "service:loopback", name


# Docker's read_only: true, as a shell in a private mount namespace gives it: every mount but
# /proc, /sys and /dev read-only, /run/syncwatch the named volume (here a directory of the test's)
# mounted read-only as the demo mounts it, no network (network_mode: none), the working directory
# /, no TMPDIR. The image's Python finds no temporary directory there, which the script checks
# before it runs the service's command.
READ_ONLY_CONTAINER = r"""
set -e
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir /run/syncwatch
mount --bind "$1" /run/syncwatch
shift
for m in $(awk '{print $5}' /proc/self/mountinfo); do
  case "$m" in /proc|/proc/*|/sys|/sys/*|/dev|/dev/*) continue;; esac
  mount -o remount,bind,ro "$m" 2>/dev/null || true
done
cd /
unset TMPDIR TEMP TMP
if python -c 'import tempfile; tempfile.mkdtemp()' 2>/dev/null; then
  echo "the sandbox left a temporary directory writable" >&2; exit 99
fi
exec python -m syncwatch "$@"
"""


def test_demo_service_runs_in_its_read_only_container(tmp_path):
    """`docker compose --profile demo up` never started: the demo made a temporary socket
    directory even with --send-to, which starts no daemon, and in its read-only container (no
    tmpfs, no TMPDIR) Python found none ("No usable temporary directory found"), so it exited
    and restarted forever. The service's own command runs here under the container's
    conditions, with the real code, and its ranks reach a real daemon through the read-only
    socket mount."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare (util-linux) for a mount namespace")
    from syncwatch.daemon.app import DaemonThread
    from syncwatch.daemon.config import DaemonConfig
    service = load(ROOT / "docker-compose.yml")["services"]["demo"]
    assert service["read_only"] is True and not service.get("tmpfs")
    assert service["network_mode"] == "none" and not service.get("environment")
    socket_path = "/run/syncwatch/ingest.sock"
    assert f"syncwatch-ingest:{os.path.dirname(socket_path)}:ro" in service["volumes"]
    assert f"--send-to={socket_path}" in service["command"]
    volume = tmp_path / "syncwatch-ingest"
    volume.mkdir()
    bindir = tmp_path / "bin"  # the image's `python` on PATH
    bindir.mkdir()
    (bindir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bindir / "python").chmod(0o755)
    env = subprocess_env(PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
                         PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
    with DaemonThread(DaemonConfig(listen="127.0.0.1:0", socket=str(volume / "ingest.sock"))) as d:
        result = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "--net", "sh", "-c",
             READ_ONLY_CONTAINER, "sh", str(volume), *service["command"],
             "--duration=3", "--step-time=0.05"],
            capture_output=True, text=True, env=env, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "is not a socket" not in result.stderr, result.stderr
        body = urllib.request.urlopen(d.url + "/metrics", timeout=5).read().decode()
    steps = re.search(r'syncwatch_steps_total\{rank="7",train_job="sim-straggler"\} (\S+)', body)
    assert steps and float(steps.group(1)) >= 3, body[:3000]
    assert 'node="sim-node-00"' in body


def test_loopback_service_stops_on_sigterm_as_pid_1():
    """`docker compose stop` sends SIGTERM to each container's PID 1 and kills it 10 s later. The
    kernel drops a signal to a PID namespace's init that has no handler for it, so the
    `loopback` service's bare signal.pause() ignored SIGTERM: every stop, down and restart of
    the stack waited the full 10 s for it and ended it with SIGKILL (exit 137). Run here as PID 1
    of a fresh PID namespace, as Docker runs it."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("pgrep"):
        pytest.skip("needs root and unshare, pgrep (util-linux, procps) for a PID namespace")
    entrypoint = load(ROOT / "docker-compose.yml")["services"]["loopback"]["entrypoint"]
    assert entrypoint[0] == "python"
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, *entrypoint[1:]])
    try:
        init = wait_for(lambda: subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                               text=True).stdout.split(), 10, "the namespace's init")
        time.sleep(0.5)  # let Python install its handler
        os.kill(int(init[0]), signal.SIGTERM)
        assert proc.wait(5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_docs_say_the_daemon_gets_nvml_only_with_the_nvidia_runtime_asked_for():
    """The daemon's runtime is the compose file's, runc unless SYNCWATCH_CONTAINER_RUNTIME says
    otherwise, whatever Docker's default runtime is: on a GPU node whose default is nvidia, plain
    ``docker compose up -d`` gets no NVML. The README said "NVML through the NVIDIA runtime when
    present", as if it came by itself."""
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["syncwatch"]
    assert raw["runtime"] == "${SYNCWATCH_CONTAINER_RUNTIME:-runc}"
    assert load(ROOT / "docker-compose.yml")["services"]["syncwatch"]["runtime"] == "runc"
    for doc in ("README.md", "docs/deploy.md", "docker-compose.yml"):
        text = " ".join((ROOT / doc).read_text().replace("#", " ").split())  # unwrapped
        assert "SYNCWATCH_CONTAINER_RUNTIME=nvidia docker compose up -d" in text, doc
        assert "even where nvidia is Docker's default runtime" in text.replace("`", ""), doc
        assert "NVIDIA runtime when present" not in text, doc


def test_docs_name_every_variable_the_compose_files_read(compose):
    """A ``${VAR}`` of a compose file changes what a user gets (the daemon's runtime, the address
    the scale-out's vminsert is published on): docs/deploy.md names each. It did not name
    SYNCWATCH_TSDB_ADDR, without which vminsert listens on 127.0.0.1 only and no rack agent on
    another machine can write to it."""
    path, _ = compose
    docs = (ROOT / "docs" / "deploy.md").read_text()
    variables = {m.group(1) for m in _VAR.finditer(path.read_text())}
    missing = sorted(v for v in variables if v not in docs)
    assert variables and not missing, f"{path.name} reads {missing}, which docs/deploy.md never names"


def test_grafana_has_no_default_admin_password():
    env = load(ROOT / "docker-compose.yml")["services"]["grafana"]["environment"]
    assert env["GF_SECURITY_DISABLE_INITIAL_ADMIN_CREATION"] == "true"
    assert not any(k.startswith("GF_SECURITY_ADMIN_PASSWORD") for k in env)
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


def test_documented_grafana_admin_change_leaves_a_login_form():
    """docs/deploy.md told how to administer Grafana: remove the line that stops the admin
    account's creation and give it a password. GF_AUTH_DISABLE_LOGIN_FORM stayed, which hides
    Grafana's user name and password form, so the admin so made had nowhere to sign in."""
    env = dict(load(ROOT / "docker-compose.yml")["services"]["grafana"]["environment"])
    text = " ".join((ROOT / "docs" / "deploy.md").read_text().split())
    advice = re.search(r"To administer it, remove (.*?) and set `GF_SECURITY_ADMIN_PASSWORD__FILE`",
                       text)
    assert advice, "docs/deploy.md says how to administer Grafana"
    for name in re.findall(r"`(GF_\w+)`", advice.group(1)):
        env.pop(name)
    assert env.get("GF_SECURITY_DISABLE_INITIAL_ADMIN_CREATION") != "true", advice.group(0)
    assert env.get("GF_AUTH_DISABLE_LOGIN_FORM") != "true", advice.group(0)


def mounted_config(service: str, flag: str):
    """The repository file behind ``flag``'s container path in ``service`` of docker-compose.yml."""
    svc = load(ROOT / "docker-compose.yml")["services"][service]
    container_path = next(a.split("=", 1)[1] for a in svc["command"] if a.startswith(flag + "="))
    for volume in svc["volumes"]:
        source, target = volume.split(":")[:2]
        if container_path.startswith(target + "/"):
            return ROOT / source / container_path[len(target) + 1:]
    raise AssertionError(f"{service}: {container_path} is not mounted")


def run_tool(name: str, package: str, *args) -> subprocess.CompletedProcess:
    tool = shutil.which(name)
    if not tool:
        pytest.skip(f"{name} (Debian package {package}) is not installed")
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60)


def test_prometheus_config_passes_promtool():
    config = mounted_config("prometheus", "--config.file")
    assert config == ROOT / "deploy" / "prometheus" / "prometheus.yml"
    result = run_tool("promtool", "prometheus", "check", "config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rule files found" in result.stdout  # the rules were found through the relative path
    scrape = yaml.safe_load(config.read_text())["scrape_configs"]
    assert all(s["sample_limit"] > 0 and s["label_limit"] > 0 for s in scrape)


def test_alertmanager_config_passes_amtool():
    config = mounted_config("alertmanager", "--config.file")
    result = run_tool("amtool", "prometheus-alertmanager", "check-config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_is_pinned_unprivileged_and_complete():
    lines = [l.strip() for l in (ROOT / "Dockerfile").read_text().splitlines()
             if l.strip() and not l.lstrip().startswith("#")]
    froms = [l.split()[1] for l in lines if l.startswith("FROM ")]
    assert froms and all(re.search(r":\d+\.\d+\.\d+-", f) for f in froms), froms
    assert [l for l in lines if l.startswith("USER ")][-1] == "USER 65532:65532"
    for line in lines:
        if line.startswith("COPY ") and "--from=" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"


def test_dockerfile_build_stage_copies_what_the_wheel_needs(tmp_path):
    """The build stage's ``pip wheel .`` sees only what it copies: a file that pyproject.toml
    installs (its data files) left out fails the image build. Its COPY lines are replayed into a
    directory and the wheel built from there."""
    lines = [l.strip() for l in (ROOT / "Dockerfile").read_text().splitlines()
             if l.strip() and not l.lstrip().startswith("#")]
    build = lines[:[i for i, l in enumerate(lines) if l.startswith("FROM ")][1]]
    context = tmp_path / "src"
    for line in build:
        if line.startswith("COPY "):
            *sources, dest = line.split()[1:]
            for source in sources:
                target = context / dest / (Path(source).name if dest.endswith("/") else "")
                if (ROOT / source).is_dir():
                    shutil.copytree(ROOT / source, target,
                                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(ROOT / source, target)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                             "--no-build-isolation", "-w", str(tmp_path / "wheel"), str(context)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def documented_docker_run() -> list[str]:
    """The training container's ``docker run`` of docs/deploy.md, expanded by a shell on a host
    named gpu-node-17 (``docker`` prints its arguments instead of running)."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    block = re.search(r"```sh\n(docker run .*?)\n```", text, re.S).group(1)
    script = "hostname() { echo gpu-node-17; }\ndocker() { printf '%s\\0' \"$@\"; }\n" + block
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, result.stderr
    return result.stdout.split("\0")[:-1]


def test_documented_training_container_reports_the_host_as_its_node(monkeypatch):
    """A rank labels its series with its own node name (SYNCWATCH_NODE, NODE_NAME, else the host
    name); the daemon relabels nothing. A container's host name is its id, so a training
    container run as documented reported a new random "node" each run, and two containers on one
    machine gave its one daemon two node values, which the hardware dashboard's join refuses."""
    from syncwatch.instrument.identity import node_from_env
    argv = documented_docker_run()
    assert argv[0] == "run" and "--group-add" in argv
    env = dict(value.split("=", 1) for flag, value in zip(argv, argv[1:]) if flag in ("-e", "--env"))
    monkeypatch.setattr("socket.gethostname", lambda: "3f2a9c1b7e4d")  # the container's id
    assert node_from_env(env) == "gpu-node-17", env
